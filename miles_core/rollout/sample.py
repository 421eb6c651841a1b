"""A rollout sample: one generated output with everything training needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.request import RolloutOutput


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
    """The trained scalar (NaN when the sample's reward failed)."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Each weighted reward of a mixture (``--reward-weights``), or the other keys of a
    dict-valued reward; empty for a plain single reward."""
    reward_failed: bool = False
    """Its reward raised or returned no finite number: it is left out of the group
    statistics, gets advantage 0 and is masked in the loss (``remove_sample``)."""
    reward_failures: dict[str, bool] = field(default_factory=dict)
    """Each reward that scored it (by its metric name: a registered reward, or
    ``custom_rm``) -> whether that reward failed for it; what ``<reward>_failed`` counts,
    kept in rollout dumps so a replay reports the same."""
    image: str | None = None
    """The conditioning image its request carried (its prompt row's, for an
    image-to-video family), for rewards and reports; None for a text prompt."""
    remove_sample: bool = False
    """Set by a per-sample filter: kept for advantage normalisation, masked in the loss.
    Also set for a sample whose reward failed (which is *not* kept for normalisation)."""

    @property
    def pixels(self) -> torch.Tensor:
        return self.output.generated_output

    @property
    def log_probs(self) -> torch.Tensor | None:
        return self.output.rollout_log_probs
