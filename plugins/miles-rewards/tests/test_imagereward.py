"""The imagereward reward: a tiny random checkpoint in ``ImageReward.pt``'s key layout and a
tiny BERT tokenizer, loaded through the registered reward and the resolved configuration,
scored against an independent float64 computation of the reference's ViT, BERT with
cross-attention and MLP head (tests/_imagereward_tiny.py) on the reference's
preprocessing written out independently (tests/_clip_tiny.py); bad checkpoints and
tokenizers are one-line errors naming the flag."""

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.errors import RewardError
from miles_rewards.imagereward import OPENAI_MEAN, OPENAI_STD, PREPROCESS, ImageReward, tokenize

from ._clip_tiny import build_reward, config_errors, config_for, reference_clip_pixels
from ._hps_tiny import tiny_state as hps_state
from ._imagereward_tiny import reference_scores, save_checkpoint, save_tokenizer, tiny_state

PROMPTS = [
    "A red apple on the wooden table.",
    "Snow on the mountain",
    "a robot walks through a quiet forest " * 6,  # > 35 tokens: truncated
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("imagereward")
    save_tokenizer(root / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    # BLIP's init_tokenizer, written out: [DEC] as bos, then [ENC].
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    state = tiny_state(len(tokenizer))
    checkpoint = save_checkpoint(root / "ImageReward.pt", state)
    return {"root": root, "tokenizer": tokenizer, "state": state, "checkpoint": checkpoint}


def imagereward(tiny, *args, checkpoint=None):
    return build_reward(
        "imagereward",
        "--imagereward-checkpoint-path",
        str(checkpoint or tiny["checkpoint"]),
        "--imagereward-tokenizer-path",
        str(tiny["root"] / "tokenizer"),
        *args,
    )


def uint8_image(seed: int, height: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def reference_pixels(images: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(
        [reference_clip_pixels(Image.fromarray(image.permute(1, 2, 0).numpy()), 224, 224, OPENAI_MEAN, OPENAI_STD) for image in images]
    )


def reference_ids(tiny, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    # The reference's call (ImageReward.score), on the tokenizer with BLIP's tokens added.
    encoded = tiny["tokenizer"](prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def expected(tiny, images: list[torch.Tensor], prompts: list[str], state=None, ids=None, **controls) -> list[float]:
    reference_ids_, mask = reference_ids(tiny, prompts)
    ids = reference_ids_ if ids is None else ids
    return reference_scores(state or tiny["state"], reference_pixels(images), ids, mask, **controls).tolist()


def far(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.exercises("--imagereward-checkpoint-path", "--imagereward-tokenizer-path")
def test_score_is_the_reference_forward(tiny):
    reward = imagereward(tiny)
    assert reward.model.vision.config.num_attention_heads == 3 and reward.model.text.config.num_attention_heads == 2
    # Non-square images, shrunk and enlarged, and a square one.
    images = [uint8_image(0, 301, 448), uint8_image(1, 40, 48), uint8_image(2, 230, 230)]
    scores = reward(images, PROMPTS, [{}] * 3)
    want = expected(tiny, images, PROMPTS)
    assert scores == pytest.approx(want, abs=TOLERANCE)
    assert all(isinstance(s, float) for s in scores)
    # Controls, each far beyond the tolerance: one nudged weight of the image tower; the head
    # counts (not in any shape); [ENC] in place of [CLS] (BLIP's matching does that swap,
    # ImageReward does not); the prompt; the image.
    nudged = dict(tiny["state"])
    nudged["blip.visual_encoder.norm.weight"] = nudged["blip.visual_encoder.norm.weight"].clone()
    nudged["blip.visual_encoder.norm.weight"][0] += 0.5
    assert far(scores, expected(tiny, images, PROMPTS, state=nudged)) > 10 * TOLERANCE
    for control in ({"vision_heads": 1}, {"text_heads": 1}):
        assert far(scores, expected(tiny, images, PROMPTS, **control)) > 1e-3
    enc = reference_ids(tiny, PROMPTS)[0].clone()
    enc[:, 0] = tiny["tokenizer"].convert_tokens_to_ids("[ENC]")
    assert far(scores, expected(tiny, images, PROMPTS, ids=enc)) > 1e-2
    swapped = reward(images, PROMPTS[::-1])
    assert swapped[0] != pytest.approx(scores[0], abs=1e-3) and swapped[1] == pytest.approx(scores[1], abs=1e-6)
    assert reward([uint8_image(9, 301, 448)], PROMPTS[:1])[0] != pytest.approx(scores[0], abs=1e-3)


def test_float_outputs_become_uint8_and_grey_frames_rgb(tiny):
    reward = imagereward(tiny)
    image = uint8_image(4, 64, 80)
    # The engine's float output of that image: round(x * 255) recovers it exactly.
    assert reward([image.float() / 255], PROMPTS[:1]) == pytest.approx(reward([image], PROMPTS[:1]), abs=1e-6)
    grey = uint8_image(5, 50, 40)[:1]
    assert reward([grey], PROMPTS[:1]) == pytest.approx(reward([grey.expand(3, -1, -1)], PROMPTS[:1]), abs=1e-6)


@pytest.mark.parametrize(
    "height, width, resized, offset",
    [
        (301, 448, (224, 333), (0, 54)),  # (333 - 224) / 2 = 54.5: round half to even gives 54
        (448, 301, (333, 224), (54, 0)),
        (200, 250, (224, 280), (0, 28)),  # enlarged: int(224 * 250 / 200) = 280
        (224, 300, (224, 300), (0, 38)),  # short side already 224: not resized, only cropped
    ],
)
def test_preprocessing_resizes_the_short_side_crops_the_centre_and_normalises(height, width, resized, offset):
    array = uint8_image(height * 1000 + width, height, width).permute(1, 2, 0).numpy()
    got = PREPROCESS([Image.fromarray(array)])[0]
    assert got.shape == (3, 224, 224) and got.dtype == torch.float32
    # The direct computation: Pillow bicubic to the torchvision size, torchvision's crop
    # offset, /255, OpenAI mean and std (float64).
    big = np.asarray(Image.fromarray(array).resize(resized[::-1], Image.BICUBIC), dtype=np.float64) if resized != (height, width) else array
    top, left = offset
    want = (np.asarray(big, dtype=np.float64)[top : top + 224, left : left + 224] / 255.0 - OPENAI_MEAN) / OPENAI_STD
    np.testing.assert_allclose(got.numpy(), want.transpose(2, 0, 1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(
        got.numpy(), reference_clip_pixels(Image.fromarray(array), 224, 224, OPENAI_MEAN, OPENAI_STD).numpy(), atol=1e-6
    )
    # Control: the crop one pixel further along the long side is another image.
    shift = (top + (resized[0] > 224), left + (resized[1] > 224))
    moved = (np.asarray(big, dtype=np.float64)[shift[0] : shift[0] + 224, shift[1] : shift[1] + 224] / 255.0 - OPENAI_MEAN) / OPENAI_STD
    assert np.abs(got.numpy() - moved.transpose(2, 0, 1)).max() > 0.1


def test_tokens_follow_the_reference_layout(tiny):
    reward = imagereward(tiny)
    tokenizer = reward.tokenizer
    assert len(tokenizer) == len(tiny["tokenizer"]) == tiny["state"]["blip.text_encoder.embeddings.word_embeddings.weight"].shape[0]
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(tokenizer) - 2, len(tokenizer) - 1]
    ids, mask = tokenize(tokenizer, PROMPTS)
    want_ids, want_mask = reference_ids(tiny, PROMPTS)
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
    assert ids.shape == (3, 35) and (ids[:, 0] == tokenizer.cls_token_id).all()
    assert ids[2, -1] == tokenizer.sep_token_id and mask[2].all()  # truncated, [SEP] kept
    length = int(mask[1].sum())
    assert ids[1, length - 1] == tokenizer.sep_token_id and (ids[1, length:] == 0).all() and not mask[1, length:].any()
    # Lower-cased WordPiece: whole words, then letters with ## continuations.
    assert tokenizer.convert_ids_to_tokens(ids[1, 1:length].tolist()) == ["snow", "on", "the", "mountain", "[SEP]"]


@pytest.mark.exercises("--imagereward-batch-size", "--imagereward-num-frames", "--reward-frame-aggregation")
def test_batches_and_video_frames(tiny):
    frames = [uint8_image(20 + i, 48, 64) for i in range(3)]
    images = [uint8_image(30 + i, 40 + 7 * i, 50) for i in range(3)]
    one = imagereward(tiny, "--imagereward-batch-size", "1")
    three = imagereward(tiny, "--imagereward-batch-size", "3")
    calls = []
    forward = three.model.vision.forward
    three.model.vision.forward = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
    batched = three(images, PROMPTS)
    assert calls == [3]
    assert batched == pytest.approx(one(images, PROMPTS), abs=1e-6)

    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame = expected(tiny, frames, [PROMPTS[1]] * 3)
    assert max(per_frame) - min(per_frame) > 1e-3  # the frames score differently
    two = imagereward(tiny, "--imagereward-batch-size", "2")
    calls.clear()
    forward = two.model.vision.forward
    two.model.vision.forward = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
    scores = two([video, frames[0]], [PROMPTS[1], PROMPTS[0]])
    assert calls == [2, 2]  # 4 frames, 2 per forward
    assert scores[0] == pytest.approx(sum(per_frame) / 3, abs=TOLERANCE)
    assert scores[1] == pytest.approx(expected(tiny, frames[:1], PROMPTS[:1])[0], abs=TOLERANCE)
    picked = imagereward(tiny, "--imagereward-num-frames", "2")([video], [PROMPTS[1]])
    assert picked == [pytest.approx((per_frame[0] + per_frame[2]) / 2, abs=TOLERANCE)]
    worst = imagereward(tiny, "--reward-frame-aggregation", "min")([video], [PROMPTS[1]])
    assert worst == [pytest.approx(min(per_frame), abs=TOLERANCE)]


class Settings(dict):
    """The resolved configuration's reading interface (attributes, ``get``) over plain
    values: builds the reward with paths the configuration check would refuse, as a
    per-sample ``metadata.rm_type`` reaches it."""

    def __getattr__(self, name):
        return self[name]


def _one_line_error(tiny, checkpoint=None, tokenizer=None) -> str:
    config = config_for(
        "--rm-type",
        "imagereward",
        "--imagereward-checkpoint-path",
        str(tiny["checkpoint"]),
        "--imagereward-tokenizer-path",
        str(tiny["root"] / "tokenizer"),
    )
    settings = Settings({dest: config.get(dest) for dest in config})
    settings.update(
        imagereward_checkpoint_path=str(tiny["checkpoint"] if checkpoint is None else checkpoint),
        imagereward_tokenizer_path=str(tiny["root"] / "tokenizer" if tokenizer is None else tokenizer),
    )
    with pytest.raises(RewardError) as info:
        ImageReward(settings)
    message = str(info.value)
    assert "\n" not in message
    return message


ARCH = "not an ImageReward state dict (BLIP ViT, BERT with cross-attention, MLP head)"


@pytest.mark.exercises("--imagereward-checkpoint-path")
def test_bad_checkpoints_are_one_line_errors(tiny, tmp_path):
    state = tiny["state"]
    flag = "--imagereward-checkpoint-path"
    assert _one_line_error(tiny, checkpoint="") == f"{flag} is required with the imagereward reward"
    missing = tmp_path / "nowhere.pt"
    assert _one_line_error(tiny, missing) == f"{flag} {missing}: no such file (ImageReward.pt from the hub repo THUDM/ImageReward)"
    assert (
        _one_line_error(tiny, tmp_path)
        == f"{flag} {tmp_path}: not a file (the checkpoint file itself is expected: ImageReward.pt from the hub repo THUDM/ImageReward)"
    )
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert _one_line_error(tiny, garbage).startswith(f"{flag} {garbage}: not a torch checkpoint (")
    a_list = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], a_list)
    assert _one_line_error(tiny, a_list) == (
        f"{flag} {a_list}: not a state dict (expected a dict of tensors, or one under 'state_dict'; got list)"
    )
    pickled = tmp_path / "pickled.pt"
    torch.save({"state_dict": state, "args": argparse.Namespace(lr=1.0)}, pickled)
    assert _one_line_error(tiny, pickled) == (
        f"{flag} {pickled}: holds a pickled argparse.Namespace; checkpoints are read with "
        "torch.load(weights_only=True), which loads tensors and plain containers only, never arbitrary objects"
    )
    # A CLIP checkpoint (open_clip's layout, as HPSv2's).
    clip = save_checkpoint(tmp_path / "clip.pt", hps_state(64))
    assert _one_line_error(tiny, clip) == (
        f"{flag} {clip}: {ARCH}: missing blip.text_encoder.embeddings.position_embeddings.weight, "
        "blip.text_encoder.embeddings.word_embeddings.weight, blip.text_encoder.encoder.layer.0.intermediate.dense.weight "
        "and 9 more (it has 62 keys, e.g. 'visual.class_embedding')"
    )
    no_head = save_checkpoint(tmp_path / "no_head.pt", {k: v for k, v in state.items() if not k.startswith("mlp.layers.6")})
    assert _one_line_error(tiny, no_head).endswith(
        f"{ARCH}: missing mlp.layers.6.weight (it has 99 keys, e.g. 'blip.visual_encoder.cls_token')"
    )
    no_bias = save_checkpoint(tmp_path / "no_bias.pt", {k: v for k, v in state.items() if not k.endswith("layers.7.bias")})
    assert _one_line_error(tiny, no_bias).endswith(f"{ARCH}: missing mlp.layers.7.bias")
    no_cross = save_checkpoint(tmp_path / "no_cross.pt", {k: v for k, v in state.items() if ".1.crossattention.output" not in k})
    assert _one_line_error(tiny, no_cross).endswith(
        f"{ARCH}: missing blip.text_encoder.encoder.layer.1.crossattention.output.LayerNorm.bias, "
        "blip.text_encoder.encoder.layer.1.crossattention.output.LayerNorm.weight, "
        "blip.text_encoder.encoder.layer.1.crossattention.output.dense.bias and 1 more"
    )
    prefixed = save_checkpoint(tmp_path / "prefixed.pt", {**state, "module.mlp.layers.7.bias": state["mlp.layers.7.bias"]})
    assert _one_line_error(tiny, prefixed).endswith(f"{ARCH}: unexpected module.mlp.layers.7.bias")
    wide = save_checkpoint(
        tmp_path / "wide.pt", {**state, "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight": torch.zeros(128, 128)}
    )
    assert _one_line_error(tiny, wide).endswith(
        f"{ARCH}: blip.text_encoder.encoder.layer.1.crossattention.self.key.weight has shape [128, 128], expected [128, 192]"
    )
    grid = save_checkpoint(tmp_path / "grid.pt", {**state, "blip.visual_encoder.pos_embed": torch.zeros(1, 197, 192)})
    assert _one_line_error(tiny, grid).endswith(
        f"{ARCH}: blip.visual_encoder.pos_embed has 197 positions; patches of 32 on ImageReward's 224x224 input need (224/patch)^2 + 1"
    )
    odd = save_checkpoint(tmp_path / "odd.pt", {**state, "blip.visual_encoder.cls_token": torch.zeros(1, 1, 100)})
    assert _one_line_error(tiny, odd).endswith(f"{ARCH}: its image width 100 is not a multiple of the head width 64")
    two = save_checkpoint(tmp_path / "two.pt", {**state, "mlp.layers.7.weight": torch.zeros(2, 6), "mlp.layers.7.bias": torch.zeros(2)})
    assert _one_line_error(tiny, two).endswith(f"{ARCH}: mlp.layers.7.weight has 2 outputs, not 1")
    # The unused tensors may be absent: the score does not read them.
    lean = {k: v for k, v in state.items() if "_proj" not in k and "position_ids" not in k}
    assert len(lean) == len(state) - 5
    image = uint8_image(6, 40, 40)
    assert imagereward(tiny, checkpoint=save_checkpoint(tmp_path / "lean.pt", lean))([image], PROMPTS[:1]) == pytest.approx(
        expected(tiny, [image], PROMPTS[:1]), abs=TOLERANCE
    )


@pytest.mark.exercises("--imagereward-tokenizer-path")
def test_bad_tokenizers_are_one_line_errors(tiny, tmp_path):
    from miles_core.tiny.tokenizers import clip_tokenizer

    flag = "--imagereward-tokenizer-path"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_line_error(tiny, tokenizer=empty).startswith(f"{flag} {empty}: cannot load a tokenizer (")
    a_file = tmp_path / "vocab.txt"
    a_file.write_text("[PAD]\n")
    assert (
        _one_line_error(tiny, tokenizer=a_file) == f"{flag} {a_file}: not a directory (bert-base-uncased's tokenizer directory is expected)"
    )
    clip_tokenizer().save_pretrained(tmp_path / "clip")
    assert _one_line_error(tiny, tokenizer=tmp_path / "clip") == (
        f"{flag} {tmp_path / 'clip'}: not a BERT tokenizer (got CLIPTokenizer; bert-base-uncased's is expected)"
    )
    bigger = save_checkpoint(
        tmp_path / "bigger.pt",
        {**tiny["state"], "blip.text_encoder.embeddings.word_embeddings.weight": torch.zeros(len(tiny["tokenizer"]) + 1, 128)},
    )
    n = len(tiny["tokenizer"])
    assert _one_line_error(tiny, bigger) == (
        f"{flag} {tiny['root'] / 'tokenizer'}: not the checkpoint's tokenizer ({n} ids with [DEC] and [ENC] added; the "
        f"checkpoint has {n + 1} word embeddings, as bert-base-uncased plus those two)"
    )


@pytest.mark.exercises("--imagereward-checkpoint-path", "--imagereward-tokenizer-path")
def test_paths_are_checked_with_the_configuration(tiny, tmp_path):
    assert config_errors("--rm-type", "imagereward") == [
        "--imagereward-checkpoint-path is required with the imagereward reward (--rm-type imagereward)",
        "--imagereward-tokenizer-path is required with the imagereward reward (--rm-type imagereward)",
    ]
    missing = tmp_path / "nowhere.pt"
    tokenizer = str(tiny["root"] / "tokenizer")
    args = ("--rm-type", "imagereward", "--imagereward-tokenizer-path", tokenizer, "--imagereward-checkpoint-path")
    assert config_errors(*args, str(missing)) == [f"--imagereward-checkpoint-path {missing}: no such file"]
    assert config_errors(*args, str(tiny["checkpoint"])) == []
