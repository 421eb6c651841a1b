"""The clipscore reward: the full path (registered reward, resolved configuration, real
transformers loading) on a tiny random CLIP model saved locally, checked against the
paper's formula 2.5 * max(cos, 0) computed in float64 from transformers' CLIPModel with
the reference's preprocessing written out independently; and the per-frame aggregation
of the CLIP frame rewards on a video whose frames score differently."""

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.errors import RewardError

from ._clip_tiny import (
    IMAGE_SIZE,
    as_pil,
    build_reward,
    config_errors,
    load_direct,
    random_image,
    reference_clip_pixels,
    save_clip_processor,
    save_tiny_clip,
)

PROMPTS = [
    "A red apple sits on a wooden table.",
    "Snow covered mountains above a calm lake.",
    "A robot made of shiny silver metal walks through a quiet forest.",
    "two cats",
]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clipscore"), seed=3)


def clipscore(clip_dir, *args):
    return build_reward("clipscore", "--clipscore-model-path", str(clip_dir), *args)


def direct_scores(clip_dir, images, prompts, *, prefix="A photo depicts ", processor_dir=None):
    """Hessel et al. eq. 1 in float64 on transformers' CLIPModel: the reference's pixels
    (written out in _clip_tiny), the prefixed prompt, both embeddings L2-normalised."""
    model, processor = load_direct(clip_dir)
    if processor_dir is not None:
        processor = _processor(processor_dir)
    settings = processor.image_processor
    pixels = torch.stack(
        [
            reference_clip_pixels(
                image, settings.size["shortest_edge"], settings.crop_size["height"], settings.image_mean, settings.image_std
            )
            for image in images
        ]
    )
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels.float())
        text = model.get_text_features(
            **processor(text=[prefix + p for p in prompts], padding=True, truncation=True, max_length=77, return_tensors="pt")
        )
    image = (image if isinstance(image, torch.Tensor) else image.pooler_output).double()
    text = (text if isinstance(text, torch.Tensor) else text.pooler_output).double()
    cos = (image * text).sum(-1) / (image.norm(dim=-1) * text.norm(dim=-1))
    return (2.5 * cos.clamp(min=0.0)).tolist(), cos.tolist()


def _processor(directory):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory, backend="pil")


@pytest.mark.exercises("--clipscore-model-path")
def test_full_path_matches_the_papers_formula(clip_dir):
    reward = clipscore(clip_dir)
    images = [random_image(seed, height=40, width=44 + 2 * seed) for seed in range(4)]
    scores = reward(images, PROMPTS, [{}] * 4)
    expected, cos = direct_scores(clip_dir, [as_pil(image) for image in images], PROMPTS)
    assert scores == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert all(isinstance(s, float) for s in scores)
    # The clamp is per score: these seeds give negative and positive cosines.
    assert min(cos) < 0 < max(cos) and min(scores) == 0.0
    assert [s for s, c in zip(scores, cos) if c > 0] == pytest.approx([2.5 * c for c in cos if c > 0], rel=1e-5)
    # Controls: the prefix is part of the text (without it the numbers differ), and
    # another image changes the score.
    unprefixed, _ = direct_scores(clip_dir, [as_pil(image) for image in images], PROMPTS, prefix="")
    assert all(a != pytest.approx(b, rel=1e-3) for a, b, c in zip(unprefixed, scores, cos) if c > 0.01)
    positive = int(np.argmax(cos))
    changed = [random_image(10) if i == positive else image for i, image in enumerate(images)]
    other = reward(changed, PROMPTS)
    assert other[positive] != pytest.approx(scores[positive], rel=1e-4, abs=1e-4)
    assert [o for i, o in enumerate(other) if i != positive] == pytest.approx([s for i, s in enumerate(scores) if i != positive], rel=1e-5)


def test_preprocessing_is_the_references_resize_and_centre_crop(clip_dir):
    """torchvision rounds the crop offset, transformers floors it: on a 40x44 image (short
    side 40 -> 32, long side int(32 * 44 / 40) = 35, 35 - 32 = 3) the reference crops rows
    2..33 and transformers' processor rows 1..32."""
    reward = clipscore(clip_dir)
    rows = np.arange(44, dtype=np.float64)[:, None, None]
    cols = np.arange(40, dtype=np.float64)[None, :, None]
    fixed = ((rows * 5 + cols * 3 + np.array([0.0, 80.0, 160.0])) % 256).astype(np.uint8)  # [H=44, W=40, 3]
    image = Image.fromarray(fixed)
    resized = reward.transform.resize(image)
    assert resized.size == (32, 35)
    assert np.array_equal(np.asarray(resized), np.asarray(image.resize((32, 35), Image.BICUBIC)))
    assert np.array_equal(np.asarray(reward.transform.crop(resized)), np.asarray(resized)[2:34, :])
    _, processor = load_direct(clip_dir)
    settings = processor.image_processor
    expected = reference_clip_pixels(image, IMAGE_SIZE, IMAGE_SIZE, settings.image_mean, settings.image_std)
    ours = reward.transform([image])[0]
    assert ours.dtype == torch.float32 and ours.shape == (3, 32, 32)
    assert torch.allclose(ours.double(), expected, rtol=0, atol=1e-5)
    # Control: transformers' processor is one row off on this image, and agrees on a
    # square one (no crop offset to round).
    hf = processor(images=[image], return_tensors="pt")["pixel_values"][0].double()
    assert not torch.allclose(hf, expected, atol=1e-2)
    shifted = (np.asarray(resized, dtype=np.float64)[1:33] / 255.0 - np.asarray(settings.image_mean)) / np.asarray(settings.image_std)
    assert torch.allclose(hf, torch.from_numpy(shifted.transpose(2, 0, 1).copy()), atol=1e-5)
    square = Image.fromarray(fixed[:40])
    assert torch.allclose(
        reward.transform([square])[0].double(), processor(images=[square], return_tensors="pt")["pixel_values"][0].double(), atol=1e-5
    )
    # An image already at the model's size is not resized; a 1-channel one becomes RGB.
    gray = Image.fromarray(fixed[:32, :32, 0])
    assert torch.allclose(
        reward.transform([gray])[0].double(), reference_clip_pixels(gray, 32, 32, settings.image_mean, settings.image_std), atol=1e-5
    )


def test_floats_are_converted_to_uint8_as_the_reference_does(clip_dir):
    reward = clipscore(clip_dir)
    image = random_image(4)
    quantised = (image * 255).round() / 255
    as_uint8 = (image * 255).round().to(torch.uint8)
    out_of_range = image * 1.0
    out_of_range[:, 0, 0] = torch.tensor([1.7, -0.3, 1.0])
    a, b, c, d, e = reward([image, quantised, as_uint8, out_of_range, out_of_range.clamp(0, 1)], [PROMPTS[0]] * 5)
    assert b == pytest.approx(a, rel=1e-6) and c == pytest.approx(a, rel=1e-6) and d == pytest.approx(e, rel=1e-6)


@pytest.mark.exercises("--clipscore-processor-path")
def test_the_processor_path_sets_tokenizer_and_pixel_settings(clip_dir, tmp_path):
    images = [random_image(seed, height=36, width=36) for seed in range(2)]
    prompts = PROMPTS[:2]
    default = clipscore(clip_dir)(images, prompts)
    same = save_clip_processor(tmp_path / "same")
    assert clipscore(clip_dir, "--clipscore-processor-path", str(same))(images, prompts) == pytest.approx(default, rel=1e-6)
    other = save_clip_processor(tmp_path / "other", image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    scores = clipscore(clip_dir, "--clipscore-processor-path", str(other))(images, prompts)
    expected, _ = direct_scores(clip_dir, [as_pil(image) for image in images], prompts, processor_dir=other)
    assert scores == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert scores != pytest.approx(default, rel=1e-4)  # control: the settings are read from it


@pytest.mark.exercises("--clipscore-batch-size", "--clipscore-num-frames")
def test_batch_size_and_video_frames(clip_dir):
    frames = [random_image(20 + i) for i in range(5)]
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame, _ = direct_scores(clip_dir, [as_pil(f) for f in frames], [PROMPTS[2]] * 5)
    reward = clipscore(clip_dir, "--clipscore-batch-size", "2")
    calls = []
    forward = reward.model.get_image_features
    reward.model.get_image_features = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
    assert reward([video], [PROMPTS[2]]) == [pytest.approx(sum(per_frame) / 5, rel=1e-5, abs=1e-6)]
    assert calls == [2, 2, 1]
    three = clipscore(clip_dir, "--clipscore-num-frames", "3")([video, frames[1]], [PROMPTS[2]] * 2)
    assert three == [
        pytest.approx((per_frame[0] + per_frame[2] + per_frame[4]) / 3, rel=1e-5, abs=1e-6),
        pytest.approx(per_frame[1], rel=1e-5, abs=1e-6),  # an image is one frame
    ]


def distinct_video(clip_dir, prompt):
    """A video whose five frames have clearly different positive CLIPScores (picked from
    random frames), and those scores."""
    candidates = [random_image(100 + i) for i in range(12)]
    scores, _ = direct_scores(clip_dir, [as_pil(f) for f in candidates], [prompt] * 12)
    order = np.argsort(scores)[::-1][:5]  # the five best, best first
    frames = [candidates[i] for i in (order[1], order[0], order[4], order[2], order[3])]
    per_frame = [scores[i] for i in (order[1], order[0], order[4], order[2], order[3])]
    assert min(per_frame) > 0 and len({round(s, 6) for s in per_frame}) == 5
    return torch.stack(frames, dim=1), per_frame


@pytest.mark.exercises("--reward-frame-aggregation")
def test_frame_aggregation_rules(clip_dir):
    prompt = PROMPTS[3]
    video, per_frame = distinct_video(clip_dir, prompt)
    expected = {
        "mean": sum(per_frame) / 5,
        "min": min(per_frame),
        "first": per_frame[0],
        "last": per_frame[-1],
    }
    results = {rule: clipscore(clip_dir, "--reward-frame-aggregation", rule)([video], [prompt])[0] for rule in expected}
    assert results == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert len({round(v, 5) for v in results.values()}) == 4  # control: the rules disagree on this video
    # first/last are the video's own first and last frames, whatever --clipscore-num-frames picks
    # (the evenly spread frames include both); min is over the picked frames only.
    picked = {"first": per_frame[0], "last": per_frame[4], "min": min(per_frame[0], per_frame[2], per_frame[4])}
    for rule, value in picked.items():
        reward = clipscore(clip_dir, "--reward-frame-aggregation", rule, "--clipscore-num-frames", "3")
        assert reward([video], [prompt]) == [pytest.approx(value, rel=1e-5, abs=1e-6)]
    # One picked frame (frame 0): last is still the video's last frame.
    reward = clipscore(clip_dir, "--reward-frame-aggregation", "last", "--clipscore-num-frames", "1")
    assert reward([video], [prompt]) == [pytest.approx(per_frame[4], rel=1e-5, abs=1e-6)]
    # An image is one frame under every rule.
    image = video[:, 1]
    for rule in expected:
        assert clipscore(clip_dir, "--reward-frame-aggregation", rule)([image], [prompt]) == [pytest.approx(per_frame[1], rel=1e-5)]


def test_pickscore_reads_the_frame_aggregation(clip_dir):
    """The rule lives in the CLIP frame rewards' shared base: pickscore honours it too."""
    from ._clip_tiny import image_embeddings, text_embeddings

    video, _ = distinct_video(clip_dir, PROMPTS[3])
    model, processor = load_direct(clip_dir)
    frames = [as_pil(video[:, i]) for i in range(5)]
    per_frame = (
        model.logit_scale.exp()
        * (image_embeddings(model, processor, frames) * text_embeddings(model, processor, [PROMPTS[3]])).sum(-1)
        / 26
    ).tolist()
    paths = ("--pickscore-model-path", str(clip_dir), "--pickscore-processor-path", str(clip_dir))
    for rule, value in {"min": min(per_frame), "last": per_frame[-1], "mean": sum(per_frame) / 5}.items():
        reward = build_reward("pickscore", *paths, "--reward-frame-aggregation", rule)
        assert reward.aggregation == rule
        assert reward([video], [PROMPTS[3]]) == [pytest.approx(value, rel=1e-5)]


def test_prompts_are_required(clip_dir):
    with pytest.raises(ValueError, match="clipscore scores an output against its prompt"):
        clipscore(clip_dir)([random_image(0)], None)


@pytest.mark.exercises("--clipscore-model-path", "--clipscore-processor-path")
def test_missing_and_invalid_paths_are_one_line_errors(clip_dir, tmp_path):
    assert config_errors("--rm-type", "clipscore") == ["--clipscore-model-path is required with the clipscore reward (--rm-type clipscore)"]
    missing = tmp_path / "nowhere" / "clip"
    assert config_errors("--rm-type", "clipscore", "--clipscore-model-path", str(missing)) == [
        f"--clipscore-model-path {missing}: no such directory (nor a hub id like org/name)"
    ]
    a_file = clip_dir / "config.json"
    assert config_errors("--rm-type", "clipscore", "--clipscore-model-path", str(clip_dir), "--clipscore-processor-path", str(a_file)) == [
        f"--clipscore-processor-path {a_file}: not a directory (a saved model directory or a hub id is expected)"
    ]
    assert config_errors("--rm-type", "clipscore", "--clipscore-model-path", "openai/clip-vit-base-patch32") == []
    assert config_errors("--reward-weights", '{"clipscore": 1, "brightness": 1}')[0] == (
        "--clipscore-model-path is required with the clipscore reward (--reward-weights)"
    )
    # At load time: an empty directory (or an unreachable hub id) names the flag and the path.
    empty = tmp_path / "empty"
    empty.mkdir()
    for flag in ("--clipscore-model-path", "--clipscore-processor-path"):
        args = ("--clipscore-model-path", str(empty if flag == "--clipscore-model-path" else clip_dir), flag, str(empty))
        with pytest.raises(RewardError) as caught:
            build_reward("clipscore", *args)
        assert str(caught.value).startswith(f"{flag} {empty}: cannot load a CLIP ") and "\n" not in str(caught.value)


def test_weights_of_another_architecture_or_incomplete_are_refused(clip_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)).save_pretrained(
        bert
    )
    with pytest.raises(RewardError) as caught:
        build_reward("clipscore", "--clipscore-model-path", str(bert), "--clipscore-processor-path", str(clip_dir))
    assert str(caught.value) == (
        f"--clipscore-model-path {bert}: not a CLIP model (its config.json has model_type 'bert'; "
        "the clipscore reward needs a transformers CLIPModel, model_type 'clip')"
    )
    # A CLIP config whose weights lack the vision tower: transformers alone would leave it random.
    partial = save_tiny_clip(tmp_path / "partial", seed=3)
    state = load_file(str(partial / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if not k.startswith("vision_model.")}, str(partial / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(RewardError) as caught:
        build_reward("clipscore", "--clipscore-model-path", str(partial))
    message = str(caught.value)
    assert message.startswith(f"--clipscore-model-path {partial}: not a complete CLIP checkpoint (") and "vision_model." in message
    assert "\n" not in message


def test_registered_and_the_entry_point_stays_light():
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.reward
    spec = registry.get("clipscore").spec
    assert (spec.ref, spec.modality, spec.uses_gpu) == ("miles_rewards.clipscore:ClipScore", ("image", "video"), True)
