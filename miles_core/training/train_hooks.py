"""The training-side customization hooks: from samples to train pairs, and from a
micro-batch of pairs to the model's inputs.

- ``--custom-convert-samples-to-train-data-path``: replaces the whole conversion
  (advantages and pair expansion)::

      def convert(config, samples: list[Sample], family: ModelFamily) -> list[TrainPair]

- ``--custom-expand-samples-to-train-pairs-path``: replaces only the expansion; the
  advantages are the run's (GRPO or ``--custom-reward-post-process-path``)::

      def expand(config, samples: list[Sample], advantages: torch.Tensor, family: ModelFamily) -> list[TrainPair]

  Both take the configuration first, as the reference's hooks do; the built-in
  :func:`~miles_core.training.pairs.build_pairs` has the expansion's signature.
- ``--custom-prepare-train-batch-path``: replaces :func:`~miles_core.training.pairs.collate`::

      def prepare(batch: list[TrainPair], config) -> dict[str, Any]

  returning collate's keys (``engine_velocity`` may be left out).

What a hook returns is checked here; every error is one line naming the flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_core.family import Conditioning, GenerationParams, ModelFamily
from miles_core.plugin_manager import loss_spec
from miles_core.refs import resolve_path_flag
from miles_core.training.pairs import TrainPair, build_pairs, collate

CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"
EXPAND_FLAG = "--custom-expand-samples-to-train-pairs-path"
PREPARE_FLAG = "--custom-prepare-train-batch-path"

ROW_KEYS: tuple[str, ...] = ("timestep", "sigma", "sigma_next", "old_log_prob", "advantages", "loss_mask")
"""Keys of a prepared batch holding one row per pair."""
STREAM_KEYS: tuple[str, ...] = ("x", "x_next")
"""Keys holding ``{stream: [B, ...]}``."""
BATCH_KEYS: tuple[str, ...] = (*STREAM_KEYS, *ROW_KEYS, "sigma_max", "cond", "params")
"""What a prepared batch must hold (``engine_velocity`` is optional)."""

PairSource = Callable[[Any, Sequence[Any], torch.Tensor], list[TrainPair]]
"""``(config, samples, advantages) -> pairs`` for one rollout, hooks applied."""


def pair_source(config: Any, family: ModelFamily) -> PairSource:
    """How the trainer turns a rollout into train pairs: the built-in expansion, or the
    hook the configuration names (loaded now, so a bad path fails before training)."""
    convert_path = getattr(config, "custom_convert_samples_to_train_data_path", None)
    expand_path = getattr(config, "custom_expand_samples_to_train_pairs_path", None)
    for flag, path in ((CONVERT_FLAG, convert_path), (EXPAND_FLAG, expand_path)):
        if path and loss_spec(config).trains_on != "sde_transitions":
            raise ValueError(
                f"{flag} {path}: --loss-type {config.loss_type} does not train on (sample, SDE step) pairs; "
                "the hook applies to pair losses (policy_loss, custom_loss)"
            )
    if convert_path and expand_path:
        raise ValueError(
            f"{CONVERT_FLAG} {convert_path}: replaces the whole conversion, pair expansion included; "
            f"it cannot be combined with {EXPAND_FLAG} {expand_path}"
        )
    if convert_path:
        convert = resolve_path_flag(CONVERT_FLAG, convert_path, "callable")

        def converted(config: Any, samples: Sequence[Any], advantages: torch.Tensor) -> list[TrainPair]:
            # The run's advantages are not used: the hook computes its own.
            return check_pairs(convert(config, list(samples), family), samples, family, f"{CONVERT_FLAG} {convert_path}")

        return converted
    if expand_path:
        expand = resolve_path_flag(EXPAND_FLAG, expand_path, "callable")

        def expanded(config: Any, samples: Sequence[Any], advantages: torch.Tensor) -> list[TrainPair]:
            return check_pairs(expand(config, list(samples), advantages, family), samples, family, f"{EXPAND_FLAG} {expand_path}")

        return expanded
    return lambda config, samples, advantages: build_pairs(config, samples, advantages, family)


def check_pairs(pairs: Any, samples: Sequence[Any], family: ModelFamily, where: str) -> list[TrainPair]:
    """A hook's train pairs, checked; a pair without a ``denoiser`` gets the family's
    (:meth:`~miles_core.family.ModelFamily.denoiser_for`). ``where`` starts each error
    (the flag and its value)."""
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"{where}: must return a list of TrainPair, got {type(pairs).__name__}")
    if not pairs:
        raise ValueError(f"{where}: returned no train pairs for {len(samples)} samples")
    streams = set(family.latent_streams)
    components = family.components()
    seen: set[tuple[int, int]] = set()
    for i, pair in enumerate(pairs):
        if not isinstance(pair, TrainPair):
            raise ValueError(f"{where}: item {i} must be a TrainPair, got {type(pair).__name__}")
        if isinstance(pair.sample_index, bool) or not isinstance(pair.sample_index, int) or not 0 <= pair.sample_index < len(samples):
            raise ValueError(f"{where}: pair {i} has sample_index {pair.sample_index!r}, not in [0, {len(samples)})")
        key = (pair.sample_index, pair.step)
        if key in seen:
            raise ValueError(f"{where}: pair {i} repeats (sample {pair.sample_index}, step {pair.step}); a pair is one transition")
        seen.add(key)
        for field in ("x", "x_next"):
            value = getattr(pair, field)
            if not isinstance(value, dict) or set(value) != streams:
                got = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise ValueError(f"{where}: pair {i}.{field} must map the family's streams {sorted(streams)}, got {got}")
        for field in ("advantage", "old_log_prob", "loss_mask"):
            value = getattr(pair, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}: pair {i}.{field} must be a finite number, got {value!r}")
        if pair.denoiser is None:
            pair.denoiser = family.denoiser_for(pair.timestep, pair.params)
        elif pair.denoiser not in components:
            raise ValueError(f"{where}: pair {i}.denoiser {pair.denoiser!r} is not a component of the family ({', '.join(components)})")
    return list(pairs)


def batch_preparer(config: Any) -> Callable[[list[TrainPair]], dict[str, Any]]:
    """How a micro-batch becomes the forward's and the loss's inputs: :func:`collate`, or
    the ``--custom-prepare-train-batch-path`` function with its result checked."""
    path = getattr(config, "custom_prepare_train_batch_path", None)
    if not path:
        return collate
    prepare = resolve_path_flag(PREPARE_FLAG, path, "callable")

    def prepared(batch: list[TrainPair]) -> dict[str, Any]:
        return check_prepared(prepare(batch, config), len(batch), f"{PREPARE_FLAG} {path}")

    return prepared


def check_prepared(data: Any, rows: int, where: str) -> dict[str, Any]:
    """A prepared batch, checked: collate's keys, ``rows`` rows per tensor."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must return a dict with the keys of collate, got {type(data).__name__}")
    missing = [key for key in BATCH_KEYS if key not in data]
    if missing:
        raise ValueError(f"{where}: the returned batch lacks {', '.join(missing)} (needs {', '.join(BATCH_KEYS)})")
    data = dict(data)
    data.setdefault("engine_velocity", None)

    def check_rows(name: str, value: Any) -> None:
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != rows:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"{where}: {name} must be a tensor with {rows} rows (one per pair), got {shape}")

    for key in ROW_KEYS:
        check_rows(key, data[key])
    for key in STREAM_KEYS:
        if not isinstance(data[key], dict) or not data[key]:
            raise ValueError(f"{where}: {key} must map latent streams to tensors, got {type(data[key]).__name__}")
        for stream, value in data[key].items():
            check_rows(f"{key}[{stream!r}]", value)
    if data["x"].keys() != data["x_next"].keys():
        raise ValueError(f"{where}: x and x_next have different streams ({sorted(data['x'])} vs {sorted(data['x_next'])})")
    if not isinstance(data["cond"], Conditioning):
        raise ValueError(f"{where}: cond must be a Conditioning, got {type(data['cond']).__name__}")
    if not isinstance(data["params"], GenerationParams):
        raise ValueError(f"{where}: params must be a GenerationParams, got {type(data['params']).__name__}")
    if data["engine_velocity"] is not None:
        check_rows("engine_velocity", data["engine_velocity"])
    return data


__all__ = [
    "BATCH_KEYS",
    "CONVERT_FLAG",
    "EXPAND_FLAG",
    "PREPARE_FLAG",
    "batch_preparer",
    "check_pairs",
    "check_prepared",
    "pair_source",
]
