"""The video rewards on synthetic videos whose ordering is known: a static video, a smooth
one (a pattern sliding one pixel per frame) and a flickering one (two unrelated frames
alternating). temporal_consistency (CLIP, a tiny random model saved locally) against
the mean cosine of consecutive frames computed in float64 from transformers' CLIPModel;
motion_magnitude against the mean absolute difference of consecutive uint8 frames and
VBench's temporal_flickering."""

import numpy as np
import pytest
import torch

from ._clip_tiny import as_pil, build_reward, config_errors, load_direct, random_image, reference_clip_pixels, save_tiny_clip

FRAMES, HEIGHT, WIDTH = 6, 40, 48


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("video"), seed=5)


def pattern(shift: int) -> torch.Tensor:
    """A smooth colour pattern ``[3, H, W]`` in [0, 1], slid ``shift`` pixels to the right."""
    y = torch.arange(HEIGHT, dtype=torch.float64)[:, None]
    x = torch.arange(WIDTH, dtype=torch.float64)[None, :] - shift
    channels = [0.5 + 0.4 * torch.sin(2 * torch.pi * (x / 24 + y / 40 + phase)) for phase in (0.0, 0.3, 0.6)]
    return torch.stack(channels).float()


@pytest.fixture(scope="module")
def videos():
    """``[C, F, H, W]`` videos: static < smooth < flicker in motion, the reverse in consistency."""
    noise = random_image(7, HEIGHT, WIDTH)
    return {
        "static": torch.stack([pattern(0)] * FRAMES, dim=1),
        "smooth": torch.stack([pattern(t) for t in range(FRAMES)], dim=1),
        "flicker": torch.stack([pattern(0) if t % 2 == 0 else noise for t in range(FRAMES)], dim=1),
    }


def uint8_frames(video: torch.Tensor) -> np.ndarray:
    """``[F, H, W, C]`` uint8, as every reward converts: round(x * 255) clamped."""
    return (video.double() * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).numpy()


def direct_consistency(clip_dir, video: torch.Tensor) -> float:
    """mean_t cos(E(frame_t), E(frame_t+1)) in float64, E the projected CLIP image
    embedding of the frame preprocessed as CLIP's reference does."""
    model, processor = load_direct(clip_dir)
    settings = processor.image_processor
    frames = [as_pil(video[:, t]) for t in range(video.shape[1])]
    pixels = torch.stack([reference_clip_pixels(f, 32, 32, settings.image_mean, settings.image_std) for f in frames]).float()
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixels)
    e = (out if isinstance(out, torch.Tensor) else out.pooler_output).double()
    cos = [float(e[t] @ e[t + 1] / (e[t].norm() * e[t + 1].norm())) for t in range(len(frames) - 1)]
    return sum(cos) / len(cos)


@pytest.mark.exercises("--clipscore-model-path", "--clipscore-batch-size")
def test_temporal_consistency_orders_the_videos_and_matches_the_formula(clip_dir, videos):
    reward = build_reward("temporal_consistency", "--clipscore-model-path", str(clip_dir), "--clipscore-batch-size", "4")
    names = ["static", "smooth", "flicker"]
    scores = dict(zip(names, reward([videos[n] for n in names])))
    assert scores["static"] == pytest.approx(1.0, abs=1e-6)
    assert scores["static"] > scores["smooth"] > scores["flicker"] >= -1.0
    for name in ("smooth", "flicker"):
        assert scores[name] == pytest.approx(direct_consistency(clip_dir, videos[name]), rel=1e-5, abs=1e-6)
    # The pairs are consecutive frames: reversing a video keeps its score, shuffling the
    # smooth one (frames 0, 3, 1, 4, 2, 5: pairs 2-3 pixels apart) lowers it. (The tiny
    # random CLIP sees little of a 1-pixel slide: 1 - smooth is about 5e-6.)
    reverse, shuffled = reward([videos["smooth"].flip(1), videos["smooth"][:, [0, 3, 1, 4, 2, 5]]])
    assert reverse == pytest.approx(scores["smooth"], abs=1e-7)
    assert 1 - shuffled > 2 * (1 - scores["smooth"])


@pytest.mark.parametrize("name", ["temporal_consistency", "motion_magnitude"])
def test_an_image_or_a_single_frame_is_a_one_line_error_naming_the_reward(clip_dir, name):
    reward = build_reward(name, "--clipscore-model-path", str(clip_dir))
    with pytest.raises(ValueError) as caught:
        reward([random_image(1)], ["a prompt"])
    assert str(caught.value) == f"{name} scores videos [C, F, H, W] of at least 2 frames, got an image [3, 40, 48]"
    with pytest.raises(ValueError, match=rf"^{name} scores videos \[C, F, H, W\] of at least 2 frames, got 1 frame\(s\) \[3, 1, 40, 48\]$"):
        reward([random_image(1)[:, None]], ["a prompt"])


def test_motion_magnitude_orders_the_videos_and_matches_the_formula(videos):
    reward = build_reward("motion_magnitude")
    names = ["static", "smooth", "flicker"]
    scores = dict(zip(names, reward([videos[n] for n in names])))
    assert scores["static"] == 0.0
    assert 0.0 < scores["smooth"] < scores["flicker"] <= 1.0
    for name in names:
        frames = uint8_frames(videos[name]).astype(np.float64)
        total = sum(np.abs(frames[t + 1] - frames[t]).sum() for t in range(FRAMES - 1))
        assert scores[name] == pytest.approx(total / ((FRAMES - 1) * HEIGHT * WIDTH * 3 * 255), rel=1e-12)
        # VBench temporal_flickering: (255 - mean over pairs of the pair's MAE) / 255.
        maes = [np.mean(np.abs(frames[t] - frames[t + 1])) for t in range(FRAMES - 1)]
        assert 1.0 - scores[name] == pytest.approx((255.0 - np.mean(maes)) / 255.0, rel=1e-12)
    # Extreme: black and white frames alternating move every pixel by 255.
    blink = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)] * 2, dim=1)
    assert reward([blink, blink.to(torch.bfloat16), (blink * 255).to(torch.uint8)]) == [1.0, 1.0, 1.0]


def test_video_rewards_are_registered_for_video_and_need_the_clip_path():
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.reward
    consistency, motion = registry.get("temporal_consistency").spec, registry.get("motion_magnitude").spec
    assert (consistency.ref, consistency.modality, consistency.uses_gpu) == ("miles_rewards.video:TemporalConsistency", ("video",), True)
    assert (motion.ref, motion.modality, motion.uses_gpu) == ("miles_rewards.video:MotionMagnitude", ("video",), False)
    assert config_errors("--rm-type", "temporal_consistency") == [
        "--clipscore-model-path is required with the temporal_consistency reward (--rm-type temporal_consistency)"
    ]
    assert config_errors("--rm-type", "motion_magnitude") == []
