"""A tiny ImageReward checkpoint in ``ImageReward.pt``'s key layout, a tiny BERT WordPiece
tokenizer, and an independent float64 computation of the ImageReward score written from
the reference's definitions (THUDM/ImageReward@c1392c6: ``models/BLIP/vit.py``
``VisionTransformer``/``Block``/``Attention``, ``models/BLIP/med.py`` ``BertModel`` with
``mode='multimodal'``, ``ImageReward.py`` ``MLP`` and ``score``) with plain tensor ops: no
transformers model, no ``nn.Module``, no conv."""

from __future__ import annotations

import math
import string
from pathlib import Path

import torch

# ViT-L/16 and BERT-base shaped, narrower and shallower, with the reference's head width
# (64): 3 image heads, 2 text heads. The image and text widths differ so that the
# cross-attention's key/value projections are not square. Patch 32 on the fixed 224 input:
# a 7 x 7 grid.
VISION_WIDTH, VISION_LAYERS, VISION_HEADS, VISION_MLP = 192, 2, 3, 256
TEXT_WIDTH, TEXT_LAYERS, TEXT_HEADS, TEXT_MLP = 128, 2, 2, 192
PATCH, GRID, POSITIONS = 32, 7, 40
HEAD_WIDTHS = (48, 24, 12, 6, 1)
PROJECTION = 16  # BLIP's vision_proj / text_proj, unused by the score
MEAN, STD = 0.16717362830052426, 1.0333394966054072

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["a", "red", "apple", "on", "the", "wooden", "table", "snow", "mountain", "robot", "forest"]


def save_tokenizer(directory: Path) -> Path:
    """A lower-casing BERT WordPiece tokenizer as bert-base-uncased's (``[PAD]`` 0,
    ``[CLS]``, ``[SEP]``): some whole words, every letter and digit with its ``##``
    continuation, punctuation. ``[DEC]`` and ``[ENC]`` are not in it (BLIP adds them)."""
    from transformers import BertTokenizer

    pieces = list(string.ascii_lowercase + string.digits)
    vocab = [*SPECIALS, *WORDS, *[p for p in pieces if p not in WORDS], *[f"##{p}" for p in pieces], *string.punctuation]
    BertTokenizer(vocab={token: index for index, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(directory)
    return directory


def tiny_state(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the keys of ``ImageReward.state_dict()``, the ignored ones
    (``vision_proj``, ``text_proj``, the ``position_ids`` buffer) included."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(prefix: str, out: int, inp: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": randn(out, inp, std=inp**-0.5), f"{prefix}.bias": randn(out, std=0.1)}

    def norm(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": 1 + randn(width, std=0.1), f"{prefix}.bias": randn(width, std=0.1)}

    v, t = "blip.visual_encoder.", "blip.text_encoder."
    state = {
        f"{v}cls_token": randn(1, 1, VISION_WIDTH, std=0.5),
        f"{v}pos_embed": randn(1, GRID * GRID + 1, VISION_WIDTH, std=0.5),
        f"{v}patch_embed.proj.weight": randn(VISION_WIDTH, 3, PATCH, PATCH, std=(3 * PATCH * PATCH) ** -0.5),
        f"{v}patch_embed.proj.bias": randn(VISION_WIDTH, std=0.1),
        **norm(f"{v}norm", VISION_WIDTH),
        f"{t}embeddings.position_ids": torch.arange(POSITIONS)[None],
        f"{t}embeddings.word_embeddings.weight": randn(vocab_size, TEXT_WIDTH, std=1.0),
        f"{t}embeddings.position_embeddings.weight": randn(POSITIONS, TEXT_WIDTH, std=0.5),
        **norm(f"{t}embeddings.LayerNorm", TEXT_WIDTH),
        **linear("blip.vision_proj", PROJECTION, VISION_WIDTH),
        **linear("blip.text_proj", PROJECTION, TEXT_WIDTH),
    }
    for i in range(VISION_LAYERS):
        b = f"{v}blocks.{i}."
        state.update(norm(f"{b}norm1", VISION_WIDTH))
        state.update(linear(f"{b}attn.qkv", 3 * VISION_WIDTH, VISION_WIDTH))
        state.update(linear(f"{b}attn.proj", VISION_WIDTH, VISION_WIDTH))
        state.update(norm(f"{b}norm2", VISION_WIDTH))
        state.update(linear(f"{b}mlp.fc1", VISION_MLP, VISION_WIDTH))
        state.update(linear(f"{b}mlp.fc2", VISION_WIDTH, VISION_MLP))
    for i in range(TEXT_LAYERS):
        lay = f"{t}encoder.layer.{i}."
        for attention, source in (("attention", TEXT_WIDTH), ("crossattention", VISION_WIDTH)):
            state.update(linear(f"{lay}{attention}.self.query", TEXT_WIDTH, TEXT_WIDTH))
            state.update(linear(f"{lay}{attention}.self.key", TEXT_WIDTH, source))
            state.update(linear(f"{lay}{attention}.self.value", TEXT_WIDTH, source))
            state.update(linear(f"{lay}{attention}.output.dense", TEXT_WIDTH, TEXT_WIDTH))
            state.update(norm(f"{lay}{attention}.output.LayerNorm", TEXT_WIDTH))
        state.update(linear(f"{lay}intermediate.dense", TEXT_MLP, TEXT_WIDTH))
        state.update(linear(f"{lay}output.dense", TEXT_WIDTH, TEXT_MLP))
        state.update(norm(f"{lay}output.LayerNorm", TEXT_WIDTH))
    width = TEXT_WIDTH
    for layer, out in zip((0, 2, 4, 6, 7), HEAD_WIDTHS):
        state.update(linear(f"mlp.layers.{layer}", out, width))
        width = out
    return state


def save_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``torch.save`` of the bare state dict, as ``ImageReward.pt`` is."""
    torch.save(state, path)
    return path


# ---- the independent computation (float64) ----


def _layer_norm(x: torch.Tensor, w: dict, prefix: str, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w[prefix + ".weight"] + w[prefix + ".bias"]


def _linear(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    n, length, d = x.shape
    return x.reshape(n, length, heads, d // heads).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def vit(w: dict, pixels: torch.Tensor, heads: int) -> torch.Tensor:
    """``vit.py`` ``VisionTransformer.forward``: patches, cls, pos, pre-norm blocks, norm."""
    p = "blip.visual_encoder."
    n = pixels.shape[0]
    # The stride-32 conv as a matmul over patches flattened in (channel, row, column) order.
    patches = pixels.reshape(n, 3, GRID, PATCH, GRID, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(n, GRID * GRID, -1)
    x = patches @ w[p + "patch_embed.proj.weight"].reshape(VISION_WIDTH, -1).T + w[p + "patch_embed.proj.bias"]
    x = torch.cat([w[p + "cls_token"].expand(n, 1, -1), x], dim=1) + w[p + "pos_embed"]
    for i in range(VISION_LAYERS):
        b = f"{p}blocks.{i}."
        h = _layer_norm(x, w, b + "norm1", 1e-6)
        q, k, v = _linear(h, w, b + "attn.qkv").split(VISION_WIDTH, dim=-1)  # reshape(B, N, 3, heads, hd)
        x = x + _linear(_attend(q, k, v, heads), w, b + "attn.proj")
        h = _layer_norm(x, w, b + "norm2", 1e-6)
        x = x + _linear(_gelu(_linear(h, w, b + "mlp.fc1")), w, b + "mlp.fc2")
    return _layer_norm(x, w, p + "norm", 1e-6)


def bert(w: dict, ids: torch.Tensor, mask: torch.Tensor, image: torch.Tensor, heads: int) -> torch.Tensor:
    """``med.py`` ``BertModel.forward(mode='multimodal')``: post-norm layers of self-attention
    (padding masked with -10000, as ``get_extended_attention_mask``), cross-attention to
    every image token, feed-forward."""
    p = "blip.text_encoder."
    x = w[p + "embeddings.word_embeddings.weight"][ids] + w[p + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    x = _layer_norm(x, w, p + "embeddings.LayerNorm", 1e-12)
    pad = (1.0 - mask.double())[:, None, None, :] * -10000.0
    for i in range(TEXT_LAYERS):
        lay = f"{p}encoder.layer.{i}."
        for attention, source, bias in (("attention", None, pad), ("crossattention", image, 0.0)):
            a = f"{lay}{attention}."
            keys = x if source is None else source
            out = _attend(
                _linear(x, w, a + "self.query"), _linear(keys, w, a + "self.key"), _linear(keys, w, a + "self.value"), heads, bias
            )
            x = _layer_norm(_linear(out, w, a + "output.dense") + x, w, a + "output.LayerNorm", 1e-12)
        h = _gelu(_linear(x, w, lay + "intermediate.dense"))
        x = _layer_norm(_linear(h, w, lay + "output.dense") + x, w, lay + "output.LayerNorm", 1e-12)
    return x


def reference_scores(
    state: dict[str, torch.Tensor],
    pixels: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    vision_heads: int = VISION_HEADS,
    text_heads: int = TEXT_HEADS,
) -> torch.Tensor:
    """``ImageReward.score`` per (image, prompt) pair, float64, from the raw state dict:
    ``(mlp(text[:, 0]) - mean) / std``, the head's linear layers with nothing between them.
    The keyword arguments are for controls."""
    w = {key: value.double() for key, value in state.items() if value.is_floating_point()}
    text = bert(w, ids, mask, vit(w, pixels.double(), vision_heads), text_heads)[:, 0]
    for layer in (0, 2, 4, 6, 7):
        text = _linear(text, w, f"mlp.layers.{layer}")
    return ((text - MEAN) / STD)[:, 0]
