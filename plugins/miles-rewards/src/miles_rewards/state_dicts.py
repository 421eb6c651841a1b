"""A preference model's checkpoint file as a state dict, checked against the architecture
its shapes describe: what ``hpsv2`` and ``imagereward`` share to map a foreign
checkpoint onto transformers' classes. Every refusal is one line naming the flag and the
path (:class:`~miles_core.api.RewardError`)."""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from miles_core.api import RewardError


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message (its class name when there is none)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def load_failure(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line: an object it
    does not load (its class named), or no readable checkpoint at all."""
    text = str(exc)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if isinstance(exc, pickle.UnpicklingError) and refused:
        return (
            f"holds a pickled {refused.group(1)}; checkpoints are read with torch.load(weights_only=True), "
            "which loads tensors and plain containers only, never arbitrary objects"
        )
    detail = re.search(r"WeightsUnpickler error: (.+)", text)
    return f"not a torch checkpoint ({type(exc).__name__}: {detail.group(1).strip() if detail else first_line(exc)})"


def read_state_dict(path: str | None, flag: str, *, reward: str, expected_file: str) -> dict[str, torch.Tensor]:
    """The state dict in the checkpoint file at ``path`` (bare, or under ``'state_dict'``),
    read with ``weights_only=True``. ``expected_file`` says which file the flag wants (for
    the messages): ``ImageReward.pt from the hub repo THUDM/ImageReward``."""
    if not path:
        raise RewardError(f"{flag} is required with the {reward} reward")
    file = Path(path).expanduser()
    if not file.exists():
        raise RewardError(f"{flag} {path}: no such file ({expected_file})")
    if not file.is_file():
        raise RewardError(f"{flag} {path}: not a file (the checkpoint file itself is expected: {expected_file})")
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RewardError(f"{flag} {path}: {load_failure(exc)}") from exc
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(state, dict) or not state or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise RewardError(
            f"{flag} {path}: not a state dict (expected a dict of tensors, or one under 'state_dict'; got {type(loaded).__name__})"
        )
    return state


def layer_count(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    """How many numbered blocks ``prefix0.``, ``prefix1.``, ... the state dict holds."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    indices = [int(match.group(1)) for key in state if (match := pattern.match(key))]
    return max(indices) + 1 if indices else 0


def listing(keys: list[str]) -> str:
    """The first three keys and how many more."""
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def check_layout(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    error: str,
    *,
    ignored: Iterable[str] = (),
) -> None:
    """``state`` has exactly the keys of ``expected`` (besides ``ignored``), each of its
    shape, as a strict ``load_state_dict`` would; else a :class:`RewardError` starting
    with ``error`` (``--flag PATH: not <architecture>``)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(ignored))
    if missing or unexpected:
        parts = ([f"missing {listing(missing)}"] if missing else []) + ([f"unexpected {listing(unexpected)}"] if unexpected else [])
        raise RewardError(f"{error}: {'; '.join(parts)}")
    wrong = [key for key, shape in expected.items() if tuple(state[key].shape) != tuple(shape)]
    if wrong:
        key = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise RewardError(f"{error}: {key} has shape {list(state[key].shape)}, expected {list(expected[key])}{more}")
