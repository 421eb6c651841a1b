"""SD3Family's runtime contract against StableDiffusion3Pipeline itself.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``StableDiffusion3Pipeline.__call__``; rows of a batch must
be independent; noise is per output; bad requests name their field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_sd3.family import SD3Family

PROMPT = "a red cube on a blue table"
SIZE = 32  # latents 4x4: small, and a multiple of 16
STEPS = 4

tiny_dir, pipe = testing.tiny_pipeline_fixtures(SD3Family)


@pytest.fixture(scope="module")
def family(pipe: StableDiffusion3Pipeline) -> SD3Family:
    return SD3Family(pipe)


def _params(family: SD3Family, guidance: float, **kwargs) -> GenerationParams:
    request = RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=guidance, **kwargs)
    return family.resolve_params(request)


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_sample(family: SD3Family, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, " ", params).expand(x.shape[0])
    return family.decode(family_checks.euler_sample(family, cond, params, {"latents": x}), params)


def _pipeline_sample(pipe: StableDiffusion3Pipeline, x: torch.Tensor, guidance: float) -> torch.Tensor:
    return pipe(
        PROMPT,
        negative_prompt=" ",
        latents=x,
        num_images_per_prompt=x.shape[0],
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        output_type="pt",
    ).images


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(family: SD3Family, pipe, guidance: float) -> None:
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    ours = _family_sample(family, params, x)
    theirs = _pipeline_sample(pipe, x, guidance)
    assert ours.shape == theirs.shape == (2, 3, SIZE, SIZE) and ours.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    print(f"guidance {guidance}: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-5

    # Control: the comparison sees the transformer. Nudge one weight of the family's
    # transformer only in the family run (the pipeline shares the module, so restore it).
    weight = family.components()["transformer"].transformer_blocks[0].attn.to_q.weight
    with family_checks.nudged(weight):
        nudged = _family_sample(family, params, x)
    assert (nudged - theirs).abs().max().item() > 1e-4
    assert torch.equal(_family_sample(family, params, x), ours)  # restored


@pytest.mark.parametrize("guidance", [4.5, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: SD3Family, guidance: float) -> None:
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    schedule = family.schedule(params)
    t = schedule.timesteps[[0, 2, 3]]  # a different step per row, as the trainer mixes them
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - single).abs().max().item()
    print(f"guidance {guidance}: max |batched - single rows| = {diff:.3e}")
    # A batch of 3 and a batch of 1 run GEMMs of other shapes, which round differently
    # (MKL and ATen pick kernels by shape and CPU). Measured on AVX-512 under MKL's default,
    # COMPATIBLE and AVX2 paths and ATen's avx2 and default kernels: at most 3.6e-7 without
    # CFG, 1.9e-6 with it (the guidance 4.5 mix scales the rounding by up to 2 x 4.5 - 1).
    tolerance = 1e-5
    assert diff <= tolerance
    # Control: one row given another row's timestep is off by far more (measured > 0.1).
    with torch.no_grad():
        wrong = family.predict({"latents": x}, t[[0, 0, 2]], cond.expand(3), params)["latents"]
    assert (wrong[1] - single[1]).abs().max().item() > 1000 * tolerance


def test_initial_noise_is_per_output(family: SD3Family) -> None:
    params = _params(family, 4.5)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 4, SIZE // 8, SIZE // 8)
    first = family.initial_latents(params, _generators(11, 1))["latents"]
    second = family.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    assert not torch.equal(first, family.initial_latents(params, _generators(13, 1))["latents"])


def test_resolve_params_defaults_and_errors(family: SD3Family, tiny_dir) -> None:
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == SD3Family.native_size(tiny_dir) == (64, 64)
    assert (params.num_inference_steps, params.guidance_scale, dict(params.extra)) == (5, 3.0, {})
    assert family.resolve_params(RolloutRequest(prompt=PROMPT, num_frames=1)).num_frames is None

    base = RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE)
    bad = [
        ("height", replace(base, height=40)),
        ("width", replace(base, width=24)),
        ("height", replace(base, height=272)),  # over the tiny pos-embed grid (16 patches x 16 px)
        ("num_frames", replace(base, num_frames=5)),
        ("true_cfg_scale", replace(base, true_cfg_scale=4.0)),
        ("extra_sampling_params", replace(base, extra_sampling_params={"guidance_scale_2": 3.0})),
    ]
    for field, request in bad:
        with pytest.raises(RequestError) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field
    with pytest.raises(RequestError, match="multiple of 16"):
        family.resolve_params(bad[0][1])


def test_conditioning_encoded_once_expands_to_repeated_encodings(family: SD3Family) -> None:
    params = _params(family, 4.5)
    once = family.encode(PROMPT, None, params)
    assert once.negative is not None
    assert set(once.positive) == set(once.negative) == {"encoder_hidden_states", "pooled_projections"}
    assert once.positive["encoder_hidden_states"].shape[0] == 1
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, once)
    # The default negative prompt is " " (the reference engine's), and differs from the prompt.
    spaced = family.encode(PROMPT, " ", params)
    assert torch.equal(spaced.negative["pooled_projections"], once.negative["pooled_projections"])
    assert not torch.equal(once.negative["pooled_projections"], once.positive["pooled_projections"])
    # Without CFG there is no negative conditioning.
    assert family.encode(PROMPT, "ignored", _params(family, 1.0)).negative is None


def test_schedule_is_the_pipelines(family: SD3Family, pipe) -> None:
    params = _params(family, 4.5)
    schedule = family.schedule(params)
    sigmas, timesteps = schedule.sigmas, schedule.timesteps
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()
    assert torch.allclose(timesteps, sigmas[:-1] * 1000)
    # The pipeline's own scheduler is left alone (each schedule works on a copy) ...
    state = (pipe.scheduler.num_inference_steps, pipe.scheduler.sigmas.clone())
    family.schedule(replace(params, num_inference_steps=7))
    assert pipe.scheduler.num_inference_steps == state[0] and torch.equal(pipe.scheduler.sigmas, state[1])
    # ... and a fresh scheduler agrees bit for bit.
    reference = type(pipe.scheduler).from_config(pipe.scheduler.config)
    reference.set_timesteps(STEPS)
    assert torch.equal(reference.sigmas, sigmas) and torch.equal(reference.timesteps, timesteps)


def test_schedule_with_dynamic_shifting_matches_the_pipeline(pipe: StableDiffusion3Pipeline) -> None:
    """SD3's scheduler has no dynamic shifting; a config that has it gets the pipeline's mu."""
    dynamic = type(pipe.scheduler).from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    dynamic_pipe = StableDiffusion3Pipeline(**{**pipe.components, "scheduler": dynamic})
    dynamic_pipe.set_progress_bar_config(disable=True)
    family = SD3Family(dynamic_pipe)
    params = _params(family, 1.0)
    schedule = family.schedule(params)
    latents = family.initial_latents(params, _generators(0, 1))["latents"]
    with torch.no_grad():
        dynamic_pipe(PROMPT, latents=latents, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=1.0, output_type="latent")
    assert torch.equal(schedule.sigmas, dynamic.sigmas) and torch.equal(schedule.timesteps, dynamic.timesteps)
    assert not torch.equal(schedule.sigmas, SD3Family(pipe).schedule(params).sigmas)  # mu mattered


def test_decode_shape_and_range(family: SD3Family) -> None:
    params = _params(family, 1.0)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    with torch.no_grad():
        image = family.decode({"latents": x}, params)
    assert image.shape == (2, 3, SIZE, SIZE) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1


def test_max_sequence_length_matches_the_pipeline_argument(family: SD3Family, pipe) -> None:
    params = _params(family, 4.5, extra_sampling_params={"max_sequence_length": 16})
    cond = family.encode(PROMPT, " ", params)
    assert cond.positive["encoder_hidden_states"].shape[1] == 77 + 16  # CLIP tokens + T5 tokens
    x = family.initial_latents(params, _generators(3, 1))["latents"]
    ours = _family_sample(family, params, x)
    theirs = pipe(
        PROMPT,
        negative_prompt=" ",
        latents=x,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.5,
        output_type="pt",
        max_sequence_length=16,
    ).images
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Control: the default length gives another image.
    assert not torch.allclose(ours, _family_sample(family, _params(family, 4.5), x))
    with pytest.raises(RequestError, match=r"^extra_sampling_params: max_sequence_length must be an integer in \[1, 512\]"):
        _params(family, 4.5, extra_sampling_params={"max_sequence_length": 0})
