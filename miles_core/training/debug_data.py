"""Debug dumps of a run: each rollout's samples (``--save-debug-rollout-data``), replayed
with no engine (``--load-debug-rollout-data``), and what training saw of them
(``--save-debug-train-data``). ``--dump-details DIR`` sets both save templates.

Files are msgpack documents written with :mod:`miles_core.engine.wire` (tensors as
safetensors records, nothing pickled); a path template is formatted with the rollout id
(``{}`` or ``{rollout_id}``).

Rollout data: ``{"format": ROLLOUT_FORMAT, "version", "rollout_id", "samples": [...],
"rewards": tensor [N], "outputs": bytes}`` where each sample record holds the prompt,
metadata, group index, index in group, seed, SDE steps, reward (NaN when it failed),
reward components, ``reward_failed``, ``reward_failures`` (per reward) and ``remove_sample`` (files written before
``reward_failed`` existed read as not failed), and ``outputs`` is
:func:`~miles_core.engine.wire.pack_outputs` of the samples'
:class:`~miles_core.request.RolloutOutput` records (a ``/rollout/generate``
response body: pixels, log-probs, trajectories, conditioning), in the same order.

Train data: ``{"format": TRAIN_FORMAT, "version", "rollout_id", "samples": {...},
"rewards", "advantages", "pairs": {...}, "metrics"}``: per sample its seed and group,
reward, advantage and whether its reward failed; per train pair (sample, SDE step) the
sample's index, the step, the old log-probability the loss used (the engine's, or the trainer's own under
``--diffusion-recompute-old-log-prob``), the advantage and the loss mask; and the
rollout's train metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles_core.engine.wire import pack, pack_outputs, unpack, unpack_outputs
from miles_core.errors import DebugDataError, WireError
from miles_core.rollout.sample import Sample

ROLLOUT_FORMAT = "miles-core rollout data"
TRAIN_FORMAT = "miles-core train data"
VERSION = 1


def debug_path(template: str, rollout_id: int) -> Path:
    """``template`` formatted with the rollout id (``{}`` or ``{rollout_id}``)."""
    return Path(template.format(rollout_id, rollout_id=rollout_id))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)  # a crash mid-write never leaves a truncated file under the name


# -- rollout data ------------------------------------------------------------------------


def save_rollout_data(template: str, rollout_id: int, samples: Sequence[Sample], rewards: torch.Tensor) -> Path:
    """Write one rollout's samples (``--save-debug-rollout-data``); return the path."""
    path = debug_path(template, rollout_id)
    document = {
        "format": ROLLOUT_FORMAT,
        "version": VERSION,
        "rollout_id": rollout_id,
        "samples": [
            {
                "prompt": s.prompt,
                "metadata": s.metadata,
                "group_index": s.group_index,
                "index_in_group": s.index_in_group,
                "seed": s.seed,
                "sde_step_indices": list(s.sde_step_indices),
                "reward": s.reward,
                "reward_components": dict(s.reward_components),
                "reward_failed": bool(getattr(s, "reward_failed", False)),
                "reward_failures": dict(getattr(s, "reward_failures", None) or {}),
                "remove_sample": s.remove_sample,
                "image": getattr(s, "image", None),
            }
            for s in samples
        ],
        "rewards": rewards.detach().cpu(),
        "outputs": pack_outputs(s.output for s in samples),
    }
    try:
        data = pack(document)
    except WireError as exc:
        raise DebugDataError(f"--save-debug-rollout-data {path}: cannot encode the rollout ({exc})") from None
    _write(path, data)
    return path


def load_rollout_data(
    template: str, rollout_id: int, *, subsample: float | None = None, seed: int = 0
) -> tuple[list[Sample], torch.Tensor]:
    """Read one rollout saved by :func:`save_rollout_data`: its samples (rewards set) and
    the reward tensor. ``subsample`` keeps that fraction of the prompt groups (at least
    one), chosen by a generator seeded with ``(seed, rollout_id)``, in their order."""
    flag = "--load-debug-rollout-data"
    path = debug_path(template, rollout_id)
    if not path.is_file():
        raise DebugDataError(f"{flag} {template}: {path} not found (rollout {rollout_id})")
    try:
        document = unpack(path.read_bytes())
        if not isinstance(document, dict) or document.get("format") != ROLLOUT_FORMAT:
            raise WireError(f"not a rollout data file (format {document.get('format') if isinstance(document, dict) else None!r})")
        if document.get("version") != VERSION:
            raise WireError(f"version {document.get('version')!r}, this build reads version {VERSION}")
        outputs = unpack_outputs(document["outputs"])
        records = document["samples"]
        if len(records) != len(outputs):
            raise WireError(f"{len(records)} sample records for {len(outputs)} outputs")
        samples = [
            Sample(
                prompt=record["prompt"],
                metadata=dict(record["metadata"]),
                rollout_id=rollout_id,
                group_index=int(record["group_index"]),
                index_in_group=int(record["index_in_group"]),
                seed=int(record["seed"]),
                sde_step_indices=tuple(int(k) for k in record["sde_step_indices"]),
                output=output,
                reward=record["reward"],
                reward_components=dict(record["reward_components"]),
                reward_failed=bool(record.get("reward_failed", False)),
                reward_failures={str(k): bool(v) for k, v in (record.get("reward_failures") or {}).items()},
                remove_sample=bool(record["remove_sample"]),
                image=record.get("image"),
            )
            for record, output in zip(records, outputs)
        ]
        rewards = document["rewards"]
    except (WireError, KeyError, TypeError, ValueError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise DebugDataError(f"{flag} {template}: {path}: {detail}") from None
    if subsample is not None:
        samples, rewards = subsample_groups(samples, rewards, subsample, seed=seed * 1_000_003 + rollout_id)
    return samples, rewards


def subsample_groups(samples: Sequence[Sample], rewards: torch.Tensor, fraction: float, *, seed: int) -> tuple[list[Sample], torch.Tensor]:
    """Whole prompt groups (advantages normalise within a group), ``round(fraction x
    groups)`` of them and at least one, picked by ``torch.Generator().manual_seed(seed)``
    (the global RNG is untouched) and kept in their original order."""
    groups = list(dict.fromkeys(s.group_index for s in samples))
    count = max(1, min(len(groups), round(fraction * len(groups))))
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))
    kept = {groups[i] for i in order[:count].tolist()}
    positions = [i for i, s in enumerate(samples) if s.group_index in kept]
    return [samples[i] for i in positions], rewards[positions]


# -- train data --------------------------------------------------------------------------


def save_train_data(
    template: str,
    rollout_id: int,
    samples: Sequence[Sample],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    pairs: Sequence[Any],
    metrics: dict[str, Any],
) -> Path:
    """Write what one rollout's training saw (``--save-debug-train-data``); ``pairs``
    are the trainer's :class:`~miles_core.training.pairs.TrainPair` of the rollout (none
    under nft, which trains on final latents)."""
    path = debug_path(template, rollout_id)
    document = {
        "format": TRAIN_FORMAT,
        "version": VERSION,
        "rollout_id": rollout_id,
        "samples": {
            "prompt": [s.prompt for s in samples],
            "seed": [s.seed for s in samples],
            "group_index": [s.group_index for s in samples],
            "index_in_group": [s.index_in_group for s in samples],
            "remove_sample": [s.remove_sample for s in samples],
            "reward_failed": [bool(getattr(s, "reward_failed", False)) for s in samples],
        },
        "rewards": rewards.detach().cpu().to(torch.float32),
        "advantages": advantages.detach().cpu().to(torch.float32),
        "pairs": {
            "sample_index": torch.tensor([p.sample_index for p in pairs], dtype=torch.int64),
            "step": torch.tensor([p.step for p in pairs], dtype=torch.int64),
            "old_log_prob": torch.tensor([p.old_log_prob for p in pairs], dtype=torch.float64),
            "advantage": torch.tensor([p.advantage for p in pairs], dtype=torch.float64),
            "loss_mask": torch.tensor([p.loss_mask for p in pairs], dtype=torch.float32),
        },
        "metrics": {k: v for k, v in metrics.items() if k.startswith("train/")},
    }
    _write(path, pack(document))
    return path


def load_train_data(path: str | Path) -> dict[str, Any]:
    """A train data file as a dict (tensors rebuilt), for analysis."""
    document = unpack(Path(path).read_bytes())
    if not isinstance(document, dict) or document.get("format") != TRAIN_FORMAT:
        raise DebugDataError(f"{path}: not a train data file")
    return document


__all__ = [
    "DebugDataError",
    "ROLLOUT_FORMAT",
    "TRAIN_FORMAT",
    "debug_path",
    "load_rollout_data",
    "load_train_data",
    "save_rollout_data",
    "save_train_data",
    "subsample_groups",
]
