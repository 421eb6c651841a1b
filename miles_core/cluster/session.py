"""What a ``--use-ray`` run holds on the cluster, from start to finish: the Ray
connection and placement group, the training-rank actors, the reward worker (and the
engine servers the run starts); :meth:`RaySession.close` releases them all, in reverse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_core.cluster.runtime import RayRuntime


class RaySession:
    def __init__(self, config: Any, runtime: RayRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.trainer: Any = None
        self.scorer: Any = None
        self._closers: list[Callable[[], None]] = []

    @classmethod
    def start(cls, config: Any, *, engines: int, reward_worker: bool, log: Callable[[str], None] = lambda line: None) -> RaySession:
        """Connect and reserve the placement for ``engines`` servers the run starts and,
        with ``reward_worker``, the reward worker."""
        return cls(config, RayRuntime.start(config, engines=engines, reward_worker=reward_worker, log=log))

    def wrap_trainer(self, local: Any) -> Any:
        """The training ranks, started from ``local`` (the driver's trainer, which becomes
        their mirror): a :class:`~miles_core.cluster.train_ranks.RayTrainer`."""
        from miles_core.cluster.train_ranks import RayTrainer

        self.trainer = RayTrainer(local, self.config, self.runtime)
        self._closers.append(self.trainer.close)
        return self.trainer

    def reward_scorer(self) -> Any:
        """The run's reward on its worker (one per session)."""
        if self.scorer is None:
            from miles_core.cluster.reward_worker import RayRewardScorer

            self.scorer = RayRewardScorer.start(self.config, self.runtime)
            self._closers.append(self.scorer.close)
        return self.scorer

    def engine_fleet(self, log_dir: Any) -> Any:
        """The engine servers the run starts, on their bundles: a
        :class:`~miles_core.cluster.engine_hosts.RayEngineFleet` (the run stops it)."""
        from miles_core.cluster.engine_hosts import RayEngineFleet

        return RayEngineFleet.start(self.config, self.runtime, log_dir)

    def close(self) -> None:
        try:
            for closer in reversed(self._closers):
                try:
                    closer()
                except Exception:  # an actor that already died: the others still go
                    pass
        finally:
            self._closers = []
            self.runtime.shutdown()


__all__ = ["RaySession"]
