"""The pickscore reward: the full path (registered reward, resolved configuration, real
transformers loading) on a tiny random CLIP model and processor saved locally, checked
against a direct computation of logit_scale.exp() * cos(text, image) / 26."""

import subprocess
import sys

import pytest
import torch

from miles_core.errors import RewardError
from miles_rewards.clip_models import frame_indices

from ._clip_tiny import (
    as_pil,
    build_reward,
    config_errors,
    image_embeddings,
    load_direct,
    random_image,
    save_tiny_clip,
    text_embeddings,
)

PROMPTS = [
    "A red apple sits on a wooden table.",
    "Snow covered mountains above a calm lake.",
    "A robot made of shiny silver metal walks through a quiet forest.",
]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("pickscore"))


def pickscore(clip_dir, *args):
    return build_reward("pickscore", "--pickscore-model-path", str(clip_dir), "--pickscore-processor-path", str(clip_dir), *args)


def direct_scores(clip_dir, images, prompts):
    model, processor = load_direct(clip_dir)
    cos = (text_embeddings(model, processor, prompts) * image_embeddings(model, processor, images)).sum(-1)
    return (model.logit_scale.exp() * cos / 26).tolist()


@pytest.mark.exercises("--pickscore-model-path", "--pickscore-processor-path")
def test_full_path_matches_the_formula(clip_dir):
    reward = pickscore(clip_dir)
    images = [random_image(seed) for seed in range(3)]
    scores = reward(images, PROMPTS, [{}] * 3)
    expected = direct_scores(clip_dir, [as_pil(image) for image in images], PROMPTS)
    assert scores == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert all(isinstance(s, float) for s in scores)
    # Controls: another prompt, another image, change the score; the formula scales
    # by logit_scale.exp() / 26 (not 1, not 100): the tiny model's exp(3.2).
    swapped = reward(images, PROMPTS[::-1], None)
    assert swapped[0] != pytest.approx(scores[0], rel=1e-4) and swapped[1] == pytest.approx(scores[1], rel=1e-5)
    other = reward([random_image(10), images[1], images[2]], PROMPTS)
    assert other[0] != pytest.approx(scores[0], rel=1e-4)
    model, processor = load_direct(clip_dir)
    assert model.logit_scale.exp().item() == pytest.approx(24.53, abs=0.01)
    cos = (text_embeddings(model, processor, PROMPTS[:1]) * image_embeddings(model, processor, [as_pil(images[0])])).sum().item()
    assert scores[0] == pytest.approx(24.5325 * cos / 26, rel=1e-4)


def test_floats_are_converted_to_uint8_as_the_reference_does(clip_dir):
    reward = pickscore(clip_dir)
    image = random_image(4)
    quantised = (image * 255).round() / 255  # the same uint8 image
    as_uint8 = (image * 255).round().to(torch.uint8)
    out_of_range = image * 1.0
    out_of_range[:, 0, 0] = torch.tensor([1.7, -0.3, 1.0])  # clamped to 255, 0, 255
    clamped = out_of_range.clamp(0, 1)
    a, b, c, d, e = reward([image, quantised, as_uint8, out_of_range, clamped], [PROMPTS[0]] * 5)
    assert b == pytest.approx(a, rel=1e-6) and c == pytest.approx(a, rel=1e-6)
    assert d == pytest.approx(e, rel=1e-6)  # batched forwards may differ in the last bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_outputs_score_as_float32_of_the_same_values(clip_dir, dtype):
    # Engines running in bfloat16 return bfloat16 images; numpy has no bfloat16.
    reward = pickscore(clip_dir)
    half = [random_image(seed).to(dtype) for seed in (20, 21)]
    video = torch.stack([random_image(22), random_image(23)], dim=1).to(dtype)
    scores = reward([*half, video], PROMPTS)
    assert scores == reward([*(image.float() for image in half), video.float()], PROMPTS)
    assert all(isinstance(s, float) and s == s for s in scores)


@pytest.mark.exercises("--pickscore-batch-size")
def test_batch_size_sets_the_frames_per_forward_not_the_scores(clip_dir):
    images = [random_image(seed) for seed in range(5)]
    prompts = [PROMPTS[i % 3] for i in range(5)]
    results = {}
    for batch_size in (1, 2, 8):
        reward = pickscore(clip_dir, "--pickscore-batch-size", str(batch_size))
        assert reward.batch_size == batch_size
        calls = []
        forward = reward.model.get_image_features
        reward.model.get_image_features = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
        results[batch_size] = reward(images, prompts)
        assert calls == {1: [1] * 5, 2: [2, 2, 1], 8: [5]}[batch_size]
    assert results[1] == pytest.approx(results[8], rel=1e-5)
    assert results[2] == pytest.approx(results[8], rel=1e-5)


@pytest.mark.parametrize(
    "count, wanted, expected",
    [
        (5, 2, [0, 4]),
        (8, 3, [0, 3, 7]),
        (4, 3, [0, 1, 3]),
        (6, 4, [0, 1, 3, 5]),
        (81, 5, [0, 20, 40, 60, 80]),
        (6, 1, [0]),
        (3, 5, [0, 1, 2]),
        (3, 3, [0, 1, 2]),
        (4, None, [0, 1, 2, 3]),
    ],
)
def test_frame_indices_are_linspace_rounded_down(count, wanted, expected):
    assert frame_indices(count, wanted) == expected
    if wanted and 1 < wanted < count:
        import numpy as np

        assert expected == np.floor(np.linspace(0, count - 1, wanted)).astype(int).tolist()


@pytest.mark.exercises("--pickscore-num-frames")
def test_video_scores_the_mean_over_evenly_spread_frames(clip_dir):
    frames = [random_image(20 + i) for i in range(5)]
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame = direct_scores(clip_dir, [as_pil(f) for f in frames], [PROMPTS[2]] * 5)
    every = pickscore(clip_dir)([video], [PROMPTS[2]])
    assert every == [pytest.approx(sum(per_frame) / 5, rel=1e-5)]
    two = pickscore(clip_dir, "--pickscore-num-frames", "2")([video, frames[1]], [PROMPTS[2]] * 2)
    assert two[0] == pytest.approx((per_frame[0] + per_frame[4]) / 2, rel=1e-5)
    assert two[1] == pytest.approx(per_frame[1], rel=1e-5)  # an image is one frame
    three = pickscore(clip_dir, "--pickscore-num-frames", "3")([video], [PROMPTS[2]])
    assert three == [pytest.approx((per_frame[0] + per_frame[2] + per_frame[4]) / 3, rel=1e-5)]
    assert three[0] != pytest.approx(every[0], rel=1e-4)  # control: the frame choice matters


def test_concurrent_calls_from_threads_agree_with_one_call(clip_dir):
    # The core scores microgroups from worker threads (asyncio.to_thread) at the same time.
    from concurrent.futures import ThreadPoolExecutor

    reward = pickscore(clip_dir, "--pickscore-batch-size", "1")
    images = [random_image(40 + i) for i in range(6)]
    prompts = [PROMPTS[i % 3] for i in range(6)]
    whole = reward(images, prompts)
    with ThreadPoolExecutor(3) as pool:
        parts = list(pool.map(lambda i: reward(images[i : i + 2], prompts[i : i + 2]), range(0, 6, 2)))
    assert [s for part in parts for s in part] == pytest.approx(whole, rel=1e-6)


def test_prompts_are_required(clip_dir):
    with pytest.raises(ValueError, match="prompt"):
        pickscore(clip_dir)([random_image(0)], None)
    with pytest.raises(ValueError, match="1 outputs but 2 prompts"):
        pickscore(clip_dir)([random_image(0)], PROMPTS[:2])


@pytest.mark.exercises("--pickscore-model-path", "--pickscore-processor-path")
def test_missing_and_invalid_paths_are_one_line_config_errors(clip_dir, tmp_path):
    assert config_errors("--rm-type", "pickscore") == [
        "--pickscore-model-path is required with the pickscore reward (--rm-type pickscore)",
        "--pickscore-processor-path is required with the pickscore reward (--rm-type pickscore)",
    ]
    missing = tmp_path / "nowhere" / "clip"
    assert config_errors("--rm-type", "pickscore", "--pickscore-model-path", str(missing), "--pickscore-processor-path", str(clip_dir)) == [
        f"--pickscore-model-path {missing}: no such directory (nor a hub id like org/name)"
    ]
    a_file = clip_dir / "config.json"
    assert config_errors("--rm-type", "pickscore", "--pickscore-model-path", str(clip_dir), "--pickscore-processor-path", str(a_file)) == [
        f"--pickscore-processor-path {a_file}: not a directory (a saved model directory or a hub id is expected)"
    ]
    # Hub ids pass the config-time check (they are resolved when the reward loads).
    assert (
        config_errors(
            "--rm-type",
            "pickscore",
            "--pickscore-model-path",
            "yuvalkirstain/PickScore_v1",
            "--pickscore-processor-path",
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        )
        == []
    )
    # Not using the reward: the paths are not required.
    assert config_errors("--rm-type", "brightness") == []
    # Used in a mixture or for evaluation only: required, and the message says where.
    assert config_errors("--reward-weights", '{"pickscore": 0.5, "brightness": 0.5}')[0] == (
        "--pickscore-model-path is required with the pickscore reward (--reward-weights)"
    )
    assert config_errors("--rm-type", "brightness", "--eval-rm-type", "pickscore")[0] == (
        "--pickscore-model-path is required with the pickscore reward (--eval-rm-type pickscore)"
    )


def test_a_directory_without_a_model_is_a_one_line_load_error(clip_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RewardError) as caught:
        build_reward("pickscore", "--pickscore-model-path", str(empty), "--pickscore-processor-path", str(clip_dir))
    message = str(caught.value)
    assert message.startswith(f"--pickscore-model-path {empty}: cannot load a CLIP model (") and "\n" not in message
    with pytest.raises(RewardError) as caught:
        build_reward("pickscore", "--pickscore-model-path", str(clip_dir), "--pickscore-processor-path", str(empty))
    message = str(caught.value)
    assert message.startswith(f"--pickscore-processor-path {empty}: ") and "\n" not in message


def test_registered_and_the_entry_point_stays_light():
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.reward
    assert registry.get("pickscore").spec.ref == "miles_rewards.pickscore:PickScore"
    assert registry.get("aesthetic").spec.ref == "miles_rewards.aesthetic:Aesthetic"
    code = "import sys, miles_rewards.plugin; print(sorted(m for m in ('torch', 'transformers', 'PIL', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
