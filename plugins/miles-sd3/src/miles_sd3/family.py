"""The SD3 / SD3.5 model family.

Import-light on purpose: the core resolves this class while validating a configuration
(for example to read :meth:`SD3Family.native_size`), before any model code is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from miles_core.family import ModelFamily, read_component_config

# Fallbacks mirror diffusers: SD3Transformer2DModel's default sample_size and
# AutoencoderKL's default block_out_channels, used when a config omits the key.
_DEFAULT_SAMPLE_SIZE = 128
_DEFAULT_VAE_BLOCKS: tuple[int, ...] = (64,)


class SD3Family(ModelFamily):
    """Stable Diffusion 3 / 3.5 checkpoints in the diffusers layout."""

    pipeline_class: ClassVar[str] = "diffusers:StableDiffusion3Pipeline"

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny, randomly initialised SD3 pipeline (see :mod:`miles_sd3.tiny`)."""
        from miles_sd3.tiny import build  # heavy: torch, diffusers, transformers

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(height, width)`` as StableDiffusion3Pipeline defaults them: transformer
        ``sample_size`` times the VAE scale factor ``2 ** (len(block_out_channels) - 1)``."""
        transformer = read_component_config(checkpoint, "transformer")
        if transformer is None:
            return None
        vae = read_component_config(checkpoint, "vae")
        # The pipeline falls back to a scale factor of 8 when it has no VAE.
        scale = 8 if vae is None else 2 ** (len(vae.get("block_out_channels", _DEFAULT_VAE_BLOCKS)) - 1)
        side = int(transformer.get("sample_size", _DEFAULT_SAMPLE_SIZE)) * scale
        return side, side
