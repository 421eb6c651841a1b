"""What every tracker logs the same way: a record's scalars, its per-optimizer-step lists
as rows against the optimizer step, and a sample's pixels as the uint8 frames
:mod:`miles_core.media` encodes."""

from __future__ import annotations

import math
from typing import Any

import torch


def _scalar(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def scalars(metrics: dict[str, Any]) -> dict[str, float | int]:
    """A record's finite scalars (booleans as 0/1), ``rollout_id`` left out: what a
    tracker plots against the rollout."""
    row = {key: _scalar(value) for key, value in metrics.items() if key != "rollout_id"}
    return {key: value for key, value in row.items() if value is not None}


def per_step_rows(metrics: dict[str, Any]) -> list[tuple[int, dict[str, float | int]]]:
    """Each per-optimizer-step list of a record (``train/<name>_per_step``) as one row per
    step: ``(train_step, {"train_step/<name>": value})`` with ``train_step = rollout_id x
    steps + i`` (``steps``: the longest list), non-finite values left out."""
    rollout_id = int(metrics["rollout_id"])
    lists = {
        key.removeprefix("train/").removesuffix("_per_step"): value
        for key, value in metrics.items()
        if key.endswith("_per_step") and isinstance(value, list)
    }
    if not lists:
        return []
    steps = max(len(v) for v in lists.values())
    rows = []
    for i in range(steps):
        row = {f"train_step/{name}": _scalar(values[i]) for name, values in lists.items() if i < len(values)}
        rows.append((rollout_id * steps + i, {key: value for key, value in row.items() if value is not None}))
    return rows


def uint8_frames(pixels: torch.Tensor) -> Any:
    """``[C, H, W]`` -> ``[H, W, C]`` or ``[C, F, H, W]`` -> ``[F, H, W, C]`` uint8 numpy
    (values in [0, 1] scaled to 0..255 and rounded, as diffusers' ``numpy_to_pil``): the
    frames :mod:`miles_core.media` encodes."""
    data = (pixels.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    return data.movedim(0, -1).contiguous().numpy()


__all__ = ["per_step_rows", "scalars", "uint8_frames"]
