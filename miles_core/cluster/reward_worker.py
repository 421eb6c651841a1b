"""The reward as a Ray actor: a :class:`RewardWorker` holds the run's
:class:`~miles_core.training.rewards.RewardScorer` (and the evaluation scorer, sharing
its reward models), so reward models load and run on the worker's bundle instead of in
the driver. :class:`RayRewardScorer` is the driver's side, with the scorer's interface:
``score`` sends the samples, the worker scores its copies and the driver copies the
outcome (reward, components, failures) back onto its own samples; ``finish`` asks the
worker for the rollout's reward metrics (a :class:`RewardError` raised there is raised
here, unchanged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_core.cluster.runtime import task_result, task_value

OUTCOME_FIELDS = ("reward", "reward_components", "reward_failed", "reward_failures", "remove_sample")
"""What scoring sets on a sample."""


class RewardWorker:
    """Made a Ray actor by :meth:`RayRewardScorer.start`."""

    def __init__(self, config: Any) -> None:
        from miles_core.config.determinism import apply_deterministic_mode
        from miles_core.training.rewards import RewardScorer

        apply_deterministic_mode(config)  # the one-process run scores its rewards under it too
        self.config = config
        self.scorers = {False: RewardScorer(config)}  # a reward that cannot be built fails here
        self.held: dict[tuple[bool, int], Any] = {}

    def _scorer(self, evaluation: bool) -> Any:
        if evaluation not in self.scorers:
            from miles_core.training.rewards import RewardScorer

            self.scorers[evaluation] = RewardScorer(self.config, evaluation=True, share=self.scorers[False])
        return self.scorers[evaluation]

    def describe(self, evaluation: bool) -> tuple[str, bool]:
        scorer = self._scorer(evaluation)
        return scorer.name, scorer.needs_whole_groups

    async def score(self, evaluation: bool, keys: Sequence[int], samples: Sequence[Any]) -> list[dict[str, Any]]:
        for key, sample in zip(keys, samples):
            self.held[(evaluation, key)] = sample
        await self._scorer(evaluation).score(samples)
        return [{name: getattr(sample, name) for name in OUTCOME_FIELDS} for sample in samples]

    def finish(self, evaluation: bool, keys: Sequence[int], prefix: str) -> dict[str, float]:
        copies = [self.held.pop((evaluation, key)) for key in keys if (evaluation, key) in self.held]
        return self._scorer(evaluation).finish(copies, prefix=prefix)


class RayRewardScorer:
    """The driver's handle on a :class:`RewardWorker` (see the module docstring)."""

    def __init__(self, worker: Any, *, evaluation: bool = False) -> None:
        import ray

        self._ray = ray
        self.worker = worker
        self.evaluation = evaluation
        self.name, self.needs_whole_groups = task_result(worker.describe.remote(evaluation))

    @classmethod
    def start(cls, config: Any, runtime: Any) -> RayRewardScorer:
        """Start the run's reward worker on its bundle of the placement group."""
        import ray

        plan = runtime.plan
        actor = ray.remote(RewardWorker).options(**runtime.options(plan.reward, plan.reward_share))
        return cls(actor.remote(config))

    def evaluation_scorer(self) -> RayRewardScorer:
        """The evaluation scorer on the same worker (sharing its reward models)."""
        return RayRewardScorer(self.worker, evaluation=True)

    async def score(self, samples: Sequence[Any]) -> Any:
        import torch

        samples = list(samples)
        outcomes = await task_value(self.worker.score.remote(self.evaluation, [id(s) for s in samples], samples))
        for sample, outcome in zip(samples, outcomes):
            for name, value in outcome.items():
                setattr(sample, name, value)
        return torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)

    def finish(self, samples: Sequence[Any], *, prefix: str = "rollout/reward/") -> dict[str, float]:
        return task_result(self.worker.finish.remote(self.evaluation, [id(s) for s in samples], prefix))

    def close(self) -> None:
        self._ray.kill(self.worker)


__all__ = ["RayRewardScorer", "RewardWorker"]
