"""Which ``WanPipeline`` directories are Wan 2.2 A14B (the ``wan2_2`` family's
``checkpoint_check``).

``WanPipeline`` runs three kinds of checkpoint: Wan 2.1 (one transformer), Wan 2.2
TI2V-5B (one transformer, ``expand_timesteps``) and Wan 2.2 A14B (two experts switched at
``boundary_ratio``). Only the last is this family's. The core has already checked that
both experts are listed in ``model_index.json`` and have a ``config.json``; this reads the
rest with the standard library only (it runs while the configuration is resolved).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_core.api import component_config

EXPERTS = ("transformer", "transformer_2")
SHARED_SHAPE = ("in_channels", "out_channels", "patch_size")
"""Expert config keys that must agree: both experts denoise the same latents."""


def two_expert_wan(directory: Path, model_index: Mapping[str, Any]) -> str | None:
    """None for a two-expert Wan 2.2 pipeline, else why the directory is not one."""
    ratio = model_index.get("boundary_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        return f"boundary_ratio {ratio!r} (a two-expert Wan 2.2 pipeline switches experts at a ratio in (0, 1))"
    if model_index.get("expand_timesteps"):
        return "expand_timesteps is set (Wan 2.2 TI2V-5B, a single-expert pipeline)"
    high, low = (component_config(directory, name) or {} for name in EXPERTS)
    differing = [key for key in SHARED_SHAPE if high.get(key) != low.get(key)]
    if differing:
        return (
            f"the experts' {', '.join(differing)} differ ({EXPERTS[0]}: {[high.get(k) for k in differing]}, "
            f"{EXPERTS[1]}: {[low.get(k) for k in differing]})"
        )
    return None
