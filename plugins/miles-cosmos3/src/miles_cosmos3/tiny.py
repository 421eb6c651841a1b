"""A tiny, randomly initialised Cosmos3OmniPipeline for offline tests and demos.

Real diffusers classes with tiny configurations: Cosmos3OmniTransformer (2 layers,
hidden 16), the tiny Wan VAE (8x spatial, 4x temporal, 16 latent channels), a UniPC
flow-matching scheduler and a locally built Qwen2 tokenizer. There is no text encoder:
the transformer embeds the token ids itself. The safety checker is off (its guardrail
models would need a download).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

from miles_core.api import mark_tiny, qwen2_tokenizer

LATENT_CHANNELS = 16
"""Latent channels: the transformer's ``latent_channel`` equals the VAE's ``z_dim``."""


def _transformer(vocab_size: int) -> Cosmos3OmniTransformer:
    patch = 2  # the real checkpoints' latent patch: exercises the 2x2 patchify/unpatchify
    return Cosmos3OmniTransformer(
        hidden_size=16,
        head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention like the real model
        intermediate_size=32,
        num_hidden_layers=2,
        latent_channel=LATENT_CHANNELS,
        latent_patch_size=patch,
        patch_latent_dim=patch * patch * LATENT_CHANNELS,
        rope_axes_dim=[2, 1, 1],  # (t, h, w) frequency split: must sum to head_dim / 2
        vocab_size=vocab_size,
    )


def _vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny pipeline deterministically from ``seed`` and ``save_pretrained`` it
    to ``out_dir``; returns the directory."""
    out = Path(out_dir)
    tokenizer = qwen2_tokenizer()
    # Cosmos3OmniPipeline ends every prompt with eos + <|vision_start|> (start of generation).
    if tokenizer.eos_token_id is None or "<|vision_start|>" not in tokenizer.get_vocab():
        raise ValueError("qwen2_tokenizer() lacks the eos or <|vision_start|> token Cosmos 3 needs")

    # Seed a forked RNG so building does not disturb the caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The transformer embeds the token ids itself: one row per id the tokenizer emits.
        transformer = _transformer(vocab_size=len(tokenizer))
        vae = _vae()
    # The scheduler class the pipeline declares, in its flow-matching mode (sigmas from 1 to 0).
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)
    pipe = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=scheduler,
        sound_tokenizer=None,
        safety_checker=None,
        enable_safety_checker=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    mark_tiny(out, family="cosmos3")  # commands load it without the hub libraries' notices
    return out
