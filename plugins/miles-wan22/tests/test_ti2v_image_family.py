"""WanTI2VFamily's image mode (image-to-video) against ``WanImageToVideoPipeline`` in its
``expand_timesteps`` mode, on the tiny TI2V-5B-like pipeline.

An Euler loop over the family (state: latent frames 1..) then ``final_latents`` equals
the pipeline's latents; the transformer sees the image frame first with timestep 0 on
its tokens; rows of a batch are independent; output i of a request equals the one-output
request seeded seed + i, and every output's first frame is the image's; bad requests name
their field.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from PIL import Image

from miles_core import family_checks, testing
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RequestError
from miles_core.family import Conditioning, GenerationParams
from miles_core.request import RolloutRequest
from miles_wan22.ti2v import WanTI2VFamily
from miles_wan22.wan_base import IMAGE_LATENTS

PROMPT = "a red apple on a table"
NEGATIVE = "blurry"
HEIGHT, WIDTH = 32, 64  # latents 2x4 (16x VAE): 1x2 tokens of 2x2 patches per latent frame
FRAMES = 5  # 2 latent frames: the image's and one denoised
FRAME_TOKENS = 1 * 2
STEPS = 3
GUIDANCE = 5.0
Z = 48  # the Wan 2.2 VAE's latent channels

tiny_dir, pipe = testing.tiny_pipeline_fixtures(WanTI2VFamily)


def _write_image(path: Path, seed: int) -> Path:
    # Not the video's size: the pipeline's video_processor resizes it, and so must the family.
    pixels = np.random.default_rng(seed).integers(0, 256, size=(40, 72, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("images")
    return _write_image(folder / "a.png", 0), _write_image(folder / "b.png", 1)


@pytest.fixture(scope="module")
def euler_pipe(pipe: WanPipeline) -> WanPipeline:
    """The same components with a FlowMatchEuler scheduler (shift 5, as the UniPC one)."""
    euler = WanPipeline(**{**pipe.components, "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0)}, expand_timesteps=True)
    euler.set_progress_bar_config(disable=True)
    return euler


@pytest.fixture(scope="module")
def family(euler_pipe: WanPipeline) -> WanTI2VFamily:
    return WanTI2VFamily(euler_pipe)


def _request(image: Path | None, guidance: float = GUIDANCE, **kwargs) -> RolloutRequest:
    fields = dict(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance)
    return RolloutRequest(**{**fields, "image_path": None if image is None else (str(image),), **kwargs})


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _i2v_latents(family: WanTI2VFamily, image: Path, noise: torch.Tensor, cond: Conditioning, guidance: float) -> torch.Tensor:
    """``WanImageToVideoPipeline(expand_timesteps=True)`` on the family's components, the
    same full-frame noise, its ``output_type="latent"`` result. The text embeddings go in
    already expanded to the batch (the i2v pipeline's encode_prompt would need ftfy, and
    it does not repeat given embeddings)."""
    i2v = WanImageToVideoPipeline(**family.pipeline.components, expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    with Image.open(image) as opened:
        return i2v(
            image=opened.convert("RGB"),
            prompt_embeds=cond.positive["encoder_hidden_states"],
            negative_prompt_embeds=None if cond.negative is None else cond.negative["encoder_hidden_states"],
            latents=noise,
            height=HEIGHT,
            width=WIDTH,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            output_type="latent",
        ).frames


@torch.no_grad()
def _family_latents(family: WanTI2VFamily, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
    cond = family.encode(PROMPT, NEGATIVE, params).expand(x.shape[0])
    return family.final_latents(family_checks.euler_sample(family, cond, params, {"latents": x}), cond, params)["latents"]


def test_image_mode_euler_loop_equals_the_i2v_pipeline(family: WanTI2VFamily, images: tuple[Path, Path]) -> None:
    image, other = images
    params = family.resolve_params(_request(image))
    generators = _generators(7, 2)
    x = family.initial_latents(params, generators)["latents"]
    # The pipeline's draw over all latent frames; the state keeps frames 1.. of it.
    noise = family.pipeline.prepare_latents(2, Z, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu", _generators(7, 2))
    assert x.shape == (2, Z, 1, HEIGHT // 16, WIDTH // 16) and torch.equal(x, noise[:, :, 1:])

    ours = _family_latents(family, params, x)
    cond = family.encode(PROMPT, NEGATIVE, params).expand(2)
    theirs = _i2v_latents(family, image, noise, cond, GUIDANCE)
    assert ours.shape == theirs.shape == (2, Z, 2, HEIGHT // 16, WIDTH // 16)
    diff = (ours - theirs).abs().max().item()
    print(f"image mode, Euler + CFG: max |family - WanImageToVideoPipeline| = {diff:.3e}")
    assert diff <= 1e-5
    # Frame 0 is the image's latent itself (the pipeline's last overwrite).
    assert torch.equal(ours[:, :, :1], cond.positive[IMAGE_LATENTS])

    # Control: another image changes the pipeline's denoised frames, and the family run
    # with it no longer matches the first image's.
    theirs_other = _i2v_latents(family, other, noise, cond, GUIDANCE)
    assert (theirs_other[:, :, 1:] - theirs[:, :, 1:]).abs().max().item() > 1e-3
    ours_other = _family_latents(family, family.resolve_params(_request(other)), x)
    assert (ours_other[:, :, 1:] - theirs[:, :, 1:]).abs().max().item() > 1e-3


def test_the_transformer_sees_the_image_frame_at_timestep_0(family: WanTI2VFamily, images: tuple[Path, Path]) -> None:
    """The model input is the image's latent frame, then the state; the frame-0 tokens get
    timestep 0 and the others t, per row (the trainer mixes steps in a micro-batch)."""
    params = family.resolve_params(_request(images[0], 1.0))
    cond = family.encode(PROMPT, None, params)
    x = family.initial_latents(params, _generators(0, 2))["latents"]
    seen: list[dict[str, torch.Tensor]] = []
    transformer = family.pipeline.transformer
    hook = transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append({k: kw[k].clone() for k in ("hidden_states", "timestep")}), with_kwargs=True
    )
    try:
        with torch.no_grad():
            v = family.predict({"latents": x}, torch.tensor([999.0, 625.0]), cond.expand(2), params)["latents"]
    finally:
        hook.remove()
    (call,) = seen  # no CFG: one call
    assert call["timestep"].tolist() == [[0.0] * FRAME_TOKENS + [999.0] * FRAME_TOKENS, [0.0] * FRAME_TOKENS + [625.0] * FRAME_TOKENS]
    assert torch.equal(call["hidden_states"], torch.cat([cond.positive[IMAGE_LATENTS].expand(2, -1, -1, -1, -1), x], dim=2))
    assert v.shape == x.shape  # the velocity of the denoised frames only
    # Control: text mode gives every token t.
    text = family.token_timesteps(torch.tensor([999.0]), call["hidden_states"][:1])
    assert text.tolist() == [[999.0] * 2 * FRAME_TOKENS]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_an_image_batch_are_independent(family: WanTI2VFamily, images: tuple[Path, Path], guidance: float) -> None:
    params = family.resolve_params(_request(images[0], guidance))
    x = family.initial_latents(params, _generators(3, 3))["latents"]
    t = torch.tensor([999.0, 937.0, 625.0])
    cond = family.encode(PROMPT, None, params)
    batched, single = family_checks.batched_and_rows(family, {"latents": x}, t, cond, params)["latents"]
    assert batched.dtype == torch.float32 and batched.shape == x.shape
    diff = (batched - single).abs().max().item()
    print(f"image mode, guidance {guidance}: max |batched - single rows| = {diff:.3e}")
    assert torch.allclose(batched, single, atol=1e-5, rtol=0)
    # Control: a row's image latent reaches its prediction, and only that row's.
    other = family.encode(PROMPT, None, family.resolve_params(_request(images[1], guidance))).positive[IMAGE_LATENTS]
    mixed = cond.expand(3)
    mixed.positive[IMAGE_LATENTS] = torch.cat([mixed.positive[IMAGE_LATENTS][:2], other])
    with torch.no_grad():
        moved = family.predict({"latents": x}, t, mixed, params)["latents"]
    # The same rows in the same batch shape; a tolerance, as rows of a GEMM need not be bitwise independent.
    assert torch.allclose(moved[:2], batched[:2], atol=1e-6, rtol=0)
    assert (moved[2] - batched[2]).abs().max().item() > 1e-3


def test_multi_output_invariant_and_the_first_frame_is_the_images(family: WanTI2VFamily, images: tuple[Path, Path]) -> None:
    request = replace(
        _request(images[0]), seed=5, num_outputs_per_prompt=2, rollout_return_dit_trajectory=True, rollout_return_denoising_env=True
    )
    worst = family_checks.check_multi_output_invariant(family, request)
    print(f"image mode: multi-output invariant max |diff| = {worst:.3e}")

    outputs = EmbeddedEngine(family).generate_sync(request)
    for output in outputs:
        # The state (trajectory, what the trainer steps) holds the denoised frame only; the
        # image latent travels in the conditioning.
        assert output.dit_trajectory["latents"].shape == (STEPS + 1, Z, 1, HEIGHT // 16, WIDTH // 16)
        assert output.denoising_env["pos_cond_kwargs"][IMAGE_LATENTS].shape == (Z, 1, HEIGHT // 16, WIDTH // 16)
    # Wan's VAE decodes the first latent frame alone: every output's first frame is the
    # image's decoding, whatever its noise; the later frames differ.
    with torch.no_grad():
        params = family.resolve_params(request)
        alone = family.decode({"latents": family.encode(PROMPT, None, params).positive[IMAGE_LATENTS]}, params)[0, :, 0]
    first, second = (o.generated_output for o in outputs)
    assert first.shape == (3, FRAMES, HEIGHT, WIDTH)
    for video in (first, second):
        assert torch.allclose(video[:, 0], alone, atol=1e-5, rtol=0)
    assert (first[:, 1:] - second[:, 1:]).abs().max().item() > 1e-2
    # Control: text-to-video on the same family denoises every frame, the first too.
    (text,) = EmbeddedEngine(family).generate_sync(replace(request, image_path=None, num_outputs_per_prompt=1))
    assert text.dit_trajectory["latents"].shape == (STEPS + 1, Z, 2, HEIGHT // 16, WIDTH // 16)
    assert IMAGE_LATENTS not in text.denoising_env["pos_cond_kwargs"]
    assert (text.generated_output[:, 0] - alone).abs().max().item() > 1e-2


def test_image_requests_that_cannot_work_name_their_field(family: WanTI2VFamily, images: tuple[Path, Path], tmp_path: Path) -> None:
    assert family.image_input == "optional"
    bad = [
        (
            _request(images[0], num_frames=1),
            "num_frames",
            "num_frames: 1: image-to-video needs frames after the conditioning image, at least 5",
        ),
        (_request(tmp_path / "missing.png"), "image_path", f"image_path: cannot read {tmp_path / 'missing.png'}"),
    ]
    for request, field, message in bad:
        with pytest.raises(RequestError) as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field and str(excinfo.value).startswith(message), str(excinfo.value)
        assert "\n" not in str(excinfo.value)
    # Controls: one frame is an image without a conditioning image; 5 frames take one.
    assert family.resolve_params(_request(None, num_frames=1)).image is None
    assert family.resolve_params(_request(images[0])).image is not None
