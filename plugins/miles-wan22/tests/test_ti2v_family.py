"""WanTI2VFamily's runtime contract against WanPipeline in its ``expand_timesteps`` mode.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, reproduce ``WanPipeline.__call__`` on the tiny TI2V-5B-like pipeline; the
transformer gets exactly the per-token timesteps the pipeline builds; rows of a batch
are independent; noise is the pipeline's ``prepare_latents``; the schedule is its
scheduler's; bad requests name their field; ``encode_pixels`` on videos is the VAE's
normalised posterior mean; the saved LoRA loads into a plain WanPipeline; output i of a
request equals the one-output request seeded seed + i.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_wan22.family import Wan22Family
from miles_wan22.ti2v import WanTI2VFamily

PROMPT = "a red apple on a table"
NEGATIVE = "blurry"
HEIGHT, WIDTH = 32, 64  # latents 2x4 (16x VAE): 1x2 tokens of 2x2 patches per latent frame
FRAMES = 5  # 2 latent frames: 4 tokens per sample
TOKENS = 2 * 1 * 2
STEPS = 4  # UniPC shift 5: timesteps 999, 937, 833, 625
GUIDANCE = 5.0

tiny_dir, pipe = testing.tiny_pipeline_fixtures(WanTI2VFamily)


@pytest.fixture(scope="module")
def family(pipe: WanPipeline) -> WanTI2VFamily:
    return WanTI2VFamily(pipe)


@pytest.fixture(scope="module")
def euler_pipe(pipe: WanPipeline) -> WanPipeline:
    """The same components with a FlowMatchEuler scheduler (shift 5, as the UniPC one): the
    pipeline then samples the ODE with Euler steps, which the family's loop must equal."""
    euler = WanPipeline(**{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0)}, expand_timesteps=True)
    euler.set_progress_bar_config(disable=True)
    return euler


def _request(guidance: float = GUIDANCE, **kwargs) -> RolloutRequest:
    fields = dict(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance)
    return RolloutRequest(**{**fields, **kwargs})


def _params(family: WanTI2VFamily, guidance: float = GUIDANCE, **kwargs) -> GenerationParams:
    return family.resolve_params(_request(guidance, **kwargs))


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_euler(family: WanTI2VFamily, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    return family.decode(family_checks.euler_sample(family, cond, params, {"latents": x}), params)


def _pipeline_sample(pipe: WanPipeline, x: torch.Tensor, guidance: float) -> torch.Tensor:
    video = pipe(
        PROMPT,
        negative_prompt=NEGATIVE,
        latents=x,
        num_videos_per_prompt=x.shape[0],
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        output_type="pt",
    ).frames
    return video.permute(0, 2, 1, 3, 4)  # the pipeline's [B, F, C, H, W] as the family's [B, C, F, H, W]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(euler_pipe: WanPipeline, guidance: float) -> None:
    family = WanTI2VFamily(euler_pipe)
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    ours = _family_euler(family, params, x)
    theirs = _pipeline_sample(euler_pipe, x, guidance)
    assert ours.shape == theirs.shape == (2, 3, FRAMES, HEIGHT, WIDTH) and ours.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    print(f"Euler, guidance {guidance}: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-5
    # Control: the comparison sees the transformer. Nudge one weight in the family run only
    # (the pipeline shares the module; nudged restores it).
    weight = family.components()["transformer"].blocks[0].attn1.to_q.weight
    with family_checks.nudged(weight):
        assert (_family_euler(family, params, x) - theirs).abs().max().item() > 1e-4
    assert torch.equal(_family_euler(family, params, x), ours)  # restored


def test_the_transformer_gets_the_pipelines_per_token_timesteps(family: WanTI2VFamily, pipe: WanPipeline) -> None:
    """WanPipeline in expand_timesteps mode calls the transformer with a [B, tokens]
    timestep; predict builds the same tensor from the contract's [B] timestep."""
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()), with_kwargs=True)
    params = _params(family, 1.0)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    try:
        _pipeline_sample(pipe, x, 1.0)
        theirs = list(seen)
        seen.clear()
        schedule = family.schedule(params)
        cond = family.encode(PROMPT, None, params).expand(2)
        with torch.no_grad():
            for t in schedule.timesteps:
                family.predict({"latents": x}, t.expand(2), cond, params)
    finally:
        hook.remove()
    assert len(theirs) == len(seen) == STEPS
    for pipeline_t, family_t in zip(theirs, seen):
        assert pipeline_t.shape == (2, TOKENS) and pipeline_t.dtype == torch.float32
        assert torch.equal(family_t, pipeline_t)
    # Rows keep their own timestep (the trainer mixes steps in a micro-batch).
    mixed = family.token_timesteps(torch.tensor([999.0, 625.0]), x)
    assert mixed.tolist() == [[999.0] * TOKENS, [625.0] * TOKENS]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: WanTI2VFamily, guidance: float) -> None:
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = torch.tensor([999.0, 937.0, 625.0])
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - single).abs().max().item()
    print(f"guidance {guidance}: max |batched - single rows| = {diff:.3e}")
    assert torch.allclose(batched, single, atol=1e-5, rtol=0)  # batch-shape rounding, amplified by CFG
    # Control: a row's timestep reaches its prediction.
    with torch.no_grad():
        other = family.predict({"latents": x}, torch.tensor([999.0, 937.0, 100.0]), cond.expand(3), params)["latents"]
    assert torch.equal(other[:2], batched[:2])  # same batch shape and rows: same kernels, same values
    assert (other[2] - batched[2]).abs().max().item() > 1e-3


def test_initial_noise_is_the_pipelines(family: WanTI2VFamily) -> None:
    params = _params(family)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 48, 2, HEIGHT // 16, WIDTH // 16) and pair.dtype == torch.float32
    assert torch.equal(pair, torch.cat([family.initial_latents(params, _generators(s, 1))["latents"] for s in (11, 12)]))
    assert not torch.equal(pair[0], pair[1])
    drawn = family.pipeline.prepare_latents(2, 48, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, drawn)


def test_schedule_is_the_pipelines(family: WanTI2VFamily, pipe: WanPipeline) -> None:
    schedule = family.schedule(_params(family))
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    reference.set_timesteps(STEPS)
    assert reference.config.flow_shift == 5.0
    assert torch.equal(schedule.timesteps, reference.timesteps.float())
    assert schedule.timesteps.tolist() == [999.0, 937.0, 833.0, 625.0]
    # UniPC's 1e-6 guard on the first sigma is undone (the SDE's sigma = 1 rule).
    assert 0 < 1 - reference.sigmas[0].item() <= 2e-6 and schedule.sigmas[0].item() == 1.0
    assert torch.equal(schedule.sigmas[1:], reference.sigmas[1:]) and schedule.sigmas[-1].item() == 0.0


def test_resolve_params_defaults_and_errors(family: WanTI2VFamily, tiny_dir: Path) -> None:
    # Unset: WanPipeline's own defaults, as diffusers samples TI2V-5B without arguments.
    assert WanTI2VFamily.native_size(tiny_dir) == (480, 832)
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=5.0, fps=24.0))
    assert (params.height, params.width, params.num_frames, params.fps, dict(params.extra)) == (480, 832, 81, 24.0, {})
    assert family.resolve_params(_request(num_frames=1)).num_frames == 1  # one frame: an image
    short = _params(family, extra_sampling_params={"max_sequence_length": 16})
    assert family.encode(PROMPT, None, short).positive["encoder_hidden_states"].shape == (1, 16, 32)

    base = _request()
    bad = [
        ("height", replace(base, height=48), "height: 48 must be a multiple of 32"),  # 16x VAE x 2x2 patches
        ("width", replace(base, width=2080), "width: 2080 exceeds the transformer's maximum of 2048 (rope_max_seq_len 64)"),
        (
            "num_frames",
            replace(base, num_frames=6),
            "num_frames: 6: Wan needs num_frames - 1 divisible by 4 (the VAE's temporal factor), e.g. 5",
        ),
        (
            "num_frames",
            replace(base, num_frames=261),
            "num_frames: 261 gives more latent frames than the transformer's rope_max_seq_len 64",
        ),
        ("fps", replace(base, fps=0.0), "fps: must be a finite number > 0"),
        ("true_cfg_scale", replace(base, true_cfg_scale=4.0), "true_cfg_scale: Wan 2.2 TI2V-5B has no true CFG"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_scale_2": 3.0}),
            "extra_sampling_params: Wan 2.2 TI2V-5B takes only flow_shift and max_sequence_length, got guidance_scale_2",
        ),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field, message
        assert str(excinfo.value).startswith(message), str(excinfo.value)
        assert "\n" not in str(excinfo.value)
    assert family.resolve_params(replace(base, num_frames=9)).num_frames == 9  # control: 4k + 1 frames pass


def test_decode_and_encode_pixels_on_a_video(family: WanTI2VFamily) -> None:
    params = _params(family, 1.0)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    with torch.no_grad():
        video = family.decode({"latents": x}, params)
        assert video.shape == (2, 3, FRAMES, HEIGHT, WIDTH) and 0 <= video.min() and video.max() <= 1
        latents = family.encode_pixels(video, params)["latents"]
        assert latents.shape == x.shape
        # The VAE's posterior mean (2x2 patchified inside encode), normalised with its stats.
        vae = family.pipeline.vae
        z = vae.encode(video * 2 - 1).latent_dist.mean
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        assert not torch.allclose(mean, torch.zeros_like(mean)) and not torch.allclose(std, torch.ones_like(std))
        assert torch.allclose(latents, (z - mean) / std, atol=1e-5)
        assert (latents - z).abs().max().item() > 1e-2  # control: the normalisation acts
        # An image is a one-frame video.
        assert family.encode_pixels(video[:, :, 0], params)["latents"].shape == (2, 48, 1, HEIGHT // 16, WIDTH // 16)


def test_pipelines_of_the_other_wan_family_are_refused(pipe: WanPipeline, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the wan2_2 family does not support expand_timesteps pipelines .*family wan2_2_ti2v"):
        Wan22Family(WanPipeline(**{**pipe.components, "transformer_2": pipe.transformer}, boundary_ratio=0.875, expand_timesteps=True))
    a14b = testing.load_tiny_pipeline(Wan22Family, Wan22Family.build_tiny_pipeline(tmp_path / "a14b"))
    with pytest.raises(ValueError, match=r"needs a one-transformer WanPipeline with expand_timesteps .*expand_timesteps=False"):
        WanTI2VFamily(a14b)


def test_saved_lora_loads_into_a_plain_pipeline(tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    trained = testing.load_tiny_pipeline(WanTI2VFamily, tiny_dir)
    family = WanTI2VFamily(trained)
    # alpha != rank: the saved metadata must carry the scale (diffusers assumes alpha = rank otherwise).
    family.components()["transformer"].add_adapter(LoraConfig(r=2, lora_alpha=6, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in family.components()["transformer"].named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    x = family.initial_latents(_params(family), _generators(1, 1))["latents"]
    ours = _pipeline_sample(trained, x, GUIDANCE)
    out = family.save_lora(tmp_path / "lora", family.components())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors")) == ["pytorch_lora_weights.safetensors"]

    plain = testing.load_tiny_pipeline(WanTI2VFamily, tiny_dir)
    base = _pipeline_sample(plain, x, GUIDANCE)
    plain.load_lora_weights(str(out))
    diff = (_pipeline_sample(plain, x, GUIDANCE) - ours).abs().max().item()
    print(f"LoRA round trip: max |loaded pipeline - trained family| = {diff:.3e}")
    assert diff <= 1e-5
    assert (base - ours).abs().max().item() > 1e-4  # control: the adapter changes the video
    # The family's own loader (generate --lora).
    fresh = WanTI2VFamily(testing.load_tiny_pipeline(WanTI2VFamily, tiny_dir))
    fresh.load_lora(out)
    assert (_pipeline_sample(fresh.pipeline, x, GUIDANCE) - ours).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="Wan 2.2 TI2V-5B LoRAs cover transformer only; got vae"):
        family.save_lora(tmp_path / "bad", {"vae": trained.vae})


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_multi_output_invariant(family: WanTI2VFamily, guidance: float) -> None:
    request = replace(_request(guidance), seed=5, num_outputs_per_prompt=3, rollout_return_dit_trajectory=True)
    worst = family_checks.check_multi_output_invariant(family, request)
    print(f"guidance {guidance}: multi-output invariant max |diff| = {worst:.3e}")  # measured 3.4e-6 / 1.4e-6
