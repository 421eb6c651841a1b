"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation", arXiv:2304.05977): a BLIP image-grounded text encoder with an
MLP head, trained on human rankings of generated images, run on transformers' BLIP classes.

Score, as ``ImageReward.score`` (THUDM/ImageReward@c1392c6 ``ImageReward/ImageReward.py``):

    e = BlipVision(image)                                   # [1 + grid^2, 1024], final norm applied
    h = BertWithCrossAttention(ids, mask, cross to e)[0]    # the [CLS] position, 768
    reward = (mlp(h) - 0.16717362830052426) / 1.0333394966054072

with ``mlp`` five linear layers 768-1024-128-64-16-1 and no activation between them (the
reference's ``nn.ReLU`` lines are commented out; its dropouts are off in eval). The two
constants are the reference's ``self.mean`` / ``self.std``, which standardise the head's
output over the training data: 0 is an average image, about +-1 one standard deviation.

Weights: ``--imagereward-checkpoint-path`` is ``ImageReward.pt`` from the hub repo
``THUDM/ImageReward``, the model's bare state dict (one under ``'state_dict'`` is taken
too), read with ``torch.load(weights_only=True)``. Its keys, from ``BLIP_Pretrain(
image_size=224, vit='large')`` (``models/BLIP/blip_pretrain.py``, ``blip.py``, ``vit.py``,
``med.py``):

- ``blip.visual_encoder.*``, a timm-style ViT: ``cls_token``, ``pos_embed``,
  ``patch_embed.proj``, ``blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``,
  ``norm``; pre-norm blocks, exact GELU, LayerNorm eps 1e-6, the final ``norm`` applied to
  every token. ViT-L/16: width 1024, 24 blocks, MLP 4096, 16 heads, 14 x 14 patches;
- ``blip.text_encoder.*``, BLIP's BERT (``med.py`` ``BertModel(add_pooling_layer=False)``):
  ``embeddings.{word_embeddings, position_embeddings, LayerNorm}`` (no token-type
  embeddings), ``encoder.layer.N.{attention, crossattention, intermediate, output}``; post-norm
  layers, exact GELU, LayerNorm eps 1e-12, a cross-attention to the image tokens in every
  layer. BERT-base: width 768, 12 layers, MLP 3072, 12 heads, 30524 ids (bert-base-uncased's
  30522 plus ``[DEC]`` and ``[ENC]``), 512 positions;
- ``mlp.layers.{0,2,4,6,7}``, the head's linear layers (1, 3, 5 are its dropouts);
- ``blip.vision_proj``, ``blip.text_proj`` (BLIP's contrastive projections) and
  ``blip.text_encoder.embeddings.position_ids`` (a buffer): in the file, unused by the score,
  and ignored here.

Any other key, a missing one, or a shape that does not fit is refused: the reference loads
with ``strict=False``, which would leave a missing tensor random. The architecture is read
from the tensors' shapes (widths, layers, MLP widths, patch size, grid, vocabulary,
positions, head widths), so smaller test checkpoints load too. The numbers of attention
heads, which no tensor shows, follow from a head width of 64, ViT-L/16's (1024 / 16) and
BERT-base's (768 / 12). The ViT keys map onto ``BlipVisionModel`` as transformers' BLIP
converter renames them (``convert_blip_original_pytorch_to_hf.py``: ``cls_token`` ->
``embeddings.class_embedding``, ``attn.proj`` -> ``self_attn.projection``, ``norm`` ->
``post_layernorm``, the fused ``qkv`` kept as it is, in the same (3, heads, head width)
order); the text keys are already ``BlipTextModel``'s names (its BERT is ``med.py``'s).
The weights are float32 on the device the run chooses, as the reference's ``load`` leaves
them (no autocast in ``score``).

Text: ``--imagereward-tokenizer-path`` is bert-base-uncased's WordPiece tokenizer (a
directory, or the hub id ``google-bert/bert-base-uncased`` where the hub is reachable); as
BLIP's ``init_tokenizer``, ``[DEC]`` (bos) and ``[ENC]`` are added, and a prompt is
``[CLS] tokens [SEP]``, truncated and ``[PAD]``-padded to 35 tokens with its attention mask.
The reference keeps ``[CLS]`` first (BLIP's image-text matching swaps it for ``[ENC]``;
ImageReward's ``score`` and its training do not). transformers 5's ``BertTokenizer`` is the
Rust WordPiece (the reference ran transformers 4's Python one): the same normaliser
(cleaning, accent stripping, lower-casing, CJK splitting) and the same ids for ordinary
prompts.

Images, as the reference's ``_transform(224)``: ``Resize(224, BICUBIC)`` (short side to 224,
the long side truncated, Pillow's bicubic), ``CenterCrop(224)`` (torchvision's rounding),
RGB, ``ToTensor``, normalised with the OpenAI CLIP mean and std: exactly
:class:`miles_rewards.clip_models.OpenAIClipTransform`, without torchvision. Outputs are
converted to ``uint8`` first (``round(x * 255)`` clamped); a video scores
``--imagereward-num-frames`` frames spread evenly, aggregated by
``--reward-frame-aggregation``; ``--imagereward-batch-size`` frames per forward (the
reference scores one image per forward; batching changes nothing but float rounding).
The text encoder's padding mask adds -10000 in the reference and the dtype's minimum in
transformers: either gives the padded tokens exactly zero weight in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from miles_core.api import RewardError
from miles_rewards.clip_models import DTYPE, ClipFrameReward, OpenAIClipTransform, reward_device
from miles_rewards.state_dicts import check_layout as check_layout_of
from miles_rewards.state_dicts import first_line, layer_count, listing, read_state_dict

CHECKPOINT_FLAG = "--imagereward-checkpoint-path"
TOKENIZER_FLAG = "--imagereward-tokenizer-path"

IMAGE_SIZE = 224
"""``BLIP_Pretrain(image_size=224)`` and ``_transform(224)``: the reference's fixed input size."""
MAX_TOKENS = 35
"""``tokenizer(prompt, padding='max_length', truncation=True, max_length=35)``."""
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
"""``ImageReward.mean`` / ``ImageReward.std``: the head's output is standardised by them."""
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
"""``_transform``'s ``Normalize`` (OpenAI CLIP's mean and std)."""
HEAD_WIDTH = 64
"""Per-head width of both towers: ViT-L/16 1024 / 16 heads, BERT-base 768 / 12 heads."""
VISION_LAYER_NORM_EPS = 1e-6  # vit.py: partial(nn.LayerNorm, eps=1e-6)
TEXT_LAYER_NORM_EPS = 1e-12  # med_config.json: layer_norm_eps
ADDED_TOKENS = ({"bos_token": "[DEC]"}, {"additional_special_tokens": ["[ENC]"]})
"""BLIP's ``init_tokenizer``: added to bert-base-uncased in this order (ids 30522, 30523)."""

_VISION = "blip.visual_encoder."
_TEXT = "blip.text_encoder."
_HEAD_LAYERS = (0, 2, 4, 6, 7)
"""Indices of the head's ``nn.Linear`` layers in ``mlp.layers`` (the others are dropouts)."""
_IGNORED = (
    "blip.vision_proj.weight",
    "blip.vision_proj.bias",
    "blip.text_proj.weight",
    "blip.text_proj.bias",
    "blip.text_encoder.embeddings.position_ids",
)
"""In ``ImageReward.pt`` (``BLIP_Pretrain`` has them) but not used by the score."""
_ARCH = "an ImageReward state dict (BLIP ViT, BERT with cross-attention, MLP head)"


@dataclass(frozen=True)
class ImageRewardDims:
    """The sizes of an ImageReward model, read from its state dict's shapes."""

    vision_width: int
    vision_layers: int
    vision_mlp: int
    patch_size: int
    grid: int
    text_width: int
    text_layers: int
    text_mlp: int
    vocab_size: int
    positions: int
    head_widths: tuple[int, ...]
    """Output widths of the head's linear layers, the last 1 (reference: 1024, 128, 64, 16, 1)."""


def _error(path: str, cause: str) -> RewardError:
    return RewardError(f"{CHECKPOINT_FLAG} {path}: {cause}")


def read_checkpoint(path: str | None) -> dict[str, torch.Tensor]:
    """The state dict in the file at ``path`` (bare, or under ``'state_dict'``), read with
    ``weights_only=True``; anything else is a one-line :class:`RewardError` naming the flag."""
    return read_state_dict(path, CHECKPOINT_FLAG, reward="imagereward", expected_file="ImageReward.pt from the hub repo THUDM/ImageReward")


# Tensors the architecture is read from: name -> (key, axis).
_SIZES = {
    "vision_width": (f"{_VISION}cls_token", -1),
    "patch_size": (f"{_VISION}patch_embed.proj.weight", -1),
    "vision_positions": (f"{_VISION}pos_embed", 1),
    "vision_mlp": (f"{_VISION}blocks.0.mlp.fc1.weight", 0),
    "vocab_size": (f"{_TEXT}embeddings.word_embeddings.weight", 0),
    "text_width": (f"{_TEXT}embeddings.word_embeddings.weight", -1),
    "positions": (f"{_TEXT}embeddings.position_embeddings.weight", 0),
    "text_mlp": (f"{_TEXT}encoder.layer.0.intermediate.dense.weight", 0),
    **{f"head_{i}": (f"mlp.layers.{layer}.weight", 0) for i, layer in enumerate(_HEAD_LAYERS)},
}


def checkpoint_dims(state: dict[str, torch.Tensor], path: str) -> ImageRewardDims:
    """The architecture of ``state``, from its shapes; one ImageReward cannot have is a
    one-line :class:`RewardError`."""
    missing = sorted({key for key, _ in _SIZES.values() if key not in state})
    if missing:
        example = next(iter(state))
        raise _error(path, f"not {_ARCH}: missing {listing(missing)} (it has {len(state)} keys, e.g. {example!r})")
    sizes: dict[str, int] = {}
    for name, (key, axis) in _SIZES.items():
        shape = tuple(state[key].shape)
        if len(shape) < 2:
            raise _error(path, f"not {_ARCH}: {key} has shape {list(shape)}")
        sizes[name] = shape[axis]
    grid = math.isqrt(sizes["vision_positions"] - 1) if sizes["vision_positions"] > 0 else 0
    if grid * grid + 1 != sizes["vision_positions"] or grid * sizes["patch_size"] != IMAGE_SIZE:
        raise _error(
            path,
            f"not {_ARCH}: {_VISION}pos_embed has {sizes['vision_positions']} positions; patches of "
            f"{sizes['patch_size']} on ImageReward's {IMAGE_SIZE}x{IMAGE_SIZE} input need (224/patch)^2 + 1",
        )
    for tower, width in (("image", sizes["vision_width"]), ("text", sizes["text_width"])):
        if width % HEAD_WIDTH:
            raise _error(path, f"not {_ARCH}: its {tower} width {width} is not a multiple of the head width {HEAD_WIDTH}")
    if sizes["positions"] < MAX_TOKENS:
        raise _error(path, f"not {_ARCH}: {sizes['positions']} text positions, fewer than the {MAX_TOKENS} tokens it reads")
    head_widths = tuple(sizes[f"head_{i}"] for i in range(len(_HEAD_LAYERS)))
    if head_widths[-1] != 1:
        raise _error(path, f"not {_ARCH}: mlp.layers.7.weight has {head_widths[-1]} outputs, not 1")
    return ImageRewardDims(
        vision_width=sizes["vision_width"],
        vision_layers=layer_count(state, f"{_VISION}blocks."),
        vision_mlp=sizes["vision_mlp"],
        patch_size=sizes["patch_size"],
        grid=grid,
        text_width=sizes["text_width"],
        text_layers=layer_count(state, f"{_TEXT}encoder.layer."),
        text_mlp=sizes["text_mlp"],
        vocab_size=sizes["vocab_size"],
        positions=sizes["positions"],
        head_widths=head_widths,
    )


def _linear(prefix: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (out, inp), f"{prefix}.bias": (out,)}


def _norm(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (width,), f"{prefix}.bias": (width,)}


def imagereward_shapes(dims: ImageRewardDims) -> dict[str, tuple[int, ...]]:
    """Every tensor the score reads, under its ``ImageReward.pt`` key, with its shape."""
    wv, wt, p = dims.vision_width, dims.text_width, dims.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{_VISION}cls_token": (1, 1, wv),
        f"{_VISION}pos_embed": (1, dims.grid * dims.grid + 1, wv),
        f"{_VISION}patch_embed.proj.weight": (wv, 3, p, p),
        f"{_VISION}patch_embed.proj.bias": (wv,),
        **_norm(f"{_VISION}norm", wv),
        f"{_TEXT}embeddings.word_embeddings.weight": (dims.vocab_size, wt),
        f"{_TEXT}embeddings.position_embeddings.weight": (dims.positions, wt),
        **_norm(f"{_TEXT}embeddings.LayerNorm", wt),
    }
    for i in range(dims.vision_layers):
        block = f"{_VISION}blocks.{i}."
        shapes.update(_norm(f"{block}norm1", wv))
        shapes.update(_linear(f"{block}attn.qkv", 3 * wv, wv))
        shapes.update(_linear(f"{block}attn.proj", wv, wv))
        shapes.update(_norm(f"{block}norm2", wv))
        shapes.update(_linear(f"{block}mlp.fc1", dims.vision_mlp, wv))
        shapes.update(_linear(f"{block}mlp.fc2", wv, dims.vision_mlp))
    for i in range(dims.text_layers):
        layer = f"{_TEXT}encoder.layer.{i}."
        for attention, source in (("attention", wt), ("crossattention", wv)):
            shapes.update(_linear(f"{layer}{attention}.self.query", wt, wt))
            shapes.update(_linear(f"{layer}{attention}.self.key", wt, source))
            shapes.update(_linear(f"{layer}{attention}.self.value", wt, source))
            shapes.update(_linear(f"{layer}{attention}.output.dense", wt, wt))
            shapes.update(_norm(f"{layer}{attention}.output.LayerNorm", wt))
        shapes.update(_linear(f"{layer}intermediate.dense", dims.text_mlp, wt))
        shapes.update(_linear(f"{layer}output.dense", wt, dims.text_mlp))
        shapes.update(_norm(f"{layer}output.LayerNorm", wt))
    width = wt
    for layer, out in zip(_HEAD_LAYERS, dims.head_widths):
        shapes.update(_linear(f"mlp.layers.{layer}", out, width))
        width = out
    return shapes


def check_layout(state: dict[str, torch.Tensor], dims: ImageRewardDims, path: str) -> None:
    """``state`` has every tensor of :func:`imagereward_shapes`, each of its shape, and no
    other key than the known unused ones."""
    check_layout_of(state, imagereward_shapes(dims), f"{CHECKPOINT_FLAG} {path}: not {_ARCH}", ignored=_IGNORED)


_VISION_NAMES = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def to_transformers(state: dict[str, torch.Tensor], dims: ImageRewardDims) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's tensors under the keys of :class:`ImageRewardModel`'s parts:
    ``vision`` (``BlipVisionModel``, renamed as transformers' BLIP converter does),
    ``text`` (``BlipTextModel``: the same names without the prefix) and ``head``
    (its linear layers in order)."""
    vision = {
        "embeddings.class_embedding": state[f"{_VISION}cls_token"],
        "embeddings.position_embedding": state[f"{_VISION}pos_embed"],
        "embeddings.patch_embedding.weight": state[f"{_VISION}patch_embed.proj.weight"],
        "embeddings.patch_embedding.bias": state[f"{_VISION}patch_embed.proj.bias"],
        "post_layernorm.weight": state[f"{_VISION}norm.weight"],
        "post_layernorm.bias": state[f"{_VISION}norm.bias"],
    }
    for i in range(dims.vision_layers):
        for old, new in _VISION_NAMES.items():
            for kind in ("weight", "bias"):
                vision[f"encoder.layers.{i}.{new}.{kind}"] = state[f"{_VISION}blocks.{i}.{old}.{kind}"]
    text = {key[len(_TEXT) :]: value for key, value in state.items() if key.startswith(_TEXT) and key not in _IGNORED}
    head = {}
    for index, layer in enumerate(_HEAD_LAYERS):
        for kind in ("weight", "bias"):
            head[f"{index}.{kind}"] = state[f"mlp.layers.{layer}.{kind}"]
    return {"vision": vision, "text": text, "head": head}


class ImageRewardModel(torch.nn.Module):
    """ImageReward's scoring path on transformers' BLIP classes: ``BlipVisionModel``,
    ``BlipTextModel`` with a cross-attention in every layer, the linear head."""

    def __init__(self, dims: ImageRewardDims) -> None:
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        vision_config = BlipVisionConfig(
            hidden_size=dims.vision_width,
            intermediate_size=dims.vision_mlp,
            num_hidden_layers=dims.vision_layers,
            num_attention_heads=dims.vision_width // HEAD_WIDTH,
            image_size=dims.grid * dims.patch_size,
            patch_size=dims.patch_size,
            hidden_act="gelu",  # exact (erf) GELU: timm's nn.GELU
            layer_norm_eps=VISION_LAYER_NORM_EPS,
            attention_dropout=0.0,
        )
        text_config = BlipTextConfig(
            vocab_size=dims.vocab_size,
            hidden_size=dims.text_width,
            encoder_hidden_size=dims.vision_width,
            intermediate_size=dims.text_mlp,
            num_hidden_layers=dims.text_layers,
            num_attention_heads=dims.text_width // HEAD_WIDTH,
            max_position_embeddings=dims.positions,
            hidden_act="gelu",
            layer_norm_eps=TEXT_LAYER_NORM_EPS,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
            bos_token_id=None,  # generation ids: unused by the encoder, and not in a small vocabulary
            eos_token_id=None,
            sep_token_id=None,
            # transformers builds BLIP's cross-attention only for a decoder config; the
            # forward below still asks for the bidirectional (encoder) mask, as med.py's.
            is_decoder=True,
            use_cache=False,
        )
        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        widths = (dims.text_width, *dims.head_widths)
        self.head = torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in zip(widths[:-1], widths[1:])))

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` rewards of ``B`` (image, prompt) pairs."""
        image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        ).last_hidden_state
        return ((self.head(text[:, 0]) - SCORE_MEAN) / SCORE_STD).squeeze(-1)


def load_model(state: dict[str, torch.Tensor], dims: ImageRewardDims, device: torch.device) -> ImageRewardModel:
    """An :class:`ImageRewardModel` built on ``device`` with the checkpoint's weights,
    float32, eval mode."""
    with torch.device(device):
        model = ImageRewardModel(dims).to(DTYPE)
    # Keys and shapes were checked against the checkpoint layout; strict catches a mapping slip.
    parts = to_transformers(state, dims)
    model.vision.load_state_dict(parts["vision"], strict=True)
    model.text.load_state_dict(parts["text"], strict=True)
    model.head.load_state_dict(parts["head"], strict=True)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str | None, dims: ImageRewardDims) -> Any:
    """bert-base-uncased's tokenizer at ``path`` with BLIP's ``[DEC]`` and ``[ENC]`` added;
    it must then have as many ids as the checkpoint has word embeddings (30524)."""
    from transformers import AutoTokenizer

    if not path:
        raise RewardError(f"{TOKENIZER_FLAG} is required with the imagereward reward")
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        raise RewardError(f"{TOKENIZER_FLAG} {path}: not a directory (bert-base-uncased's tokenizer directory is expected)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
    except Exception as exc:
        raise RewardError(f"{TOKENIZER_FLAG} {path}: cannot load a tokenizer ({type(exc).__name__}: {first_line(exc)})") from exc
    if type(tokenizer).__name__ not in ("BertTokenizer", "BertTokenizerFast"):
        raise RewardError(
            f"{TOKENIZER_FLAG} {path}: not a BERT tokenizer (got {type(tokenizer).__name__}; bert-base-uncased's is expected)"
        )
    for tokens in ADDED_TOKENS:  # no-ops when the directory already has them
        tokenizer.add_special_tokens(tokens)
    if len(tokenizer) != dims.vocab_size or tokenizer.cls_token_id is None or tokenizer.pad_token_id is None:
        raise RewardError(
            f"{TOKENIZER_FLAG} {path}: not the checkpoint's tokenizer ({len(tokenizer)} ids with [DEC] and [ENC] added; "
            f"the checkpoint has {dims.vocab_size} word embeddings, as bert-base-uncased plus those two)"
        )
    return tokenizer


def tokenize(tokenizer: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's call: ``[CLS] tokens [SEP]`` truncated and padded to 35; ids and
    attention mask, ``[N, 35]`` int64."""
    encoded = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


PREPROCESS = OpenAIClipTransform(IMAGE_SIZE, IMAGE_SIZE, IMAGE_SIZE, OPENAI_MEAN, OPENAI_STD)
"""``_transform(224)``: Resize(224, BICUBIC), CenterCrop(224), RGB, ToTensor, Normalize."""


class ImageReward(ClipFrameReward):
    """The ``imagereward`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "imagereward"
    needs_prompts = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.imagereward_batch_size)
        self.num_frames = config.imagereward_num_frames
        self.device = reward_device()
        path = str(config.imagereward_checkpoint_path) if config.imagereward_checkpoint_path else None
        state = read_checkpoint(path)
        self.dims = checkpoint_dims(state, path)
        check_layout(state, self.dims, path)
        self.tokenizer = load_tokenizer(config.imagereward_tokenizer_path, self.dims)
        self.model = load_model(state, self.dims, self.device)

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        # Each (image, prompt) pair needs its own text forward: the text attends to the image.
        pixels = PREPROCESS(images).to(self.device)
        ids, mask = tokenize(self.tokenizer, prompts)
        return self.model(pixels, ids.to(self.device), mask.to(self.device))
