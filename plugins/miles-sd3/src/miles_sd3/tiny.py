"""A tiny, randomly initialised StableDiffusion3Pipeline built offline.

Real diffusers / transformers classes with tiny configurations (docs/guide.md, "Tiny
pipelines") and locally trained tokenizers, so tests, the demo and
benchmarks go through the normal ``from_pretrained(DIR)`` path without a model hub.
Heavy imports: only :meth:`miles_sd3.family.SD3Family.build_tiny_pipeline` pulls this in.

Two scales (:data:`SCALES`): ``"tiny"`` (the default: a 25k-parameter transformer,
64x64, what the tests use) and ``"bench"``, a transformer of about 20M parameters at 128x128
for benchmarks where model compute, not the framework around it, should dominate. The
bench text encoders stay small: they are frozen and run once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerBase,
    T5Config,
    T5EncoderModel,
)

from miles_core.api import clip_tokenizer, mark_tiny, t5_tokenizer

CLIP_HIDDEN = 16
CLIP_PROJECTION = 16
T5_D_MODEL = 32
LATENT_CHANNELS = 4
# SD3's VAE latent normalisation (sd3-medium vae/config.json): latents are
# ``(z - shift_factor) * scaling_factor`` and the pipeline undoes it before decoding.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609
_SECOND_CLIP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Scale:
    """The sizes of one scale of the pipeline."""

    clip_hidden: int
    clip_intermediate: int
    clip_projection: int
    clip_heads: int
    t5_d_model: int
    """Also the transformer's ``joint_attention_dim``: SD3 pads the CLIP states up to it."""
    t5_d_kv: int
    t5_d_ff: int
    t5_heads: int
    latent_channels: int
    sample_size: int
    """Latent side at the native size: pixels / 8 (the VAE's three downsamplings)."""
    layers: int
    heads: int
    head_dim: int
    pos_embed_max_size: int
    dual_attention_layers: tuple[int, ...]
    vae_channels: tuple[int, int, int, int]
    vae_norm_groups: int


SCALES: dict[str, Scale] = {
    "tiny": Scale(
        clip_hidden=CLIP_HIDDEN,
        clip_intermediate=32,
        clip_projection=CLIP_PROJECTION,
        clip_heads=2,
        t5_d_model=T5_D_MODEL,
        t5_d_kv=8,
        t5_d_ff=64,
        t5_heads=4,
        latent_channels=LATENT_CHANNELS,
        sample_size=8,
        layers=2,
        heads=2,
        head_dim=8,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        vae_channels=(4, 4, 4, 4),
        vae_norm_groups=2,
    ),
    # 8 MMDiT blocks of 4 heads x 64 (hidden 256, ~20M parameters; SD3.5's extra image
    # attention in the first half), 16 latent channels like the real SD3 VAE, 128x128
    # native (an 8x8 grid of 2x2 patches). 8 heads x 64 (~81M) would cost ~3.5 s per CFG
    # forward of 8 samples on one CPU thread at SD3's 333 text tokens (77 CLIP + 256 T5):
    # too slow for a benchmark run of a few minutes.
    "bench": Scale(
        clip_hidden=64,
        clip_intermediate=128,
        clip_projection=64,
        clip_heads=2,
        t5_d_model=128,
        t5_d_kv=32,
        t5_d_ff=256,
        t5_heads=4,
        latent_channels=16,
        sample_size=16,
        layers=8,
        heads=4,
        head_dim=64,
        pos_embed_max_size=32,
        dual_attention_layers=tuple(range(4)),
        vae_channels=(32, 64, 128, 128),
        vae_norm_groups=32,
    ),
}


def _scale(scale: str) -> Scale:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    return SCALES[scale]


def _clip_text_encoder(tokenizer: PreTrainedTokenizerBase, seed: int, size: Scale) -> CLIPTextModelWithProjection:
    """One CLIP-L/G stand-in. Its special-token ids must be the tokenizer's: CLIP pools
    the hidden state at the first ``eos_token_id``, and SD3 feeds that pooled output
    to the transformer."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.clip_hidden,
        intermediate_size=size.clip_intermediate,
        projection_dim=size.clip_projection,
        num_hidden_layers=2,
        num_attention_heads=size.clip_heads,
        max_position_embeddings=tokenizer.model_max_length,  # SD3 pads CLIP prompts to this
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


def _t5_text_encoder(tokenizer: PreTrainedTokenizerBase, seed: int, size: Scale) -> T5EncoderModel:
    """The T5-XXL stand-in; its ``d_model`` is the transformer's ``joint_attention_dim``."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=size.t5_d_model,
        d_kv=size.t5_d_kv,
        d_ff=size.t5_d_ff,
        num_layers=2,
        num_heads=size.t5_heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as SD3's text_encoder_3
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def build_transformer(seed: int, scale: str = "tiny") -> SD3Transformer2DModel:
    """An MMDiT (two blocks at the tiny scale); the first blocks have SD3.5's extra
    image-only attention (block 0 at the tiny scale, the first half at the bench scale)."""
    size = _scale(scale)
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=size.sample_size,
        patch_size=2,
        in_channels=size.latent_channels,
        out_channels=size.latent_channels,
        num_layers=size.layers,
        attention_head_dim=size.head_dim,
        num_attention_heads=size.heads,
        joint_attention_dim=size.t5_d_model,  # the CLIP states (2 x clip_hidden) are padded up to T5's width
        caption_projection_dim=size.heads * size.head_dim,  # = heads x head_dim, like the real model
        pooled_projection_dim=2 * size.clip_projection,  # the two CLIP pooled outputs, concatenated
        pos_embed_max_size=size.pos_embed_max_size,
        dual_attention_layers=size.dual_attention_layers,
        qk_norm="rms_norm",
    ).eval()


def _vae(seed: int, size: Scale) -> AutoencoderKL:
    """Four levels (three downsamplings: 8x like the real VAE); four channels each at
    the tiny scale."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=size.vae_channels,
        layers_per_block=1,
        latent_channels=size.latent_channels,
        norm_num_groups=size.vae_norm_groups,
        sample_size=size.sample_size * 8,
        scaling_factor=SD3_VAE_SCALING_FACTOR,
        shift_factor=SD3_VAE_SHIFT_FACTOR,
        use_quant_conv=False,  # SD3's VAE has no quant convs either
        use_post_quant_conv=False,
    ).eval()


def build_pipeline(*, seed: int = 0, vae: AutoencoderKL | None = None, scale: str = "tiny") -> StableDiffusion3Pipeline:
    """The pipeline in memory; every module's weights depend only on ``seed`` (and
    ``scale``). ``vae`` replaces the random VAE (the demo variant's trained one,
    :mod:`miles_sd3.demo`)."""
    size = _scale(scale)
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=build_transformer(seed, scale),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed, size) if vae is None else vae,
        text_encoder=_clip_text_encoder(tokenizer, seed, size),
        tokenizer=tokenizer,
        # Offset seed: with the same config and seed the two CLIPs would be identical.
        text_encoder_2=_clip_text_encoder(tokenizer_2, seed + _SECOND_CLIP_SEED_OFFSET, size),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_text_encoder(tokenizer_3, seed, size),
        tokenizer_3=tokenizer_3,
    )


def build(out_dir: str | Path, *, seed: int = 0, scale: str = "tiny") -> Path:
    """Write the pipeline of ``scale`` (``"tiny"`` or ``"bench"``, see :data:`SCALES`)
    to ``out_dir`` (safetensors) and return the directory."""
    _scale(scale)  # an unknown scale fails before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_pipeline(seed=seed, scale=scale).save_pretrained(out, safe_serialization=True)
    mark_tiny(out, family="sd3")  # commands load it without the hub libraries' notices
    return out
