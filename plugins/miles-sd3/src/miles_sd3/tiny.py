"""A tiny, randomly initialised StableDiffusion3Pipeline built offline.

Real diffusers / transformers classes with tiny configurations (sizes measured in
``notes/tiny-pipelines.md``) and locally trained tokenizers, so tests, the demo and
benchmarks go through the normal ``from_pretrained(DIR)`` path without a model hub.
Heavy imports: only :meth:`miles_sd3.family.SD3Family.build_tiny_pipeline` pulls this in.
"""

from __future__ import annotations

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

from miles_core.tiny.tokenizers import clip_tokenizer, t5_tokenizer

CLIP_HIDDEN = 16
CLIP_PROJECTION = 16
T5_D_MODEL = 32
LATENT_CHANNELS = 4
# SD3's VAE latent normalisation (sd3-medium vae/config.json): latents are
# ``(z - shift_factor) * scaling_factor`` and the pipeline undoes it before decoding.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609
_SECOND_CLIP_SEED_OFFSET = 1_000_003


def _clip_text_encoder(tokenizer: PreTrainedTokenizerBase, seed: int) -> CLIPTextModelWithProjection:
    """One CLIP-L/G stand-in. Its special-token ids must be the tokenizer's: CLIP pools
    the hidden state at the first ``eos_token_id``, and SD3 feeds that pooled output
    to the transformer."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=32,
        projection_dim=CLIP_PROJECTION,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,  # SD3 pads CLIP prompts to this
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


def _t5_text_encoder(tokenizer: PreTrainedTokenizerBase, seed: int) -> T5EncoderModel:
    """The T5-XXL stand-in; its ``d_model`` is the transformer's ``joint_attention_dim``."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_D_MODEL,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as SD3's text_encoder_3
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def build_transformer(seed: int) -> SD3Transformer2DModel:
    """A two-block MMDiT; block 0 has SD3.5's extra image-only attention."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=T5_D_MODEL,  # CLIP states (2 x 16) are padded up to T5's width
        caption_projection_dim=16,  # = heads x head_dim, like the real model
        pooled_projection_dim=2 * CLIP_PROJECTION,  # the two CLIP pooled outputs, concatenated
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).eval()


def _vae(seed: int) -> AutoencoderKL:
    """Four levels (three downsamplings: 8x like the real VAE) of four channels."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 4, 4),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=2,
        sample_size=64,
        scaling_factor=SD3_VAE_SCALING_FACTOR,
        shift_factor=SD3_VAE_SHIFT_FACTOR,
        use_quant_conv=False,  # SD3's VAE has no quant convs either
        use_post_quant_conv=False,
    ).eval()


def build_pipeline(*, seed: int = 0, vae: AutoencoderKL | None = None) -> StableDiffusion3Pipeline:
    """The tiny pipeline in memory; every module's weights depend only on ``seed``.
    ``vae`` replaces the random VAE (the demo variant's trained one, :mod:`miles_sd3.demo`)."""
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=build_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed) if vae is None else vae,
        text_encoder=_clip_text_encoder(tokenizer, seed),
        tokenizer=tokenizer,
        # Offset seed: with the same config and seed the two CLIPs would be identical.
        text_encoder_2=_clip_text_encoder(tokenizer_2, seed + _SECOND_CLIP_SEED_OFFSET),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_t5_text_encoder(tokenizer_3, seed),
        tokenizer_3=tokenizer_3,
    )


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny pipeline to ``out_dir`` (safetensors) and return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_pipeline(seed=seed).save_pretrained(out, safe_serialization=True)
    return out

