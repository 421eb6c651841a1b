"""The Qwen-Image model family: loading, native size and the tiny pipeline factory.

Import-light: torch and diffusers are imported only inside methods that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from miles_core.family import ModelFamily, read_component_config

DEFAULT_SAMPLE_SIZE = 128
"""``QwenImagePipeline.default_sample_size``, hard-coded in its ``__init__`` (diffusers 0.42);
multiplied by ``vae_scale_factor`` it gives the default output side."""


class QwenImageFamily(ModelFamily):
    """Qwen-Image (``QwenImagePipeline``): 2x2-packed latents, true CFG."""

    pipeline_class: ClassVar[str] = "diffusers:QwenImagePipeline"

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny random Qwen-Image pipeline to ``out_dir`` (see :mod:`.tiny`)."""
        from miles_qwen_image.tiny import build

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``default_sample_size * vae_scale_factor`` for both sides, where the pipeline
        takes ``vae_scale_factor = 2 ** len(vae.temperal_downsample)``."""
        vae = read_component_config(checkpoint, "vae")
        if vae is None:
            return None
        # The VAE's own default when the config omits it: [False, True, True].
        downsample = vae.get("temperal_downsample", [False, True, True])
        side = DEFAULT_SAMPLE_SIZE * 2 ** len(downsample)
        return side, side
