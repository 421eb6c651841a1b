"""The hpsv2 reward: a tiny random checkpoint in open_clip's ViT-H/14 key layout, loaded
through the registered reward and the resolved configuration, scored against an
independent float64 computation of the open_clip forward and of HPSv2's preprocessing
(tests/_hps_tiny.py); bad checkpoints are one-line errors naming the flag."""

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.errors import RewardError
from miles_rewards.hpsv2 import OPENAI_MEAN, OPENAI_STD, HPSv2, preprocess, tokenize

from ._clip_tiny import build_reward, config_errors, config_for
from ._hps_tiny import open_clip_ids, reference_preprocess, reference_scores, save_checkpoint, tiny_state

PROMPTS = [
    "A red apple sits on a wooden table.",
    "Snow covered mountains above a calm lake.",
    "a robot made of shiny silver metal walks through a quiet forest " * 12,  # > 77 tokens: truncated
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles_core.tiny.tokenizers import clip_tokenizer

    root = tmp_path_factory.mktemp("hpsv2")
    tokenizer = clip_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    state = tiny_state(len(tokenizer))
    save_checkpoint(root / "HPS_v2.1_compressed.pt", state)
    return {"root": root, "tokenizer": tokenizer, "state": state, "checkpoint": root / "HPS_v2.1_compressed.pt"}


def hpsv2(tiny, *args, checkpoint=None):
    return build_reward(
        "hpsv2",
        "--hpsv2-checkpoint-path",
        str(checkpoint or tiny["checkpoint"]),
        "--hpsv2-tokenizer-path",
        str(tiny["root"] / "tokenizer"),
        *args,
    )


def uint8_image(seed: int, height: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def expected(tiny, images: list[torch.Tensor], prompts: list[str], **controls) -> list[float]:
    pixels = torch.from_numpy(np.stack([reference_preprocess(image.permute(1, 2, 0).numpy()) for image in images]))
    return reference_scores(tiny["state"], pixels, open_clip_ids(tiny["tokenizer"], prompts), **controls).tolist()


@pytest.mark.exercises("--hpsv2-checkpoint-path", "--hpsv2-tokenizer-path")
def test_score_is_the_cosine_of_the_open_clip_forward(tiny):
    reward = hpsv2(tiny)
    # Non-square images, shrunk and enlarged, and a square one.
    images = [uint8_image(0, 301, 448), uint8_image(1, 40, 48), uint8_image(2, 230, 230)]
    scores = reward(images, PROMPTS, [{}] * 3)
    want = expected(tiny, images, PROMPTS)
    assert scores == pytest.approx(want, abs=2e-5)
    assert all(isinstance(s, float) for s in scores)
    # Controls: the attention heads (not in any tensor's shape) and the exact GELU
    # matter; so do the prompt and the image.
    for control in ({"vision_heads": 1}, {"text_heads": 1}, {"quick_gelu": True}):
        assert max(abs(a - b) for a, b in zip(scores, expected(tiny, images, PROMPTS, **control))) > 1e-3
    swapped = reward(images, PROMPTS[::-1])
    assert swapped[0] != pytest.approx(scores[0], abs=1e-3) and swapped[1] == pytest.approx(scores[1], abs=1e-6)
    assert reward([uint8_image(9, 301, 448)], PROMPTS[:1])[0] != pytest.approx(scores[0], abs=1e-3)


def test_float16_checkpoint_loads_into_float32(tiny, tmp_path):
    half = save_checkpoint(tmp_path / "half.pt", tiny["state"], half=True)
    reward = hpsv2(tiny, checkpoint=half)
    assert reward.model.dtype == torch.float32
    image = uint8_image(3, 64, 80)
    state = {key: value.half().double() for key, value in tiny["state"].items()}
    pixels = torch.from_numpy(reference_preprocess(image.permute(1, 2, 0).numpy()))[None]
    want = reference_scores(state, pixels, open_clip_ids(tiny["tokenizer"], PROMPTS[:1]))
    assert reward([image], PROMPTS[:1]) == pytest.approx(want.tolist(), abs=2e-5)


@pytest.mark.parametrize(
    "height, width, resized",
    [
        (512, 768, (149, 224)),  # pad 75: 37 above, 38 below
        (768, 512, (224, 149)),  # the same on the left and right
        (301, 448, (150, 224)),  # 150.5: Python's round gives 150 (floor(x + 0.5) would give 151)
        (40, 48, (187, 224)),  # enlarged: 186.67 -> 187, pad 37: 18 and 19
        (230, 230, (224, 224)),  # square: no pad
    ],
)
def test_preprocessing_resizes_the_longer_side_pads_and_normalises(height, width, resized):
    image = uint8_image(height * 1000 + width, height, width).permute(1, 2, 0).numpy()
    got = preprocess(Image.fromarray(image), 224)
    assert got.shape == (3, 224, 224) and got.dtype == torch.float32
    want = reference_preprocess(image)
    # float32 against float64: PyTorch's kernel also places its taps in float32, which
    # moves a value by up to ~3e-5 after normalising (one grey level is ~1.5e-2).
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=0)
    # The padding is black before normalisation, exactly where the reference puts it.
    pad = ((0 - np.array(OPENAI_MEAN)) / np.array(OPENAI_STD))[:, None]
    top, left = (224 - resized[0]) // 2, (224 - resized[1]) // 2
    content = np.zeros((224, 224), dtype=bool)
    content[top : top + resized[0], left : left + resized[1]] = True
    np.testing.assert_allclose(got.numpy()[:, ~content], np.broadcast_to(pad, (3, int((~content).sum()))), atol=1e-6)
    assert not np.isclose(got.numpy()[:, content], pad[:, :1]).all(axis=0).any()


def test_preprocessing_is_not_clamped_and_grey_frames_become_rgb():
    # A hard edge overshoots under bicubic: the reference does not clamp float tensors.
    edge = np.zeros((100, 300, 3), dtype=np.uint8)
    edge[:, 150:] = 255
    got = preprocess(Image.fromarray(edge), 224).numpy()
    np.testing.assert_allclose(got, reference_preprocess(edge), atol=1e-4)
    assert got[0].max() > (1 - OPENAI_MEAN[0]) / OPENAI_STD[0] + 1e-3
    grey = np.full((50, 40), 77, dtype=np.uint8)
    np.testing.assert_array_equal(
        preprocess(Image.fromarray(grey), 224).numpy(), preprocess(Image.fromarray(np.stack([grey] * 3, -1)), 224).numpy()
    )


def test_tokens_follow_open_clips_layout(tiny):
    ids = tokenize(tiny["tokenizer"], PROMPTS, 77)
    assert torch.equal(ids, open_clip_ids(tiny["tokenizer"], PROMPTS))
    eos = tiny["tokenizer"].eos_token_id
    assert ids[2, -1] == eos and (ids[2] != 0).all()  # truncated, end token kept
    assert (ids[0] == eos).sum() == 1 and ids[0, -1] == 0  # zero padding, not end-of-text padding


@pytest.mark.exercises("--hpsv2-batch-size", "--hpsv2-num-frames")
def test_batches_and_video_frames(tiny):
    frames = [uint8_image(20 + i, 48, 64) for i in range(3)]
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame = expected(tiny, frames, [PROMPTS[1]] * 3)
    reward = hpsv2(tiny, "--hpsv2-batch-size", "2")
    calls = []
    forward = reward.model.get_image_features
    reward.model.get_image_features = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
    scores = reward([video, frames[0]], [PROMPTS[1], PROMPTS[0]])
    assert calls == [2, 2]  # 4 frames, 2 per forward
    assert scores[0] == pytest.approx(sum(per_frame) / 3, abs=2e-5)
    assert scores[1] == pytest.approx(expected(tiny, frames[:1], PROMPTS[:1])[0], abs=2e-5)
    two = hpsv2(tiny, "--hpsv2-num-frames", "2")([video], [PROMPTS[1]])
    assert two == [pytest.approx((per_frame[0] + per_frame[2]) / 2, abs=2e-5)]


class Settings(dict):
    """The resolved configuration's reading interface (attributes, ``get``) over plain
    values: builds the reward with paths the configuration check would refuse, as a
    per-sample ``metadata.rm_type`` reaches it."""

    def __getattr__(self, name):
        return self[name]


def _one_line_error(tiny, checkpoint=None, tokenizer=None) -> str:
    config = config_for(
        "--rm-type", "hpsv2", "--hpsv2-checkpoint-path", str(tiny["checkpoint"]), "--hpsv2-tokenizer-path", str(tiny["root"] / "tokenizer")
    )
    settings = Settings({dest: config.get(dest) for dest in config})
    settings.update(
        hpsv2_checkpoint_path=str(tiny["checkpoint"] if checkpoint is None else checkpoint),
        hpsv2_tokenizer_path=str(tokenizer or tiny["root"] / "tokenizer"),
    )
    with pytest.raises(RewardError) as info:
        HPSv2(settings)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.exercises("--hpsv2-checkpoint-path")
def test_bad_checkpoints_are_one_line_errors(tiny, tmp_path):
    state = tiny["state"]
    assert _one_line_error(tiny, checkpoint="") == "--hpsv2-checkpoint-path is required with the hpsv2 reward"
    missing = tmp_path / "nowhere.pt"
    assert _one_line_error(tiny, missing) == (
        f"--hpsv2-checkpoint-path {missing}: no such file (HPS_v2_compressed.pt or HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2)"
    )
    assert "not a file" in _one_line_error(tiny, tmp_path)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert _one_line_error(tiny, garbage).startswith(f"--hpsv2-checkpoint-path {garbage}: not a torch checkpoint (")
    a_list = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], a_list)
    assert _one_line_error(tiny, a_list) == (
        f"--hpsv2-checkpoint-path {a_list}: not a state dict (expected a dict of tensors, or one under 'state_dict'; got list)"
    )
    pickled = tmp_path / "pickled.pt"
    torch.save({"state_dict": state, "args": argparse.Namespace(lr=1.0)}, pickled)
    assert _one_line_error(tiny, pickled) == (
        f"--hpsv2-checkpoint-path {pickled}: holds a pickled argparse.Namespace; checkpoints are read with "
        "torch.load(weights_only=True), which loads tensors and plain containers only, never arbitrary objects"
    )

    other = tmp_path / "other.pt"
    torch.save({"state_dict": {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}}, other)
    assert _one_line_error(tiny, other) == (
        f"--hpsv2-checkpoint-path {other}: not an open_clip ViT-H/14 (HPSv2) state dict: missing positional_embedding, "
        "token_embedding.weight, transformer.resblocks.0.mlp.c_fc.weight and 5 more "
        "(it has 1 keys, e.g. 'model.diffusion_model.input_blocks.0.0.weight')"
    )
    no_ln = save_checkpoint(tmp_path / "no_ln.pt", {k: v for k, v in state.items() if not k.startswith("visual.ln_post")})
    assert _one_line_error(tiny, no_ln).endswith(
        "not an open_clip ViT-H/14 (HPSv2) state dict: missing visual.ln_post.bias, visual.ln_post.weight"
    )
    prefixed = save_checkpoint(tmp_path / "prefixed.pt", {**state, "module.logit_scale": state["logit_scale"]})
    assert _one_line_error(tiny, prefixed).endswith("state dict: unexpected module.logit_scale")
    wide = save_checkpoint(tmp_path / "wide.pt", {**state, "transformer.resblocks.1.mlp.c_fc.weight": torch.zeros(100, 128)})
    assert _one_line_error(tiny, wide).endswith(
        "state dict: transformer.resblocks.1.mlp.c_fc.weight has shape [100, 128], expected [512, 128]"
    )
    embed = save_checkpoint(tmp_path / "embed.pt", {**state, "text_projection": torch.zeros(128, 32)})
    assert _one_line_error(tiny, embed).endswith("state dict: text_projection has shape [128, 32], expected [128, 48]")
    heads = {k: v for k, v in state.items()}
    heads["visual.class_embedding"] = torch.zeros(100)
    assert _one_line_error(tiny, save_checkpoint(tmp_path / "heads.pt", heads)).endswith(
        "state dict: its image width 100 is not a multiple of ViT-H/14's head width 80"
    )


@pytest.mark.exercises("--hpsv2-tokenizer-path")
def test_bad_tokenizers_are_one_line_errors(tiny, tmp_path):
    from transformers import CLIPTokenizer

    bigger = dict(tiny["state"])
    bigger["token_embedding.weight"] = torch.zeros(len(tiny["tokenizer"]) + 1, 128)
    checkpoint = save_checkpoint(tmp_path / "bigger.pt", bigger)
    n = len(tiny["tokenizer"])
    assert _one_line_error(tiny, checkpoint) == (
        f"--hpsv2-tokenizer-path {tiny['root'] / 'tokenizer'}: not the checkpoint's tokenizer ({n} ids, end-of-text id "
        f"{n - 1}; the checkpoint has {n + 1} token embeddings and needs end-of-text {n}, as OpenAI CLIP's BPE, "
        "e.g. openai/clip-vit-large-patch14)"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_line_error(tiny, tokenizer=empty).startswith(f"--hpsv2-tokenizer-path {empty}: cannot load a tokenizer (")
    assert isinstance(tiny["tokenizer"], CLIPTokenizer)


@pytest.mark.exercises("--hpsv2-checkpoint-path", "--hpsv2-tokenizer-path")
def test_paths_are_checked_with_the_configuration(tiny, tmp_path):
    assert config_errors("--rm-type", "hpsv2") == [
        "--hpsv2-checkpoint-path is required with the hpsv2 reward (--rm-type hpsv2)",
        "--hpsv2-tokenizer-path is required with the hpsv2 reward (--rm-type hpsv2)",
    ]
    missing = tmp_path / "nowhere.pt"
    tokenizer = str(tiny["root"] / "tokenizer")
    assert config_errors("--rm-type", "hpsv2", "--hpsv2-checkpoint-path", str(missing), "--hpsv2-tokenizer-path", tokenizer) == [
        f"--hpsv2-checkpoint-path {missing}: no such file"
    ]
    assert (
        config_errors("--rm-type", "hpsv2", "--hpsv2-checkpoint-path", str(tiny["checkpoint"]), "--hpsv2-tokenizer-path", tokenizer) == []
    )
