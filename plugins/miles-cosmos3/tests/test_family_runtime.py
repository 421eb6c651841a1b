"""Cosmos3Family's runtime contract against Cosmos3OmniPipeline itself.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``Cosmos3OmniPipeline.__call__`` run with an Euler scheduler;
under the checkpoint's own UniPC scheduler, predict must give the pipeline's velocity at
every step and schedule its timesteps. One transformer call per sample (two with CFG);
noise per output; bad requests name their field.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from diffusers import (
    Cosmos3OmniPipeline,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_cosmos3.family import (
    LORA_WEIGHT_NAME,
    Cosmos3Family,
    is_generation_parameter,
)

PROMPT = "a red apple on a wooden table"
NEGATIVE = "blurry, low quality"
STEPS = 4
IMAGE = {"height": 32, "width": 32, "num_frames": 1}  # latents 4x4: 2x2 patches
VIDEO = {"height": 16, "width": 24, "num_frames": 5}  # 2 latent frames of 2x3 (3 is padded to the patch)
TARGETS = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

tiny_dir, pipe = testing.tiny_pipeline_fixtures(Cosmos3Family)


@pytest.fixture(scope="module")
def euler_pipe(pipe: Cosmos3OmniPipeline) -> Cosmos3OmniPipeline:
    """The tiny pipeline with an Euler flow-matching scheduler (same shift): its own
    sampling is then exactly the ODE the engine integrates."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler = Cosmos3OmniPipeline(**{**pipe.components, "scheduler": scheduler}, enable_safety_checker=False)
    euler.set_progress_bar_config(disable=True)
    return euler


@pytest.fixture(scope="module")
def family(pipe: Cosmos3OmniPipeline) -> Cosmos3Family:
    return Cosmos3Family(pipe)


@pytest.fixture(scope="module")
def euler_family(euler_pipe: Cosmos3OmniPipeline) -> Cosmos3Family:
    return Cosmos3Family(euler_pipe)


def _params(family: Cosmos3Family, guidance: float, size: dict = IMAGE, **kwargs) -> GenerationParams:
    request = RolloutRequest(prompt=PROMPT, num_inference_steps=STEPS, guidance_scale=guidance, **size, **kwargs)
    return family.resolve_params(request)


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_sample(family: Cosmos3Family, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    return family.decode(family_checks.euler_sample(family, cond, params, {"latents": x}), params)


def _pipeline_sample(pipe: Cosmos3OmniPipeline, x: torch.Tensor, guidance: float, size: dict) -> torch.Tensor:
    """The pipeline's own output for each row of ``x`` (one sample per call), in the
    family's layout: ``[B, C, H, W]`` for an image, ``[B, C, F, H, W]`` for a video."""
    videos = [
        pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            latents=x[i : i + 1],
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            output_type="pt",
            **size,
        ).video  # [F, C, H, W]
        for i in range(x.shape[0])
    ]
    video = torch.stack(videos).permute(0, 2, 1, 3, 4)
    return video[:, :, 0] if size["num_frames"] == 1 else video


@pytest.mark.parametrize(("guidance", "size"), [(4.5, IMAGE), (1.0, IMAGE), (4.5, VIDEO)], ids=["image-cfg", "image-no-cfg", "video-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(euler_family, euler_pipe, guidance: float, size: dict) -> None:
    params = _params(euler_family, guidance, size)
    x = euler_family.initial_latents(params, _generators(7, 2))["latents"]
    ours = _family_sample(euler_family, params, x)
    theirs = _pipeline_sample(euler_pipe, x, guidance, size)
    frames = () if size["num_frames"] == 1 else (size["num_frames"],)
    assert ours.shape == theirs.shape == (2, 3, *frames, size["height"], size["width"]) and ours.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    print(f"guidance {guidance}, {size}: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-6
    assert ours.min() >= 0 and ours.max() <= 1

    # Control: the comparison sees the generation path. Nudge one generation weight in
    # the family run only (the pipeline shares the module, so restore it).
    weight = euler_family.components()["transformer"].layers[0].self_attn.add_q_proj.weight
    with family_checks.nudged(weight):
        nudged = _family_sample(euler_family, params, x)
    assert (nudged - theirs).abs().max().item() > 1e-4
    assert torch.equal(_family_sample(euler_family, params, x), ours)  # restored


@pytest.mark.parametrize("guidance", [6.0, 1.0], ids=["cfg", "no-cfg"])
def test_predict_is_the_pipelines_velocity_at_every_unipc_step(family, pipe, guidance: float) -> None:
    """Under the checkpoint's UniPC scheduler the pipeline's output is not an Euler
    integral; its velocities are what the family must reproduce, step by step."""
    params = _params(family, guidance, VIDEO)
    x = family.initial_latents(params, _generators(3, 1))["latents"]
    transformer = pipe.transformer
    calls: list[tuple[torch.Tensor, float, torch.Tensor]] = []
    original = transformer.forward

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((kwargs["vision_tokens"][0].clone(), float(kwargs["vision_timesteps"][0]), out[0][0].clone()))
        return out

    with mock.patch.object(transformer, "forward", side_effect=recording):
        pipe(PROMPT, negative_prompt=NEGATIVE, latents=x, num_inference_steps=STEPS, guidance_scale=guidance, output_type="latent", **VIDEO)
    per_step = 2 if guidance != 1 else 1
    assert len(calls) == STEPS * per_step
    schedule = family.schedule(params)
    cond = family.encode(PROMPT, NEGATIVE, params)
    worst = 0.0
    for k in range(STEPS):
        latents, timestep, pos = calls[per_step * k]
        assert timestep == schedule.timesteps[k].item()
        expected = pos.float()
        if per_step == 2:
            neg = calls[2 * k + 1][2].float()
            expected = neg + guidance * (expected - neg)
        with torch.no_grad():
            ours = family.predict({"latents": latents.float()}, schedule.timesteps[k : k + 1], cond, params)["latents"]
        worst = max(worst, (ours - expected).abs().max().item())
    print(f"guidance {guidance}: max |family velocity - pipeline velocity| over the UniPC run = {worst:.3e}")
    assert worst == 0.0


def test_schedule_is_the_pipelines(family: Cosmos3Family, pipe: Cosmos3OmniPipeline, euler_family: Cosmos3Family) -> None:
    params = _params(family, 4.5)
    schedule = family.schedule(params)
    sigmas, timesteps = schedule.sigmas, schedule.timesteps
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
    assert sigmas[-1].item() == 0.0 and (sigmas[1:] < sigmas[:-1]).all()
    # The pipeline's own scheduler is left alone (each schedule works on a copy) ...
    state = (pipe.scheduler.num_inference_steps, pipe.scheduler.sigmas.clone())
    family.schedule(replace(params, num_inference_steps=7))
    assert pipe.scheduler.num_inference_steps == state[0] and torch.equal(pipe.scheduler.sigmas, state[1])
    # ... and a fresh UniPC scheduler agrees: the integer timesteps the transformer sees,
    # every sigma but the first, which UniPC lowers by 1e-6 and the family keeps at 1.
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    reference.set_timesteps(STEPS)
    assert reference.timesteps.dtype == torch.int64 and torch.equal(reference.timesteps.float(), timesteps)
    assert torch.equal(reference.sigmas[1:], sigmas[1:])
    assert reference.sigmas[0].item() == pytest.approx(1 - 1e-6, abs=1e-7) and sigmas[0].item() == 1.0
    # The Euler scheduler's sigmas start at 1 already: nothing to restore.
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(STEPS)
    schedule = euler_family.schedule(params)
    assert torch.equal(euler.sigmas, schedule.sigmas) and torch.equal(euler.timesteps, schedule.timesteps)


def test_flow_shift_rebuilds_the_scheduler_or_is_refused(family: Cosmos3Family, euler_family: Cosmos3Family, pipe) -> None:
    shifted = _params(family, 4.5, extra_sampling_params={"flow_shift": 5.0})
    assert shifted.flow_shift == 5.0 and shifted.extra == {}
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0)
    reference.set_timesteps(STEPS)
    schedule = family.schedule(shifted)
    assert torch.equal(reference.timesteps.float(), schedule.timesteps)
    assert torch.equal(reference.sigmas[1:], schedule.sigmas[1:])
    assert not torch.equal(schedule.sigmas, family.schedule(_params(family, 4.5)).sigmas)  # the shift mattered
    euler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    euler.set_timesteps(STEPS)
    assert torch.equal(euler.sigmas, euler_family.schedule(_params(euler_family, 4.5, extra_sampling_params={"flow_shift": 5.0})).sigmas)
    # A scheduler that is not flow matching has no shift to set.
    plain = UniPCMultistepScheduler()  # sigmas from betas
    no_shift = Cosmos3Family(Cosmos3OmniPipeline(**{**pipe.components, "scheduler": plain}, enable_safety_checker=False))
    with pytest.raises(
        RequestError, match=r"^extra_sampling_params: flow_shift: the pipeline's UniPCMultistepScheduler has no flow shift$"
    ):
        _params(no_shift, 4.5, extra_sampling_params={"flow_shift": 5.0})


def test_native_flow_schedule_is_the_pipelines(pipe: Cosmos3OmniPipeline) -> None:
    native = Cosmos3OmniPipeline(**pipe.components, enable_safety_checker=False, use_native_flow_schedule=True)
    family = Cosmos3Family(native)
    schedule = family.schedule(_params(family, 4.5))
    reference = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    import numpy as np

    reference.set_timesteps(STEPS, sigmas=np.linspace(1 - 1 / 1000, 0.0, STEPS + 1)[:-1])
    assert torch.equal(reference.sigmas, schedule.sigmas) and torch.equal(reference.timesteps.float(), schedule.timesteps)


def test_one_transformer_call_per_sample_and_rows_are_independent(family: Cosmos3Family) -> None:
    params = _params(family, 4.5, VIDEO)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = family.schedule(params).timesteps[[0, 2, 3]]  # a different step per row, as the trainer mixes them
    cond = family.encode(PROMPT, None, params)
    transformer = family.pipeline.transformer
    original = transformer.forward
    samples_per_call = []

    def counting(*args, **kwargs):
        samples_per_call.append(len(kwargs["vision_tokens"]))
        assert kwargs["vision_tokens"][0].shape[0] == 1 and kwargs["vision_timesteps"].dtype == torch.float32
        return original(*args, **kwargs)

    with torch.no_grad(), mock.patch.object(transformer, "forward", side_effect=counting):
        batched = family.predict({"latents": x}, t, cond.expand(3), params)["latents"]
    assert samples_per_call == [1] * 6  # 3 rows x (conditional + unconditional), never batched
    with torch.no_grad():
        rows = [family.predict({"latents": x[i : i + 1]}, t[i : i + 1], cond, params)["latents"] for i in range(3)]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    assert torch.equal(batched, torch.cat(rows))


def test_initial_noise_is_per_output_and_the_pipelines(family: Cosmos3Family, pipe: Cosmos3OmniPipeline) -> None:
    params = _params(family, 4.5, VIDEO)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 16, 2, 2, 3) and pair.dtype == torch.float32
    first = family.initial_latents(params, _generators(11, 1))["latents"]
    second = family.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    # The pipeline draws the same noise from the same generator.
    drawn = pipe.prepare_latents(
        num_frames=5, height=16, width=24, generator=torch.Generator().manual_seed(11), device="cpu", dtype=torch.float32
    )[0]
    assert torch.equal(drawn, first)


def test_resolve_params_defaults_and_errors(family: Cosmos3Family) -> None:
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == Cosmos3Family.native_size("any") == (720, 1280)
    assert (params.num_frames, params.fps, params.num_inference_steps, params.guidance_scale) == (1, 24.0, 5, 3.0)
    assert dict(params.extra) == {} and params.flow_shift is None
    video = family.resolve_params(RolloutRequest(prompt=PROMPT, num_frames=9, fps=16.0, height=24, width=40))
    assert (video.num_frames, video.fps, video.height, video.width) == (9, 16.0, 24, 40)

    base = RolloutRequest(prompt=PROMPT, height=32, width=32)
    bad = [
        ("height", replace(base, height=36), "height: 36 must be a multiple of 8 (the VAE's spatial factor)"),
        ("width", replace(base, width=20), "width: 20 must be a multiple of 8 (the VAE's spatial factor)"),
        (
            "num_frames",
            replace(base, num_frames=4),
            "num_frames: 4: a video has 1 + 4k frames (the VAE compresses time 4x; the pipeline would return 1)",
        ),
        ("fps", replace(base, num_frames=5, fps=0.0), "fps: must be a finite number > 0, got 0.0"),
        ("true_cfg_scale", replace(base, true_cfg_scale=4.0), "true_cfg_scale: Cosmos 3 has no true CFG; use guidance_scale"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_scale_2": 3.0}),
            "extra_sampling_params: Cosmos 3 takes only max_sequence_length and flow_shift, got guidance_scale_2",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"max_sequence_length": 0}),
            "extra_sampling_params: max_sequence_length must be a positive integer, got 0",
        ),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field
        assert str(excinfo.value) == message and "\n" not in message


def test_conditioning_is_the_pipelines_token_ids_encoded_once(family: Cosmos3Family, pipe) -> None:
    params = _params(family, 4.5, VIDEO)
    once = family.encode(PROMPT, NEGATIVE, params)
    assert once.negative is not None
    assert set(once.positive) == set(once.negative) == {"input_ids", "attention_mask"}
    ids, mask = once.positive["input_ids"], once.positive["attention_mask"]
    assert ids.shape == mask.shape == (1, Cosmos3Family.max_sequence_length) and ids.dtype == torch.long
    # The pipeline's tokenization (templates with this size, frames and fps), right-padded.
    cond_ids, uncond_ids = pipe.tokenize_prompt(PROMPT, NEGATIVE, num_frames=5, height=16, width=24, fps=24.0)
    assert ids[0, : len(cond_ids)].tolist() == cond_ids and int(mask.sum()) == len(cond_ids)
    assert once.negative["input_ids"][0, : len(uncond_ids)].tolist() == uncond_ids
    assert not mask[0, len(cond_ids) :].any()
    # fps enters through the duration template.
    faster = family.encode(PROMPT, NEGATIVE, replace(params, fps=16.0))
    assert not torch.equal(faster.positive["input_ids"], ids)
    # Encoded once and expanded equals encoding every output.
    family_checks.check_expand_matches_repeated(family, PROMPT, NEGATIVE, params, once)
    # A None negative prompt is the pipeline's "" (with its inverse templates).
    _, empty_ids = pipe.tokenize_prompt(PROMPT, "", num_frames=5, height=16, width=24, fps=24.0)
    assert family.encode(PROMPT, None, params).negative["input_ids"][0, : len(empty_ids)].tolist() == empty_ids
    # Without CFG (guidance exactly 1, the pipeline's rule) there is no negative conditioning.
    assert family.encode(PROMPT, "ignored", _params(family, 1.0)).negative is None
    assert family.encode(PROMPT, None, _params(family, 0.5)).negative is not None
    # A prompt longer than the padded length is a request error, never truncated.
    short = _params(family, 4.5, extra_sampling_params={"max_sequence_length": 16})
    with pytest.raises(RequestError, match=r"^prompt: \d+ tokens with the pipeline's templates, more than max_sequence_length 16"):
        family.encode(PROMPT, None, short)


def test_decode_shapes_and_encode_pixels(family: Cosmos3Family) -> None:
    for size, shape in ((IMAGE, (2, 3, 32, 32)), (VIDEO, (2, 3, 5, 16, 24))):
        params = _params(family, 1.0, size)
        x = family.initial_latents(params, _generators(0, 2))["latents"]
        with torch.no_grad():
            pixels = family.decode({"latents": x}, params)
            assert pixels.shape == shape and pixels.dtype == torch.float32
            assert pixels.min() >= 0 and pixels.max() <= 1
            z = family.encode_pixels(pixels, params)["latents"]
        assert z.shape == x.shape  # the inverse's layout (a random VAE is no autoencoder)
        with torch.no_grad():
            assert torch.equal(family.encode_pixels(pixels[1:], params)["latents"], z[1:])  # per sample


def test_multi_output_invariant(family: Cosmos3Family) -> None:
    """The engine loops over outputs (no batch dimension): output i is the one-output request with seed + i."""
    request = RolloutRequest(
        prompt=PROMPT,
        seed=5,
        num_outputs_per_prompt=3,
        num_inference_steps=3,
        guidance_scale=4.5,
        rollout_return_dit_trajectory=True,
        **VIDEO,
    )
    worst = family_checks.check_multi_output_invariant(family, request, atol=0.0)
    print(f"multi-output invariant: max |diff| = {worst:.3e}")


def test_lora_saved_and_loaded_with_the_transformer_adapter_api(family: Cosmos3Family, tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    trained = Cosmos3Family.from_pretrained(tiny_dir)
    transformer = trained.components()["transformer"]
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(TARGETS)))
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.fill_(0.25)
    out = trained.save_lora(tmp_path / "lora", {"transformer": transformer})
    saved = {key.split(":", 1)[1] for key in testing.saved_tensors(out)}
    assert (out / LORA_WEIGHT_NAME).is_file() and len(saved) == 2 * len(TARGETS) * 2  # lora_A/B x targets x layers
    assert all(".lora_A." in key or ".lora_B." in key for key in saved)
    assert not any(key.startswith("transformer.") for key in saved)  # keys without a prefix
    assert all(is_generation_parameter(key) for key in saved)
    with pytest.raises(ValueError, match="trains only the transformer"):
        trained.save_lora(tmp_path / "other", {"transformer_2": transformer})

    fresh = Cosmos3Family.from_pretrained(tiny_dir)
    loaded = fresh.load_lora(out)
    assert loaded == len(TARGETS) * fresh.pipeline.transformer.config.num_hidden_layers > 0
    params = _params(fresh, 4.5)
    x = fresh.initial_latents(params, _generators(0, 1))["latents"]
    assert torch.equal(_family_sample(fresh, params, x), _family_sample(trained, params, x))
    assert not torch.equal(_family_sample(fresh, params, x), _family_sample(family, params, x))
