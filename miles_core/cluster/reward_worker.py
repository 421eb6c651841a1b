"""The reward on Ray: ``--reward-num-workers`` :class:`RewardWorker` actors, each holding
the run's :class:`~miles_core.training.rewards.RewardScorer` (and the evaluation scorer,
sharing its reward models) on its own bundle, so reward models load and run there
instead of in the driver. :class:`RayRewardScorer` is the driver's side, with the
scorer's interface:

- ``score`` splits the samples into contiguous chunks of near-equal size, one per worker
  (whole prompt groups when the reward needs them, ``--group-rm``), sends each worker its
  chunk, and copies each sample's outcome (reward, components, failures) back onto the
  driver's sample, so a sample whose reward failed stays masked as in one process. The
  first chunk of a call goes to the worker after the previous call's last, so streaming
  calls of one microgroup each spread over the workers too;
- ``finish`` computes the rollout's reward metrics in the driver, over all of its
  samples, from the outcomes the workers sent back and the sum of their rewards' own
  counters (``pop_metrics``): N workers report what one reports (a counter of calls
  counts the calls the N workers made). A :class:`RewardError` is raised as the
  in-process scorer raises it.

A worker whose reward cannot be built reports the scorer's error when it is first asked
(one line, exit status 2); a worker that dies is a :class:`RewardWorkerDiedError` naming
the worker and its node (exit status 1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from miles_core.cluster.runtime import task_result, task_value
from miles_core.errors import RewardWorkerDiedError

OUTCOME_FIELDS = ("reward", "reward_components", "reward_failed", "reward_failures", "remove_sample")
"""What scoring sets on a sample."""


class RewardWorker:
    """Made a Ray actor by :meth:`RayRewardScorer.start`."""

    def __init__(self, config: Any) -> None:
        from miles_core.config.determinism import apply_deterministic_mode
        from miles_core.training.rewards import RewardScorer

        apply_deterministic_mode(config)  # the one-process run scores its rewards under it too
        self.config = config
        self.scorers: dict[bool, Any] = {}
        self.error: Exception | None = None
        try:
            self.scorers[False] = RewardScorer(config)
        except Exception as exc:  # raised by describe: an actor whose constructor raises dies with Ray's many lines
            self.error = exc

    def _scorer(self, evaluation: bool) -> Any:
        if self.error is not None:
            raise self.error
        if evaluation not in self.scorers:
            from miles_core.training.rewards import RewardScorer

            self.scorers[evaluation] = RewardScorer(self.config, evaluation=True, share=self.scorers[False])
        return self.scorers[evaluation]

    def describe(self, evaluation: bool) -> tuple[str, bool]:
        scorer = self._scorer(evaluation)
        return scorer.name, scorer.needs_whole_groups

    async def score(self, evaluation: bool, samples: Sequence[Any]) -> list[dict[str, Any]]:
        """Score the copies of the driver's samples; per sample its outcome fields and,
        under ``scored_by``, what :meth:`RewardScorer.finish` needs of it."""
        scorer = self._scorer(evaluation)
        await scorer.score(samples)
        return [
            {**{name: getattr(sample, name) for name in OUTCOME_FIELDS}, "scored_by": scorer.take_outcome(sample)} for sample in samples
        ]

    def counters(self, evaluation: bool, rewards: Sequence[str], prefix: str) -> dict[str, float]:
        return self._scorer(evaluation).pop_counters(rewards, prefix)


def split_chunks(samples: Sequence[Any], parts: int, *, whole_groups: bool) -> list[list[int]]:
    """The indices of ``samples`` in at most ``parts`` contiguous chunks of near-equal
    size, in order; with ``whole_groups`` every prompt group (``group_index``) is in one
    chunk (a group whose samples are not adjacent still goes whole, where it first
    appears)."""
    if whole_groups:
        groups: dict[Any, list[int]] = {}
        for index, sample in enumerate(samples):
            groups.setdefault(getattr(sample, "group_index", None), []).append(index)
        units = list(groups.values())
    else:
        units = [[index] for index in range(len(samples))]
    chunks: dict[int, list[int]] = {}
    before = 0
    for unit in units:
        # The chunk holding the unit's first sample, were the samples cut evenly.
        chunks.setdefault(before * parts // len(samples), []).extend(unit)
        before += len(unit)
    return [chunks[key] for key in sorted(chunks)]


class RayRewardScorer:
    """The driver's handle on the run's :class:`RewardWorker` actors (see the module
    docstring). ``places``: per worker, where it runs, for messages."""

    def __init__(self, workers: Sequence[Any], *, evaluation: bool = False, places: Sequence[str] | None = None) -> None:
        import ray

        self._ray = ray
        self.workers = list(workers)
        self.evaluation = evaluation
        self.places = list(places) if places is not None else ["an unknown node"] * len(self.workers)
        self._next = 0
        self._outcomes: dict[int, dict[str, str | None]] = {}
        described = self._get([worker.describe.remote(evaluation) for worker in self.workers])
        self.name, self.needs_whole_groups = described[0]

    @property
    def worker(self) -> Any:
        """The first worker (the only one with ``--reward-num-workers 1``)."""
        return self.workers[0]

    @classmethod
    def start(cls, config: Any, runtime: Any) -> RayRewardScorer:
        """Start the run's reward workers, one on each of its bundles of the placement group."""
        import ray

        plan = runtime.plan
        workers = []
        for bundle in plan.rewards:
            # A bundle's GPU share may be a fraction, which the default share of its device is not.
            options = {**runtime.options(bundle, plan.reward_share), "num_gpus": plan.reward_gpus}
            workers.append(ray.remote(RewardWorker).options(**options).remote(config))
        return cls(workers, places=_places(runtime, plan.rewards))

    def evaluation_scorer(self) -> RayRewardScorer:
        """The evaluation scorer on the same workers (sharing their reward models)."""
        return RayRewardScorer(self.workers, evaluation=True, places=self.places)

    def _died(self, index: int, exc: BaseException) -> RewardWorkerDiedError:
        lines = str(exc).strip().splitlines()
        return RewardWorkerDiedError(
            f"reward worker {index} of {len(self.workers)} on {self.places[index]} died: {lines[0] if lines else type(exc).__name__}"
        )

    def _get(self, refs: list[Any]) -> list[Any]:
        values = []
        for index, ref in enumerate(refs):
            try:
                values.append(task_result(ref))
            except self._ray.exceptions.RayActorError as exc:
                raise self._died(index, exc) from None
        return values

    async def _score_on(self, index: int, samples: list[Any]) -> list[dict[str, Any]]:
        try:
            return await task_value(self.workers[index].score.remote(self.evaluation, samples))
        except self._ray.exceptions.RayActorError as exc:
            raise self._died(index, exc) from None

    async def score(self, samples: Sequence[Any]) -> Any:
        import torch

        samples = list(samples)
        chunks = split_chunks(samples, len(self.workers), whole_groups=self.needs_whole_groups) if samples else []
        first, self._next = self._next, (self._next + len(chunks)) % len(self.workers)
        workers = [(first + offset) % len(self.workers) for offset in range(len(chunks))]
        results = await asyncio.gather(*(self._score_on(w, [samples[i] for i in chunk]) for w, chunk in zip(workers, chunks)))
        for chunk, outcomes in zip(chunks, results):
            for index, outcome in zip(chunk, outcomes):
                sample = samples[index]
                self._outcomes[id(sample)] = outcome.pop("scored_by")
                for name, value in outcome.items():
                    setattr(sample, name, value)
        return torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)

    def finish(self, samples: Sequence[Any], *, prefix: str = "rollout/reward/") -> dict[str, float]:
        from miles_core.training.rewards import summarize_rewards

        outcomes = [self._outcomes.pop(id(sample), None) or {} for sample in samples]

        def counters(rewards: list[str]) -> dict[str, float]:
            totals: dict[str, float] = {}
            if rewards:
                for part in self._get([w.counters.remote(self.evaluation, rewards, prefix) for w in self.workers]):
                    for key, value in part.items():
                        totals[key] = totals.get(key, 0.0) + value
            return totals

        return summarize_rewards(samples, outcomes, counters, name=self.name, evaluation=self.evaluation, prefix=prefix)

    def close(self) -> None:
        for worker in self.workers:
            self._ray.kill(worker)


def _places(runtime: Any, bundles: Sequence[int]) -> list[str]:
    """Per bundle, ``node IP (node id prefix)`` from the placement group's table."""
    import ray

    try:
        table = ray.util.placement_group_table(runtime.group)
        where = {int(bundle): str(node) for bundle, node in (table.get("bundles_to_node_id") or {}).items()}
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    except Exception:  # the table's shape is Ray's: a message without the node is better than none
        return ["an unknown node"] * len(bundles)
    return [f"node {addresses.get(where.get(b, ''), '?')} ({where.get(b, '?')[:8]})" for b in bundles]


__all__ = ["RayRewardScorer", "RewardWorker", "split_chunks"]
