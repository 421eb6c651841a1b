"""Scoring a rollout's samples with the selected reward (``--rm-type`` or
``--custom-rm-path``)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from miles_core.rollout.sample import Sample


class RewardError(RuntimeError):
    """A reward that failed or returned something unusable."""


class RewardScorer:
    def __init__(self, config: Any) -> None:
        from miles_core.plugin_manager import get_host
        from miles_core.refs import resolve_path_flag

        self.config = config
        if config.custom_rm_path:
            self.name = config.custom_rm_path
            self.custom = resolve_path_flag("--custom-rm-path", config.custom_rm_path, "async_callable")
            self.reward = None
        elif config.rm_type:
            self.name = config.rm_type
            self.custom = None
            self.reward = get_host().registries.reward.get(config.rm_type).load()(config)
        else:
            raise RewardError("no reward: set --rm-type (a registered reward) or --custom-rm-path")

    async def score(self, samples: Sequence[Sample]) -> torch.Tensor:
        if self.custom is not None:
            values = await self.custom(self.config, list(samples))
        else:
            values = self.reward(
                [s.pixels for s in samples], [s.prompt for s in samples], [s.metadata for s in samples]
            )
        values = list(values)
        if len(values) != len(samples):
            raise RewardError(f"reward {self.name} returned {len(values)} values for {len(samples)} samples")
        bad = [i for i, v in enumerate(values) if not isinstance(v, (int, float)) or not math.isfinite(float(v))]
        if bad:
            raise RewardError(f"reward {self.name} returned a non-finite or non-numeric value for sample(s) {bad[:8]}")
        for sample, value in zip(samples, values):
            sample.reward = float(value)
        return torch.tensor([float(v) for v in values], dtype=torch.float32)
