import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from miles_rewards.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb
from miles_rewards.pixels import to_uint8_frames


def _pil_size_kb(array_hwc: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(array_hwc).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000.0


def _noise_image(seed: int, size: int = 64) -> torch.Tensor:
    return torch.rand(3, size, size, generator=torch.Generator().manual_seed(seed))


def test_flat_image_compresses_better_than_noise():
    flat = torch.full((3, 64, 64), 0.5)
    noise = _noise_image(0)
    comp = JpegCompressibility()([flat, noise])
    incomp = JpegIncompressibility()([flat, noise])
    assert comp[0] > comp[1]
    assert incomp[0] < incomp[1]
    assert comp == [-v / 500 for v in incomp]


def test_compressibility_is_flow_grpos_minus_size_over_500():
    image = _noise_image(4)
    size_kb = _pil_size_kb((image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
    # flow_grpo: jpeg_incompressibility = size_kB; jpeg_compressibility = -size_kB / 500.
    assert JpegIncompressibility()([image]) == [size_kb]
    assert JpegCompressibility()([image]) == [-size_kb / 500]
    assert size_kb > 1  # a non-trivial size, so an unscaled -size_kB would differ


def test_size_matches_pillow_at_quality_95():
    image = _noise_image(1)
    expected = _pil_size_kb((image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
    assert JpegIncompressibility()([image]) == [pytest.approx(expected, abs=0)]
    # Control: another quality gives another size, so the check above can fail.
    buffer = io.BytesIO()
    Image.fromarray(to_uint8_frames(image)[0]).save(buffer, format="JPEG", quality=50)
    assert len(buffer.getvalue()) / 1000.0 != expected


def test_uint8_and_float_inputs_agree():
    image = _noise_image(2)
    as_uint8 = (image * 255).round().to(torch.uint8).numpy()
    assert JpegIncompressibility()([image]) == JpegIncompressibility()([as_uint8])


def test_video_scores_the_mean_over_frames():
    frames = [_noise_image(3), torch.full((3, 64, 64), 0.2)]
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame = [jpeg_size_kb(f) for f in to_uint8_frames(video)]
    assert len(per_frame) == 2
    assert JpegIncompressibility()([video]) == [pytest.approx(sum(per_frame) / 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores_as_float32_of_the_same_values(dtype):
    video = torch.stack([_noise_image(5), _noise_image(6), torch.full((3, 64, 64), 0.3)], dim=1)
    half = video.to(dtype)
    as_float32 = half.float()  # the same (rounded) values
    assert [f.tolist() for f in to_uint8_frames(half)] == [f.tolist() for f in to_uint8_frames(as_float32)]
    for reward in (JpegCompressibility(), JpegIncompressibility()):
        assert reward([half, half[:, 0]]) == reward([as_float32, as_float32[:, 0]])
    # Control: rounding to half precision moves some pixels, so the check compares like with like.
    assert to_uint8_frames(video)[0].tolist() != to_uint8_frames(half)[0].tolist()


def test_float_conversion_rounds_and_clamps():
    image = torch.tensor([-0.5, 0.0, 0.5, 1.0, 2.0]).view(1, 1, 5).expand(3, 1, 5)
    frame = to_uint8_frames(image)[0]
    assert frame[0, :, 0].tolist() == [0, 0, 128, 255, 255]


@pytest.mark.parametrize("shape", [(64, 64), (2, 3, 64, 64, 1), (4, 64, 64)])
def test_bad_shapes_are_rejected(shape):
    with pytest.raises(ValueError, match="shape"):
        JpegCompressibility()([np.zeros(shape, dtype=np.uint8)])


def test_registered_and_light():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="miles.plugins") if ep.name == "rewards"]
    assert ep.dist.metadata["Name"] == "miles-rewards"
    names = {spec.name: spec.ref for spec in ep.load().miles_register_rewards()}
    assert names == {
        "jpeg_compressibility": "miles_rewards.jpeg:JpegCompressibility",
        "jpeg_incompressibility": "miles_rewards.jpeg:JpegIncompressibility",
        "brightness": "miles_rewards.diagnostic:Brightness",
        "redness": "miles_rewards.diagnostic:Redness",
        "colorfulness": "miles_rewards.diagnostic:Colorfulness",
        "pickscore": "miles_rewards.pickscore:PickScore",
        "aesthetic": "miles_rewards.aesthetic:Aesthetic",
        "clipscore": "miles_rewards.clipscore:ClipScore",
        "temporal_consistency": "miles_rewards.video:TemporalConsistency",
        "motion_magnitude": "miles_rewards.video:MotionMagnitude",
        "hpsv2": "miles_rewards.hpsv2:HPSv2",
        "imagereward": "miles_rewards.imagereward:ImageReward",
        "ocr": "miles_rewards.ocr:OcrReward",
        "vlm_judge": "miles_rewards.vlm_judge:VlmJudge",
    }
    code = "import sys, miles_rewards.plugin; print(sorted(m for m in ('torch', 'PIL', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
