"""Trainer-side rollout (docs/design.md, "Seeds and microgroups"): seeds, microgroups, concurrent requests,
streaming callbacks, prompt data.

Pinned here: groups come back in prompt order and samples in seed order whatever order
the microgroups finish in; every sample's seed is
``(rollout_seed + group_index * n) % 2**31 + offset + i`` with ``group_index`` monotonic
over rollouts; a replayed rollout is bit-identical; at most
``--sglang-server-concurrency`` requests are in flight; ``on_microgroup`` streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from miles_core.engine.base import RolloutEngine
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import PromptDataError
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.rollout.data import PromptRecord, PromptSource, load_prompts
from miles_core.rollout.generate import RolloutSettings, generate_rollout
from miles_core.rollout.sample import Sample
from miles_core.rollout.seeds import (
    SEED_MODULUS,
    group_index,
    group_seed_base,
    microgroups,
)
from miles_core.step_strategies import StepSelection, sde_window
from miles_sd3.family import SD3Family

torch.set_num_threads(1)

N = 4
MICROGROUP = 2
STEPS = 4
ROLLOUT_SEED = 2**31 - 3  # the seed base wraps at 2**31 from the second group on
PROMPTS = [PromptRecord("a red cube", {"id": 0}, 0), PromptRecord("a blue sphere", {"id": 1}, 1)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    tiny = SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "tiny")
    return EmbeddedEngine.from_checkpoint(tiny, "sd3")


def settings(**overrides) -> RolloutSettings:
    fields = dict(
        n_samples_per_prompt=N,
        rollout_microgroup_size=MICROGROUP,
        rollout_batch_size=len(PROMPTS),
        rollout_seed=ROLLOUT_SEED,
        diffusion_num_steps=STEPS,
        diffusion_num_sde_steps=2,
        diffusion_sde_window_range=None,
        diffusion_sde_candidate_steps=None,
        diffusion_guidance_scale=4.5,
        diffusion_true_cfg_scale=None,
        diffusion_negative_prompt=None,
        diffusion_height=32,
        diffusion_width=32,
        diffusion_output_num_frames=1,
        diffusion_fps=None,
        diffusion_sde_type="sde",
        diffusion_noise_level=0.7,
        diffusion_log_prob_no_const=False,
        diffusion_debug_mode=False,
        sglang_server_concurrency=8,
    )
    return RolloutSettings(**{**fields, **overrides})


class RecordingEngine(RolloutEngine):
    """Delegates to an engine; delays each request, counts requests in flight and
    records when each generation ends."""

    @classmethod
    def from_config(cls, config):  # a test double, never built from a configuration
        raise TypeError("RecordingEngine wraps an engine; build it directly")

    def __init__(self, inner: RolloutEngine, delays: Sequence[float] = ()) -> None:
        self.inner = inner
        self.delays = list(delays)
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[RolloutRequest] = []
        self.ends: list[float] = []

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        call = self.calls
        self.calls += 1
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if call < len(self.delays):
                await asyncio.sleep(self.delays[call])
            outputs = await self.inner.generate(request)
            self.ends.append(time.perf_counter())
            return outputs
        finally:
            self.in_flight -= 1

    async def weights_checksum(self, module_names: Sequence[str]) -> dict[str, str]:
        return await self.inner.weights_checksum(module_names)


def rollout(engine: RolloutEngine, rollout_id: int, s: RolloutSettings | None = None, **kwargs) -> list[list[Sample]]:
    return asyncio.run(generate_rollout(engine, s or settings(), rollout_id, PROMPTS, sde_window, **kwargs))


def assert_same_samples(a: list[list[Sample]], b: list[list[Sample]]) -> None:
    assert len(a) == len(b)
    for group_a, group_b in zip(a, b):
        assert len(group_a) == len(group_b)
        for x, y in zip(group_a, group_b):
            assert (x.prompt, x.seed, x.group_index, x.index_in_group, x.sde_step_indices) == (
                y.prompt,
                y.seed,
                y.group_index,
                y.index_in_group,
                y.sde_step_indices,
            )
            assert torch.equal(x.pixels, y.pixels)
            assert torch.equal(x.log_probs, y.log_probs)
            assert torch.equal(x.output.dit_trajectory["latents"], y.output.dit_trajectory["latents"])


@pytest.fixture(scope="module")
def baseline(engine: EmbeddedEngine) -> dict[int, list[list[Sample]]]:
    """Rollouts 0 and 1, undelayed."""
    return {rid: rollout(engine, rid) for rid in (0, 1)}


def test_groups_in_prompt_order_samples_in_seed_order(baseline) -> None:
    for rid, groups in baseline.items():
        assert [g[0].prompt for g in groups] == [p.prompt for p in PROMPTS]
        for position, group in enumerate(groups):
            gi = rid * len(PROMPTS) + position
            base = (ROLLOUT_SEED + gi * N) % 2**31
            assert len(group) == N
            for i, sample in enumerate(group):
                assert sample.rollout_id == rid
                assert sample.group_index == gi
                assert sample.index_in_group == i
                assert sample.metadata == PROMPTS[position].metadata
                # microgroup offset + index in the microgroup = index in the group
                assert sample.seed == sample.output.seed == base + (i // MICROGROUP) * MICROGROUP + i % MICROGROUP
                assert sample.log_probs.shape == (STEPS,)
                # 2 SDE steps out of 4, a window shared by the microgroup
                assert len(sample.sde_step_indices) == 2
                assert set(torch.nonzero(sample.log_probs).flatten().tolist()) == set(sample.sde_step_indices)
                assert sample.output.dit_trajectory["sde_step_indices"].tolist() == list(sample.sde_step_indices)
    indices = [s.group_index for rid in (0, 1) for g in baseline[rid] for s in g[:1]]
    assert indices == [0, 1, 2, 3]  # monotonic across rollout ids
    seeds = [s.seed for rid in (0, 1) for g in baseline[rid] for s in g]
    assert len(set(seeds)) == len(seeds)
    assert seeds[3] == 2**31 and seeds[4] == (ROLLOUT_SEED + N) % 2**31 == 1  # the wrap happened


def test_replaying_a_rollout_is_bit_identical(engine: EmbeddedEngine, baseline) -> None:
    assert_same_samples(rollout(engine, 1), baseline[1])
    # Control: another rollout id gives other samples.
    assert not torch.equal(baseline[0][0][0].pixels, baseline[1][0][0].pixels)


def test_results_do_not_depend_on_completion_order(engine: EmbeddedEngine, baseline) -> None:
    # 4 microgroups; the first submitted finishes last.
    wrapped = RecordingEngine(engine, delays=[0.3, 0.2, 0.1, 0.0])
    finished: list[tuple[int, int]] = []

    async def record(samples: list[Sample]) -> None:
        finished.append((samples[0].group_index, samples[0].index_in_group))

    groups = rollout(wrapped, 0, on_microgroup=record)
    assert finished == [(1, 2), (1, 0), (0, 2), (0, 0)]  # really reversed
    assert_same_samples(groups, baseline[0])


@pytest.mark.exercises("--sglang-server-concurrency")
def test_concurrency_bound_is_respected(engine: EmbeddedEngine, baseline) -> None:
    wrapped = RecordingEngine(engine, delays=[0.02] * 4)
    groups = rollout(wrapped, 0, settings(sglang_server_concurrency=1))
    assert wrapped.calls == 4 and wrapped.max_in_flight == 1
    assert_same_samples(groups, baseline[0])
    # Control: with room for all, they overlap.
    wide = RecordingEngine(engine, delays=[0.02] * 4)
    rollout(wide, 0, settings(sglang_server_concurrency=4))
    assert wide.max_in_flight == 4


def test_on_microgroup_streams(engine: EmbeddedEngine) -> None:
    wrapped = RecordingEngine(engine)
    calls: list[tuple[float, list[Sample]]] = []

    async def on_microgroup(samples: list[Sample]) -> None:
        calls.append((time.perf_counter(), samples))

    groups = rollout(wrapped, 0, settings(sglang_server_concurrency=2), on_microgroup=on_microgroup)
    assert len(calls) == wrapped.calls == len(PROMPTS) * (N // MICROGROUP)
    streamed = sorted((s.group_index, s.index_in_group) for _, samples in calls for s in samples)
    assert streamed == [(g, i) for g in range(len(PROMPTS)) for i in range(N)]
    for _, samples in calls:
        assert len(samples) == MICROGROUP and samples[1].seed == samples[0].seed + 1
    # Streaming: the first callback ran before the last microgroup finished generating.
    assert calls[0][0] < max(wrapped.ends)
    # Callbacks received the very sample objects the rollout returns.
    assert {id(s) for _, samples in calls for s in samples} == {id(s) for g in groups for s in g}


def test_requests_carry_the_settings(engine: EmbeddedEngine) -> None:
    wrapped = RecordingEngine(engine)
    rollout(wrapped, 0)
    for req in wrapped.requests:
        assert req.num_outputs_per_prompt == MICROGROUP and req.num_inference_steps == STEPS
        assert req.rollout and req.rollout_return_dit_trajectory and req.rollout_return_denoising_env
        sde = req.rollout_sde_step_indices
        assert len(sde) == 2 and sde[1] == sde[0] + 1 and sde[1] < STEPS - 1
        assert set(req.rollout_return_step_indices) == {*sde, *(k + 1 for k in sde), STEPS}


def test_step_strategies_receive_the_rollout_id(engine: EmbeddedEngine) -> None:
    """A strategy sees which rollout a request belongs to (a curriculum over training),
    and only that: the same rollout id gives the same steps."""
    seen: list[tuple[int, int]] = []

    def by_rollout(ctx):
        seen.append((ctx.rollout_id, ctx.seed))
        k = ctx.rollout_id % (ctx.num_steps - 1)  # the SDE step walks down the schedule
        return StepSelection.build(sde_steps=(k,), num_steps=ctx.num_steps)

    for rollout_id in (1, 2):
        wrapped = RecordingEngine(engine)
        asyncio.run(generate_rollout(wrapped, settings(), rollout_id, PROMPTS, by_rollout))
        assert {r.rollout_sde_step_indices for r in wrapped.requests} == {(rollout_id % (STEPS - 1),)}
    # Without the rollout id every request would get step 0: both rollouts' steps differ from that.
    assert {rollout_id for rollout_id, _ in seen} == {1, 2} and 0 not in {1 % (STEPS - 1), 2 % (STEPS - 1)}


# -- seeds (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize("microgroup_size", [1, 3, 8])
def test_no_seed_collision_across_a_run(microgroup_size: int) -> None:
    n, batch, rollouts = 16, 8, 50
    seeds = []
    for rid in range(rollouts):
        for position in range(batch):
            gi = group_index(rid, position, batch)
            for mg in microgroups(1234, gi, n, microgroup_size):
                seeds += [mg.seed + i for i in range(mg.size)]
    assert len(seeds) == rollouts * batch * n
    assert len(set(seeds)) == len(seeds)


def test_microgroup_offsets_and_sizes() -> None:
    mgs = microgroups(7, 3, 8, 2)
    assert [m.offset for m in mgs] == [0, 2, 4, 6]
    assert [m.size for m in mgs] == [2, 2, 2, 2]
    assert [m.seed for m in mgs] == [group_seed_base(7, 3, 8) + o for o in (0, 2, 4, 6)]
    assert group_seed_base(7, 3, 8) == 7 + 3 * 8
    uneven = microgroups(0, 0, 16, 3)
    assert [m.offset for m in uneven] == [0, 3, 6, 9, 12, 15]
    assert [m.size for m in uneven] == [3, 3, 3, 3, 3, 1]
    assert sum(m.size for m in uneven) == 16
    assert group_seed_base(SEED_MODULUS - 1, 1, 4) == 3
    with pytest.raises(ValueError):
        microgroups(0, 0, 4, 0)


# -- prompt data ------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_prompts_reads_rows(tmp_path: Path) -> None:
    path = write(tmp_path, '{"input": "a cat", "metadata": {"k": 1}}\n\n{"input": "a dog"}\n')
    records = load_prompts(path)
    assert [(r.prompt, r.metadata, r.index) for r in records] == [("a cat", {"k": 1}, 0), ("a dog", {}, 1)]


@pytest.mark.exercises("--input-key", "--metadata-key")
def test_input_and_metadata_keys_are_honoured(tmp_path: Path) -> None:
    path = write(tmp_path, '{"caption": "a cat", "info": {"k": 2}, "input": "ignored", "metadata": {"k": 0}}\n')
    (record,) = load_prompts(path, input_key="caption", metadata_key="info")
    assert record.prompt == "a cat" and record.metadata == {"k": 2}
    with pytest.raises(PromptDataError, match="'prompt'"):
        load_prompts(path, input_key="prompt")


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"input": "ok"}\n{"input": \n', 2, "not valid JSON"),
        ('{"input": "ok"}\n["a list"]\n', 2, "must be a JSON object"),
        ('{"input": "ok"}\n{"text": "x"}\n', 2, "no 'input' key"),
        ('{"input": "  "}\n', 1, "non-empty string"),
        ('{"input": 3}\n', 1, "non-empty string"),
        ('{"input": "ok"}\n\n{"input": "x", "metadata": [1]}\n', 3, "'metadata' must be a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PromptDataError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert message in str(info.value)


def test_empty_or_missing_file(tmp_path: Path) -> None:
    path = write(tmp_path, "\n  \n")
    with pytest.raises(PromptDataError, match="empty file") as info:
        load_prompts(path)
    assert str(path) in str(info.value)
    with pytest.raises(PromptDataError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def test_prompt_source_is_a_pure_function_of_the_rollout_id() -> None:
    records = [PromptRecord(f"p{i}", {}, i) for i in range(6)]
    source = PromptSource(records, batch_size=3, seed=5)
    again = PromptSource(records, batch_size=3, seed=5)
    # Any order of calls, a fresh instance: the same batches.
    assert [again.batch(r) for r in (3, 0, 2, 1)] == [source.batch(r) for r in (3, 0, 2, 1)]
    epoch0 = [r.index for rid in (0, 1) for r in source.batch(rid)]
    epoch1 = [r.index for rid in (2, 3) for r in source.batch(rid)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(6))  # each prompt once per epoch
    assert source.epoch_of(1) == 0 and source.epoch_of(2) == 1
    assert epoch0 != epoch1  # control: epochs are shuffled differently
    assert PromptSource(records, batch_size=3, seed=6).epoch_order(0) != source.epoch_order(0)
    plain = PromptSource(records, batch_size=4, seed=5, shuffle=False)
    # Batches that straddle an epoch boundary.
    assert [r.index for r in plain.batch(1)] == [4, 5, 0, 1]
    with pytest.raises(ValueError):
        PromptSource(records, batch_size=0, seed=0)
