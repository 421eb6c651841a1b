"""Flux2Family's runtime contract against Flux2KleinPipeline itself (FLUX.2 [klein]).

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``Flux2KleinPipeline.__call__`` for the step-distilled model
(guidance ignored) and the undistilled base (real CFG with the pipeline's empty negative
prompt, or the request's); rows of a batch must be independent; noise is per output and
the pipeline's; bad requests name their field; the saved LoRA loads with
``load_lora_weights``. FLUX.2 [dev] (``Flux2Pipeline``) is refused with the reason.

The distilled pipeline is the base one's components with ``is_distilled`` set: the same
weights, so any difference between the two is the guidance rule alone.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline

from miles_core import family_checks, testing
from miles_core.errors import CheckpointError, RequestError
from miles_core.family import Conditioning, GenerationParams
from miles_core.request import RolloutRequest
from miles_flux.family import FluxFamily
from miles_flux.flux2 import MAX_SEQUENCE_LENGTH, Flux2Family
from miles_flux.plugin import KLEIN_LORA_TARGET_MODULES

PROMPT = "a red cube on a blue table"
SIZE = 32  # latents 8x8, 16 packed tokens; a multiple of 8 = VAE factor 4 x 2x2 packing
STEPS = 4
CFG = 4.0
TOKENS = (SIZE // 8) ** 2
CHANNELS = 32  # 4 x the tiny VAE's 8 latent channels
PIPELINE_TOLERANCE = 1e-5
"""Family vs pipeline, same kernels in the same order: measured 0.0 on this CPU; the
bound leaves room for another BLAS."""

tiny_dir, pipe = testing.tiny_pipeline_fixtures(FluxFamily, variant="klein-base")


@pytest.fixture(scope="module")
def base(pipe: Flux2KleinPipeline) -> Flux2Family:
    return FluxFamily(pipe)


@pytest.fixture(scope="module")
def distilled_pipe(pipe: Flux2KleinPipeline) -> Flux2KleinPipeline:
    distilled = Flux2KleinPipeline(**pipe.components, is_distilled=True)
    distilled.set_progress_bar_config(disable=True)
    return distilled


@pytest.fixture(scope="module")
def distilled(distilled_pipe: Flux2KleinPipeline) -> Flux2Family:
    return FluxFamily(distilled_pipe)


def _params(family: Flux2Family, guidance: float = CFG, **kwargs) -> GenerationParams:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    request = RolloutRequest(prompt=PROMPT, num_inference_steps=STEPS, guidance_scale=guidance, **kwargs)
    return family.resolve_params(request)


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _family_sample(family: Flux2Family, params: GenerationParams, x: torch.Tensor, negative: str | None = None):
    cond = family.encode(PROMPT, negative, params).expand(x.shape[0])
    with torch.no_grad():
        latents = family_checks.euler_sample(family, cond, params, {"latents": x})["latents"]
        return latents, family.decode({"latents": latents}, params)


def _patchified(x: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    """Packed tokens back to the ``[B, 4C, h/2, w/2]`` layout the pipeline's ``latents``
    argument takes (it packs them itself)."""
    side = size // 8
    return x.permute(0, 2, 1).reshape(x.shape[0], CHANNELS, side, side)


def _pipeline(pipe: Flux2KleinPipeline, x: torch.Tensor, guidance: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's final packed latents (read by its step callback) and its pixels."""
    seen = {}

    def record(p, i, t, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    with torch.no_grad():
        pixels = pipe(
            prompt=kwargs.pop("prompt", PROMPT),
            latents=_patchified(x, kwargs.get("height", SIZE)),
            height=kwargs.pop("height", SIZE),
            width=kwargs.pop("width", SIZE),
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            num_images_per_prompt=x.shape[0],
            output_type="pt",
            callback_on_step_end=record,
            **kwargs,
        ).images
    return seen["latents"], pixels


@pytest.mark.parametrize(
    ("which", "guidance"), [("distilled", CFG), ("base", CFG), ("base", 1.0)], ids=["distilled", "base-cfg", "base-no-cfg"]
)
def test_euler_loop_over_the_family_equals_the_pipeline(request, which: str, guidance: float) -> None:
    family = request.getfixturevalue(which)
    params = _params(family, guidance)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    assert x.shape == (2, TOKENS, CHANNELS)
    latents, pixels = _family_sample(family, params, x)
    their_latents, their_pixels = _pipeline(family.pipeline, x, guidance)
    assert pixels.shape == their_pixels.shape == (2, 3, SIZE, SIZE) and pixels.dtype == torch.float32
    latent_diff = (latents - their_latents).abs().max().item()
    pixel_diff = (pixels - their_pixels).abs().max().item()
    print(f"{which} guidance {guidance}: max |family - pipeline| latents {latent_diff:.3e}, pixels {pixel_diff:.3e}")
    assert latent_diff <= PIPELINE_TOLERANCE and pixel_diff <= PIPELINE_TOLERANCE
    assert 0.01 < pixels.std().item()  # not a saturated image: the comparison sees the decoder

    # Control: the comparison sees the transformer. Nudge one weight in the family run only
    # (the pipeline shares the module, so it is restored).
    weight = family.components()["transformer"].single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight
    with family_checks.nudged(weight):
        nudged, _ = _family_sample(family, params, x)
    assert (nudged - their_latents).abs().max().item() > 1e-4
    assert torch.equal(_family_sample(family, params, x)[0], latents)  # restored


def test_the_distilled_model_ignores_guidance_and_the_base_does_not(distilled: Flux2Family, base: Flux2Family) -> None:
    x = distilled.initial_latents(_params(distilled), _generators(3, 1))["latents"]
    weak, strong = (_family_sample(distilled, _params(distilled, g), x)[0] for g in (1.0, 7.0))
    assert torch.equal(weak, strong)
    assert distilled.encode(PROMPT, None, _params(distilled, 7.0)).negative is None  # no CFG branch
    # The same weights undistilled: guidance 7 is CFG and changes the sample; guidance 1 is
    # the distilled model's single call.
    assert torch.equal(_family_sample(base, _params(base, 1.0), x)[0], weak)
    assert (_family_sample(base, _params(base, 7.0), x)[0] - weak).abs().max().item() > 1e-3


def test_cfg_is_the_pipelines_combination(base: Flux2Family) -> None:
    params = _params(base, CFG)
    x = base.initial_latents(params, _generators(5, 2))["latents"]
    t = base.schedule(params).timesteps[[1, 2]]
    cond = base.encode(PROMPT, None, params).expand(2)
    plain = replace(params, guidance_scale=1.0)
    with torch.no_grad():
        guided = base.predict({"latents": x}, t, cond, params)["latents"]
        pos = base.predict({"latents": x}, t, Conditioning(cond.positive), plain)["latents"]
        neg = base.predict({"latents": x}, t, Conditioning(cond.negative), plain)["latents"]
    # neg + s (pos - neg) without any rescale, computed in the same order and dtype.
    assert torch.equal(guided, neg + CFG * (pos - neg))
    assert not torch.allclose(guided, pos, atol=1e-3)
    # The default negative prompt is the pipeline's "".
    assert torch.equal(cond.negative["encoder_hidden_states"][:1], base.encode("", None, plain).positive["encoder_hidden_states"])


def test_a_negative_prompt_equals_the_pipelines_negative_embeddings(base: Flux2Family, pipe) -> None:
    params = _params(base, CFG)
    x = base.initial_latents(params, _generators(9, 1))["latents"]
    ours, _ = _family_sample(base, params, x, negative="blurry, low quality")
    default, _ = _family_sample(base, params, x)
    assert (ours - default).abs().max().item() > 1e-3  # the negative prompt matters
    with torch.no_grad():
        negative_embeds, _ = pipe.encode_prompt("blurry, low quality")
    theirs, _ = _pipeline(pipe, x, CFG, negative_prompt_embeds=negative_embeds)
    assert (ours - theirs).abs().max().item() <= PIPELINE_TOLERANCE


@pytest.mark.parametrize("which", ["base", "distilled"])
def test_rows_of_a_batch_are_independent(request, which: str) -> None:
    family = request.getfixturevalue(which)
    params = _params(family, CFG)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = family.schedule(params).timesteps[[0, 2, 3]]  # a different step per row, as the trainer mixes them
    # Two prompts in one batch: what the trainer's micro-batches hold.
    conds = [family.encode(p, None, params) for p in (PROMPT, "a small green frog on a leaf", PROMPT)]
    with torch.no_grad():
        batched = family.predict({"latents": x}, t, Conditioning.cat(conds), params)["latents"]
        alone = torch.cat([family.predict({"latents": x[i : i + 1]}, t[i : i + 1], c, params)["latents"] for i, c in enumerate(conds)])
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - alone).abs().max().item()
    print(f"{which}: max |batched - single rows| = {diff:.3e}")
    assert diff <= 1e-5  # batched matmuls may sum in another order
    # Control: a row given another row's prompt is another prediction.
    with torch.no_grad():
        swapped = family.predict({"latents": x[1:2]}, t[1:2], conds[0], params)["latents"]
    assert (swapped - alone[1:2]).abs().max().item() > 1e-4


def test_initial_noise_is_per_output_and_the_pipelines(base: Flux2Family, pipe) -> None:
    params = _params(base)
    pair = base.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, TOKENS, CHANNELS) and pair.dtype == torch.float32
    first = base.initial_latents(params, _generators(11, 1))["latents"]
    second = base.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    # prepare_latents with a generator list: drawn patchified per row, then packed.
    theirs, ids = pipe.prepare_latents(2, CHANNELS // 4, SIZE, SIZE, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, theirs) and ids.shape == (2, TOKENS, 4)
    wide = base.initial_latents(_params(base, width=2 * SIZE), _generators(0, 1))["latents"]
    assert wide.shape == (1, 2 * TOKENS, CHANNELS)


def test_schedule_is_the_pipelines(base: Flux2Family, distilled_pipe) -> None:
    seen = {}

    def record(p, i, t, tensors):
        seen.setdefault("sigmas", p.scheduler.sigmas.clone())
        seen.setdefault("timesteps", p.scheduler.timesteps.clone())
        return {}

    for size, steps in ((SIZE, STEPS), (2 * SIZE, STEPS), (SIZE, 7)):
        params = replace(_params(base, height=size, width=size), num_inference_steps=steps)
        schedule = base.schedule(params)
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        assert sigmas.dtype == timesteps.dtype == torch.float32
        assert sigmas.shape == (steps + 1,) and timesteps.shape == (steps,)
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        x = base.initial_latents(params, _generators(0, 1))["latents"]
        seen.clear()
        with torch.no_grad():
            distilled_pipe(
                prompt=PROMPT,
                latents=_patchified(x, size),
                height=size,
                width=size,
                num_inference_steps=steps,
                output_type="latent",
                callback_on_step_end=record,
            )
        assert torch.equal(seen["sigmas"], sigmas) and torch.equal(seen["timesteps"], timesteps)
    # mu depends on the image token count and on the step count (compute_empirical_mu) ...
    four = base.schedule(_params(base)).sigmas
    assert not torch.equal(base.schedule(_params(base, height=2 * SIZE, width=2 * SIZE)).sigmas, four)
    seven = base.schedule(replace(_params(base), num_inference_steps=7)).sigmas
    linear = torch.linspace(1, 0, 8)[:-1]
    assert not torch.allclose(seven[:-1], linear)  # shifted, not the raw grid
    # ... and the pipeline's own scheduler is left alone (each schedule works on a copy).
    state = base.pipeline.scheduler.sigmas.clone()
    base.schedule(replace(_params(base), num_inference_steps=5))
    assert torch.equal(base.pipeline.scheduler.sigmas, state)


def test_flow_shift_replaces_the_dynamic_shift(distilled: Flux2Family, distilled_pipe) -> None:
    params = _params(distilled, extra_sampling_params={"flow_shift": 3.0})
    assert params.flow_shift == 3.0
    schedule = distilled.schedule(params)
    shifted = type(distilled_pipe.scheduler).from_config(distilled_pipe.scheduler.config, shift=3.0, use_dynamic_shifting=False)
    shifted_pipe = Flux2KleinPipeline(**{**distilled_pipe.components, "scheduler": shifted}, is_distilled=True)
    shifted_pipe.set_progress_bar_config(disable=True)
    x = distilled.initial_latents(params, _generators(1, 1))["latents"]
    theirs, _ = _pipeline(shifted_pipe, x, 1.0)
    assert torch.equal(schedule.sigmas, shifted.sigmas) and torch.equal(schedule.timesteps, shifted.timesteps)
    assert not torch.equal(schedule.sigmas, distilled.schedule(_params(distilled)).sigmas)
    ours, _ = _family_sample(distilled, params, x)
    assert (ours - theirs).abs().max().item() <= PIPELINE_TOLERANCE


def test_max_sequence_length_matches_the_pipeline_argument(distilled: Flux2Family, distilled_pipe) -> None:
    params = _params(distilled, extra_sampling_params={"max_sequence_length": 16})
    cond = distilled.encode(PROMPT, None, params)
    assert cond.positive["encoder_hidden_states"].shape == (1, 16, 48)
    x = distilled.initial_latents(params, _generators(3, 1))["latents"]
    ours, _ = _family_sample(distilled, params, x)
    theirs, _ = _pipeline(distilled_pipe, x, 1.0, max_sequence_length=16)
    assert (ours - theirs).abs().max().item() <= PIPELINE_TOLERANCE
    # Control: the default length (512, the prompt padded) gives another sample.
    assert not torch.allclose(ours, _family_sample(distilled, _params(distilled), x)[0])


def test_resolve_params_defaults_and_errors(base: Flux2Family, tiny_dir: Path) -> None:
    params = base.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == FluxFamily.native_size(tiny_dir) == (512, 512)
    assert (params.num_inference_steps, params.guidance_scale, params.true_cfg_scale, dict(params.extra)) == (5, 3.0, None, {})
    assert base.resolve_params(RolloutRequest(prompt=PROMPT, num_frames=1, fps=8.0)).num_frames is None

    request = RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE)
    bad = [
        ("height", replace(request, height=36), r"^height: 36 must be a multiple of 8 \(VAE factor x 2x2 packing\)$"),
        ("width", replace(request, width=20), "multiple of 8"),
        ("num_frames", replace(request, num_frames=5), r"FLUX.2 \[klein\] generates images \(1 frame\), got 5"),
        (
            "true_cfg_scale",
            replace(request, true_cfg_scale=4.0),
            r"^true_cfg_scale: FLUX.2 \[klein\] has no true CFG .* use guidance_scale",
        ),
        ("true_cfg_scale", replace(request, true_cfg_scale=1.0), "has no true CFG"),
        ("extra_sampling_params", replace(request, extra_sampling_params={"true_cfg_scale": 3.0}), "true_cfg_scale"),
        ("extra_sampling_params", replace(request, extra_sampling_params={"max_sequence_length": 4096}), r"\[1, 2048\]"),
        ("extra_sampling_params", replace(request, extra_sampling_params={"max_sequence_length": 0}), r"\[1, 2048\]"),
    ]
    for field, req, message in bad:
        with pytest.raises(RequestError, match=message) as excinfo:
            base.resolve_params(req)
        assert excinfo.value.field == field
        assert "\n" not in str(excinfo.value)


def test_flow_shift_needs_a_shiftable_scheduler(pipe) -> None:
    from diffusers import DDIMScheduler

    other = Flux2KleinPipeline(**{**pipe.components, "scheduler": DDIMScheduler()})
    with pytest.raises(RequestError, match="flow_shift: the pipeline's DDIMScheduler has no shift") as excinfo:
        FluxFamily(other).resolve_params(RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE, extra_sampling_params={"flow_shift": 3.0}))
    assert excinfo.value.field == "extra_sampling_params"


def test_conditioning_encoded_once_expands_to_repeated_encodings(base: Flux2Family, distilled: Flux2Family) -> None:
    params = _params(base, CFG)
    once = base.encode(PROMPT, None, params)
    assert once.negative is not None
    assert set(once.positive) == set(once.negative) == {"encoder_hidden_states"}
    embeds = once.positive["encoder_hidden_states"]
    assert embeds.shape == (1, MAX_SEQUENCE_LENGTH, 48) and embeds.dtype == torch.float32
    family_checks.check_expand_matches_repeated(base, PROMPT, None, params, once)
    family_checks.check_expand_matches_repeated(base, PROMPT, "blurry", params, base.encode(PROMPT, "blurry", params))
    assert not torch.equal(once.negative["encoder_hidden_states"], embeds)
    # Two prompts give rows of one shape: the trainer concatenates them.
    other = base.encode("a small green frog on a leaf in the rain", None, params)
    assert Conditioning.cat([once, other]).positive["encoder_hidden_states"].shape == (2, MAX_SEQUENCE_LENGTH, 48)
    # Without CFG (the distilled model, or guidance <= 1) there is no negative conditioning.
    assert distilled.encode(PROMPT, "ignored", _params(distilled, CFG)).negative is None
    assert base.encode(PROMPT, "ignored", _params(base, 1.0)).negative is None


def test_multi_output_request_equals_one_output_requests(base: Flux2Family) -> None:
    request = RolloutRequest(
        prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=2, num_outputs_per_prompt=2, guidance_scale=CFG, seed=4
    )
    assert family_checks.check_multi_output_invariant(base, request) <= 1e-5


def test_encode_pixels_is_the_inverse_of_decode(base: Flux2Family, pipe) -> None:
    params = _params(base)
    pixels = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    vae = pipe.vae
    with torch.no_grad():
        latents = base.encode_pixels(pixels, params)["latents"]
        assert latents.shape == (2, TOKENS, CHANNELS)  # the packed layout of initial_latents
        # The pipeline's own encoding of a reference image: patchify, BatchNorm-normalise, pack.
        reference, _ = pipe.prepare_image_latents([pixels[:1] * 2 - 1], 1, None, "cpu", torch.float32)
        single = base.encode_pixels(pixels[:1], params)["latents"]  # the same batch of 1: the same kernels
        back = base.decode({"latents": latents}, params)
        raw = vae.decode(vae.encode(pixels * 2 - 1).latent_dist.mode()).sample
    assert torch.equal(single, reference)
    assert (latents[:1] - single).abs().max().item() <= 1e-5  # rows are independent
    # decode(encode_pixels(p)) is the VAE's own reconstruction of p: the BatchNorm steps cancel.
    assert (back - (raw * 0.5 + 0.5).clamp(0, 1)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\]"):
        base.encode_pixels(pixels.unsqueeze(2), params)
    with pytest.raises(ValueError, match="multiples of 8"):
        base.encode_pixels(pixels[..., :28], params)


def test_save_lora_loads_with_the_pipeline(distilled: Flux2Family, tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    adapted = copy.deepcopy(distilled.pipeline.transformer)
    adapted.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(KLEIN_LORA_TARGET_MODULES), init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    wrapped = sorted(n for n, m in adapted.named_modules() if hasattr(m, "lora_A"))
    trained = FluxFamily(Flux2KleinPipeline(**{**distilled.pipeline.components, "transformer": adapted}, is_distilled=True))
    out = trained.save_lora(tmp_path / "lora", {"transformer": adapted})
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    loaded = testing.load_tiny_pipeline(FluxFamily, tiny_dir)
    loaded.load_lora_weights(str(out))
    assert sorted(n for n, m in loaded.transformer.named_modules() if hasattr(m, "lora_A")) == wrapped
    params = _params(distilled, 1.0)
    x = distilled.initial_latents(params, _generators(2, 1))["latents"]
    mine, _ = _family_sample(trained, params, x)
    theirs, _ = _pipeline(loaded, x, 1.0)  # the base checkpoint, guidance 1: the distilled model's single call
    base_sample, _ = _family_sample(distilled, params, x)
    assert (mine - theirs).abs().max().item() <= PIPELINE_TOLERANCE
    assert (mine - base_sample).abs().max().item() > 1e-4  # the adapter matters


def test_flux2_dev_is_refused_with_the_reason(pipe) -> None:
    from diffusers import Flux2Pipeline

    # klein's components under FLUX.2 [dev]'s class: its own processor cannot be built here.
    dev = Flux2Pipeline(**pipe.components)
    with pytest.raises(
        CheckpointError, match=r"^FLUX.2 \[dev\] \(Flux2Pipeline\) is not served: .*PixtralProcessor, which requires torchvision"
    ) as excinfo:
        FluxFamily(dev)
    assert "\n" not in str(excinfo.value)
    assert isinstance(FluxFamily(pipe), Flux2Family)  # the control: the same components as klein are served
