"""A tiny HPSv2 checkpoint in open_clip's key layout, and an independent float64
computation of the HPSv2 score written from the reference's definitions (tgxs002/HPSv2
@866735e: ``open_clip/transformer.py`` ``VisionTransformer``/``ResidualAttentionBlock``,
``open_clip/model.py`` ``CLIP.encode_text``, ``open_clip/transform.py`` ``ResizeMaxSize``)
with plain tensor ops: no transformers, no ``nn.MultiheadAttention``, no conv, no
``interpolate``. The resize is Pillow's antialiased convolution resampling (the kernel
PyTorch's antialiased bicubic follows), written out as weight matrices."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

# A ViT-H/14-shaped model, narrower and shallower: head widths stay ViT-H/14's (80 for
# the image, 64 for the text), so 2 heads each; patch 14 on a 16 x 16 grid (224 pixels).
VISION_WIDTH, VISION_LAYERS, VISION_HEADS = 160, 2, 2
TEXT_WIDTH, TEXT_LAYERS, TEXT_HEADS = 128, 2, 2
PATCH, GRID, EMBED, CONTEXT = 14, 16, 48, 77
MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])


def _block(prefix: str, width: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    return {
        f"{prefix}ln_1.weight": 1 + randn(width, std=0.1),
        f"{prefix}ln_1.bias": randn(width, std=0.1),
        f"{prefix}attn.in_proj_weight": randn(3 * width, width, std=width**-0.5),
        f"{prefix}attn.in_proj_bias": randn(3 * width, std=0.1),
        f"{prefix}attn.out_proj.weight": randn(width, width, std=width**-0.5),
        f"{prefix}attn.out_proj.bias": randn(width, std=0.1),
        f"{prefix}ln_2.weight": 1 + randn(width, std=0.1),
        f"{prefix}ln_2.bias": randn(width, std=0.1),
        f"{prefix}mlp.c_fc.weight": randn(4 * width, width, std=width**-0.5),
        f"{prefix}mlp.c_fc.bias": randn(4 * width, std=0.1),
        f"{prefix}mlp.c_proj.weight": randn(width, 4 * width, std=(4 * width) ** -0.5),
        f"{prefix}mlp.c_proj.bias": randn(width, std=0.1),
    }


def tiny_state(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under exactly the keys of open_clip ``CLIP.state_dict()`` (ViT,
    non-custom text tower), as in ``HPS_v2*_compressed.pt``'s ``'state_dict'``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state = {
        "visual.class_embedding": randn(VISION_WIDTH, std=0.5),
        "visual.positional_embedding": randn(GRID * GRID + 1, VISION_WIDTH, std=0.5),
        "visual.proj": randn(VISION_WIDTH, EMBED, std=VISION_WIDTH**-0.5),
        "visual.conv1.weight": randn(VISION_WIDTH, 3, PATCH, PATCH, std=(3 * PATCH * PATCH) ** -0.5),
        "visual.ln_pre.weight": 1 + randn(VISION_WIDTH, std=0.1),
        "visual.ln_pre.bias": randn(VISION_WIDTH, std=0.1),
        "visual.ln_post.weight": 1 + randn(VISION_WIDTH, std=0.1),
        "visual.ln_post.bias": randn(VISION_WIDTH, std=0.1),
        "positional_embedding": randn(CONTEXT, TEXT_WIDTH, std=0.5),
        "text_projection": randn(TEXT_WIDTH, EMBED, std=TEXT_WIDTH**-0.5),
        "logit_scale": torch.tensor(math.log(1 / 0.07)),
        "token_embedding.weight": randn(vocab_size, TEXT_WIDTH, std=1.0),
        "ln_final.weight": 1 + randn(TEXT_WIDTH, std=0.1),
        "ln_final.bias": randn(TEXT_WIDTH, std=0.1),
    }
    for i in range(VISION_LAYERS):
        state.update(_block(f"visual.transformer.resblocks.{i}.", VISION_WIDTH, g))
    for i in range(TEXT_LAYERS):
        state.update(_block(f"transformer.resblocks.{i}.", TEXT_WIDTH, g))
    return state


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], *, half: bool = False) -> Path:
    """``torch.save`` in the HPSv2 file's shape: ``{'state_dict': ..., ...}``."""
    tensors = {key: value.half() if half else value for key, value in state.items()}
    torch.save({"epoch": 1, "name": "tiny-hpsv2", "state_dict": tensors}, path)
    return path


# ---- the independent computation (float64) ----


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def _gelu(x: torch.Tensor, quick: bool) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x) if quick else 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _blocks(x: torch.Tensor, w: dict, prefix: str, layers: int, heads: int, causal: bool, quick_gelu: bool) -> torch.Tensor:
    n, t, d = x.shape
    hd = d // heads
    mask = torch.triu(torch.full((t, t), float("-inf"), dtype=x.dtype), diagonal=1) if causal else torch.zeros(t, t, dtype=x.dtype)
    for i in range(layers):
        p = f"{prefix}{i}."
        h = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = h @ w[p + "attn.in_proj_weight"].T + w[p + "attn.in_proj_bias"]
        q, k, v = (part.reshape(n, t, heads, hd).transpose(1, 2) for part in qkv.split(d, dim=-1))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        x = x + attn.transpose(1, 2).reshape(n, t, d) @ w[p + "attn.out_proj.weight"].T + w[p + "attn.out_proj.bias"]
        h = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        h = _gelu(h @ w[p + "mlp.c_fc.weight"].T + w[p + "mlp.c_fc.bias"], quick_gelu)
        x = x + h @ w[p + "mlp.c_proj.weight"].T + w[p + "mlp.c_proj.bias"]
    return x


def reference_scores(
    state: dict[str, torch.Tensor],
    pixels: torch.Tensor,
    ids: torch.Tensor,
    *,
    vision_heads: int = VISION_HEADS,
    text_heads: int = TEXT_HEADS,
    quick_gelu: bool = False,
) -> torch.Tensor:
    """``diag(normalize(encode_image(pixels)) @ normalize(encode_text(ids)).T)`` in
    float64, from the open_clip tensors; the keyword arguments are for controls."""
    w = {key: value.double() for key, value in state.items()}
    n = pixels.shape[0]
    # Patches as the stride-14 conv sees them: [N, g*g, 3*p*p] in (channel, row, column) order.
    patches = pixels.double().reshape(n, 3, GRID, PATCH, GRID, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(n, GRID * GRID, -1)
    x = patches @ w["visual.conv1.weight"].reshape(VISION_WIDTH, -1).T
    x = torch.cat([w["visual.class_embedding"].expand(n, 1, -1), x], dim=1) + w["visual.positional_embedding"]
    x = _layer_norm(x, w["visual.ln_pre.weight"], w["visual.ln_pre.bias"])
    x = _blocks(x, w, "visual.transformer.resblocks.", VISION_LAYERS, vision_heads, False, quick_gelu)
    image = _layer_norm(x[:, 0], w["visual.ln_post.weight"], w["visual.ln_post.bias"]) @ w["visual.proj"]

    t = w["token_embedding.weight"][ids] + w["positional_embedding"]
    t = _blocks(t, w, "transformer.resblocks.", TEXT_LAYERS, text_heads, True, quick_gelu)
    t = _layer_norm(t, w["ln_final.weight"], w["ln_final.bias"])
    text = t[torch.arange(ids.shape[0]), ids.argmax(dim=-1)] @ w["text_projection"]
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return (image * text).sum(-1)


def open_clip_ids(tokenizer, prompts: list[str], context: int = CONTEXT) -> torch.Tensor:
    """open_clip's ``tokenize``: ``[sot] + bpe + [eot]``, cut to ``context`` with the last
    one set to eot, zero-filled."""
    out = torch.zeros(len(prompts), context, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False), tokenizer.eos_token_id]
        if len(tokens) > context:
            tokens = tokens[:context]
            tokens[-1] = tokenizer.eos_token_id
        out[row, : len(tokens)] = torch.tensor(tokens)
    return out


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resample_matrix(in_size: int, out_size: int) -> np.ndarray:
    """Pillow's antialiased resampling weights (``Resample.c`` ``precompute_coeffs``) for
    the bicubic filter, ``[out, in]``: the kernel widened by the scale when shrinking."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        taps = _cubic((np.arange(lo, hi) - center + 0.5) / filter_scale)
        weights[i, lo:hi] = taps / taps.sum()
    return weights


def reference_preprocess(image: np.ndarray, size: int = GRID * PATCH) -> np.ndarray:
    """HPSv2's validation transform on a ``uint8`` ``[H, W, 3]`` image, float64
    ``[3, size, size]``: /255, longer side to ``size`` (Python's round for the other),
    zero-pad (left/top ``pad // 2``), OpenAI mean/std."""
    x = image.astype(np.float64).transpose(2, 0, 1) / 255.0
    h, w = x.shape[1:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        nh, nw = round(h * scale), round(w * scale)
        rows, cols = resample_matrix(h, nh), resample_matrix(w, nw)
        x = np.stack([rows @ channel @ cols.T for channel in x])
    h, w = x.shape[1:]
    out = np.zeros((3, size, size))
    top, left = (size - h) // 2, (size - w) // 2
    out[:, top : top + h, left : left + w] = x
    return (out - MEAN[:, None, None]) / STD[:, None, None]
