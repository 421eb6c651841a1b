"""A randomly initialised, tiny Qwen-Image pipeline (real diffusers/transformers classes).

Heavy module: imports torch, diffusers and transformers. Reached only through
:meth:`miles_qwen_image.family.QwenImageFamily.build_tiny_pipeline`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from miles_core.api import mark_tiny, qwen2_tokenizer

Z_DIM = 4
"""Latent channels; the transformer sees 2x2-packed latents, so ``in_channels = 4 * Z_DIM``."""
TEXT_HIDDEN = 16
"""Text encoder hidden size, which is the transformer's ``joint_attention_dim``."""

# Qwen-Image's own scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json):
# dynamic exponential shift between 256 and 8192 image tokens, terminal sigma 0.02.
SCHEDULER_CONFIG: dict[str, object] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}


def _transformer() -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * Z_DIM,
        out_channels=Z_DIM,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
    )


def _vae() -> AutoencoderKLQwenImage:
    # dim_mult of 3 stages downsamples twice, so temperal_downsample needs exactly 2
    # entries: the pipeline derives vae_scale_factor as 2 ** len(temperal_downsample).
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
    )


def _text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]},  # sums to head_dim / 2
            "rope_theta": 1_000_000.0,
            "bos_token_id": None,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        # The vision tower is never run by the text-to-image pipeline; keep it minimal.
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random ``QwenImagePipeline`` to ``out_dir``, deterministic in ``seed``."""
    out = Path(out_dir)
    tokenizer = qwen2_tokenizer()
    # fork_rng leaves the caller's global RNG untouched; one seed per component, so changing
    # one component's config leaves the others' weights alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer()
        torch.manual_seed(seed + 1)
        vae = _vae()
        torch.manual_seed(seed + 2)
        text_encoder = _text_encoder(tokenizer)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    mark_tiny(out, family="qwen-image")  # commands load it without the hub libraries' notices
    return out
