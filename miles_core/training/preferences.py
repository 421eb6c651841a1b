"""Preference pairs from rollout groups (the ``preference_pairs`` training data, online
Diffusion-DPO / Flow-DPO): each group's best and worst sample.

flow_grpo's online DPO (yifan123/flow_grpo, scripts/train_sd3_dpo.py) takes, per prompt
group, the sample of the highest reward as the chosen one and the lowest as the rejected
one. Here the ranking is by advantage, which within a group orders samples as their
rewards do (group normalisation is increasing in the reward) and also covers
``--reward-aggregation advantage``, where several rewards are mixed after normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PreferencePair:
    """One group's chosen (best) and rejected (worst) sample, as rollout positions."""

    chosen: int
    rejected: int
    group: int
    """The group's index in the rollout."""


def preference_pairs(samples: Sequence[Any], advantages: Sequence[float]) -> list[PreferencePair]:
    """One pair per group whose kept samples (not removed by a per-sample filter, reward
    not failed) differ in advantage: the highest against the lowest, the first in seed
    order on a tie. A group whose kept samples are all equal, or fewer than two, gives
    none (nothing to prefer). Groups in rollout order."""
    groups: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        if sample.remove_sample or sample.reward_failed:
            continue
        groups.setdefault(int(sample.group_index), []).append(index)
    pairs = []
    for group, members in groups.items():
        if len(members) < 2:
            continue
        values = [float(advantages[i]) for i in members]
        best = members[max(range(len(members)), key=lambda i: (values[i], -i))]
        worst = members[min(range(len(members)), key=lambda i: (values[i], i))]
        if float(advantages[best]) > float(advantages[worst]):
            pairs.append(PreferencePair(chosen=best, rejected=worst, group=group))
    return pairs
