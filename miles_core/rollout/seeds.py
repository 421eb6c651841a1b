"""The seed layout (docs/design.md, "Seeds and microgroups").

``seed_base = (rollout_seed + group_index * n) % 2**31`` for a prompt group of ``n``
samples; a microgroup starting at offset ``o`` of its group sends ``seed_base + o``, and
the engine gives output *i* the seed ``seed_base + o + i``. ``group_index`` counts every
group of the run, so no two samples of a run share a seed (until the 2**31 wrap).
"""

from __future__ import annotations

from dataclasses import dataclass

SEED_MODULUS = 2**31


@dataclass(frozen=True)
class Microgroup:
    group_index: int
    offset: int
    """Index of the microgroup's first sample in its group (0, M, 2M, ...)."""
    size: int
    seed: int
    """The request's seed; output i uses ``seed + i``."""


def group_seed_base(rollout_seed: int, group_index: int, n_samples_per_prompt: int) -> int:
    return (rollout_seed + group_index * n_samples_per_prompt) % SEED_MODULUS


def group_index(rollout_id: int, prompt_position: int, rollout_batch_size: int) -> int:
    """Monotonic over the run: rollout ``r``'s ``j``-th prompt group."""
    return rollout_id * rollout_batch_size + prompt_position


def microgroups(rollout_seed: int, group: int, n_samples_per_prompt: int, microgroup_size: int) -> list[Microgroup]:
    """Split one group into requests of at most ``microgroup_size`` outputs."""
    if microgroup_size < 1 or n_samples_per_prompt < 1:
        raise ValueError("group and microgroup sizes must be positive")
    base = group_seed_base(rollout_seed, group, n_samples_per_prompt)
    return [
        Microgroup(group, offset, min(microgroup_size, n_samples_per_prompt - offset), base + offset)
        for offset in range(0, n_samples_per_prompt, microgroup_size)
    ]
