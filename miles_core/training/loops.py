"""The run loop for each kind of training data (:data:`miles_core.specs.TRAINING_DATA`):
a loss's spec says what it trains on, and that picks the loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from miles_core.errors import RunError
from miles_core.specs import LossSpec
from miles_core.training.run_context import RunContext

Loop = Callable[[RunContext], AsyncIterator[tuple[dict[str, Any], Any]]]


def loop_for(spec: LossSpec) -> Loop:
    """The loop that trains ``spec``'s kind of data."""
    if spec.trains_on in ("sde_transitions", "nft_pairs", "preference_pairs"):
        from miles_core.training.rl_loop import rl_rollouts

        return rl_rollouts
    if spec.trains_on == "supervised_rows":
        from miles_core.training.sft import sft_rollouts

        return sft_rollouts
    raise RunError(f"--loss-type {spec.name}: no run loop trains on {spec.trains_on!r} data in this version")


def rollouts(run: RunContext) -> AsyncIterator[tuple[dict[str, Any], Any]]:
    """The run's loop, chosen by what its loss trains on: ``(metrics, samples)`` per rollout."""
    return loop_for(run.loss_spec)(run)


def rolls_out(spec: LossSpec) -> bool:
    """Whether a loss of this kind needs rollouts (an engine and a reward)."""
    return spec.trains_on != "supervised_rows"
