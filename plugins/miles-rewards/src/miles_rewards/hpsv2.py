"""HPSv2 / HPSv2.1 (Human Preference Score v2): an open_clip ViT-H/14 fine-tuned on human
preferences between generated images, run on transformers' ``CLIPModel``.

Score, as ``hpsv2.score`` (tgxs002/HPSv2@866735e ``hpsv2/img_score.py``): the plain cosine
of the L2-normalised image and text embeddings,

    reward = <f_img / |f_img|, f_txt / |f_txt|>

with no ``logit_scale`` and no factor 100 (typical values 0.2-0.35). The factor 100 belongs
to the benchmark, ``hpsv2.evaluate`` (``hpsv2/evaluation.py``, ``image_features @
text_features.T * 100``): the README's tables (e.g. "30.23") are on that scale; divide
them by 100 to compare. v2.0 and v2.1 share architecture, preprocessing and code; only
the weights differ, and their scores are not comparable with each other.

Weights: ``--hpsv2-checkpoint-path`` is the checkpoint file itself (``HPS_v2_compressed.pt``
or ``HPS_v2.1_compressed.pt`` from the hub repo ``xswu/HPSv2``): a dict with the open_clip
``CLIP`` state dict under ``'state_dict'`` (a bare open_clip state dict is taken too). It is
read with ``torch.load(weights_only=True)`` (tensors and plain containers only, never
arbitrary pickled objects). The architecture comes from the tensors' shapes (widths,
layers, patch size, grid, vocabulary, context length, embedding size); the numbers of
attention heads, which no tensor shows, come from open_clip's ``ViT-H-14.json``: head width
80 in the image tower (1280 / 80 = 16 heads), 64 in the text tower (1024 / 64 = 16). The
activation is exact (erf) GELU (``force_quick_gelu=False``), layer norms use eps 1e-5.
The open_clip keys map onto ``CLIPModel`` as transformers' own OpenAI-CLIP converter does
(huggingface/transformers ``convert_clip_original_pytorch_to_hf.py``): ``in_proj`` split
into q/k/v, ``visual.proj`` and ``text_projection`` transposed, ``c_fc``/``c_proj`` to
``fc1``/``fc2``. The weights are float32 on the device the run chooses; the reference runs
under ``torch.cuda.amp.autocast`` (float16 matmuls on a GPU), so its GPU scores differ
from ours in about the third decimal.

Text: ``--hpsv2-tokenizer-path`` is a transformers CLIP tokenizer (a local directory or a
hub id), e.g. ``openai/clip-vit-large-patch14`` or ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``:
the OpenAI CLIP BPE that open_clip's ``SimpleTokenizer`` implements (49408 ids,
start 49406, end 49407), truncated to 77 as open_clip does (start, 75 tokens, end) and
zero-padded. Its normaliser is NFC, whitespace collapsing and lower-casing; open_clip
also runs ``ftfy.fix_text`` and ``html.unescape`` twice, so prompts with HTML entities
(``&amp;``), curly quotes, ligatures, full-width characters or mojibake may tokenize
differently; plain ASCII prompts give the same ids.

Images, as HPSv2's ``light_augmentation`` validation transform (``hpsv2/src/open_clip/
transform.py``: ``ToTensor``, ``ResizeMaxSize(224, fill=0)``, OpenAI normalisation): the
``uint8`` frame as float in ``[0, 1]``, the longer side resized to 224 (the other to
``round(side * 224 / longer)``, Python's round) with antialiased bicubic, zero-padded to
224 x 224 (left/top ``pad // 2``), then ``(x - mean) / std``; no centre crop. The
resize is torchvision's tensor path exactly: ``torchvision.transforms.functional.resize``
on a float tensor calls ``torch.nn.functional.interpolate(mode="bicubic",
align_corners=False, antialias=True)`` (pytorch/vision ``_functional_tensor.py``
``resize``; antialias is the default from torchvision 0.17, which HPSv2 leaves unpinned),
unclamped, so we call that function and need no torchvision. PIL's own bicubic resize
uses the same kernel (cubic, a = -0.5) but rounds to 8 bits, so it is not used. One
deliberate difference: an image that is not square and whose longer side is already 224
is padded here; the reference skips resize and pad alike and then fails on the
non-square input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from miles_core.api import RewardError
from miles_rewards.clip_models import DTYPE, ClipFrameReward, features, reward_device
from miles_rewards.state_dicts import check_layout as check_layout_of
from miles_rewards.state_dicts import first_line, layer_count, listing, read_state_dict

CHECKPOINT_FLAG = "--hpsv2-checkpoint-path"
TOKENIZER_FLAG = "--hpsv2-tokenizer-path"

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
"""open_clip's ``OPENAI_DATASET_MEAN`` / ``OPENAI_DATASET_STD`` (HPSv2 ``constants.py``)."""

VISION_HEAD_WIDTH = 80
TEXT_HEAD_WIDTH = 64
"""Per-head widths of open_clip's ViT-H-14 (``head_width: 80``; text ``width 1024, heads 16``)."""

LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class OpenClipDims:
    """The sizes of an open_clip ViT CLIP, read from its state dict's shapes."""

    vision_width: int
    vision_layers: int
    vision_mlp: int
    patch_size: int
    grid: int
    text_width: int
    text_layers: int
    text_mlp: int
    vocab_size: int
    context_length: int
    embed_dim: int

    @property
    def image_size(self) -> int:
        return self.grid * self.patch_size


def _error(path: str, cause: str) -> RewardError:
    return RewardError(f"{CHECKPOINT_FLAG} {path}: {cause}")


def read_checkpoint(path: str | None) -> dict[str, torch.Tensor]:
    """The open_clip state dict in the checkpoint at ``path`` (``{'state_dict': ...}`` or
    a bare state dict), read with ``weights_only=True``; anything else is a one-line
    :class:`RewardError` naming the flag."""
    return read_state_dict(
        path, CHECKPOINT_FLAG, reward="hpsv2", expected_file="HPS_v2_compressed.pt or HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2"
    )


# Tensors the architecture is read from: (key, axis) -> what that axis is.
_SIZES = {
    "vision_width": ("visual.class_embedding", 0),
    "patch_size": ("visual.conv1.weight", -1),
    "vision_positions": ("visual.positional_embedding", 0),
    "embed_dim": ("visual.proj", -1),
    "vision_mlp": ("visual.transformer.resblocks.0.mlp.c_fc.weight", 0),
    "vocab_size": ("token_embedding.weight", 0),
    "text_width": ("token_embedding.weight", -1),
    "context_length": ("positional_embedding", 0),
    "text_mlp": ("transformer.resblocks.0.mlp.c_fc.weight", 0),
}
_ARCH = "an open_clip ViT-H/14 (HPSv2) state dict"


def checkpoint_dims(state: dict[str, torch.Tensor], path: str) -> OpenClipDims:
    """The architecture of ``state``, from its shapes (heads from ViT-H-14's head widths)."""
    missing = sorted({key for key, _ in _SIZES.values() if key not in state})
    if missing:
        example = next(iter(state))
        raise _error(path, f"not {_ARCH}: missing {listing(missing)} (it has {len(state)} keys, e.g. {example!r})")
    sizes: dict[str, int] = {}
    for name, (key, axis) in _SIZES.items():
        shape = tuple(state[key].shape)
        if not shape:
            raise _error(path, f"not {_ARCH}: {key} has shape []")
        sizes[name] = shape[axis]
    grid = math.isqrt(sizes["vision_positions"] - 1) if sizes["vision_positions"] > 0 else 0
    if grid * grid + 1 != sizes["vision_positions"]:
        raise _error(path, f"not {_ARCH}: visual.positional_embedding has {sizes['vision_positions']} rows, not grid*grid+1")
    for tower, width, head in (("image", sizes["vision_width"], VISION_HEAD_WIDTH), ("text", sizes["text_width"], TEXT_HEAD_WIDTH)):
        if width % head:
            raise _error(path, f"not {_ARCH}: its {tower} width {width} is not a multiple of ViT-H/14's head width {head}")
    return OpenClipDims(
        vision_width=sizes["vision_width"],
        vision_layers=layer_count(state, "visual.transformer.resblocks."),
        vision_mlp=sizes["vision_mlp"],
        patch_size=sizes["patch_size"],
        grid=grid,
        text_width=sizes["text_width"],
        text_layers=layer_count(state, "transformer.resblocks."),
        text_mlp=sizes["text_mlp"],
        vocab_size=sizes["vocab_size"],
        context_length=sizes["context_length"],
        embed_dim=sizes["embed_dim"],
    )


def _block_shapes(prefix: str, width: int, mlp: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}ln_1.weight": (width,),
        f"{prefix}ln_1.bias": (width,),
        f"{prefix}attn.in_proj_weight": (3 * width, width),
        f"{prefix}attn.in_proj_bias": (3 * width,),
        f"{prefix}attn.out_proj.weight": (width, width),
        f"{prefix}attn.out_proj.bias": (width,),
        f"{prefix}ln_2.weight": (width,),
        f"{prefix}ln_2.bias": (width,),
        f"{prefix}mlp.c_fc.weight": (mlp, width),
        f"{prefix}mlp.c_fc.bias": (mlp,),
        f"{prefix}mlp.c_proj.weight": (width, mlp),
        f"{prefix}mlp.c_proj.bias": (width,),
    }


def openclip_shapes(dims: OpenClipDims) -> dict[str, tuple[int, ...]]:
    """Every key of open_clip's ``CLIP.state_dict()`` for ``dims``, with its shape (the
    ``attn_mask`` buffers are not persistent, so they are not in it)."""
    wv, wt = dims.vision_width, dims.text_width
    shapes: dict[str, tuple[int, ...]] = {
        "visual.class_embedding": (wv,),
        "visual.positional_embedding": (dims.grid * dims.grid + 1, wv),
        "visual.proj": (wv, dims.embed_dim),
        "visual.conv1.weight": (wv, 3, dims.patch_size, dims.patch_size),
        "visual.ln_pre.weight": (wv,),
        "visual.ln_pre.bias": (wv,),
        "visual.ln_post.weight": (wv,),
        "visual.ln_post.bias": (wv,),
        "positional_embedding": (dims.context_length, wt),
        "text_projection": (wt, dims.embed_dim),
        "logit_scale": (),
        "token_embedding.weight": (dims.vocab_size, wt),
        "ln_final.weight": (wt,),
        "ln_final.bias": (wt,),
    }
    for i in range(dims.vision_layers):
        shapes.update(_block_shapes(f"visual.transformer.resblocks.{i}.", wv, dims.vision_mlp))
    for i in range(dims.text_layers):
        shapes.update(_block_shapes(f"transformer.resblocks.{i}.", wt, dims.text_mlp))
    return shapes


def check_layout(state: dict[str, torch.Tensor], dims: OpenClipDims, path: str) -> None:
    """``state`` has exactly open_clip's keys for ``dims``, each of its shape (the strict
    ``load_state_dict`` the reference does)."""
    check_layout_of(state, openclip_shapes(dims), f"{CHECKPOINT_FLAG} {path}: not {_ARCH}")


_BLOCK_NAMES = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def to_transformers(state: dict[str, torch.Tensor], dims: OpenClipDims) -> dict[str, torch.Tensor]:
    """open_clip's keys renamed to ``CLIPModel``'s (transformers' OpenAI-CLIP converter,
    ``convert_clip_original_pytorch_to_hf.py``): fused ``in_proj`` split into q, k, v
    (in that order along dim 0); ``proj`` matrices, applied as ``x @ proj``, transposed
    into ``nn.Linear`` weights."""
    out = {
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].t(),
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].t(),
        "logit_scale": state["logit_scale"],
    }
    for source, target, layers in (
        ("visual.transformer.resblocks", "vision_model.encoder.layers", dims.vision_layers),
        ("transformer.resblocks", "text_model.encoder.layers", dims.text_layers),
    ):
        for i in range(layers):
            src, dst = f"{source}.{i}.", f"{target}.{i}."
            for kind in ("weight", "bias"):
                q, k, v = state[f"{src}attn.in_proj_{kind}"].chunk(3, dim=0)
                out.update({f"{dst}self_attn.q_proj.{kind}": q, f"{dst}self_attn.k_proj.{kind}": k, f"{dst}self_attn.v_proj.{kind}": v})
                for old, new in _BLOCK_NAMES.items():
                    out[f"{dst}{new}.{kind}"] = state[f"{src}{old}.{kind}"]
    return {key: value.contiguous() for key, value in out.items()}


def clip_config(dims: OpenClipDims, tokenizer: Any) -> Any:
    """The ``CLIPConfig`` of the checkpoint's architecture: exact GELU, eps 1e-5, and the
    tokenizer's start and end ids (pooling takes the first end-of-text token)."""
    from transformers import CLIPConfig

    common = dict(hidden_act="gelu", layer_norm_eps=LAYER_NORM_EPS, attention_dropout=0.0)
    return CLIPConfig(
        text_config=dict(
            **common,
            vocab_size=dims.vocab_size,
            hidden_size=dims.text_width,
            intermediate_size=dims.text_mlp,
            num_hidden_layers=dims.text_layers,
            num_attention_heads=dims.text_width // TEXT_HEAD_WIDTH,
            max_position_embeddings=dims.context_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=0,  # open_clip pads with 0
            projection_dim=dims.embed_dim,
        ),
        vision_config=dict(
            **common,
            hidden_size=dims.vision_width,
            intermediate_size=dims.vision_mlp,
            num_hidden_layers=dims.vision_layers,
            num_attention_heads=dims.vision_width // VISION_HEAD_WIDTH,
            image_size=dims.image_size,
            patch_size=dims.patch_size,
            num_channels=3,
            projection_dim=dims.embed_dim,
        ),
        projection_dim=dims.embed_dim,
    )


def load_tokenizer(path: str | None, dims: OpenClipDims) -> Any:
    """The CLIP tokenizer at ``path``; it must be the BPE the checkpoint was trained with:
    as many ids as the checkpoint has token embeddings, end-of-text the highest id (open_clip
    pools at ``argmax`` of the ids)."""
    from transformers import AutoTokenizer, CLIPTokenizer

    if not path:
        raise RewardError(f"{TOKENIZER_FLAG} is required with the hpsv2 reward")
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        raise RewardError(f"{TOKENIZER_FLAG} {path}: not a directory (a saved CLIP tokenizer or a hub id is expected)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else path)
    except Exception as exc:
        raise RewardError(f"{TOKENIZER_FLAG} {path}: cannot load a tokenizer ({type(exc).__name__}: {first_line(exc)})") from exc
    if not isinstance(tokenizer, CLIPTokenizer):
        raise RewardError(f"{TOKENIZER_FLAG} {path}: not a CLIP tokenizer (got {type(tokenizer).__name__})")
    if len(tokenizer) != dims.vocab_size or tokenizer.eos_token_id != dims.vocab_size - 1 or tokenizer.bos_token_id is None:
        raise RewardError(
            f"{TOKENIZER_FLAG} {path}: not the checkpoint's tokenizer ({len(tokenizer)} ids, end-of-text id "
            f"{tokenizer.eos_token_id}; the checkpoint has {dims.vocab_size} token embeddings and needs end-of-text "
            f"{dims.vocab_size - 1}, as OpenAI CLIP's BPE, e.g. openai/clip-vit-large-patch14)"
        )
    return tokenizer


def load_model(state: dict[str, torch.Tensor], dims: OpenClipDims, tokenizer: Any, device: torch.device) -> Any:
    """A ``CLIPModel`` built on ``device`` with the checkpoint's weights, float32, eval mode."""
    from transformers import CLIPModel

    with torch.device(device):
        model = CLIPModel(clip_config(dims, tokenizer)).to(DTYPE)
    # Keys and shapes were checked against open_clip's layout; strict catches a mapping slip.
    model.load_state_dict(to_transformers(state, dims), strict=True)
    return model.eval().requires_grad_(False)


def preprocess(image: Image.Image | np.ndarray, size: int) -> torch.Tensor:
    """HPSv2's validation transform, ``[3, size, size]`` float32: ``ToTensor`` (``uint8 /
    255``), the longer side resized to ``size`` with antialiased bicubic (torchvision's
    float-tensor resize), zero-padded to a square (left/top ``pad // 2``), then OpenAI
    mean/std."""
    array = np.array(image.convert("RGB") if isinstance(image, Image.Image) else image)  # a writable copy
    pixels = torch.from_numpy(array).permute(2, 0, 1).to(DTYPE).div(255)
    height, width = pixels.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_height, new_width = round(height * scale), round(width * scale)  # Python's round, as ResizeMaxSize
        pixels = torch.nn.functional.interpolate(
            pixels[None], size=(new_height, new_width), mode="bicubic", align_corners=False, antialias=True
        )[0]
    height, width = pixels.shape[1:]
    canvas = torch.zeros(3, size, size, dtype=DTYPE)
    top, left = (size - height) // 2, (size - width) // 2
    canvas[:, top : top + height, left : left + width] = pixels
    mean = torch.tensor(OPENAI_MEAN, dtype=DTYPE)[:, None, None]
    std = torch.tensor(OPENAI_STD, dtype=DTYPE)[:, None, None]
    return (canvas - mean) / std


def tokenize(tokenizer: Any, prompts: list[str], context_length: int) -> torch.Tensor:
    """open_clip's layout: ``[start] + tokens + [end]``, truncated to ``context_length``
    with the end token kept, zero-padded, ``[N, context_length]`` int64."""
    encoded = tokenizer(list(prompts), truncation=True, max_length=context_length)["input_ids"]
    ids = torch.zeros(len(encoded), context_length, dtype=torch.long)
    for row, tokens in enumerate(encoded):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids


class HPSv2(ClipFrameReward):
    """The ``hpsv2`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "hpsv2"
    needs_prompts = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.hpsv2_batch_size)
        self.num_frames = config.hpsv2_num_frames
        self.device = reward_device()
        path = str(config.hpsv2_checkpoint_path) if config.hpsv2_checkpoint_path else None
        state = read_checkpoint(path)
        self.dims = checkpoint_dims(state, path)
        check_layout(state, self.dims, path)
        self.tokenizer = load_tokenizer(config.hpsv2_tokenizer_path, self.dims)
        self.model = load_model(state, self.dims, self.tokenizer, self.device)

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        pixels = torch.stack([preprocess(image, self.dims.image_size) for image in images]).to(self.device)
        # Samples of one prompt share its text embedding: embed each distinct prompt once.
        distinct = list(dict.fromkeys(prompts))
        ids = tokenize(self.tokenizer, distinct, self.dims.context_length).to(self.device)
        image_embeds = features(self.model.get_image_features(pixel_values=pixels))
        text_embeds = features(self.model.get_text_features(input_ids=ids))
        image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        row_of = {prompt: row for row, prompt in enumerate(distinct)}
        rows = torch.tensor([row_of[prompt] for prompt in prompts], device=self.device)
        return (image_embeds * text_embeds[rows]).sum(dim=-1)
