"""Flux1Family's runtime contract against FluxPipeline itself (FLUX.1 [dev]).

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``FluxPipeline.__call__`` (packed latents with their image ids,
T5 + CLIP conditioning, timesteps / 1000, the embedded guidance, true CFG, the dynamic
shift); rows of a batch, prompts mixed, must be independent; noise is per output; bad
requests name their field; the saved LoRA loads with ``load_lora_weights``.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import Conditioning, GenerationParams
from miles_core.request import RolloutRequest
from miles_flux.family import FluxFamily
from miles_flux.flux1 import MAX_SEQUENCE_LENGTH, Flux1Family
from miles_flux.plugin import LORA_TARGET_MODULES

PROMPT = "a red cube on a blue table"
OTHER_PROMPT = "a very small green frog sitting on a large wet leaf next to a pond"
SIZE = 32  # latents 8x8 (16 packed tokens); a multiple of 8 = VAE factor 4 x 2x2 packing
STEPS = 4
GUIDANCE = 3.5
TRUE_CFG = 4.0

tiny_dir, pipe = testing.tiny_pipeline_fixtures(FluxFamily)


@pytest.fixture(scope="module")
def family(pipe: FluxPipeline) -> Flux1Family:
    family = FluxFamily(pipe)  # the registered class hands out the FLUX.1 subclass
    assert type(family) is Flux1Family
    return family


def _params(family: Flux1Family, true_cfg: float | None, **kwargs) -> GenerationParams:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    kwargs.setdefault("guidance_scale", GUIDANCE)
    request = RolloutRequest(prompt=PROMPT, num_inference_steps=STEPS, true_cfg_scale=true_cfg, **kwargs)
    return family.resolve_params(request)


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_latents(family: Flux1Family, params: GenerationParams, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    return family_checks.euler_sample(family, cond, params, {"latents": x})["latents"]


def _family_sample(family: Flux1Family, params: GenerationParams, x: torch.Tensor, prompt: str = PROMPT):
    cond = family.encode(prompt, " ", params).expand(x.shape[0])
    latents = _family_latents(family, params, x, cond)
    with torch.no_grad():
        return latents, family.decode({"latents": latents}, params)


def _pipeline(pipe: FluxPipeline, prompt, x: torch.Tensor, true_cfg: float | None, output_type: str, **kwargs):
    with torch.no_grad():
        return pipe(
            prompt,
            negative_prompt=" " if true_cfg else None,
            true_cfg_scale=true_cfg or 1.0,
            guidance_scale=kwargs.pop("guidance_scale", GUIDANCE),
            latents=x,
            num_images_per_prompt=x.shape[0] // (len(prompt) if isinstance(prompt, list) else 1),
            height=kwargs.pop("height", SIZE),
            width=kwargs.pop("width", SIZE),
            num_inference_steps=STEPS,
            output_type=output_type,
            **kwargs,
        ).images


def _with_transformer(pipe: FluxPipeline, transformer: torch.nn.Module) -> FluxPipeline:
    other = FluxPipeline(**{**pipe.components, "transformer": transformer})
    other.set_progress_bar_config(disable=True)
    return other


@pytest.mark.parametrize("true_cfg", [None, TRUE_CFG], ids=["embedded-guidance", "true-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(family: Flux1Family, pipe, true_cfg) -> None:
    params = _params(family, true_cfg)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    assert x.shape == (2, (SIZE // 8) ** 2, 64)  # packed: (h/2)(w/2) tokens of 4 x 16 channels
    latents, pixels = _family_sample(family, params, x)
    their_latents = _pipeline(pipe, PROMPT, x, true_cfg, "latent")
    their_pixels = _pipeline(pipe, PROMPT, x, true_cfg, "pt")
    assert pixels.shape == their_pixels.shape == (2, 3, SIZE, SIZE) and pixels.dtype == torch.float32
    latent_diff = (latents - their_latents).abs().max().item()
    pixel_diff = (pixels - their_pixels).abs().max().item()
    print(f"true_cfg {true_cfg}: max |family - pipeline| latents {latent_diff:.3e}, pixels {pixel_diff:.3e}")
    assert latent_diff <= 1e-5 and pixel_diff <= 1e-5  # measured 0.0: the same calls in the same order

    # Control: the comparison sees the transformer. Nudge one weight of the family's
    # transformer only in the family run (the pipeline shares the module, so restore it).
    weight = family.components()["transformer"].transformer_blocks[0].attn.to_q.weight
    with family_checks.nudged(weight):
        nudged, _ = _family_sample(family, params, x)
    assert (nudged - their_latents).abs().max().item() > 1e-4
    assert torch.equal(_family_sample(family, params, x)[0], latents)  # restored


def test_bf16_euler_loop_equals_the_pipeline(tiny_dir: Path) -> None:
    # Exact by construction: the same modules in bf16 on the same inputs, the same true-CFG
    # expression in bf16, and the scheduler step's arithmetic repeated below.
    bf16 = FluxPipeline.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    bf16.set_progress_bar_config(disable=True)
    family = Flux1Family(bf16, dtype=torch.bfloat16)
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    assert x.dtype == torch.bfloat16
    cond = family.encode(PROMPT, " ", params).expand(2)
    schedule = family.schedule(params)
    latents = x
    with torch.no_grad():
        for k in range(STEPS):
            v = family.predict({"latents": latents}, schedule.timesteps[k].expand(2), cond, params)["latents"]
            # FlowMatchEulerDiscreteScheduler.step: fp32 sample + dt * (bf16 velocity), back to bf16.
            dt = schedule.sigmas[k + 1] - schedule.sigmas[k]
            latents = (latents.float() + dt * v.to(torch.bfloat16)).to(torch.bfloat16)
    theirs = _pipeline(bf16, PROMPT, x, TRUE_CFG, "latent")
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(latents, theirs)
    # Control: another guidance value gives another bf16 sample.
    other = _pipeline(bf16, PROMPT, x, TRUE_CFG, "latent", guidance_scale=1.0)
    assert not torch.equal(latents, other)


def test_guidance_is_a_transformer_input_and_ignored_without_guidance_embeds(family: Flux1Family, pipe) -> None:
    params = _params(family, None)
    x = family.initial_latents(params, _generators(5, 1))["latents"]
    t = family.schedule(params).timesteps[1:2]
    cond = family.encode(PROMPT, None, params)
    with torch.no_grad():
        at = {g: family.predict({"latents": x}, t, cond, replace(params, guidance_scale=g))["latents"] for g in (1.0, GUIDANCE)}
    # The distilled transformer reads the guidance value: one forward, no CFG batch.
    assert (at[1.0] - at[GUIDANCE]).abs().max().item() > 1e-4

    # The same weights without the guidance embedder: guidance_scale is ignored, as the
    # pipeline ignores it (it passes guidance=None).
    plain = FluxTransformer2DModel.from_config(pipe.transformer.config, guidance_embeds=False).eval()
    missing, unexpected = plain.load_state_dict(pipe.transformer.state_dict(), strict=False)
    assert missing == [] and unexpected and all(k.startswith("time_text_embed.guidance_embedder.") for k in unexpected)
    other_pipe = _with_transformer(pipe, plain)
    undistilled = Flux1Family(other_pipe)
    with torch.no_grad():
        low = undistilled.predict({"latents": x}, t, cond, replace(params, guidance_scale=1.0))["latents"]
        high = undistilled.predict({"latents": x}, t, cond, replace(params, guidance_scale=7.0))["latents"]
    assert torch.equal(low, high)
    assert (low - at[1.0]).abs().max().item() > 1e-4  # the guidance embedding mattered above
    xs = family.initial_latents(params, _generators(5, 2))["latents"]
    ours = _family_latents(undistilled, replace(params, guidance_scale=7.0), xs, undistilled.encode(PROMPT, None, params).expand(2))
    theirs = _pipeline(other_pipe, PROMPT, xs, None, "latent", guidance_scale=1.0)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_true_cfg_is_the_pipelines_formula(family: Flux1Family) -> None:
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(5, 1))["latents"]
    t = family.schedule(params).timesteps[1:2]
    cond = family.encode(PROMPT, "blurry", params)
    off = replace(params, true_cfg_scale=None)
    with torch.no_grad():
        guided = family.predict({"latents": x}, t, cond, params)["latents"]
        plain = family.predict({"latents": x}, t, Conditioning(cond.positive), off)["latents"]
        negative = family.predict({"latents": x}, t, Conditioning(cond.negative), off)["latents"]
    # neg + s (pos - neg), no norm rescale. Equal by construction: each side is the same
    # batch-1 forward on the same inputs, and the expression is the product's, in fp32.
    assert torch.equal(guided, negative + TRUE_CFG * (plain - negative))
    assert (guided - plain).abs().max().item() > 1e-4
    # A true_cfg_scale <= 1 is off, as in the pipeline (one call, no negative encoded).
    assert family.encode(PROMPT, "blurry", replace(params, true_cfg_scale=1.0)).negative is None


@pytest.mark.parametrize("true_cfg", [None, TRUE_CFG], ids=["embedded-guidance", "true-cfg"])
def test_rows_of_a_batch_are_independent(family: Flux1Family, pipe, true_cfg) -> None:
    params = _params(family, true_cfg)
    # Two prompts in one batch, each row at its own step: what the trainer's micro-batches hold.
    conds = [family.encode(p, None, params) for p in (PROMPT, OTHER_PROMPT, PROMPT)]
    both = Conditioning.cat(conds)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = family.schedule(params).timesteps[[0, 2, 3]]
    with torch.no_grad():
        batched = family.predict({"latents": x}, t, both, params)["latents"]
        alone = torch.cat([family.predict({"latents": x[i : i + 1]}, t[i : i + 1], c, params)["latents"] for i, c in enumerate(conds)])
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - alone).abs().max().item()
    print(f"true_cfg {true_cfg}: max |batched - single rows| = {diff:.3e}")
    assert diff <= 1e-5  # batched matmuls may sum in another order
    # A batch of two prompts through the pipeline's own batch encode (a list of prompts).
    ours = _family_latents(family, params, x[:2], Conditioning.cat(conds[:2]))
    theirs = _pipeline(pipe, [PROMPT, OTHER_PROMPT], x[:2], true_cfg, "latent")
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_initial_noise_is_per_output_and_the_pipelines(family: Flux1Family, pipe) -> None:
    params = _params(family, None)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 16, 64) and pair.dtype == torch.float32
    first = family.initial_latents(params, _generators(11, 1))["latents"]
    second = family.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    # prepare_latents with a generator list: drawn unpacked per row, then packed.
    theirs, image_ids = pipe.prepare_latents(2, 16, SIZE, SIZE, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, theirs)
    assert image_ids.shape == (16, 3)
    wide = family.initial_latents(_params(family, None, width=2 * SIZE), _generators(0, 1))["latents"]
    assert wide.shape == (1, 4 * 8, 64)


def test_schedule_is_the_pipelines(family: Flux1Family, pipe) -> None:
    seen = {}

    def record(p, i, t, kwargs):
        seen.setdefault("sigmas", p.scheduler.sigmas.clone())
        seen.setdefault("timesteps", p.scheduler.timesteps.clone())
        return {}

    schedules = []
    for size in (SIZE, 4 * SIZE):
        params = _params(family, None, height=size, width=size)
        schedule = family.schedule(params)
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        assert sigmas.dtype == timesteps.dtype == torch.float32
        assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        x = family.initial_latents(params, _generators(0, 1))["latents"]
        seen.clear()
        with torch.no_grad():
            pipe(PROMPT, latents=x, height=size, width=size, num_inference_steps=STEPS, output_type="latent", callback_on_step_end=record)
        assert torch.equal(seen["sigmas"], sigmas) and torch.equal(seen["timesteps"], timesteps)
        schedules.append(sigmas)
    # mu grows with the image token count (the dynamic shift): more tokens, later sigmas higher.
    assert (schedules[1][1:-1] > schedules[0][1:-1]).all()
    # ... and the pipeline's own scheduler is left alone (each schedule works on a copy).
    state = pipe.scheduler.sigmas.clone()
    family.schedule(replace(params, num_inference_steps=7))
    assert torch.equal(pipe.scheduler.sigmas, state)


@pytest.mark.exercises("--diffusion-flow-shift")
def test_flow_shift_replaces_the_dynamic_shift(family: Flux1Family, pipe, tiny_dir: Path) -> None:
    from miles_core.config.resolve import resolve_config
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    # The flag reaches the family as extra_sampling_params.flow_shift (sglang-diffusion's name).
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            "--rollout-batch-size",
            "1",
            "--diffusion-height",
            str(SIZE),
            "--diffusion-width",
            str(SIZE),
            "--diffusion-num-steps",
            str(STEPS),
            "--diffusion-flow-shift",
            "3.0",
        ]
    )
    request = RolloutSettings.from_config(config).request(PROMPT, Microgroup(0, 0, 1, 0), (0,), tuple(range(STEPS + 1)))
    params = family.resolve_params(request)
    assert params.flow_shift == 3.0 and params.guidance_scale == GUIDANCE  # the family's default guidance
    schedule = family.schedule(params)
    shifted = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0, use_dynamic_shifting=False)
    shifted_pipe = FluxPipeline(**{**pipe.components, "scheduler": shifted})
    shifted_pipe.set_progress_bar_config(disable=True)
    x = family.initial_latents(params, _generators(1, 1))["latents"]
    with torch.no_grad():
        theirs = shifted_pipe(PROMPT, latents=x, height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent").images
    assert torch.equal(schedule.sigmas, shifted.sigmas) and torch.equal(schedule.timesteps, shifted.timesteps)
    assert not torch.equal(schedule.sigmas, family.schedule(_params(family, None)).sigmas)
    ours = _family_latents(family, params, x, family.encode(PROMPT, None, params))
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_resolve_params_defaults_and_errors(family: Flux1Family, tiny_dir) -> None:
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == FluxFamily.native_size(tiny_dir) == (512, 512)
    assert (params.num_inference_steps, params.guidance_scale, params.true_cfg_scale, dict(params.extra)) == (5, 3.0, None, {})
    assert family.resolve_params(RolloutRequest(prompt=PROMPT, num_frames=1, fps=8.0)).num_frames is None
    assert _params(family, 4.0).true_cfg_scale == 4.0
    assert dict(_params(family, None, extra_sampling_params={"max_sequence_length": 512}).extra) == {"max_sequence_length": 512}

    base = RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE)
    bad = [
        ("height", replace(base, height=36), r"^height: 36 must be a multiple of 8 \(VAE factor x 2x2 packing\)$"),
        ("width", replace(base, width=20), r"^width: 20 must be a multiple of 8 \(VAE factor x 2x2 packing\)$"),
        ("num_frames", replace(base, num_frames=5), r"^num_frames: FLUX.1 \[dev\] generates images \(1 frame\), got 5$"),
        ("true_cfg_scale", replace(base, true_cfg_scale=-1.0), r"^true_cfg_scale: must be a finite number >= 0, got -1.0$"),
        ("true_cfg_scale", replace(base, true_cfg_scale=float("nan")), r"^true_cfg_scale: must be a finite number >= 0, got nan$"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_scale_2": 3.0}),
            r"^extra_sampling_params: FLUX.1 \[dev\] takes only max_sequence_length and flow_shift, got guidance_scale_2$",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"max_sequence_length": 513}),
            r"^extra_sampling_params: max_sequence_length must be an integer in \[1, 512\], got 513$",
        ),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError, match=message) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field


def test_conditioning_encoded_once_expands_to_repeated_encodings(family: Flux1Family, pipe) -> None:
    params = _params(family, TRUE_CFG)
    once = family.encode(PROMPT, None, params)
    assert once.negative is not None
    assert set(once.positive) == set(once.negative) == {"encoder_hidden_states", "pooled_projections"}
    embeds, pooled = once.positive["encoder_hidden_states"], once.positive["pooled_projections"]
    # T5 padded to max_sequence_length (the same shape for every prompt, no mask), CLIP pooled.
    assert embeds.shape == (1, MAX_SEQUENCE_LENGTH, pipe.transformer.config.joint_attention_dim)
    assert pooled.shape == (1, pipe.transformer.config.pooled_projection_dim)
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, once)
    # The default negative prompt is " ", and differs from the prompt.
    spaced = family.encode(PROMPT, " ", params)
    for key in once.negative:
        assert torch.equal(spaced.negative[key], once.negative[key])
        assert not torch.equal(once.negative[key], once.positive[key])
    # Without true CFG there is no negative conditioning.
    assert family.encode(PROMPT, "ignored", _params(family, None)).negative is None


def test_max_sequence_length_matches_the_pipeline_argument(family: Flux1Family, pipe) -> None:
    params = _params(family, TRUE_CFG, extra_sampling_params={"max_sequence_length": 8})
    cond = family.encode(PROMPT, " ", params)
    assert cond.positive["encoder_hidden_states"].shape[1] == 8
    x = family.initial_latents(params, _generators(3, 1))["latents"]
    ours = _family_latents(family, params, x, cond)
    theirs = _pipeline(pipe, PROMPT, x, TRUE_CFG, "latent", max_sequence_length=8)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Control: the default length gives another sample.
    default = _params(family, TRUE_CFG)
    assert not torch.allclose(ours, _family_latents(family, default, x, family.encode(PROMPT, " ", default)))


def test_decode_shape_and_range(family: Flux1Family) -> None:
    params = _params(family, None, width=2 * SIZE)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    with torch.no_grad():
        image = family.decode({"latents": x}, params)
    assert image.shape == (2, 3, SIZE, 2 * SIZE) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1


def test_encode_pixels_is_the_inverse_of_decode(family: Flux1Family, pipe) -> None:
    vae = pipe.vae
    params = _params(family, None)
    pixels = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = family.encode_pixels(pixels, params)["latents"]
        assert latents.shape == (2, 16, 64)  # the packed layout of initial_latents
        mean = vae.encode(pixels * 2 - 1).latent_dist.mean
        back = family.decode({"latents": latents}, params)
        raw = vae.decode(mean).sample
    # The latents are the posterior mean normalised with FLUX.1's shift and scale, packed
    # (the tiny VAE has FLUX.1's non-trivial factors, so a swapped normalisation shows).
    normalised = (mean - vae.config.shift_factor) * vae.config.scaling_factor
    assert torch.equal(latents, FluxPipeline._pack_latents(normalised, 2, 16, SIZE // 4, SIZE // 4))
    assert not torch.allclose(latents, FluxPipeline._pack_latents(mean, 2, 16, SIZE // 4, SIZE // 4), atol=1e-2)
    # decode(encode_pixels(p)) is the VAE's own reconstruction of p (the normalisation
    # round trip costs a few ulps).
    assert (back - (raw * 0.5 + 0.5).clamp(0, 1)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\]"):
        family.encode_pixels(pixels.unsqueeze(2), params)
    with pytest.raises(ValueError, match=r"multiples of 8 \(VAE factor x 2x2 packing\), got \(36, 32\)"):
        family.encode_pixels(torch.rand(1, 3, 36, 32), params)


def test_save_lora_loads_with_the_pipeline(family: Flux1Family, tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    adapted = copy.deepcopy(family.pipeline.transformer)
    adapted.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(LORA_TARGET_MODULES), init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    trained = Flux1Family(_with_transformer(family.pipeline, adapted))
    out = trained.save_lora(tmp_path / "lora", {"transformer": adapted})
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    loaded = testing.load_tiny_pipeline(FluxFamily, tiny_dir)
    loaded.load_lora_weights(str(out))
    wrapped = {n for n, m in loaded.transformer.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {n for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(2, 1))["latents"]
    mine, _ = _family_sample(trained, params, x)
    theirs = _pipeline(loaded, PROMPT, x, TRUE_CFG, "latent")
    base, _ = _family_sample(family, params, x)
    assert (mine - theirs).abs().max().item() <= 1e-5
    assert (mine - base).abs().max().item() > 1e-4  # the adapter matters
