"""Prompt data: ``--prompt-data`` JSONL, one row per prompt.

Each row is a JSON object with the prompt under ``--input-key`` (default ``input``) and
optional metadata (an object) under ``--metadata-key`` (default ``metadata``). A bad row
is an error that names the file and the line; nothing is skipped silently.

A family that takes a conditioning image (image-to-video: its spec's ``image_input`` is
``"optional"`` or ``"required"``) reads each row's image path under ``--image-key``
(default ``image``), relative to the JSONL file's directory; a text-only family never
reads that key (:func:`run_image_options`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from miles_core.errors import PromptDataError


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    """Row number in the file (0-based), for tracing a sample back to its prompt."""
    image: str | None = None
    """The row's conditioning image (an absolute path, or as given when absolute), for an
    image-to-video family; requests carry it as ``image_path=(image,)``."""


def jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(file:line, object)`` for every non-blank line of a JSONL file; a file that
    cannot be read, a line that is not JSON or not an object is a :class:`PromptDataError`
    naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptDataError(f"{path}: cannot read prompt data ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptDataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise PromptDataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
        yield where, row


def load_prompts(
    path: str | Path,
    *,
    input_key: str = "input",
    metadata_key: str = "metadata",
    image_key: str | None = None,
    image_required_by: str | None = None,
) -> list[PromptRecord]:
    """The prompt rows of a JSONL file. With ``image_key``, a row's value under it is its
    conditioning image: a non-empty string naming an existing file, relative to the
    file's directory. With ``image_required_by`` (the family's name), every row must
    carry one. Every violation is a :class:`PromptDataError` naming FILE:LINE."""
    path = Path(path)
    records: list[PromptRecord] = []
    for where, row in jsonl_rows(path):
        if input_key not in row:
            raise PromptDataError(f"{where}: no {input_key!r} key (set --input-key to the prompt's key)")
        prompt = row[input_key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptDataError(f"{where}: {input_key!r} must be a non-empty string, got {prompt!r}")
        metadata = row.get(metadata_key, {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise PromptDataError(f"{where}: {metadata_key!r} must be a JSON object, got {type(metadata).__name__}")
        image = None
        if image_key is not None:
            image = _row_image(path, where, row, image_key, image_required_by)
        records.append(PromptRecord(prompt, metadata, len(records), image))
    if not records:
        raise PromptDataError(f"{path}: no prompts (empty file)")
    return records


def _row_image(path: Path, where: str, row: dict[str, Any], key: str, required_by: str | None) -> str | None:
    """A row's conditioning image as an absolute path (servers a run starts need not share
    its working directory), checked to exist now rather than at the first request."""
    if key not in row:
        if required_by is not None:
            raise PromptDataError(
                f"{where}: no {key!r} key: the {required_by} family is image-to-video (set --image-key to the image's key)"
            )
        return None
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise PromptDataError(f"{where}: {key!r} must be a non-empty string (an image path), got {value!r}")
    image = Path(value)
    if not image.is_absolute():
        image = path.parent / image
    image = image.absolute()
    if not image.is_file():
        raise PromptDataError(f"{where}: {key!r}: no such image file {image}")
    return str(image)


def run_image_options(config: Any) -> dict[str, Any]:
    """:func:`load_prompts`' image keywords for a run's prompt files: none for a text-only
    family (``--image-key`` is not read), ``image_key`` for one that takes an image, and
    ``image_required_by`` too for one that needs it."""
    from miles_core.config.resolve import family_image_input

    mode, name = family_image_input(config)
    if mode == "none":
        return {}
    return {"image_key": getattr(config, "image_key", "image"), "image_required_by": name if mode == "required" else None}


@runtime_checkable
class DataSource(Protocol):
    """What a run asks of its prompt source: the built-in :class:`PromptSource` over
    ``--prompt-data``, or a ``--data-source-path`` class, built as ``cls(config,
    records)`` (``records``: the ``--prompt-data`` rows, None under
    ``--disable-rollout-global-dataset``). An optional ``epoch_of(rollout_id) -> int``
    gives the step strategies their epoch (0 without it). See docs/customization.md."""

    def batch(self, rollout_id: int) -> Sequence[PromptRecord]:
        """The ``--rollout-batch-size`` prompts of rollout ``rollout_id``, called once
        per rollout, in order."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to go on where it stands (JSON-like values and tensors),
        saved in each checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` when a run resumes (``--load``)."""
        ...


class PromptSource:
    """Prompts for each rollout, a pure function of the rollout id: rollout ``r`` takes
    positions ``r*B .. r*B+B-1`` of an endless sequence of epochs, each epoch a
    permutation of the file seeded by ``(seed, epoch)``. A resumed or replayed rollout
    gets the same prompts."""

    def __init__(self, records: list[PromptRecord], *, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def epoch_of(self, rollout_id: int) -> int:
        return rollout_id * self.batch_size // len(self.records)

    def batch(self, rollout_id: int) -> list[PromptRecord]:
        size = len(self.records)
        out = []
        for position in range(rollout_id * self.batch_size, (rollout_id + 1) * self.batch_size):
            epoch, offset = divmod(position, size)
            out.append(self.records[self.epoch_order(epoch)[offset]])
        return out

    def state_dict(self) -> dict[str, Any]:
        # Stateless: a resumed run recomputes any batch from its rollout id.
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass
