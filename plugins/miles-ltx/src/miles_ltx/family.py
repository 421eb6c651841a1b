"""The LTX-2 / LTX-2.3 model family (diffusers ``LTX2Pipeline``).

Import-light like :mod:`miles_core.family`: torch and diffusers load only inside the
methods that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from miles_core.family import ModelFamily

# LTX2Pipeline.__call__ defaults (height=512, width=768): hard-coded in the signature, not
# read from any component config, so they hold for every LTX-2 checkpoint.
_DEFAULT_HEIGHT = 512
_DEFAULT_WIDTH = 768


class LtxFamily(ModelFamily):
    """LTX-2 / LTX-2.3: video latents plus an audio latent branch, Gemma 3 text encoder."""

    pipeline_class: ClassVar[str] = "diffusers:LTX2Pipeline"

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write the tiny LTX-2 pipeline (see :mod:`miles_ltx.tiny`) to ``out_dir``."""
        from miles_ltx import tiny  # heavy: torch, diffusers, transformers

        return tiny.build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(512, 768)``: ``LTX2Pipeline``'s ``height`` / ``width`` defaults, which do not
        depend on the checkpoint."""
        return (_DEFAULT_HEIGHT, _DEFAULT_WIDTH)
