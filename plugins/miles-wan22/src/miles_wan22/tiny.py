"""Tiny, randomly initialised Wan 2.2 pipelines (real diffusers classes): the two-expert
A14B layout (:func:`build`), the one-transformer TI2V-5B layout (:func:`build_ti2v`) and
the two-expert image-to-video I2V-A14B layout (:func:`build_i2v`).

Heavy module (torch, diffusers, transformers): import it only when building.
Tiny configurations of the real classes (docs/guide.md, "Tiny pipelines"); the saved directory is well under 1 MB and
loads with ``WanPipeline.from_pretrained(dir)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from miles_core.api import mark_tiny, t5_tokenizer

BOUNDARY_RATIO = 0.875
"""Wan 2.2 A14B: timesteps >= 0.875 x 1000 go to ``transformer``, the rest to ``transformer_2``."""
TEXT_DIM = 32
"""UMT5 ``d_model``; the transformers' ``text_dim`` must equal it."""
LATENT_CHANNELS = 16
"""VAE ``z_dim``; also the transformers' in/out channels (the VAE's latents_mean/std have 16)."""
_MODULE_COUNT = 4
"""Seeded modules per pipeline (text encoder, VAE, two experts)."""
TI2V_LATENT_CHANNELS = 48
"""Wan 2.2's own VAE (TI2V-5B): ``z_dim`` 48, the transformer's in/out channels."""
TI2V_FLOW_SHIFT = 5.0
"""Wan's published TI2V-5B sampling shift (``sample_shift``)."""
I2V_BOUNDARY_RATIO = 0.9
"""Wan 2.2 I2V-A14B's published expert boundary (``boundary``): timesteps >= 900 go to ``transformer``."""
I2V_MASK_CHANNELS = 4
"""The first-frame mask's channels in front of the image latents: the VAE's temporal factor."""

T = TypeVar("T")


def _transformer(channels: int = LATENT_CHANNELS, rope_max_seq_len: int = 32, out_channels: int | None = None) -> WanTransformer3DModel:
    """One A14B expert (both share this config and differ only in their weights), or, with
    ``TI2V_LATENT_CHANNELS`` and a RoPE grid of 64 positions of 32 px (which reaches
    WanPipeline's default 480x832 and 81 frames, so the family's defaults resolve), TI2V-5B's
    transformer layout, or (``out_channels`` set) an I2V-A14B expert, which reads the noisy
    latents with the image condition behind them: two small layers, 1x2x2 patches."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=channels,
        out_channels=channels if out_channels is None else out_channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=rope_max_seq_len,
    )


def _text_encoder(vocab_size: int) -> UMT5EncoderModel:
    """UMT5 encoder sized to the tiny tokenizer; its d_model feeds the experts' text_dim."""
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config).eval()


def _vae() -> AutoencoderKLWan:
    # Four levels with three spatial and two temporal halvings keep the real 8x / 4x
    # compression, so pipeline size arithmetic matches the real model's.
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()


def _scheduler(flow_shift: float = 3.0) -> UniPCMultistepScheduler:
    # What the released Wan checkpoints ship: UniPC in flow-matching mode.
    return UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=flow_shift,
    )


def _ti2v_vae() -> AutoencoderKLWan:
    """Wan 2.2's VAE layout: residual blocks, 2x2 pixel patchification in front (3 x 4 =
    12 channels in and out), three spatial and two temporal halvings: 16x spatial, 4x
    temporal, as the real one. Latent statistics that are neither 0 nor 1, so a test sees
    the normalisation."""
    return AutoencoderKLWan(
        base_dim=4,
        z_dim=TI2V_LATENT_CHANNELS,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[round((i % 7 - 3) / 10, 2) for i in range(TI2V_LATENT_CHANNELS)],
        latents_std=[round(0.5 + (i % 5) / 4, 2) for i in range(TI2V_LATENT_CHANNELS)],
    ).eval()


def _seeded(seed: int, index: int, make: Callable[[], T]) -> T:
    """Build one module from its own random stream: one module's size never shifts
    another's weights, the two experts (same config) differ, and no module of one seed
    repeats a module of another seed."""
    torch.manual_seed(seed * _MODULE_COUNT + index)
    return make()


def _text_components(seed: int) -> dict[str, Any]:
    """The tokenizer and the seeded UMT5 encoder every tiny Wan pipeline shares."""
    tokenizer = t5_tokenizer(model_max_length=512)
    return {"tokenizer": tokenizer, "text_encoder": _seeded(seed, 0, lambda: _text_encoder(len(tokenizer)))}


def _save(pipe: Any, out_dir: str | Path, family: str) -> Path:
    out = Path(out_dir)
    pipe.save_pretrained(out)
    mark_tiny(out, family=family)  # commands load it without the hub libraries' notices
    return out


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny pipeline to ``out_dir``; the same ``seed`` gives identical weights."""
    pipe = WanPipeline(
        **_text_components(seed),
        vae=_seeded(seed, 1, _vae),
        scheduler=_scheduler(),
        transformer=_seeded(seed, 2, _transformer),
        transformer_2=_seeded(seed, 3, _transformer),
        boundary_ratio=BOUNDARY_RATIO,
    )
    return _save(pipe, out_dir, "wan22")


def build_ti2v(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2 TI2V-5B-like pipeline (``WanPipeline`` with
    ``expand_timesteps``, one transformer, Wan 2.2's VAE) to ``out_dir``; the same
    ``seed`` gives identical weights."""
    pipe = WanPipeline(
        **_text_components(seed),
        vae=_seeded(seed, 1, _ti2v_vae),
        scheduler=_scheduler(TI2V_FLOW_SHIFT),
        transformer=_seeded(seed, 2, lambda: _transformer(TI2V_LATENT_CHANNELS, rope_max_seq_len=64)),
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,
    )
    return _save(pipe, out_dir, "wan22_ti2v")


def build_i2v(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny Wan 2.2 I2V-A14B-like pipeline (``WanImageToVideoPipeline`` with
    ``boundary_ratio``, two experts reading ``2 x z_dim + 4`` channels, no CLIP image encoder)
    to ``out_dir``; the same ``seed`` gives identical weights. The text encoder, VAE and
    experts' sizes are :func:`build`'s."""
    channels = 2 * LATENT_CHANNELS + I2V_MASK_CHANNELS

    def expert() -> WanTransformer3DModel:
        return _transformer(channels, out_channels=LATENT_CHANNELS)

    pipe = WanImageToVideoPipeline(
        **_text_components(seed),
        vae=_seeded(seed, 1, _vae),
        # Shift 3 (as build's, not I2V-A14B's published 5): 3 steps are then 999, 857, 600,
        # so a tiny run's two SDE steps reach both experts across the 900 boundary.
        scheduler=_scheduler(),
        image_processor=None,
        image_encoder=None,
        transformer=_seeded(seed, 2, expert),
        transformer_2=_seeded(seed, 3, expert),
        boundary_ratio=I2V_BOUNDARY_RATIO,
    )
    return _save(pipe, out_dir, "wan22_i2v")
