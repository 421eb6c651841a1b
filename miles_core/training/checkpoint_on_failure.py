"""The checkpoint a run keeps when it fails mid-run (``--save``): the infrastructure
around the trainer failed (an engine, the router, a reward worker, a weight-update group,
the cluster) or the user stopped it (Ctrl-C), and the trainer still holds a rollout's
exact end state, so the rollouts trained since the last ``--save-interval`` checkpoint
are not lost. :func:`miles_core.training.run.train` calls :class:`FailureCheckpoint`
after each rollout's record and once when its loop raises.

Which rollout: the loops keep :attr:`RunContext.settled
<miles_core.training.run_context.RunContext.settled>`, the last rollout whose train phase
is over. A rollout runs generate, score, train, sync, evaluate, then its record is
written (and an interval checkpoint, if due). So a failure

- before rollout N trains (generation, scoring) finds the trainer exactly as rollout N-1
  left it: checkpoint N-1 (the last record), with the RNG and ``--data-source-path``
  state as they were at that record, since generating N may have moved them;
- after rollout N trained (its weight sync, its evaluation) finds the trainer exactly as
  rollout N left it: checkpoint N. Its record is not written (its sync and evaluation
  metrics do not exist); resuming from N starts at N+1 with a sync of these weights,
  which is what the sync that failed would have given the engines. Checkpointing N-1
  instead is impossible: the trainer no longer holds it;
- while rollout N trains (its optimizer steps half applied) keeps nothing new.

A failure that may mean the trainer's state is bad (a non-finite log-probability or
loss, every reward failing, a bug in a hook) keeps nothing new either: the last interval
checkpoint stays the one to resume from.
"""

from __future__ import annotations

import asyncio
import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from miles_core.errors import (
    ClusterError,
    EngineRequestError,
    FleetError,
    MilesError,
    NoHealthyEngineError,
    RewardWorkerDiedError,
    SglangEngineError,
    WeightsMismatchError,
    WeightSyncError,
)
from miles_core.training.run_context import RunContext

INFRASTRUCTURE_FAILURES: tuple[type[BaseException], ...] = (
    EngineRequestError,  # an engine (or the router in front of it) that died or refused
    NoHealthyEngineError,
    FleetError,
    SglangEngineError,
    WeightSyncError,  # WeightGroupError too: the weight-update group broke
    WeightsMismatchError,
    RewardWorkerDiedError,
    ClusterError,
)
"""Failures outside the trainer: its state is as good as before they happened.
:class:`~miles_core.errors.RewardsFailedError` is not one: a policy that diverged makes
images no reward can score."""

STOPS: tuple[type[BaseException], ...] = (KeyboardInterrupt, asyncio.CancelledError)
"""The user stopping the run (Ctrl-C cancels ``asyncio.run``'s task)."""


def keeps_a_checkpoint(exc: BaseException) -> bool:
    """Whether a run that fails with ``exc`` keeps a checkpoint of its last settled rollout."""
    return isinstance(exc, INFRASTRUCTURE_FAILURES + STOPS)


class FailureCheckpoint:
    """What the checkpoint of a failed run needs that the failure may have moved on,
    captured at each record an interval save did not follow, and the save itself."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.recorded = run.start - 1
        """The last rollout whose record is written."""
        self.saved: int | None = None
        """The last rollout this run checkpointed."""
        self._rng: Any = None
        self._data_source: Any = None
        self._guard: Any = None

    def recorded_rollout(self, rollout_id: int, *, saved: bool) -> None:
        """Rollout ``rollout_id``'s record is written (and, with ``saved``, its checkpoint).
        Without a checkpoint, keep what one written now would hold besides the trainer's
        state: the RNG streams, a custom data source's state and the guard's."""
        from miles_core.training.checkpoint import capture_rng

        self.recorded = rollout_id
        if saved:
            self.saved, self._rng, self._data_source, self._guard = rollout_id, None, None, None
        elif self.run.config.save:
            self._rng = capture_rng()
            if self.run.guard is not None:
                self._guard = _Frozen(copy.deepcopy(self.run.guard.state_dict()))
            source = self.run.data_source
            if self.run.config.data_source_path and source is not None:
                self._data_source = copy.deepcopy(source.state_dict())

    async def keep(self, exc: BaseException) -> None:
        """After the run's loop raised ``exc``: checkpoint the last settled rollout when
        ``exc`` is an infrastructure failure or a stop, ``--save`` is set and this run
        trained it, and log one line saying where it is. A failure of this save is logged
        in one line and swallowed: the caller re-raises ``exc``. An infrastructure failure
        that exits 2 (a cluster or sglang error) exits 1 once something was trained."""
        run, config = self.run, self.run.config
        if not keeps_a_checkpoint(exc):
            return
        rollout = run.settled
        if isinstance(exc, MilesError) and exc.exit_code != 1 and (rollout is None or rollout >= run.start):
            exc.exit_code = 1  # mid-run: the run was configured well enough to train
        if not config.save:
            return
        if rollout is None:
            run.log(f"no checkpoint kept: the run stopped while rollout {self.recorded + 1} trained (its optimizer steps half applied)")
            return
        if rollout < run.start:
            return  # nothing trained in this run: the checkpoint it started from, if any, stays
        from miles_core.training.checkpoint import iteration_dir

        where = iteration_dir(Path(config.save), rollout)
        if rollout == self.saved:
            run.log(f"checkpoint kept at rollout {rollout}: {where} (written before the failure)")
            return
        if rollout == self.recorded:
            rng, data_source = self._rng, _Frozen(self._data_source) if self._data_source is not None else run.data_source
            guard = self._guard
        elif rollout == self.recorded + 1:
            rng, data_source, guard = None, run.data_source, run.guard  # trained just now: nothing has moved since
        else:  # not a state this class knows how to save
            return
        try:
            await self._save(rollout, rng, data_source, guard)
        except Exception as failure:  # the run's own error is the one to report
            run.log(f"checkpoint at rollout {rollout} not kept: {type(failure).__name__}: {' '.join(str(failure).split())}")
            return
        note = "" if rollout == self.recorded else " (its record is not in metrics.jsonl: the run failed after it trained)"
        run.log(f"checkpoint kept at rollout {rollout}: {where}{note}")

    async def _save(self, rollout: int, rng: Any, data_source: Any, guard: Any) -> None:
        from miles_core.training.run_state import save_run_state

        run = self.run
        # --offload-train: the trainer's state comes back to be saved (the engine, which
        # may be the part that failed, is left as it is).
        resident = run.turns.trainer_resident() if run.turns is not None else nullcontext()
        async with resident:
            save_run_state(
                run.config, run.trainer, rollout, data_source, run.schedule, resumed_from=run.resumed_from, rng_state=rng, guard=guard
            )
        self.saved = rollout


class _Frozen:
    """A data source's (or the guard's) state as it was at a record (``state_dict`` only)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


__all__ = ["INFRASTRUCTURE_FAILURES", "STOPS", "FailureCheckpoint", "keeps_a_checkpoint"]
