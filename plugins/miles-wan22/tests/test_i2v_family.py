"""WanI2VFamily's runtime contract against WanImageToVideoPipeline itself.

The family's encode / initial_latents / schedule / predict / decode, driven by a plain
Euler loop, must reproduce ``WanImageToVideoPipeline.__call__`` (both experts, CFG with
``guidance_scale_2``, the same generators and image), and a different image must change
the video; the image condition is ``prepare_latents``' own; rows of a batch are
independent; output *i* of a request is the one-output request with seed + *i*; requests
without a usable image and non-I2V-A14B pipelines are refused naming the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
from PIL import Image

from miles_core import family_checks, testing
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_wan22.family import EXPERTS
from miles_wan22.i2v import WanI2VFamily
from miles_wan22.wan_base import IMAGE_LATENTS

PROMPT = "a red apple on a table"
NEGATIVE = "blurry"
HEIGHT, WIDTH = 32, 64  # latents 4x8: multiples of 16 (8x VAE x 2x2 patches)
FRAMES = 5  # 2 latent frames
STEPS = 3  # shift 3: timesteps about 1000 / 857 (transformer, transformer_2 below 900) / 600
GUIDANCE, GUIDANCE_2 = 4.0, 3.0

tiny_dir, pipe = testing.tiny_pipeline_fixtures(WanI2VFamily)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two conditioning images at another size than the video's (the processor resizes)."""
    folder = tmp_path_factory.mktemp("images")
    return tuple(family_checks.write_conditioning_image(folder / f"image{s}.png", height=40, width=72, seed=s) for s in (0, 1))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def family(pipe: WanImageToVideoPipeline) -> WanI2VFamily:
    return WanI2VFamily(pipe)


@pytest.fixture(scope="module")
def euler_pipe(pipe: WanImageToVideoPipeline) -> WanImageToVideoPipeline:
    """The same components with a FlowMatchEuler scheduler (shift 3, as the UniPC one): the
    pipeline then samples the ODE with Euler steps, which the family's loop must equal."""
    euler = WanImageToVideoPipeline(
        **{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0)},
        boundary_ratio=pipe.config.boundary_ratio,
    )
    euler.set_progress_bar_config(disable=True)
    return euler


def _request(image: Path | None, guidance: float = GUIDANCE, **kwargs) -> RolloutRequest:
    fields = dict(
        prompt=PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        extra_sampling_params={"guidance_scale_2": GUIDANCE_2} if guidance > 1 else {},
        image_path=None if image is None else (str(image),),
    )
    return RolloutRequest(**{**fields, **kwargs})


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_euler(family: WanI2VFamily, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    final = family.final_latents(family_checks.euler_sample(family, cond, params, {"latents": x}), cond, params)
    return family.decode(final, params)


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_euler_loop_over_the_family_equals_the_pipeline(euler_pipe, images, guidance: float) -> None:
    family = WanI2VFamily(euler_pipe)
    params = family.resolve_params(_request(images[0], guidance))
    # Both experts take part: the loop crosses the boundary (900).
    assert {family.denoiser_for(t, params) for t in family.schedule(params).timesteps} == set(EXPERTS)
    x = family.initial_latents(params, _generators(7, 2))["latents"]
    ours = _family_euler(family, params, x)
    # The pipeline draws its own noise from the same generators, and encodes the image
    # itself; the text embeddings are passed (its prompt cleaning needs ftfy).
    cond = family.encode(PROMPT, NEGATIVE, params).expand(2)
    with Image.open(images[0]) as opened:
        image = opened.convert("RGB")
    theirs = euler_pipe(
        image=image,
        prompt_embeds=cond.positive["encoder_hidden_states"],
        negative_prompt_embeds=None if cond.negative is None else cond.negative["encoder_hidden_states"],
        generator=_generators(7, 2),
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        guidance_scale_2=GUIDANCE_2 if guidance > 1 else None,
        output_type="pt",
    ).frames.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W] as the family's [B, C, F, H, W]
    assert ours.shape == theirs.shape == (2, 3, FRAMES, HEIGHT, WIDTH) and ours.dtype == torch.float32
    diff = (ours - theirs).abs().max().item()
    print(f"Euler, guidance {guidance}: max |family - pipeline| = {diff:.3e}")
    assert diff <= 1e-5
    # Control: the other image, same noise and prompt, gives another video.
    other = _family_euler(family, family.resolve_params(_request(images[1], guidance)), x)
    assert (other - theirs).abs().max().item() > 1e-3


def test_the_image_condition_is_prepare_latents(family: WanI2VFamily, pipe, images) -> None:
    params = family.resolve_params(_request(images[0]))
    condition = family.image_condition(params)
    with Image.open(images[0]) as opened:
        pixels = pipe.video_processor.preprocess(opened.convert("RGB"), height=HEIGHT, width=WIDTH).float()
    with torch.no_grad():
        _, expected = pipe.prepare_latents(pixels, 1, 16, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu", None)
    assert condition.shape == expected.shape == (1, 4 + 16, 2, HEIGHT // 8, WIDTH // 8) and condition.dtype == torch.float32
    assert torch.equal(condition, expected)  # the same VAE call and normalisation, in the same order
    # The mask: 1 on latent frame 0 (the image), 0 on the frame to generate.
    assert torch.equal(condition[:, :4, 0], torch.ones(1, 4, HEIGHT // 8, WIDTH // 8)) and not condition[:, :4, 1:].any()
    # encode carries it on the positive side only, in the model dtype; the trainer gets it from there.
    cond = family.encode(PROMPT, None, params)
    assert set(cond.positive) == {"encoder_hidden_states", IMAGE_LATENTS} and set(cond.negative) == {"encoder_hidden_states"}
    assert torch.equal(cond.positive[IMAGE_LATENTS], condition)
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, cond)
    # Control: another image gives another condition (mask aside).
    other = family.image_condition(family.resolve_params(_request(images[1])))
    assert torch.equal(other[:, :4], condition[:, :4]) and (other[:, 4:] - condition[:, 4:]).abs().max().item() > 1e-2


def test_noise_has_the_vaes_channels_as_the_pipeline_draws_it(family: WanI2VFamily, pipe, images) -> None:
    params = family.resolve_params(_request(images[0]))
    pair = family.initial_latents(params, _generators(11, 2))["latents"]
    assert pair.shape == (2, 16, 2, HEIGHT // 8, WIDTH // 8)  # z_dim, not the experts' 36 in_channels
    pixels = torch.zeros(1, 3, HEIGHT, WIDTH)
    with torch.no_grad():
        drawn, _ = pipe.prepare_latents(pixels, 2, 16, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu", _generators(11, 2))
    assert torch.equal(pair, drawn)


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: WanI2VFamily, images, guidance: float) -> None:
    params = family.resolve_params(_request(images[0], guidance))
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = torch.tensor([999.0, 857.0, 600.0])  # one row for the high-noise expert, two for the low-noise one
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.shape == x.shape and batched.dtype == torch.float32
    assert torch.allclose(batched, single, atol=1e-5, rtol=0)


def test_multi_output_invariant(family: WanI2VFamily, images) -> None:
    request = _request(images[0], seed=5, num_outputs_per_prompt=3, rollout_return_dit_trajectory=True)
    diff = family_checks.check_multi_output_invariant(family, request)
    print(f"multi-output invariant: max |output i of 3 - seed + i alone| = {diff:.3e}")


def test_requests_without_a_usable_image_are_refused(family: WanI2VFamily, images, tmp_path: Path) -> None:
    engine = EmbeddedEngine(family)
    broken = tmp_path / "broken.png"
    broken.write_text("not an image", encoding="utf-8")
    bad = [
        (None, "image_path: .*is image-to-video and needs a conditioning image; none given$"),
        (tmp_path / "missing.png", f"image_path: cannot read {re.escape(str(tmp_path / 'missing.png'))} "),
        (broken, f"image_path: {re.escape(str(broken))} is not an image PIL can read "),
    ]
    for image, message in bad:
        with pytest.raises(RequestError) as caught:
            engine.generate_sync(_request(image, num_inference_steps=1))
        assert caught.value.field == "image_path" and re.match(message, str(caught.value)), str(caught.value)
        assert "\n" not in str(caught.value)
    # resolve_params' own checks are wan2_2's (one example), and the image is on the parameters.
    with pytest.raises(RequestError, match=r"^num_frames: 6: Wan needs num_frames - 1 divisible by 4"):
        family.resolve_params(_request(images[0], num_frames=6))
    params = family.resolve_params(_request(images[0]))
    assert params.image is not None and params.image.path == str(images[0])
    assert dict(params.extra) == {"guidance_scale_2": GUIDANCE_2}


def _expert(**config) -> WanTransformer3DModel:
    shape = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1)
    return WanTransformer3DModel(**{**shape, "in_channels": 36, "out_channels": 16, **config})


def test_other_image_to_video_pipelines_are_refused(pipe: WanImageToVideoPipeline) -> None:
    parts = {**pipe.components}
    cases = [
        # Wan 2.1 I2V: one transformer taking CLIP image embeddings.
        (
            {"transformer": _expert(image_dim=16, added_kv_proj_dim=16), "transformer_2": None},
            {},
            r"^the wan2_2_i2v family serves Wan 2\.2 I2V-A14B; this WanImageToVideoPipeline is not one: the transformer's "
            r"image_dim is 16 \(CLIP image embeddings: Wan 2\.1 I2V\); Wan 2\.1 I2V is not supported; Wan 2\.2 TI2V-5B is "
            r"family wan2_2_ti2v$",
        ),
        (
            {},
            {"expand_timesteps": True},
            r"does not support expand_timesteps pipelines \(Wan 2\.2 TI2V-5B's image-to-video: family wan2_2_ti2v\)$",
        ),
        (
            {"transformer_2": None},
            {"boundary_ratio": None},
            r"needs a two-expert WanImageToVideoPipeline .*boundary_ratio=None and no transformer_2 \(Wan 2\.1 I2V is not supported",
        ),
        (
            {"transformer_2": _expert(in_channels=16)},
            {},
            # The rules are the checkpoint check's (checkpoint.i2v_configs_problem), on every expert.
            r"^the wan2_2_i2v family serves Wan 2\.2 I2V-A14B; this WanImageToVideoPipeline is not one: the transformer_2's "
            r"in_channels 16 / out_channels 16 are not 2 x z_dim \+ 4 / z_dim for the VAE's z_dim 16 \(an I2V expert reads "
            r"the latents, a 4-channel mask and the image latents\); Wan 2\.1 I2V",
        ),
    ]
    for components, config, message in cases:
        options = {"boundary_ratio": pipe.config.boundary_ratio, **config}
        with pytest.raises(ValueError, match=message):
            WanI2VFamily(WanImageToVideoPipeline(**{**parts, **components}, **options))
