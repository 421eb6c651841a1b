"""The Wan 2.2 model family: loading, native size and the tiny pipeline factory.

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

from pathlib import Path

from miles_core.family import ModelFamily

# WanPipeline.__call__ defaults (diffusers 0.42): the size is fixed in the signature and
# not read from any config, so it is the same for every checkpoint (tests pin it).
WAN_DEFAULT_HEIGHT = 480
WAN_DEFAULT_WIDTH = 832


class Wan22Family(ModelFamily):
    """Wan 2.2 text-to-video: ``transformer`` (high noise) and ``transformer_2`` (low noise)."""

    pipeline_class = "diffusers:WanPipeline"

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny, randomly initialised two-expert WanPipeline to ``out_dir``."""
        from miles_wan22.tiny import build

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(480, 832)``: WanPipeline's hard-coded default, whatever the checkpoint."""
        return (WAN_DEFAULT_HEIGHT, WAN_DEFAULT_WIDTH)
