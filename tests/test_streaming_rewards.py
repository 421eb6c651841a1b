"""Streaming scoring: each microgroup is scored as soon as it returns, while the rest of
the rollout is still generating, and ``--no-streaming-reward`` turns that off.

The overlap is shown with timestamps: the engine records when each request ends, the
reward when each scoring call starts. A delayed fake engine serves the rollout-level
tests; the run-level one drives the tiny SD3 pipeline's embedded engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.base import RolloutEngine
from miles_core.errors import RewardError
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.hooks import build_data_source
from miles_core.training.metrics_logging import Progress
from miles_core.training.rollout_scoring import RolloutSource, StreamingScores
from tests.tiny_runs import run_metrics, tiny_run_args

HERE = "tests.test_streaming_rewards"
SCORE_CALLS: list[tuple[float, list[int]]] = []
"""(start, seeds) of every call of the rewards below."""
GENERATED: list[tuple[float, float]] = []
"""(start, end) of every request through :func:`timed_generate`."""


async def slow_rm(args, samples):
    """A reward that takes 30 ms a call (off the CPU, like a remote reward server); the
    reward of a sample is its seed."""
    SCORE_CALLS.append((time.perf_counter(), [s.seed for s in samples]))
    await asyncio.sleep(0.03)
    return [float(s.seed) for s in samples]


async def threaded_rm(args, samples):
    """A reward whose work runs in a thread of the event loop's default pool, as a CPU
    reward does; the start is taken when the thread starts working."""

    def work():
        SCORE_CALLS.append((time.perf_counter(), [s.seed for s in samples]))
        time.sleep(0.02)
        return [float(s.seed % 7) for s in samples]

    return await asyncio.to_thread(work)


async def wrong_length_rm(args, samples):
    SCORE_CALLS.append((time.perf_counter(), [s.seed for s in samples]))
    return [1.0]  # one value for a microgroup of two: not a per-sample failure


async def timed_generate(engine, request):
    start = time.perf_counter()
    outputs = await engine.generate(request)
    GENERATED.append((start, time.perf_counter()))
    return outputs


async def whole_rollout(config, rollout_id, engine, data_source):
    """A --rollout-function-path function: the built-in rollout, samples handed over at once."""
    from miles_core.rollout.generate import diffusion_rollout

    return await diffusion_rollout(config, rollout_id, engine, data_source)


class DelayedEngine(RolloutEngine):
    """Answers each request after ``delay`` seconds with blank outputs of the right seeds;
    records when each request ended."""

    @classmethod
    def from_config(cls, config):  # a test double
        raise TypeError("build DelayedEngine directly")

    def __init__(self, delay: float = 0.04) -> None:
        self.delay = delay
        self.ends: list[float] = []

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        await asyncio.sleep(self.delay)
        self.ends.append(time.perf_counter())
        return [
            RolloutOutput(
                request_id=f"r{request.seed}",
                prompt=request.prompt,
                seed=request.seed + i,
                generated_output=torch.zeros(3, 8, 8),
                rollout_log_probs=torch.zeros(2),
            )
            for i in range(request.num_outputs_per_prompt)
        ]

    async def weights_checksum(self, module_names):
        return {}


BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-microgroup-size",
    "2",
    "--diffusion-num-steps",
    "3",
    "--diffusion-num-sde-steps",
    "2",
    "--sglang-server-concurrency",
    "1",
]


@pytest.fixture(autouse=True)
def _fresh_records():
    SCORE_CALLS.clear()
    GENERATED.clear()


def rollout(*extra: str, engine: DelayedEngine | None = None):
    """One rollout of 2 prompts x 4 samples in microgroups of 2 (four requests, one at a
    time) through the run's rollout source: (engine, samples, rewards, busy seconds)."""
    config = resolve_config([*BASE, *extra])
    engine = engine or DelayedEngine()
    prompts = [PromptRecord("a red cube", {}, 0), PromptRecord("a blue ball", {}, 1)]
    source = RolloutSource(config, engine, build_data_source(config, prompts), Progress(enabled=False), 1)

    async def go():
        samples = await source.generate(0)
        rewards, metrics, busy = await source.score(samples)
        return samples, rewards, metrics, busy

    samples, rewards, metrics, busy = asyncio.run(go())
    return engine, samples, rewards, metrics, busy


@pytest.mark.exercises("--no-streaming-reward", "--custom-rm-path", "--rollout-microgroup-size")
def test_each_microgroup_is_scored_while_the_rest_generates():
    engine, samples, rewards, metrics, busy = rollout("--custom-rm-path", f"{HERE}.slow_rm")
    assert len(engine.ends) == 4
    # One scoring call per microgroup, each starting once its microgroup returned...
    assert [len(seeds) for _, seeds in SCORE_CALLS] == [2, 2, 2, 2]
    starts = [start for start, _ in SCORE_CALLS]
    assert starts == sorted(starts) and starts[0] >= engine.ends[0]
    # ...and the first one before the last microgroup's generation ended: the overlap.
    assert starts[0] < engine.ends[-1] and starts[2] < engine.ends[-1]
    # The rewards land on their samples, in sample order.
    assert rewards.tolist() == [float(s.seed) for s in samples] == [s.reward for s in samples]
    assert metrics["rollout/reward/raw_mean"] == pytest.approx(sum(s.seed for s in samples) / 8)
    assert busy >= 4 * 0.03

    # The control: without streaming, one call for the whole rollout after the last request ended.
    SCORE_CALLS.clear()
    engine, samples, rewards, _, busy = rollout("--custom-rm-path", f"{HERE}.slow_rm", "--no-streaming-reward")
    assert [len(seeds) for _, seeds in SCORE_CALLS] == [8]
    assert SCORE_CALLS[0][0] >= engine.ends[-1]
    assert rewards.tolist() == [float(s.seed) for s in samples]
    assert 0.03 <= busy < 2 * 0.03


@pytest.mark.exercises("--rollout-function-path")
def test_samples_of_a_rollout_function_are_scored_all_at_once():
    engine, samples, rewards, _, _ = rollout("--custom-rm-path", f"{HERE}.slow_rm", "--rollout-function-path", f"{HERE}.whole_rollout")
    assert len(engine.ends) == 4 and len(samples) == 8
    assert [len(seeds) for _, seeds in SCORE_CALLS] == [8]
    assert SCORE_CALLS[0][0] >= engine.ends[-1]
    assert rewards.tolist() == [float(s.seed) for s in samples]


@pytest.mark.exercises("--custom-rm-path")
def test_a_reward_error_stops_the_generation_it_overlaps():
    engine = DelayedEngine(delay=0.05)
    with pytest.raises(RewardError, match="returned 1 values? for 2 samples"):
        rollout("--custom-rm-path", f"{HERE}.wrong_length_rm", engine=engine)
    # The first microgroup's scoring failed: the rollout stopped instead of generating the rest.
    assert len(SCORE_CALLS) == 1 and len(engine.ends) < 4


class FailingEngine(DelayedEngine):
    """Fails its third request."""

    async def generate(self, request):
        if len(self.ends) == 2:
            await asyncio.sleep(self.delay)
            raise RuntimeError("engine down")
        return await super().generate(request)


def test_an_engine_error_cancels_the_scoring_in_flight():
    config = resolve_config([*BASE, "--custom-rm-path", f"{HERE}.slow_rm"])
    prompts = [PromptRecord("a red cube", {}, 0), PromptRecord("a blue ball", {}, 1)]
    source = RolloutSource(config, FailingEngine(delay=0.01), build_data_source(config, prompts), Progress(enabled=False), 1)

    async def go():
        with pytest.raises(RuntimeError, match="engine down"):
            await source.generate(0)
        return source._pending.tasks

    tasks = asyncio.run(go())
    # Two microgroups returned and went to scoring; the failure cancelled what was still running.
    assert len(tasks) == 2 and all(task.done() for task in tasks)
    assert any(task.cancelled() for task in tasks)


@pytest.mark.exercises("--group-rm")
def test_with_group_rm_each_prompt_group_is_scored_when_it_is_complete():
    engine, samples, rewards, _, _ = rollout("--custom-rm-path", f"{HERE}.slow_rm", "--group-rm")
    # Two calls of one whole group each; the first group was complete after the second
    # request, and was scored while the second group generated.
    assert [sorted(seeds) for _, seeds in SCORE_CALLS] == [[s.seed for s in samples[:4]], [s.seed for s in samples[4:]]]
    assert engine.ends[1] <= SCORE_CALLS[0][0] < engine.ends[-1]
    assert rewards.tolist() == [float(s.seed) for s in samples]


class GroupScorer:
    """A scorer that needs whole prompt groups (what --group-rm asks of the reward)."""

    needs_whole_groups = True

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int]]] = []

    async def score(self, samples):
        self.calls.append([(s.group_index, s.index_in_group) for s in samples])
        for s in samples:
            s.reward = float(s.index_in_group)
        return torch.tensor([s.reward for s in samples])


def test_whole_groups_are_scored_when_their_last_microgroup_returns():
    from types import SimpleNamespace

    def mg(group, *indices):
        return [SimpleNamespace(group_index=group, index_in_group=i, reward=None) for i in indices]

    async def go():
        scorer = GroupScorer()
        pending = StreamingScores(scorer, group_size=4)
        pending.add(mg(7, 2, 3))
        pending.add(mg(8, 0, 1))
        await asyncio.sleep(0)
        assert scorer.calls == []  # no group complete yet
        pending.add(mg(7, 0, 1))  # group 7 complete (microgroups out of order)
        await asyncio.sleep(0)
        assert scorer.calls == [[(7, 0), (7, 1), (7, 2), (7, 3)]]
        rest = mg(8, 2, 3)
        pending.add(rest)
        await pending.wait()
        return scorer.calls

    assert asyncio.run(go())[1] == [(8, 0), (8, 1), (8, 2), (8, 3)]


@pytest.mark.exercises("--no-streaming-reward", "--custom-generate-function-path")
def test_the_embedded_engine_generates_while_a_threaded_reward_scores(tiny_sd3, prompts, tmp_path):
    """The real engine: 2 prompts x 4 samples in microgroups of 1 (eight requests, more
    than the default thread pool of a 2-core machine holds), a reward working in a
    thread. The first scoring starts before the last request ends; without streaming,
    after it. The run reports generation time, the wait for scoring after it, and the
    scoring's own time."""
    args = tiny_run_args(tiny_sd3, prompts, tmp_path / "s", n=4, steps=2, sde_steps=1)
    at = args.index("--rm-type")
    del args[at : at + 2]  # the reward is the custom one
    args += [
        "--rollout-microgroup-size",
        "1",
        "--custom-rm-path",
        f"{HERE}.threaded_rm",
        "--custom-generate-function-path",
        f"{HERE}.timed_generate",
        "--num-rollout",
        "1",
        "--debug-rollout-only",
    ]
    streamed = run_metrics(args)[0]
    assert len(GENERATED) == 8 and len(SCORE_CALLS) == 8
    last_end = max(end for _, end in GENERATED)
    assert min(start for start, _ in SCORE_CALLS) < last_end
    busy = streamed["perf/reward_busy_time"]
    assert busy >= 8 * 0.02
    # Most of the scoring overlapped generation: the run waited less than it cost.
    assert streamed["perf/reward_time"] < busy
    assert streamed["perf/rollout_time"] >= last_end - min(start for start, _ in GENERATED) - 1e-3

    SCORE_CALLS.clear()
    GENERATED.clear()
    args[args.index(str(tmp_path / "s"))] = str(tmp_path / "n")
    plain = run_metrics([*args, "--no-streaming-reward"])[0]
    assert len(SCORE_CALLS) == 1 and min(start for start, _ in SCORE_CALLS) >= max(end for _, end in GENERATED)
    assert plain["perf/reward_time"] >= plain["perf/reward_busy_time"] >= 0.02
    assert plain["rollout/reward/raw_mean"] == streamed["rollout/reward/raw_mean"]
