"""What one training run holds while it runs: the record the loops, benches and tests
share (built by :func:`miles_core.training.run.prepare_run`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.engine.base import RolloutEngine


@dataclass
class RunContext:
    """A prepared run: everything is built and restored, nothing has run yet.

    :func:`miles_core.training.loops.rollouts` yields its ``(metrics, samples)`` for each
    rollout from :attr:`start` to :attr:`total`; :meth:`close` releases the engine and the
    servers the run started.
    """

    config: Config
    trainer: Any
    """The :class:`~miles_core.training.trainer.Trainer` (or, under Ray, the driver-side handle of its ranks, which holds no weights)."""
    loss_spec: Any
    """The :class:`~miles_core.specs.LossSpec` of ``--loss-type``: what the run trains on."""
    schedule: Any
    """The learning-rate schedule (:mod:`~miles_core.training.lr_schedule`)."""
    out: Path
    """The run directory."""
    start: int
    """The first rollout to run (0, or the one after a restored checkpoint)."""
    total: int
    """Rollouts in the whole run."""
    engine: RolloutEngine | None = None
    """None when the run generates nothing (supervised rows, replayed rollouts)."""
    data_source: Any = None
    """Where prompts come from (RL runs), with ``batch(rollout_id)``."""
    rows: list[Any] = field(default_factory=list)
    """The supervised rows of an SFT run."""
    eval_datasets: dict[str, list[Any]] | None = None
    """The ``--eval-prompt-data`` sets, loaded (and checked) before the engine was built;
    None when the run does not evaluate (the evaluator then loads them itself)."""
    resumed: bool = False
    """Whether a checkpoint was restored."""
    resumed_from: int | None = None
    """The id of the restored checkpoint, which ``--save-keep-last`` never deletes."""
    progress: Any = None
    """Progress bars (:class:`~miles_core.training.metrics_logging.Progress`); None: none."""
    scorer: Any = None
    """The reward: None builds a :class:`~miles_core.training.rewards.RewardScorer` here."""
    fleet: Any = None
    """The engine servers this run started (``--rollout-num-engines``), stopped by :meth:`close`."""
    turns: Any = None
    """The turn-taking of ``--offload-train`` / ``--offload-rollout``
    (:class:`~miles_core.training.offload.TurnTaking`), set by the RL loop; a checkpoint is
    written in its ``checkpoint`` turn. None: no turns (SFT, a replay)."""
    on_phase: Callable[[str, Any], None] | None = None
    """Called as ``(phase, report)`` at each phase of :data:`~miles_core.training.offload.PHASES`
    the RL loop enters, once its turn is taken, with this process's memory audit there
    (a :class:`~miles_core.memory.MemoryReport`, :func:`~miles_core.training.offload.run_memory_report`)."""
    log: Callable[[str], None] = print
    guard: Any = None
    """The reward-hacking guard (:class:`~miles_core.training.guard.RunGuard`), set by the RL
    loop; checkpoints keep its baselines. None: no guard."""
    trackers: Any = None
    """Where records go besides ``metrics.jsonl`` (W&B, TensorBoard:
    :class:`~miles_core.training.metrics_logging.Trackers`), set by :func:`~miles_core.training.run.train`;
    the RL loop hands it each evaluation's media. None: no tracker."""
    thread_plan: Any = None
    """The run's :class:`~miles_core.config.thread_plan.ThreadPlan`; with
    ``shared_compute_thread`` the RL loop trains on the embedded engine's thread."""
    restore_threads: Callable[[], None] | None = None
    """Gives the caller's thread its torch thread count back; :meth:`close` calls it."""
    settled: int | None = None
    """The last rollout whose end state the trainer holds: its train phase is over (its
    optimizer steps applied, or none to apply). None while a rollout's optimizer steps
    run (the trainer then holds no rollout's end state). The loops set it; a run that fails
    checkpoints this rollout (:mod:`~miles_core.training.checkpoint_on_failure`). Starts at
    ``start - 1``."""

    def __post_init__(self) -> None:
        if self.settled is None:
            self.settled = self.start - 1

    async def close(self) -> None:
        from miles_core.training.weight_sync import close_weight_groups

        await close_weight_groups()  # --weight-sync-path distributed: the servers leave the run's groups
        if self.engine is not None:
            await self.engine.close()
        if self.fleet is not None:
            await asyncio.to_thread(self.fleet.stop)
        if self.restore_threads is not None:
            self.restore_threads()
