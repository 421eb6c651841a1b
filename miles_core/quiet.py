"""The hub libraries' progress bars and notices in our commands: silenced while a tiny
local pipeline the families build (``miles-core make-tiny``) loads (loading it needs
neither, and they drown the command's own output), shown for everything else (a hub id, a
real local checkpoint, a reward model the same run loads from the hub: a 40 GB download
needs its progress bar, and a load warning may matter).

The silence is scoped to the tiny pipeline's load (:func:`quiet_hub_load`, around every
pipeline load: ``ModelFamily.load_pipeline``), never set for the whole process through the
environment (``HF_HUB_DISABLE_PROGRESS_BARS``), which would reach every later download and
every child process too. Only a process that loads nothing but tiny pipelines it builds
(``make-tiny``, the benchmarks) quiets the libraries for good (:func:`quiet_hub_libraries`).

A tiny pipeline is recognised by the marker file (:data:`TINY_MARKER`) every family's
tiny builder writes into it (``miles_core.api.mark_tiny``; ``miles-core make-tiny`` and the
tests' pipelines alike), not by its name or size."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TINY_MARKER = "miles-tiny.json"
HUB_LOGGERS = ("transformers", "diffusers", "huggingface_hub")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def mark_tiny(directory: Path, **about: Any) -> Path:
    """Mark ``directory`` as a tiny local pipeline (``about``: what built it)."""
    path = Path(directory) / TINY_MARKER
    path.write_text(json.dumps({"tiny": True, **about}, sort_keys=True) + "\n", encoding="utf-8")
    return path


def is_local_tiny(checkpoint: str | Path | None) -> bool:
    """Whether ``checkpoint`` is a local tiny pipeline (its directory holds the marker)."""
    if not checkpoint:
        return False
    return (Path(checkpoint) / TINY_MARKER).is_file()


def _set_hub_libraries(verbosity: int, bars: bool) -> None:
    import diffusers
    import huggingface_hub
    import transformers

    transformers.logging.set_verbosity(verbosity)
    diffusers.utils.logging.set_verbosity(verbosity)
    huggingface_hub.utils.logging.set_verbosity(verbosity)
    if bars:
        transformers.logging.enable_progress_bar()
        diffusers.utils.logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()
    else:
        transformers.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


def show_hub_libraries(level: str = "info") -> None:
    """The hub libraries log at ``level`` (``--log-level``) for the rest of the process:
    info and debug show download progress bars; info and warning their load warnings
    (their info records are chatty), debug everything."""
    number = LEVELS[level]
    _set_hub_libraries(logging.DEBUG if number <= logging.DEBUG else max(number, logging.WARNING), number <= logging.INFO)


def quiet_hub_libraries() -> None:
    """Errors only and no progress bars from the hub libraries for the rest of the process:
    for a process that loads nothing but the tiny pipelines it builds (``make-tiny``, the
    benchmarks). A command that may load a checkpoint of the user's calls
    :func:`show_hub_libraries` instead."""
    _set_hub_libraries(logging.ERROR, False)


@contextmanager
def quiet_hub_load(checkpoint: str | Path | None) -> Iterator[bool]:
    """While the block loads ``checkpoint``: the hub libraries quiet (errors only, no
    progress bars) when it is a local tiny pipeline, as they were otherwise; after the
    block, as they were. Yields whether they were quieted."""
    if not is_local_tiny(checkpoint):
        yield False
        return
    import diffusers
    import huggingface_hub
    import transformers

    verbosities = (
        transformers.logging.get_verbosity(),
        diffusers.utils.logging.get_verbosity(),
        huggingface_hub.utils.logging.get_verbosity(),
    )
    bars = (
        transformers.utils.logging.is_progress_bar_enabled(),
        diffusers.utils.logging.is_progress_bar_enabled(),
        not huggingface_hub.utils.are_progress_bars_disabled(),
    )
    quiet_hub_libraries()
    try:
        yield True
    finally:
        transformers.logging.set_verbosity(verbosities[0])
        diffusers.utils.logging.set_verbosity(verbosities[1])
        huggingface_hub.utils.logging.set_verbosity(verbosities[2])
        (transformers.logging.enable_progress_bar if bars[0] else transformers.logging.disable_progress_bar)()
        (diffusers.utils.logging.enable_progress_bar if bars[1] else diffusers.utils.logging.disable_progress_bar)()
        (huggingface_hub.utils.enable_progress_bars if bars[2] else huggingface_hub.utils.disable_progress_bars)()


__all__ = [
    "HUB_LOGGERS",
    "LEVELS",
    "TINY_MARKER",
    "is_local_tiny",
    "mark_tiny",
    "quiet_hub_libraries",
    "quiet_hub_load",
    "show_hub_libraries",
]
