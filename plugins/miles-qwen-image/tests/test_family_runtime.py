"""QwenImageFamily's runtime contract against QwenImagePipeline itself.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``QwenImagePipeline.__call__`` (packed latents, masked text,
timesteps / 1000, true CFG with its norm rescale, the dynamic-shift schedule); rows of a
batch, prompts of different lengths included, must be independent; noise is per output;
bad requests name their field; the saved LoRA loads with ``load_lora_weights``.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline

from miles_core import family_checks, testing
from miles_core.errors import RequestError
from miles_core.family import Conditioning, GenerationParams
from miles_core.request import RolloutRequest
from miles_qwen_image.family import MAX_SEQUENCE_LENGTH, QwenImageFamily
from miles_qwen_image.plugin import LORA_TARGET_MODULES

PROMPT = "a red cube on a blue table"
LONG_PROMPT = "a very small green frog sitting on a large wet leaf next to a pond under the rain at night"
SIZE = 32  # latents 8x8 (16 packed tokens); a multiple of 8 = VAE factor 4 x 2x2 packing
STEPS = 4
TRUE_CFG = 4.0

tiny_dir, pipe = testing.tiny_pipeline_fixtures(QwenImageFamily)


@pytest.fixture(scope="module")
def family(pipe: QwenImagePipeline) -> QwenImageFamily:
    return QwenImageFamily(pipe)


def _params(family: QwenImageFamily, true_cfg: float | None, **kwargs) -> GenerationParams:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    request = RolloutRequest(prompt=PROMPT, num_inference_steps=STEPS, true_cfg_scale=true_cfg, **kwargs)
    return family.resolve_params(request)


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_latents(family: QwenImageFamily, params: GenerationParams, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    return family_checks.euler_sample(family, cond, params, {"latents": x})["latents"]


def _family_sample(family: QwenImageFamily, params: GenerationParams, x: torch.Tensor, prompt: str = PROMPT):
    cond = family.encode(prompt, " ", params).expand(x.shape[0])
    latents = _family_latents(family, params, x, cond)
    with torch.no_grad():
        return latents, family.decode({"latents": latents}, params)


def _pipeline(pipe: QwenImagePipeline, prompt, x: torch.Tensor, true_cfg: float | None, output_type: str, **kwargs):
    with torch.no_grad():
        return pipe(
            prompt,
            negative_prompt=" " if true_cfg else None,
            true_cfg_scale=true_cfg or 1.0,
            latents=x,
            num_images_per_prompt=x.shape[0] // (len(prompt) if isinstance(prompt, list) else 1),
            height=kwargs.pop("height", SIZE),
            width=kwargs.pop("width", SIZE),
            num_inference_steps=STEPS,
            output_type=output_type,
            **kwargs,
        ).images


@pytest.mark.parametrize("true_cfg", [TRUE_CFG, None], ids=["true-cfg", "no-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(family: QwenImageFamily, pipe, true_cfg) -> None:
    params = _params(family, true_cfg)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    assert x.shape == (2, (SIZE // 8) ** 2, 16)  # packed: (h/2)(w/2) tokens of 4 x 4 channels
    latents, pixels = _family_sample(family, params, x)
    their_latents = _pipeline(pipe, PROMPT, x, true_cfg, "latent")
    their_pixels = _pipeline(pipe, PROMPT, x, true_cfg, "pt")
    assert pixels.shape == their_pixels.shape == (2, 3, SIZE, SIZE) and pixels.dtype == torch.float32
    latent_diff = (latents - their_latents).abs().max().item()
    pixel_diff = (pixels - their_pixels).abs().max().item()
    print(f"true_cfg {true_cfg}: max |family - pipeline| latents {latent_diff:.3e}, pixels {pixel_diff:.3e}")
    assert latent_diff <= 1e-5 and pixel_diff <= 1e-5

    # Control: the comparison sees the transformer. Nudge one weight of the family's
    # transformer only in the family run (the pipeline shares the module, so restore it).
    weight = family.components()["transformer"].transformer_blocks[0].attn.to_q.weight
    with family_checks.nudged(weight):
        nudged, _ = _family_sample(family, params, x)
    assert (nudged - their_latents).abs().max().item() > 1e-4
    assert torch.equal(_family_sample(family, params, x)[0], latents)  # restored


def test_bf16_euler_loop_equals_the_pipeline(tiny_dir: Path) -> None:
    bf16 = QwenImagePipeline.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    bf16.set_progress_bar_config(disable=True)
    family = QwenImageFamily(bf16, dtype=torch.bfloat16)
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    assert x.dtype == torch.bfloat16
    cond = family.encode(PROMPT, " ", params).expand(2)
    schedule = family.schedule(params)
    latents = x
    with torch.no_grad():
        for k in range(STEPS):
            v = family.predict({"latents": latents}, schedule.timesteps[k].expand(2), cond, params)["latents"]
            # FlowMatchEulerDiscreteScheduler.step's arithmetic: fp32 sample + dt * (bf16 velocity), back to bf16.
            dt = schedule.sigmas[k + 1] - schedule.sigmas[k]
            latents = (latents.float() + dt * v.to(torch.bfloat16)).to(torch.bfloat16)
    theirs = _pipeline(bf16, PROMPT, x, TRUE_CFG, "latent")
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(latents, theirs)


def test_true_cfg_changes_the_sample_and_keeps_the_conditional_norm(family: QwenImageFamily) -> None:
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(5, 1))["latents"]
    t = family.schedule(params).timesteps[1:2]
    cond = family.encode(PROMPT, "blurry", params)
    with torch.no_grad():
        guided = family.predict({"latents": x}, t, cond, params)["latents"]
        plain = family.predict({"latents": x}, t, Conditioning(cond.positive), replace(params, true_cfg_scale=None))["latents"]
        negative = family.predict({"latents": x}, t, Conditioning(cond.negative), replace(params, true_cfg_scale=None))["latents"]
    # comb = neg + s (pos - neg), rescaled token by token to the conditional prediction's norm.
    comb = negative + TRUE_CFG * (plain - negative)
    expected = comb * (plain.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
    assert torch.allclose(guided, expected, atol=1e-6, rtol=0)
    assert torch.allclose(guided.norm(dim=-1), plain.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(guided, plain, atol=1e-3)
    # A true_cfg_scale <= 1 is off, as in the pipeline (one call, no negative encoded).
    assert family.encode(PROMPT, "blurry", replace(params, true_cfg_scale=1.0)).negative is None


def test_two_prompts_of_different_lengths_batch_like_each_alone(family: QwenImageFamily, pipe) -> None:
    params = _params(family, TRUE_CFG)
    short, long = family.encode(PROMPT, " ", params), family.encode(LONG_PROMPT, "low quality, blurry", params)
    lengths = [int(c.positive["encoder_hidden_states_mask"].sum()) for c in (short, long)]
    assert lengths[0] < lengths[1], lengths  # the batch really pads the short prompt
    both = Conditioning.cat([short, long])  # what the trainer builds for a mixed micro-batch
    x = family.initial_latents(params, _generators(3, 2))["latents"]
    t = family.schedule(params).timesteps[[0, 2]]
    with torch.no_grad():
        batched = family.predict({"latents": x}, t, both, params)["latents"]
        alone = torch.cat(
            [family.predict({"latents": x[i : i + 1]}, t[i : i + 1], cond, params)["latents"] for i, cond in enumerate((short, long))]
        )
    diff = (batched - alone).abs().max().item()
    print(f"two prompts: max |batched - each alone| = {diff:.3e}")
    assert diff <= 1e-5
    # The same batch through the pipeline's own padding (a list of two prompts).
    plain = replace(params, true_cfg_scale=None)
    ours = _family_latents(
        family, plain, x, Conditioning.cat([family.encode(PROMPT, None, plain), family.encode(LONG_PROMPT, None, plain)])
    )
    theirs = _pipeline(pipe, [PROMPT, LONG_PROMPT], x, None, "latent")
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("true_cfg", [TRUE_CFG, None], ids=["true-cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: QwenImageFamily, true_cfg) -> None:
    params = _params(family, true_cfg)
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = family.schedule(params).timesteps[[0, 2, 3]]  # a different step per row, as the trainer mixes them
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - single).abs().max().item()
    print(f"true_cfg {true_cfg}: max |batched - single rows| = {diff:.3e}")
    assert diff <= 1e-5  # batched matmuls sum in another order; CFG's rescale amplifies it


def test_initial_noise_is_per_output_and_the_pipelines(family: QwenImageFamily, pipe) -> None:
    params = _params(family, TRUE_CFG)
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 16, 16) and pair.dtype == torch.float32
    first = family.initial_latents(params, _generators(11, 1))["latents"]
    second = family.initial_latents(params, _generators(12, 1))["latents"]
    assert torch.equal(pair, torch.cat([first, second]))
    assert not torch.equal(pair[0], pair[1])
    # prepare_latents with a generator list: drawn unpacked per row, then packed.
    theirs = pipe.prepare_latents(2, 4, SIZE, SIZE, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, theirs)
    wide = family.initial_latents(_params(family, None, width=2 * SIZE), _generators(0, 1))["latents"]
    assert wide.shape == (1, 4 * 8, 16)


def test_resolve_params_defaults_and_errors(family: QwenImageFamily, tiny_dir) -> None:
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == QwenImageFamily.native_size(tiny_dir) == (512, 512)
    assert (params.num_inference_steps, params.guidance_scale, params.true_cfg_scale, dict(params.extra)) == (5, 3.0, None, {})
    assert family.resolve_params(RolloutRequest(prompt=PROMPT, num_frames=1, fps=8.0)).num_frames is None
    assert _params(family, 4.0).true_cfg_scale == 4.0

    base = RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE)
    bad = [
        ("height", replace(base, height=36), "multiple of 8"),
        ("width", replace(base, width=20), "multiple of 8"),
        ("num_frames", replace(base, num_frames=5), "1 frame"),
        ("true_cfg_scale", replace(base, true_cfg_scale=-1.0), ">= 0"),
        ("true_cfg_scale", replace(base, true_cfg_scale=float("nan")), ">= 0"),
        ("num_inference_steps", replace(base, num_inference_steps=1), "at least 2"),
        ("extra_sampling_params", replace(base, extra_sampling_params={"guidance_scale_2": 3.0}), "guidance_scale_2"),
        ("extra_sampling_params", replace(base, extra_sampling_params={"max_sequence_length": 2048}), r"\[1, 1024\]"),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError, match=message) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field
        assert "\n" not in str(excinfo.value)


def test_flow_shift_needs_a_shiftable_scheduler(pipe) -> None:
    from diffusers import DDIMScheduler

    other = QwenImagePipeline(**{**pipe.components, "scheduler": DDIMScheduler()})
    with pytest.raises(RequestError, match="flow_shift: the pipeline's DDIMScheduler has no shift") as excinfo:
        QwenImageFamily(other).resolve_params(
            RolloutRequest(prompt=PROMPT, height=SIZE, width=SIZE, extra_sampling_params={"flow_shift": 3.0})
        )
    assert excinfo.value.field == "extra_sampling_params"


def test_conditioning_encoded_once_expands_to_repeated_encodings(family: QwenImageFamily) -> None:
    params = _params(family, TRUE_CFG)
    once = family.encode(PROMPT, None, params)
    assert once.negative is not None
    keys = {"encoder_hidden_states", "encoder_hidden_states_mask"}
    assert set(once.positive) == set(once.negative) == keys
    embeds, mask = once.positive["encoder_hidden_states"], once.positive["encoder_hidden_states_mask"]
    assert embeds.shape == (1, MAX_SEQUENCE_LENGTH, 16) and mask.shape == (1, MAX_SEQUENCE_LENGTH)
    tokens = int(mask.sum())
    assert mask[0, :tokens].all() and not mask[0, tokens:].any()
    assert not embeds[0, tokens:].any()  # zero padding
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, once)
    # The default negative prompt is " ", and differs from the prompt.
    spaced = family.encode(PROMPT, " ", params)
    assert torch.equal(spaced.negative["encoder_hidden_states"], once.negative["encoder_hidden_states"])
    assert not torch.equal(once.negative["encoder_hidden_states"], once.positive["encoder_hidden_states"])
    # Without true CFG there is no negative conditioning.
    assert family.encode(PROMPT, "ignored", _params(family, None)).negative is None


def test_conditioning_is_encoded_once_per_request(family: QwenImageFamily, monkeypatch) -> None:
    from miles_core.engine.embedded import EmbeddedEngine

    calls = []
    original = family.pipeline.encode_prompt

    def counting(*args, **kwargs):
        calls.append(kwargs.get("prompt"))
        return original(*args, **kwargs)

    monkeypatch.setattr(family.pipeline, "encode_prompt", counting)
    request = RolloutRequest(
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        num_outputs_per_prompt=3,
        true_cfg_scale=TRUE_CFG,
        negative_prompt="blurry",
        rollout=False,
    )
    outputs = EmbeddedEngine(family).generate_sync(request)
    assert len(outputs) == 3
    assert calls == [PROMPT, "blurry"]  # one positive and one negative encode for three outputs


def test_schedule_is_the_pipelines(family: QwenImageFamily, pipe) -> None:
    seen = {}

    def record(p, i, t, kwargs):
        seen.setdefault("sigmas", p.scheduler.sigmas.clone())
        seen.setdefault("timesteps", p.scheduler.timesteps.clone())
        return {}

    for size in (SIZE, 2 * SIZE):
        params = _params(family, None, height=size, width=size)
        schedule = family.schedule(params)
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        assert sigmas.dtype == timesteps.dtype == torch.float32
        assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        assert sigmas[-2].item() == pytest.approx(0.02)  # Qwen-Image's shift_terminal
        x = family.initial_latents(params, _generators(0, 1))["latents"]
        seen.clear()
        with torch.no_grad():
            pipe(
                PROMPT,
                latents=x,
                height=size,
                width=size,
                num_inference_steps=STEPS,
                output_type="latent",
                true_cfg_scale=1.0,
                callback_on_step_end=record,
            )
        assert torch.equal(seen["sigmas"], sigmas) and torch.equal(seen["timesteps"], timesteps)
    # mu depends on the image token count (the dynamic shift), ...
    assert not torch.equal(family.schedule(_params(family, None)).sigmas, sigmas)
    # ... and the pipeline's own scheduler is left alone (each schedule works on a copy).
    state = pipe.scheduler.sigmas.clone()
    family.schedule(replace(params, num_inference_steps=7))
    assert torch.equal(pipe.scheduler.sigmas, state)


@pytest.mark.exercises("--diffusion-flow-shift")
def test_flow_shift_replaces_the_dynamic_shift(family: QwenImageFamily, pipe) -> None:
    from miles_core.config.resolve import resolve_config
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    # The flag reaches the family as extra_sampling_params.flow_shift (sglang-diffusion's name).
    config = resolve_config(
        [
            "--hf-checkpoint",
            "Qwen/Qwen-Image",
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
    assert params.flow_shift == 3.0
    schedule = family.schedule(params)
    shifted = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0, use_dynamic_shifting=False)
    shifted_pipe = QwenImagePipeline(**{**pipe.components, "scheduler": shifted})
    shifted_pipe.set_progress_bar_config(disable=True)
    x = family.initial_latents(params, _generators(1, 1))["latents"]
    with torch.no_grad():
        theirs = shifted_pipe(
            PROMPT, latents=x, height=SIZE, width=SIZE, num_inference_steps=STEPS, true_cfg_scale=1.0, output_type="latent"
        ).images
    assert torch.equal(schedule.sigmas, shifted.sigmas) and torch.equal(schedule.timesteps, shifted.timesteps)
    assert not torch.equal(schedule.sigmas, family.schedule(_params(family, None)).sigmas)
    ours = _family_latents(family, params, x, family.encode(PROMPT, None, params))
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_max_sequence_length_matches_the_pipeline_argument(family: QwenImageFamily, pipe) -> None:
    params = _params(family, TRUE_CFG, extra_sampling_params={"max_sequence_length": 4})
    cond = family.encode(PROMPT, " ", params)
    assert cond.positive["encoder_hidden_states"].shape[1] == 4 and bool(cond.positive["encoder_hidden_states_mask"].all())
    x = family.initial_latents(params, _generators(3, 1))["latents"]
    ours = _family_latents(family, params, x, cond)
    theirs = _pipeline(pipe, PROMPT, x, TRUE_CFG, "latent", max_sequence_length=4)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Control: the default length gives another sample.
    assert not torch.allclose(
        ours, _family_latents(family, _params(family, TRUE_CFG), x, family.encode(PROMPT, " ", _params(family, TRUE_CFG)))
    )


def test_decode_shape_and_range(family: QwenImageFamily) -> None:
    params = _params(family, None, width=2 * SIZE)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    with torch.no_grad():
        image = family.decode({"latents": x}, params)
    assert image.shape == (2, 3, SIZE, 2 * SIZE) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1


def test_encode_pixels_is_the_inverse_of_decode(pipe) -> None:
    # A VAE with a non-trivial latent mean / std, so a swapped normalisation would show.
    vae = copy.deepcopy(pipe.vae)
    vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 2.0, 1.5, 1.0])
    family = QwenImageFamily(QwenImagePipeline(**{**pipe.components, "vae": vae}))
    params = _params(family, None)
    pixels = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = family.encode_pixels(pixels, params)["latents"]
        assert latents.shape == (2, 16, 16)  # the packed layout of initial_latents
        back = family.decode({"latents": latents}, params)
        raw = vae.decode(vae.encode(pixels.unsqueeze(2) * 2 - 1).latent_dist.mean).sample[:, :, 0]
    # decode(encode_pixels(p)) is the VAE's own reconstruction of p.
    assert (back - (raw * 0.5 + 0.5).clamp(0, 1)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\]"):
        family.encode_pixels(pixels.unsqueeze(2), params)


def test_save_lora_loads_with_the_pipeline(family: QwenImageFamily, tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    adapted = copy.deepcopy(family.pipeline.transformer)
    adapted.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(LORA_TARGET_MODULES), init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    trained = QwenImageFamily(QwenImagePipeline(**{**family.pipeline.components, "transformer": adapted}))
    out = trained.save_lora(tmp_path / "lora", {"transformer": adapted})
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    loaded = testing.load_tiny_pipeline(QwenImageFamily, tiny_dir)
    loaded.load_lora_weights(str(out))
    wrapped = [n for n, m in loaded.transformer.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == len(LORA_TARGET_MODULES) * len(loaded.transformer.transformer_blocks)
    params = _params(family, TRUE_CFG)
    x = family.initial_latents(params, _generators(2, 1))["latents"]
    mine, _ = _family_sample(trained, params, x)
    theirs = _pipeline(loaded, PROMPT, x, TRUE_CFG, "latent")
    base, _ = _family_sample(family, params, x)
    assert (mine - theirs).abs().max().item() <= 1e-5
    assert (mine - base).abs().max().item() > 1e-4  # the adapter matters
