"""A rollout sample: one generated output with everything training needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.engine.request import RolloutOutput


@dataclass
class Sample:
    prompt: str
    metadata: dict[str, Any]
    rollout_id: int
    group_index: int
    """Monotonic over the run (see :mod:`miles_core.rollout.seeds`)."""
    index_in_group: int
    seed: int
    """The output's own seed: microgroup seed + its index in the microgroup."""
    sde_step_indices: tuple[int, ...]
    output: RolloutOutput
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    remove_sample: bool = False
    """Set by a per-sample filter: kept for advantage normalisation, masked in the loss."""

    @property
    def pixels(self) -> torch.Tensor:
        return self.output.generated_output

    @property
    def log_probs(self) -> torch.Tensor | None:
        return self.output.rollout_log_probs
