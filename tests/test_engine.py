"""The embedded engine against docs/design.md, "The wire contract" (and its seed and SDE-step sections).

Pinned here: output *i* of a request equals a one-output request with seed ``seed + i``;
the same request is bit-identical on a rerun; log-probs are 0 on ODE steps and the
trainer's recomputation (``family.predict`` + ``score_streams`` on the returned
trajectory and ``denoising_env``) reproduces them exactly in fp32; evaluation requests
return pixels only; trajectories, sigmas and debug tensors have the contract's shapes;
bad requests name their field; generation runs off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RequestError
from miles_core.family import Conditioning
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.sde import score_streams
from miles_sd3.family import SD3Family

torch.set_num_threads(1)

SIZE = 32  # latents [4, 4, 4]
STEPS = 4
PROMPT = "a red cube on a blue table"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    tiny = SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "tiny")
    engine = EmbeddedEngine.from_checkpoint(tiny, "sd3")
    engine.family.pipeline.set_progress_bar_config(disable=True)
    return engine


def request(**overrides) -> RolloutRequest:
    fields = dict(
        prompt=PROMPT,
        seed=1234,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.5,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
    )
    return RolloutRequest(**{**fields, **overrides})


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_outputs_equal(a: list[RolloutOutput], b: list[RolloutOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.seed == y.seed
        assert torch.equal(x.generated_output, y.generated_output)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        assert torch.equal(x.dit_trajectory["latents"], y.dit_trajectory["latents"])


# -- batch independence and determinism ---------------------------------------------------


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
def test_output_i_equals_a_one_output_request_with_seed_plus_i(engine: EmbeddedEngine, guidance: float) -> None:
    batch = engine.generate_sync(request(num_outputs_per_prompt=4, guidance_scale=guidance))
    assert [o.seed for o in batch] == [1234, 1235, 1236, 1237]
    worst = 0.0
    for i, output in enumerate(batch):
        (single,) = engine.generate_sync(request(seed=1234 + i, guidance_scale=guidance))
        assert single.seed == output.seed
        for a, b in (
            (output.generated_output, single.generated_output),
            (output.rollout_log_probs, single.rollout_log_probs),
            (output.dit_trajectory["latents"], single.dit_trajectory["latents"]),
        ):
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=0, atol=1e-5), max_diff(a, b)
            worst = max(worst, max_diff(a, b))
    print(f"guidance {guidance}: max |batch of 4 - single| = {worst:.3e}")
    # Control: the outputs of one batch really differ (each has its own noise).
    assert max_diff(batch[0].generated_output, batch[1].generated_output) > 1e-3


def test_same_request_is_bit_identical_and_another_seed_differs(engine: EmbeddedEngine) -> None:
    first = engine.generate_sync(request(num_outputs_per_prompt=2))
    again = engine.generate_sync(request(num_outputs_per_prompt=2))
    assert_outputs_equal(first, again)
    other = engine.generate_sync(request(num_outputs_per_prompt=2, seed=99))
    assert not torch.equal(first[0].generated_output, other[0].generated_output)
    assert not torch.equal(first[0].rollout_log_probs, other[0].rollout_log_probs)


# -- log-probs and the trainer's recomputation --------------------------------------------


def test_log_probs_are_zero_exactly_on_ode_steps(engine: EmbeddedEngine) -> None:
    outputs = engine.generate_sync(request(num_outputs_per_prompt=2, rollout_sde_step_indices=(1,)))
    for output in outputs:
        lp = output.rollout_log_probs
        assert lp.shape == (STEPS,) and lp.dtype == torch.float32
        assert lp[0] == 0 and lp[2] == 0 and lp[3] == 0  # ODE steps and the last step
        assert lp[1] != 0 and torch.isfinite(lp[1])
        assert output.dit_trajectory["sde_step_indices"].tolist() == [1]
    # Default: every step but the last runs the SDE.
    (default,) = engine.generate_sync(request())
    assert (default.rollout_log_probs[: STEPS - 1] != 0).all() and default.rollout_log_probs[STEPS - 1] == 0


@pytest.mark.parametrize("overrides", [{"rollout_noise_level": 0.0}, {"rollout_sde_type": "ode"}], ids=["eta0", "ode"])
def test_no_noise_gives_all_zero_log_probs(engine: EmbeddedEngine, overrides: dict) -> None:
    (output,) = engine.generate_sync(request(**overrides))
    assert torch.equal(output.rollout_log_probs, torch.zeros(STEPS))
    assert output.dit_trajectory["sde_step_indices"].numel() == 0


def recompute_log_probs(engine: EmbeddedEngine, output: RolloutOutput, req: RolloutRequest) -> torch.Tensor:
    """The trainer's side: rebuild conditioning from ``denoising_env``, predict on each
    recorded latent, and score the recorded transition with the same backend."""
    family = engine.family
    env, traj = output.denoising_env, output.dit_trajectory
    assert traj["step_indices"].tolist() == list(range(STEPS + 1))

    def batch1(kwargs):
        return None if kwargs is None else {k: v.unsqueeze(0) for k, v in kwargs.items()}

    cond = Conditioning(batch1(env["pos_cond_kwargs"]), batch1(env["neg_cond_kwargs"]))
    params = family.resolve_params(req)
    assert env["guidance"]["guidance_scale"] == params.guidance_scale
    backend = engine.backends[req.rollout_sde_type](noise_level=req.rollout_noise_level, log_prob_no_const=req.rollout_log_prob_no_const)
    sigmas, timesteps, latents = traj["sigmas"], traj["timesteps"], traj["latents"]
    sigma_max = float(sigmas[1])
    out = torch.zeros(STEPS)
    with torch.no_grad():
        for k in traj["sde_step_indices"].tolist():
            x = {"latents": latents[k].unsqueeze(0)}
            x_next = {"latents": latents[k + 1].unsqueeze(0)}
            v = family.predict(x, timesteps[k].reshape(1), cond, params)
            out[k] = score_streams(
                backend, x_next, x, v, float(sigmas[k]), float(sigmas[k + 1]), sigma_max=sigma_max, step_index=k
            ).log_prob[0]
    return out


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
def test_trainer_recomputation_reproduces_the_engine_log_probs_exactly(engine: EmbeddedEngine, guidance: float) -> None:
    req = request(guidance_scale=guidance)
    (output,) = engine.generate_sync(req)
    assert (output.denoising_env["neg_cond_kwargs"] is None) == (guidance <= 1)
    recomputed = recompute_log_probs(engine, output, req)
    assert torch.equal(recomputed, output.rollout_log_probs), (recomputed - output.rollout_log_probs).abs().max()

    # Control: a perturbed transformer weight changes the recomputation.
    weight = next(p for n, p in engine.family.pipeline.transformer.named_parameters() if n.endswith("proj_out.weight"))
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] += 0.05
        perturbed = recompute_log_probs(engine, output, req)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not torch.equal(perturbed, output.rollout_log_probs)
    assert torch.equal(recompute_log_probs(engine, output, req), output.rollout_log_probs)  # restored


def test_cps_with_no_const_log_prob_end_to_end(engine: EmbeddedEngine) -> None:
    req = request(rollout_sde_type="cps", rollout_log_prob_no_const=True)
    (output,) = engine.generate_sync(req)
    lp = output.rollout_log_probs
    assert (lp <= 0).all() and (lp[: STEPS - 1] < 0).all() and lp[STEPS - 1] == 0
    assert torch.equal(recompute_log_probs(engine, output, req), lp)
    # Control: the no-const form really differs from the Gaussian one.
    (gaussian,) = engine.generate_sync(replace(req, rollout_log_prob_no_const=False))
    assert torch.equal(gaussian.generated_output, output.generated_output)
    assert not torch.equal(gaussian.rollout_log_probs, lp)


# -- what comes back ---------------------------------------------------------------------


def test_evaluation_request_returns_pixels_only(engine: EmbeddedEngine) -> None:
    outputs = engine.generate_sync(request(rollout=False, num_outputs_per_prompt=2, rollout_debug_mode=True))
    assert len(outputs) == 2
    for output in outputs:
        assert output.generated_output.shape == (3, SIZE, SIZE)
        assert 0 <= output.generated_output.min() and output.generated_output.max() <= 1
        assert output.rollout_log_probs is None
        assert output.dit_trajectory is None
        assert output.denoising_env is None
        assert output.rollout_debug_tensors is None


def test_return_step_indices_limit_the_trajectory(engine: EmbeddedEngine) -> None:
    (full,) = engine.generate_sync(request())
    traj = full.dit_trajectory
    assert traj["latents"].shape == (STEPS + 1, 4, SIZE // 8, SIZE // 8)
    assert traj["sigmas"].shape == (STEPS + 1,) and traj["sigmas"][-1] == 0 and traj["sigmas"][0] == 1
    assert (traj["sigmas"][1:] < traj["sigmas"][:-1]).all()
    assert traj["timesteps"].shape == (STEPS,)
    (part,) = engine.generate_sync(request(rollout_return_step_indices=(1, 2, STEPS)))
    assert part.dit_trajectory["step_indices"].tolist() == [1, 2, STEPS]
    assert torch.equal(part.dit_trajectory["latents"], traj["latents"][[1, 2, STEPS]])
    assert torch.equal(part.generated_output, full.generated_output)


def test_debug_tensors_have_the_contract_shapes(engine: EmbeddedEngine) -> None:
    outputs = engine.generate_sync(request(num_outputs_per_prompt=2, rollout_debug_mode=True, rollout_sde_step_indices=(0, 2)))
    for output in outputs:
        debug = output.rollout_debug_tensors
        latent = (4, SIZE // 8, SIZE // 8)
        assert debug["rollout_variance_noises"].shape == (STEPS, *latent)
        assert debug["rollout_prev_sample_means"].shape == (STEPS, *latent)
        assert debug["rollout_model_outputs"].shape == (STEPS, *latent)
        assert debug["rollout_noise_std_devs"].shape == (STEPS,)
        std = debug["rollout_noise_std_devs"]
        assert (std[[0, 2]] > 0).all() and (std[[1, 3]] == 0).all()
        noises = debug["rollout_variance_noises"]
        assert (noises[[1, 3]] == 0).all() and (noises[[0, 2]] != 0).any()
        # x_{k+1} = mean + std * noise on the SDE steps.
        latents = output.dit_trajectory["latents"]
        for k in (0, 2):
            rebuilt = debug["rollout_prev_sample_means"][k] + std[k] * noises[k]
            assert torch.allclose(rebuilt, latents[k + 1], atol=1e-6)
    assert (
        outputs[0].rollout_debug_tensors["rollout_variance_noises"] != outputs[1].rollout_debug_tensors["rollout_variance_noises"]
    ).any()


@pytest.mark.parametrize(("overrides", "field"), [({"height": 50}, "height"), ({"num_frames": 3}, "num_frames")])
def test_a_bad_request_raises_naming_the_field(engine: EmbeddedEngine, overrides: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        engine.generate_sync(request(**overrides))
    assert info.value.field == field and str(info.value).startswith(f"{field}:")
    with pytest.raises(RequestError):
        asyncio.run(engine.generate(request(**overrides)))


# -- concurrency -----------------------------------------------------------------------------


def test_generation_runs_off_the_event_loop(engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    family = engine.family
    predict_times: list[float] = []
    original = family.predict

    def timed_predict(*args, **kwargs):
        predict_times.append(time.perf_counter())
        return original(*args, **kwargs)

    monkeypatch.setattr(family, "predict", timed_predict)

    async def main() -> list[float]:
        ticks: list[float] = []
        task = asyncio.ensure_future(engine.generate(request(num_inference_steps=12, num_outputs_per_prompt=2)))
        while not task.done():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)
        await task
        return ticks

    ticks = asyncio.run(main())
    assert len(predict_times) == 12
    during = [t for t in ticks if predict_times[0] < t < predict_times[-1]]
    assert len(during) > 0, "the event loop did not advance while the engine generated"


def test_a_family_whose_noise_is_a_strided_view_still_recomputes_exactly(engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family may hand back its initial noise as a transposed view (FLUX.2's packing is a
    permute). The sampler steps from a contiguous copy, so every later latent has the
    layout the trainer's stacked copies have and the per-sample log-prob reductions sum in
    the same order: exact by construction, whatever the family's layout."""
    original = engine.family.initial_latents

    def strided(params, generators):
        latents = original(params, generators)
        # Same values, channels-last strides: x.permute(...).contiguous().permute(back).
        return {name: x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) for name, x in latents.items()}

    monkeypatch.setattr(engine.family, "initial_latents", strided)
    req = request(guidance_scale=1.0, rollout_sde_step_indices=(0, 1, 2))
    (output,) = engine.generate_sync(req)
    assert torch.equal(recompute_log_probs(engine, output, req), output.rollout_log_probs)


# -- the VAE decode in chunks ---------------------------------------------------------------


def test_outputs_decode_in_chunks_of_the_decode_batch_size(engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    family = engine.family
    decode = family.decode
    calls: list[int] = []

    def counted(latents, params):
        calls.append(next(iter(latents.values())).shape[0])
        return decode(latents, params)

    monkeypatch.setattr(family, "decode", counted)
    outputs = {}
    for size in (4, 3, 1):
        monkeypatch.setattr(engine, "decode_batch_size", size)
        calls.clear()
        outputs[size] = engine.generate_sync(request(num_outputs_per_prompt=4))
        assert calls == {4: [4], 3: [3, 1], 1: [1, 1, 1, 1]}[size]
    worst = 0.0
    for size in (3, 1):
        for whole, chunked in zip(outputs[4], outputs[size]):
            # The denoising is the same computation; only the decode's batch differs.
            assert torch.equal(whole.dit_trajectory["latents"], chunked.dit_trajectory["latents"])
            assert whole.generated_output.shape == chunked.generated_output.shape
            worst = max(worst, max_diff(whole.generated_output, chunked.generated_output))
    print(f"max |whole-batch decode - chunked decode| = {worst:.3e}")
    assert worst <= 1e-5
    # Control: neighbouring outputs differ by far more than the tolerance.
    assert max_diff(outputs[1][0].generated_output, outputs[1][1].generated_output) > 1e-3


def test_the_decode_batch_size_must_be_positive(engine: EmbeddedEngine) -> None:
    from miles_core.engine.sampler import sample

    with pytest.raises(ValueError, match="decode_batch_size must be at least 1, got 0"):
        sample(engine.family, request(), engine.backends, decode_batch_size=0)


@pytest.mark.exercises("--vae-tiling", "--vae-decode-batch-size")
def test_the_vae_flags_reach_the_engine_and_a_vae_without_tiling_is_named(tmp_path) -> None:
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError

    tiny = SD3Family.build_tiny_pipeline(tmp_path / "tiny")
    args = ["--hf-checkpoint", str(tiny), "--prompt-data", "unused.jsonl", "--rollout-batch-size", "1"]
    engine = EmbeddedEngine.from_config(resolve_config([*args, "--vae-tiling", "--vae-decode-batch-size", "3"]))
    assert engine.decode_batch_size == 3 and engine.family.pipeline.vae.use_tiling
    plain = EmbeddedEngine.from_config(resolve_config(args))
    assert plain.decode_batch_size == 1 and not plain.family.pipeline.vae.use_tiling
    family = engine.family
    # A VAE without diffusers' tiled path (its use_tiling switch) is a one-line configuration error.
    del family.pipeline.vae.use_tiling
    with pytest.raises(ConfigError, match=r"^--vae-tiling: the SD3Family family's VAE \(AutoencoderKL\) has no tiled decode"):
        family.enable_vae_tiling()
