"""One rollout's samples and their rewards: generation through the built-in rollout
(or ``--rollout-function-path``) with scoring that starts as each microgroup returns."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import torch

from miles_core.config.model import Config


class RolloutSource:
    """Prompts, the engine and the reward of a run: :meth:`generate` produces one
    rollout's samples (the built-in rollout, with a progress bar over its microgroups, or
    the checked samples of ``--rollout-function-path``) and starts scoring each
    microgroup as it returns; :meth:`score` waits for the scores."""

    def __init__(self, config: Config, engine: Any, data_source: Any, progress: Any, total: int, scorer: Any = None) -> None:
        from miles_core.rollout.hooks import rollout_hook
        from miles_core.training.rewards import RewardScorer

        self.config = config
        self.engine = engine
        self.data_source = data_source
        self.progress = progress
        self.total = total
        self.scorer = scorer if scorer is not None else RewardScorer(config)
        self.hook = rollout_hook(config)
        self.streaming = not getattr(config, "no_streaming_reward", False)
        self._pending: StreamingScores | None = None

    async def generate(self, rollout_id: int) -> list[Any]:
        from miles_core.rollout.generate import diffusion_rollout
        from miles_core.rollout.hooks import check_samples

        config = self.config
        self._pending = pending = StreamingScores(self.scorer, config.n_samples_per_prompt)
        if self.hook is not None:
            # A rollout function hands its samples over at once: they are scored in score().
            samples = await self.hook(config, rollout_id, self.engine, self.data_source)
            return check_samples(self.hook, samples, config.n_samples_per_prompt)
        per_group = math.ceil(config.n_samples_per_prompt / config.rollout_microgroup_size)
        total = config.rollout_batch_size * per_group
        with self.progress.phase(f"rollout {rollout_id + 1}/{self.total}", total, "microgroup") as bar:

            async def on_microgroup(samples: list[Any]) -> None:
                bar.update(1)
                if self.streaming:
                    pending.add(samples)

            return await pending.guard(diffusion_rollout(config, rollout_id, self.engine, self.data_source, on_microgroup=on_microgroup))

    async def score(self, samples: list[Any]) -> tuple[torch.Tensor, dict[str, float], float]:
        """Score what :meth:`generate` did not already send (everything without
        streaming), wait for all of it; return the rewards in sample order, the reward
        metrics of the rollout (the scorer's ``finish``) and the seconds the score calls
        ran, summed."""
        pending = self._pending or StreamingScores(self.scorer, self.config.n_samples_per_prompt)
        self._pending = None
        pending.add_rest(samples)
        await pending.wait()
        rewards = torch.tensor([reward_value(s) for s in samples], dtype=torch.float32)
        # RewardError naming the reward when every sample's reward failed.
        return rewards, self.scorer.finish(samples), pending.busy


def reward_value(sample: Any) -> float:
    return math.nan if sample.reward is None else float(sample.reward)


class StreamingScores:
    """The scoring of one rollout, started piece by piece while it generates.

    :meth:`add` takes the samples of one returned microgroup and starts a task scoring
    them; when the scorer needs whole prompt groups (``--group-rm``), a group's task
    starts when its last microgroup returns. :meth:`add_rest` scores whatever was not
    sent yet (a rollout function's samples, or all of them without streaming) in one
    call, :meth:`wait` waits for every task. A scoring task that fails stops the
    generation it overlaps (:meth:`guard`) and the error reaches the run."""

    def __init__(self, scorer: Any, group_size: int) -> None:
        self.scorer = scorer
        self.group_size = group_size
        self.whole_groups = bool(getattr(scorer, "needs_whole_groups", False))
        self.tasks: list[asyncio.Task] = []
        self.sent: set[int] = set()
        self.partial: dict[int, list[Any]] = {}
        self.busy = 0.0
        """Seconds the score calls ran, summed over calls."""
        self._failed: asyncio.Future | None = None

    def _failure(self) -> asyncio.Future:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed

    async def _score(self, samples: list[Any]) -> None:
        began = time.perf_counter()
        try:
            await self.scorer.score(samples)
        finally:
            self.busy += time.perf_counter() - began

    def _start(self, samples: list[Any]) -> None:
        self.sent.update(id(s) for s in samples)
        task = asyncio.ensure_future(self._score(samples))
        failure = self._failure()

        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None and not failure.done():
                failure.set_exception(task.exception())

        task.add_done_callback(done)
        self.tasks.append(task)

    def add(self, samples: list[Any]) -> None:
        if not self.whole_groups:
            self._start(list(samples))
            return
        for sample in samples:
            group = self.partial.setdefault(sample.group_index, [])
            group.append(sample)
            if len(group) == self.group_size:
                del self.partial[sample.group_index]
                self._start(sorted(group, key=lambda s: s.index_in_group))

    def add_rest(self, samples: list[Any]) -> None:
        rest = [s for s in samples if id(s) not in self.sent]
        if rest:
            self._start(rest)

    async def guard(self, generation: Any) -> Any:
        """Await ``generation``; if a scoring task fails first, cancel it and raise
        that error. Whatever goes wrong, no scoring task is left running."""
        generating = asyncio.ensure_future(generation)
        failure = self._failure()
        try:
            await asyncio.wait({generating, failure}, return_when=asyncio.FIRST_COMPLETED)
            if not generating.done():
                generating.cancel()
                await asyncio.gather(generating, return_exceptions=True)
                failure.result()  # raises the scoring error
            return generating.result()
        except BaseException:
            if not generating.done():
                generating.cancel()
            self.cancel()
            raise

    async def wait(self) -> None:
        try:
            await asyncio.gather(*self.tasks)
        except BaseException:
            self.cancel()
            raise
        finally:
            failure = self._failed
            if failure is not None and failure.done() and not failure.cancelled():
                failure.exception()  # retrieved: no "exception was never retrieved" warning

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
