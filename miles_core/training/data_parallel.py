"""Splitting an optimizer step's samples across data-parallel ranks (``--train-dp-split-mode``).

Every optimizer step trains ``--global-batch-size`` samples; each of the ``world``
data-parallel ranks trains ``global_batch_size / world`` of them and the gradients are
averaged, so the step sees the same samples whatever the world size. Which share a rank
gets:

- ``contiguous``: rank ``r`` takes the ``r``-th consecutive block. Samples arrive in seed
  order, microgroup by microgroup, so when the block size is a multiple of
  ``--rollout-microgroup-size`` every microgroup lands whole on one rank, and a
  micro-batch there can reproduce the engine's batch exactly (the alignment probe);
- ``stride``: rank ``r`` takes samples ``r, r + world, r + 2·world, ...`` (round-robin),
  spreading each prompt group over the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

FLAG = "--train-dp-split-mode"
SPLIT_MODES: tuple[str, ...] = ("contiguous", "stride")


def shard_for_rank(items: Sequence[T], rank: int, world: int, mode: str) -> list[T]:
    """Rank ``rank``'s share of ``items`` out of ``world`` equal shares, order kept.

    Raises:
        ValueError: an unknown ``mode``, a rank outside ``[0, world)``, or a count of
            items that ``world`` does not divide (ranks must train equal shares for the
            averaged gradient to be the step's mean).
    """
    if mode not in SPLIT_MODES:
        raise ValueError(f"{FLAG} {mode}: must be one of {', '.join(SPLIT_MODES)}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{FLAG} {mode}: data-parallel rank {rank} is not in [0, {world}) (data-parallel size {world})")
    count = len(items)
    if count % world:
        raise ValueError(
            f"{FLAG} {mode}: {count} samples do not split evenly over {world} data-parallel ranks "
            f"({count} % {world} = {count % world}); --global-batch-size must be a multiple of the data-parallel size"
        )
    if mode == "stride":
        return list(items[rank::world])
    share = count // world
    return list(items[rank * share : (rank + 1) * share])


__all__ = ["FLAG", "SPLIT_MODES", "shard_for_rank"]
