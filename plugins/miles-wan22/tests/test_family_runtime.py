"""Wan22Family's runtime contract against WanPipeline itself.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``WanPipeline.__call__`` (ODE sampling, both experts, CFG with
``guidance_scale_2``); driven by the checkpoint's own UniPC scheduler they must reproduce
the pipeline with that scheduler; rows of a batch are independent; the expert follows
the timestep; noise is per output; bad requests name their field; the saved LoRA loads
into a plain WanPipeline for both experts.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanPipeline,
)

import miles_core.family
from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_wan22.family import EXPERTS, WAN_DEFAULT_NUM_FRAMES, Wan22Family

PROMPT = "a red apple on a table"
NEGATIVE = "blurry"
SIZE = 32  # latents 4x4: a multiple of 16 (8x VAE x 2x2 patches)
FRAMES = 5  # 2 latent frames
STEPS = 4  # UniPC shift 3: timesteps 999, 900 (high-noise expert), 750, 500 (low-noise)
GUIDANCE, GUIDANCE_2 = 4.0, 3.0

tiny_dir, pipe = testing.tiny_pipeline_fixtures(Wan22Family)


@pytest.fixture(scope="module")
def family(pipe: WanPipeline) -> Wan22Family:
    return Wan22Family(pipe)


@pytest.fixture(scope="module")
def euler_pipe(pipe: WanPipeline) -> WanPipeline:
    """The same components with a FlowMatchEuler scheduler (shift 3, as the UniPC one): the
    pipeline then samples the ODE with Euler steps, which the family's loop must equal."""
    euler = WanPipeline(
        **{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0)},
        boundary_ratio=pipe.config.boundary_ratio,
    )
    euler.set_progress_bar_config(disable=True)
    return euler


def _request(guidance: float = GUIDANCE, **kwargs) -> RolloutRequest:
    extra = {"guidance_scale_2": GUIDANCE_2} if guidance > 1 else {}
    fields = dict(
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        extra_sampling_params=extra,
    )
    return RolloutRequest(**{**fields, **kwargs})


def _params(family: Wan22Family, guidance: float = GUIDANCE, **kwargs) -> GenerationParams:
    return family.resolve_params(_request(guidance, **kwargs))


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_euler(family: Wan22Family, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    return family.decode(family_checks.euler_sample(family, cond, params, {"latents": x}), params)


@torch.no_grad()
def _family_with_scheduler(family: Wan22Family, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    """The family's predict stepped by a copy of the pipeline's own scheduler (UniPC)."""
    scheduler = copy.deepcopy(family.pipeline.scheduler)
    scheduler.set_timesteps(params.num_inference_steps)
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    latents = x.float()
    for t in scheduler.timesteps:
        v = family.predict({"latents": latents}, t.float().expand(latents.shape[0]), cond, params)["latents"]
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    return family.decode({"latents": latents}, params)


def _pipeline_sample(pipe: WanPipeline, x: torch.Tensor, guidance: float) -> torch.Tensor:
    video = pipe(
        PROMPT,
        negative_prompt=NEGATIVE,
        latents=x,
        num_videos_per_prompt=x.shape[0],
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        guidance_scale_2=GUIDANCE_2 if guidance > 1 else None,
        output_type="pt",
    ).frames
    return video.permute(0, 2, 1, 3, 4)  # the pipeline's [B, F, C, H, W] as the family's [B, C, F, H, W]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(euler_pipe: WanPipeline, guidance: float) -> None:
    family = Wan22Family(euler_pipe)
    params = _params(family, guidance)
    schedule = family.schedule(params)
    # Both experts take part: the loop crosses the boundary.
    assert {family.denoiser_for(t, params) for t in schedule.timesteps} == set(EXPERTS)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    ours = _family_euler(family, params, x)
    theirs = _pipeline_sample(euler_pipe, x, guidance)
    assert ours.shape == theirs.shape == (2, 3, FRAMES, SIZE, SIZE) and ours.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    print(f"Euler, guidance {guidance}: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-5

    # Control: the comparison sees each expert. Nudge one weight of one expert in the
    # family run only (the pipeline shares the module, so restore it).
    for expert in EXPERTS:
        weight = family.components()[expert].blocks[0].attn1.to_q.weight
        with family_checks.nudged(weight):
            nudged = _family_euler(family, params, x)
        assert (nudged - theirs).abs().max().item() > 1e-4, expert
    assert torch.equal(_family_euler(family, params, x), ours)  # restored


def test_guidance_scale_2_drives_the_low_noise_expert(euler_pipe: WanPipeline) -> None:
    family = Wan22Family(euler_pipe)
    params = _params(family)
    x = family.initial_latents(params, _generators(7, 1))["latents"]
    other = replace(params, extra={"guidance_scale_2": 6.0})
    ours = _family_euler(family, other, x)
    theirs = euler_pipe(
        PROMPT,
        negative_prompt=NEGATIVE,
        latents=x,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        guidance_scale_2=6.0,
        output_type="pt",
    ).frames.permute(0, 2, 1, 3, 4)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - _family_euler(family, params, x)).abs().max().item() > 1e-4  # control: the scale mattered


def test_an_unset_guidance_scale_2_is_the_pipelines_fallback(euler_pipe: WanPipeline) -> None:
    # WanPipeline.__call__ with guidance_scale_2=None samples the low-noise expert with
    # guidance_scale; a request without it must give that video.
    family = Wan22Family(euler_pipe)
    unset = _params(family, extra_sampling_params={})
    x = family.initial_latents(unset, _generators(7, 1))["latents"]
    ours = _family_euler(family, unset, x)
    theirs = euler_pipe(
        PROMPT,
        negative_prompt=NEGATIVE,
        latents=x,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        output_type="pt",
    ).frames.permute(0, 2, 1, 3, 4)
    assert (ours - theirs).abs().max().item() <= 1e-5  # the Euler comparison's tolerance
    # By construction the same computation as giving guidance_scale as the second scale ...
    assert torch.equal(ours, _family_euler(family, _params(family, extra_sampling_params={"guidance_scale_2": GUIDANCE}), x))
    # ... and not GUIDANCE_2's (control).
    assert (ours - _family_euler(family, _params(family), x)).abs().max().item() > 1e-4


def test_the_checkpoints_unipc_scheduler_over_the_family_equals_the_pipeline(family: Wan22Family, pipe) -> None:
    """With the scheduler the checkpoint ships (UniPC, integer timesteps), predict is the
    pipeline's transformer calls and CFG exactly."""
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
    params = _params(family)
    x = family.initial_latents(params, _generators(3, 2))["latents"]
    ours = _family_with_scheduler(family, params, x)
    theirs = _pipeline_sample(pipe, x, GUIDANCE)
    diff = (ours - theirs).abs().max().item()
    print(f"UniPC: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-5


def test_schedule_is_the_pipelines(family: Wan22Family, pipe, euler_pipe) -> None:
    params = _params(family)
    schedule = family.schedule(params)
    assert schedule.sigmas.dtype == schedule.timesteps.dtype == torch.float32
    assert schedule.sigmas.shape == (STEPS + 1,) and schedule.timesteps.shape == (STEPS,)
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    reference.set_timesteps(STEPS)
    # The integer timesteps the transformer sees, exactly.
    assert torch.equal(schedule.timesteps, reference.timesteps.float())
    assert schedule.timesteps.tolist() == [999.0, 900.0, 750.0, 500.0]
    # The sigmas, except UniPC's 1e-6 guard on the first one, which is undone.
    assert 0 < 1 - reference.sigmas[0].item() <= 2e-6
    assert schedule.sigmas[0].item() == 1.0 and schedule.sigmas[-1].item() == 0.0
    assert torch.equal(schedule.sigmas[1:], reference.sigmas[1:])
    # The pipeline's own scheduler is left alone (each schedule works on a copy).
    before = (pipe.scheduler.num_inference_steps, None if pipe.scheduler.sigmas is None else pipe.scheduler.sigmas.clone())
    family.schedule(replace(params, num_inference_steps=7))
    assert pipe.scheduler.num_inference_steps == before[0]
    # A FlowMatchEuler checkpoint: its schedule, bit for bit (no guard to undo).
    euler = Wan22Family(euler_pipe).schedule(params)
    fresh = FlowMatchEulerDiscreteScheduler.from_config(euler_pipe.scheduler.config)
    fresh.set_timesteps(STEPS)
    assert torch.equal(euler.sigmas, fresh.sigmas) and torch.equal(euler.timesteps, fresh.timesteps)


def test_the_first_sde_step_follows_flow_grpos_sigma_one_rule(family: Wan22Family, pipe) -> None:
    """Why the first sigma is restored to 1: Flow-GRPO's SDE replaces the denominator's σ
    by σ_1 in ``s = η·sqrt(σ / (1 − σ))`` only at σ = 1; at UniPC's 1 − 1e-6 the first step's noise
    scale would be about 1000·η and the sample would explode."""
    from miles_core.sde import FlowSdeBackend

    sigmas = family.schedule(_params(family)).sigmas
    backend = FlowSdeBackend(noise_level=0.7)
    x = torch.zeros(1, 16, 2, 4, 4)
    scale = backend.noise_scale(x, float(sigmas[0]), float(sigmas[1]), sigma_max=float(sigmas[1])).flatten()[0].item()
    expected = 0.7 * (1 / (1 - float(sigmas[1]))) ** 0.5  # σ = 1 over 1 - σ_1
    assert scale == pytest.approx(expected, rel=1e-6) and scale < 3
    reference = copy.deepcopy(pipe.scheduler)
    reference.set_timesteps(STEPS)
    guarded = backend.noise_scale(x, float(reference.sigmas[0]), float(sigmas[1]), sigma_max=float(sigmas[1]))
    assert guarded.flatten()[0].item() > 500  # control: the unrestored sigma


@pytest.mark.exercises("--diffusion-flow-shift")
def test_flow_shift_rebuilds_the_scheduler_with_that_shift(family: Wan22Family, pipe, euler_pipe) -> None:
    shifted = family.schedule(_params(family, extra_sampling_params={"guidance_scale_2": 3.0, "flow_shift": 8.0}))
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=8.0)
    reference.set_timesteps(STEPS)
    assert torch.equal(shifted.timesteps, reference.timesteps.float())
    assert torch.equal(shifted.sigmas[1:], reference.sigmas[1:]) and shifted.sigmas[0].item() == 1.0
    assert not torch.equal(shifted.sigmas, family.schedule(_params(family)).sigmas)  # control: the shift mattered
    euler_family = Wan22Family(euler_pipe)
    euler = euler_family.schedule(_params(euler_family, extra_sampling_params={"guidance_scale_2": 3.0, "flow_shift": 8.0}))
    fresh = FlowMatchEulerDiscreteScheduler.from_config(euler_pipe.scheduler.config, shift=8.0)
    fresh.set_timesteps(STEPS)
    assert torch.equal(euler.sigmas, fresh.sigmas) and torch.equal(euler.timesteps, fresh.timesteps)


def test_flow_shift_is_refused_for_a_scheduler_without_shift(family: Wan22Family, monkeypatch) -> None:
    monkeypatch.setattr(miles_core.family, "flow_shift_key", lambda scheduler: None)  # check_flow_shift reads it
    with pytest.raises(RequestError, match=r"^extra_sampling_params: flow_shift: the pipeline's UniPCMultistepScheduler has no shift$"):
        _params(family, extra_sampling_params={"guidance_scale_2": 3.0, "flow_shift": 5.0})


def test_the_expert_follows_the_timestep(family: Wan22Family) -> None:
    params = _params(family)
    assert family.boundary_timestep == 875.0
    assert family.denoiser_for(torch.tensor(875.0), params) == "transformer"
    assert family.denoiser_for(874.9, params) == "transformer_2"
    assert family.denoiser_for(999.0, params) == "transformer" and family.denoiser_for(0.0, params) == "transformer_2"
    assert set(family.components()) == set(EXPERTS)
    # predict uses that expert: nudging transformer_2 changes low-noise predictions only.
    x = family.initial_latents(params, _generators(0, 1))["latents"]
    cond = family.encode(PROMPT, None, params)
    times = {"high": torch.tensor([900.0]), "low": torch.tensor([750.0])}
    with torch.no_grad():
        before = {k: family.predict({"latents": x}, t, cond, params)["latents"] for k, t in times.items()}
        weight = family.components()["transformer_2"].blocks[0].attn1.to_q.weight
        with family_checks.nudged(weight):
            after = {k: family.predict({"latents": x}, t, cond, params)["latents"] for k, t in times.items()}
    assert torch.equal(before["high"], after["high"])
    assert not torch.allclose(before["low"], after["low"])


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: Wan22Family, guidance: float) -> None:
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = torch.tensor([999.0, 900.0, 750.0])  # two rows for the high-noise expert, one for the low-noise one
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - single).abs().max().item()
    print(f"guidance {guidance}: max |batched - single rows| = {diff:.3e}")
    assert torch.allclose(batched, single, atol=1e-5, rtol=0)  # CFG x4 amplifies batch-shape rounding


def test_initial_noise_is_per_output(family: Wan22Family) -> None:
    params = _params(family)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 16, 2, SIZE // 8, SIZE // 8) and pair.dtype == torch.float32
    first = family.initial_latents(params, _generators(11, 1))["latents"]
    second = family.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    # What WanPipeline.prepare_latents draws with the same generators.
    drawn = family.pipeline.prepare_latents(2, 16, SIZE, SIZE, FRAMES, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, drawn)


def test_multi_output_invariant(family: Wan22Family) -> None:
    request = _request(seed=5, num_inference_steps=3, num_outputs_per_prompt=3, rollout_return_dit_trajectory=True)
    diff = family_checks.check_multi_output_invariant(family, request)
    print(f"multi-output invariant: max |output i of 3 - seed + i alone| = {diff:.3e}")


def test_resolve_params_defaults_and_errors(family: Wan22Family, tiny_dir) -> None:
    # Unset sizes are the pipeline's (480, 832); the tiny transformer's rope grid (32
    # positions of 16 px) reaches the height but not the width.
    assert Wan22Family.native_size(tiny_dir) == (480, 832)
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, width=SIZE, guidance_scale=1.0, num_inference_steps=5))
    assert (params.height, params.width, params.num_inference_steps) == (480, SIZE, 5)
    with pytest.raises(RequestError, match=r"^width: 832 exceeds the transformer's maximum of 512 \(rope_max_seq_len 32\)$"):
        family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=1.0))
    params = family.resolve_params(
        RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE, guidance_scale=5.0, fps=16.0, extra_sampling_params={"guidance_scale_2": 2})
    )
    assert (params.num_frames, params.fps, params.guidance_scale, dict(params.extra)) == (
        WAN_DEFAULT_NUM_FRAMES,
        16.0,
        5.0,
        {"guidance_scale_2": 2.0},
    )
    assert params.flow_shift is None and params.true_cfg_scale is None
    assert family.resolve_params(_request(num_frames=1)).num_frames == 1  # one frame: an image
    # Unset, the low-noise expert's scale is guidance_scale (WanPipeline.__call__'s fallback).
    assert dict(_params(family, 1.0).extra) == {"guidance_scale_2": 1.0}
    assert dict(_params(family, extra_sampling_params={}).extra) == {"guidance_scale_2": GUIDANCE}

    base = _request()
    extra = {"guidance_scale_2": 3.0}
    bad = [
        ("height", replace(base, height=40), "height: 40 must be a multiple of 16"),
        ("width", replace(base, width=24), "width: 24 must be a multiple of 16"),
        ("height", replace(base, height=528), "height: 528 exceeds the transformer's maximum of 512"),
        ("num_frames", replace(base, num_frames=6), "num_frames: 6: Wan needs num_frames - 1 divisible by 4"),
        ("num_frames", replace(base, num_frames=133), "num_frames: 133 gives more latent frames"),
        ("fps", replace(base, fps=0.0), "fps: must be a finite number > 0"),
        ("true_cfg_scale", replace(base, true_cfg_scale=4.0), "true_cfg_scale: Wan 2.2 has no true CFG"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={**extra, "true_cfg": 1}),
            "extra_sampling_params: Wan 2.2 takes only flow_shift, guidance_scale_2, max_sequence_length, got true_cfg",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_scale_2": -1.0}),
            "extra_sampling_params: guidance_scale_2 must be a finite number >= 0",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_scale_2": True}),
            "extra_sampling_params: guidance_scale_2 must be a finite number >= 0",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={**extra, "max_sequence_length": 0}),
            "extra_sampling_params: max_sequence_length must be an integer in [1, 512]",
        ),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field, message
        assert str(excinfo.value).startswith(message), str(excinfo.value)
        assert "\n" not in str(excinfo.value)


def test_native_frames_default_is_the_pipelines() -> None:
    import inspect

    assert inspect.signature(WanPipeline.__call__).parameters["num_frames"].default == WAN_DEFAULT_NUM_FRAMES


def test_conditioning_encoded_once_expands_to_repeated_encodings(family: Wan22Family, pipe) -> None:
    params = _params(family)
    once = family.encode(PROMPT, None, params)
    assert once.negative is not None
    assert set(once.positive) == set(once.negative) == {"encoder_hidden_states"}
    assert once.positive["encoder_hidden_states"].shape == (1, 512, 32)
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, once)
    # The pipeline's own encoding of the same prompts.
    with torch.no_grad():  # (autograd picks other kernels: not bit-equal with grad on)
        embeds, neg = pipe.encode_prompt(PROMPT, " ", do_classifier_free_guidance=True, max_sequence_length=512)
    assert torch.equal(once.positive["encoder_hidden_states"], embeds)
    assert torch.equal(once.negative["encoder_hidden_states"], neg)  # default negative prompt " "
    assert not torch.equal(once.negative["encoder_hidden_states"], once.positive["encoder_hidden_states"])
    # Without CFG there is no negative conditioning; max_sequence_length is the pipeline's argument.
    assert family.encode(PROMPT, "ignored", _params(family, 1.0)).negative is None
    short = _params(family, extra_sampling_params={"guidance_scale_2": 3.0, "max_sequence_length": 16})
    assert family.encode(PROMPT, None, short).positive["encoder_hidden_states"].shape == (1, 16, 32)


def test_decode_and_encode_pixels(family: Wan22Family) -> None:
    params = _params(family, 1.0)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    with torch.no_grad():
        video = family.decode({"latents": x}, params)
        assert video.shape == (2, 3, FRAMES, SIZE, SIZE) and video.dtype == torch.float32
        assert video.min() >= 0 and video.max() <= 1
        latents = family.encode_pixels(video, params)["latents"]
        assert latents.shape == x.shape
        # The inverse of decode's normalisation: the VAE's posterior mean, normalised.
        vae = family.pipeline.vae
        z = vae.encode(video * 2 - 1).latent_dist.mean
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        assert torch.allclose(latents, (z - mean) / std, atol=1e-5)
        # An image is a one-frame video.
        image = family.encode_pixels(video[:, :, 0], params)["latents"]
        assert image.shape == (2, 16, 1, SIZE // 8, SIZE // 8)


def test_non_two_expert_pipelines_are_refused(pipe: WanPipeline) -> None:
    single = WanPipeline(**{**pipe.components, "transformer_2": None})
    with pytest.raises(ValueError, match=r"needs a two-expert WanPipeline .*boundary_ratio=None and no transformer_2"):
        Wan22Family(single)
    from diffusers import DDIMScheduler

    ddim = WanPipeline(**{**pipe.components, "scheduler": DDIMScheduler()}, boundary_ratio=0.875)
    with pytest.raises(ValueError, match="DDIMScheduler is not a flow-matching scheduler"):
        Wan22Family(ddim)


def _add_random_lora(module: torch.nn.Module, seed: int) -> None:
    from peft import LoraConfig

    # alpha != rank: the saved metadata must carry the scale (diffusers assumes alpha = rank otherwise).
    module.add_adapter(LoraConfig(r=2, lora_alpha=6, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def test_saved_lora_loads_into_a_plain_pipeline_for_both_experts(tiny_dir: Path, tmp_path: Path) -> None:
    trained = testing.load_tiny_pipeline(Wan22Family, tiny_dir)
    family = Wan22Family(trained)
    for seed, module in enumerate(family.components().values()):
        _add_random_lora(module, seed)
    params = _params(family)
    x = family.initial_latents(params, _generators(1, 1))["latents"]
    ours = _pipeline_sample(trained, x, GUIDANCE)

    out = family.save_lora(tmp_path / "lora", family.components())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors")) == [
        "transformer/pytorch_lora_weights.safetensors",
        "transformer_2/pytorch_lora_weights.safetensors",
    ]

    plain = testing.load_tiny_pipeline(Wan22Family, tiny_dir)
    base = _pipeline_sample(plain, x, GUIDANCE)
    # No silent half-load: the folder itself holds no LoRA file.
    with pytest.raises(OSError, match="no file named pytorch_lora_weights"):
        plain.load_lora_weights(str(out))
    plain.load_lora_weights(str(out), subfolder="transformer")
    high_only = _pipeline_sample(plain, x, GUIDANCE)
    plain.load_lora_weights(str(out), subfolder="transformer_2", load_into_transformer_2=True)
    both = _pipeline_sample(plain, x, GUIDANCE)
    diff = (both - ours).abs().max().item()
    print(f"LoRA round trip: max |loaded pipeline - trained family| = {diff:.3e}")
    assert diff <= 1e-5
    # Each expert's adapter changes the output.
    assert (high_only - base).abs().max().item() > 1e-4
    assert (both - high_only).abs().max().item() > 1e-4
    # The family's own loader (``generate --lora``) loads both folders.
    fresh = Wan22Family(testing.load_tiny_pipeline(Wan22Family, tiny_dir))
    fresh.load_lora(out)
    assert (_pipeline_sample(fresh.pipeline, x, GUIDANCE) - ours).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="Wan 2.2 LoRAs cover transformer, transformer_2; got vae"):
        family.save_lora(tmp_path / "bad", {"vae": trained.vae})
