"""Wan 2.2 TI2V-5B image-to-video end to end on the tiny pipeline: a Flow-GRPO + LoRA run
on prompt rows that carry a conditioning image keeps the alignment probe at exactly 0
(the trainer conditions on the image latent the engine sent), and ``miles-core generate
--image`` writes videos whose first frame is the image's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles_core import family_checks, testing
from miles_core.request import RolloutRequest
from miles_wan22.ti2v import WanTI2VFamily
from miles_wan22.wan_base import IMAGE_LATENTS

from .image_probe import check_probe_catches_a_trainer_side_image_shift

HEIGHT, WIDTH, FRAMES = 32, 64, 5
TI2V_FLAGS = (
    "--diffusion-height",
    str(HEIGHT),
    "--diffusion-width",
    str(WIDTH),
    "--diffusion-output-num-frames",
    str(FRAMES),
    "--diffusion-guidance-scale",
    "5.0",
)
GENERATE_FLAGS = ("--height", str(HEIGHT), "--width", str(WIDTH), "--num-frames", str(FRAMES))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return WanTI2VFamily.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-ti2v-tiny")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_checks.write_conditioning_image(tmp_path_factory.mktemp("images") / "image.png", height=HEIGHT, width=WIDTH)


def test_flow_grpo_lora_on_image_rows_trains_with_zero_probe_drift(
    tiny: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    records = family_checks.run_training(family_checks.tiny_train_args(tiny, run, *TI2V_FLAGS, "--lr", "1e-2", image=image))
    assert [r["rollout_id"] for r in records] == [0, 1]
    for record in records:
        assert record["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(record["train/loss"]))
        assert record["train/num_pairs"] == 4  # 2 samples x 2 SDE steps, on the denoised frames
    tensors = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in key and value.abs().max() > 0 for key, value in tensors.items())  # PEFT starts lora_B at 0

    record = family_checks.check_alignment_probe(
        family_checks.tiny_train_args(tiny, tmp_path / "probe", *TI2V_FLAGS, "--num-rollout", "1", image=image)
    )
    assert record["train/num_pairs"] == 4
    print("image mode alignment probe:", {k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("per_step")})

    # Control: the trainer alone conditions on a shifted image latent; the probe reports it.
    args = family_checks.tiny_train_args(tiny, tmp_path / "control", *TI2V_FLAGS, "--num-rollout", "1", image=image)
    check_probe_catches_a_trainer_side_image_shift(WanTI2VFamily, args, monkeypatch)


def _generate_first_frames(tiny: Path, out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> list[np.ndarray]:
    """``miles-core generate`` (two outputs, seeds 0 and 1) and each video's first frame as
    generate hands it to the file writer (uint8 ``H x W x 3``): the written MP4 / GIF
    is lossy, the frames it was written from are not."""
    from miles_core import media

    written: list[np.ndarray] = []
    with monkeypatch.context() as patch:
        for name in ("write_mp4", "write_gif"):
            original = getattr(media, name)

            def spy(path: Path, frames: np.ndarray, *args: object, _original: Any = original, **kwargs: object) -> object:
                written.append(np.array(frames[0]))
                return _original(path, frames, *args, **kwargs)

            patch.setattr(media, name, spy)
        files = family_checks.check_generate_writes(tiny, out, *GENERATE_FLAGS, *extra)
    assert len(files) == len(written) == 2 and all(family_checks.read_frames(f) == FRAMES for f in files)
    return written


def test_generate_with_an_image_starts_every_video_with_it(
    tiny: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wan's VAE decodes the first latent frame alone, so with ``--image`` every output's
    first frame is the decoding of the image's latent, whatever its seed; without, it is
    not (the control)."""
    from miles_core.training.record_values import uint8_frames

    family = WanTI2VFamily(testing.load_tiny_pipeline(WanTI2VFamily, tiny))
    request = RolloutRequest(prompt="p", height=HEIGHT, width=WIDTH, num_frames=FRAMES, image_path=(str(image),))
    params = family.resolve_params(request)
    with torch.no_grad():
        decoded = family.decode({"latents": family.encode("p", None, params).positive[IMAGE_LATENTS]}, params)[0]
    expected = uint8_frames(decoded)[0].astype(np.int16)  # the image frame alone, as generate rounds it

    with_image = _generate_first_frames(tiny, tmp_path / "i2v", monkeypatch, "--image", str(image))
    text_only = _generate_first_frames(tiny, tmp_path / "t2v", monkeypatch)
    assert with_image[0].shape == expected.shape == (HEIGHT, WIDTH, 3)
    errors = [int(np.abs(frame.astype(np.int16) - expected).max()) for frame in with_image]
    controls = [float(np.abs(frame.astype(np.int16) - expected).mean()) for frame in text_only]
    print(f"first frame vs the image's decoding (uint8 levels): max |diff| {errors} with --image, mean |diff| {controls} without")
    assert max(errors) <= 1  # rounding of a ~1e-7 decode difference may flip one level
    assert min(controls) > 2
