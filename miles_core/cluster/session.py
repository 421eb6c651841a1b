"""What a ``--use-ray`` run holds on the cluster, from start to finish: the Ray
connection and placement group, the training-rank actors, the reward workers (and the
engine servers the run starts, the embedded engine's actor among them);
:meth:`RaySession.close` releases them all, in reverse."""

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
        with ``reward_worker``, the reward workers."""
        return cls(config, RayRuntime.start(config, engines=engines, reward_worker=reward_worker, log=log))

    def start_trainer(self) -> Any:
        """The training ranks, each loading the model and building its trainer: a
        :class:`~miles_core.cluster.train_ranks.RayTrainer` (the driver loads no model)."""
        from miles_core.cluster.train_ranks import RayTrainer

        self.trainer = RayTrainer(self.config, self.runtime)
        self._closers.append(self.trainer.close)
        return self.trainer

    def reward_scorer(self, log_dir: Any = None) -> Any:
        """The run's reward on its ``--reward-num-workers`` worker servers (one scorer per
        session), their logs in ``log_dir`` (None: a temporary directory)."""
        if self.scorer is None:
            from miles_core.cluster.reward_worker import RayRewardScorer

            self.scorer = RayRewardScorer.start(self.config, self.runtime, log_dir)
            self._closers.append(self.scorer.close)
        return self.scorer

    def engine_fleet(self, log_dir: Any, *, api_key: str | None = None) -> Any:
        """The engine servers the run starts, on their bundles (the embedded engine on an
        actor of its own under ``--rollout-engine embedded``), each requiring ``api_key``
        (the run's secret) of every request: a
        :class:`~miles_core.cluster.engine_hosts.RayEngineFleet` (the run stops it)."""
        from miles_core.cluster.engine_hosts import RayEngineFleet

        if self.config.rollout_engine == "embedded":
            return RayEngineFleet.start_embedded(self.config, self.runtime, api_key=api_key)
        if self.config.rollout_engine == "sglang":  # its work directory (weight syncs, logs) is log_dir
            return RayEngineFleet.start_sglang(self.config, self.runtime, log_dir, api_key=api_key)
        return RayEngineFleet.start(self.config, self.runtime, log_dir, api_key=api_key)

    def poster(self, fleet: Any, *, api_key: str | None = None) -> Any:
        """``--use-distributed-post``: the post actors on ``fleet``'s nodes, a
        :class:`~miles_core.cluster.post_actors.DistributedPoster` (stopped with the session);
        their requests carry ``api_key``."""
        from miles_core.cluster.post_actors import DistributedPoster

        poster = DistributedPoster.start(self.config, self.runtime, fleet, api_key=api_key)
        self._closers.append(poster.close)
        return poster

    def node_address(self) -> str:
        """This (the driver's) node's IP address, which actors on other nodes reach."""
        return self.runtime.ray.util.get_node_ip_address()

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
