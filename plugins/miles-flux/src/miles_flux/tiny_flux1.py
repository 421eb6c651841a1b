"""A randomly initialised, tiny FLUX.1 [dev] pipeline (``FluxPipeline``, real classes).

Heavy module: imports torch, diffusers and transformers. Reached only through
:func:`miles_flux.tiny.build` (``FluxFamily.build_tiny_pipeline(..., variant="dev")``).

What is kept from FLUX.1 [dev]: a guidance-distilled transformer (``guidance_embeds``),
16 latent channels seen 2x2-packed (64 transformer input channels), a VAE without
quant convs whose latents are normalised by FLUX.1's scaling and shift factors, a CLIP
text model whose pooled output and a T5 v1.1 encoder whose hidden states condition the
transformer, and FLUX.1 [dev]'s own scheduler config. Everything else is shrunk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerBase, T5Config, T5EncoderModel

from miles_core.api import clip_tokenizer, mark_tiny, t5_tokenizer

LATENT_CHANNELS = 16
"""FLUX.1's VAE latent channels; the transformer sees 2x2-packed latents (``in_channels`` 64)."""
CLIP_HIDDEN = 16
"""CLIP's hidden size: its pooled output is the transformer's ``pooled_projections``."""
T5_D_MODEL = 32
"""T5's ``d_model``: the transformer's ``joint_attention_dim``."""
VAE_CHANNELS = (8, 8, 8)
"""Three levels, two downsamplings: ``vae_scale_factor`` 4, the VAE's true compression, so
sides must be multiples of 8 (VAE factor x 2x2 packing) and 32x32 images work."""

# FLUX.1 [dev]'s VAE latent normalisation (black-forest-labs/FLUX.1-dev vae/config.json):
# latents are (z - shift_factor) * scaling_factor; the pipeline undoes it before decoding.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159

# FLUX.1 [dev]'s scheduler config (scheduler/scheduler_config.json): a dynamic shift whose
# mu runs linearly from 0.5 at 256 image tokens to 1.15 at 4096.
SCHEDULER_CONFIG: dict[str, object] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def _transformer() -> FluxTransformer2DModel:
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,  # double-stream blocks
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=True,  # FLUX.1 [dev] is guidance-distilled
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim, as FLUX.1's (16, 56, 56) sums to 128
    ).eval()


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=128 * 2 ** (len(VAE_CHANNELS) - 1),  # the pipeline's native side
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False,  # FLUX.1's VAE has no quant convs
        use_post_quant_conv=False,
    ).eval()


def _clip(tokenizer: PreTrainedTokenizerBase) -> CLIPTextModel:
    """The CLIP-L stand-in. Its special-token ids are the tokenizer's: CLIP pools the
    hidden state at the first ``eos_token_id``."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,  # FluxPipeline pads CLIP prompts to it
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _t5(tokenizer: PreTrainedTokenizerBase) -> T5EncoderModel:
    """The T5-XXL (v1.1, gated GELU) stand-in."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_D_MODEL,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def build_pipeline(*, seed: int = 0) -> FluxPipeline:
    """The pipeline in memory, deterministic in ``seed``."""
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    # fork_rng leaves the caller's global RNG untouched; one seed per component, so changing
    # one component's config leaves the others' weights alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer()
        torch.manual_seed(seed + 1)
        vae = _vae()
        torch.manual_seed(seed + 2)
        text_encoder = _clip(tokenizer)
        torch.manual_seed(seed + 3)
        text_encoder_2 = _t5(tokenizer_2)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random ``FluxPipeline`` to ``out_dir`` and return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_pipeline(seed=seed).save_pretrained(out, safe_serialization=True)
    mark_tiny(out, family="flux")  # commands load it without the hub libraries' notices
    return out
