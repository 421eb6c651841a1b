"""Which ``WanPipeline`` directories are which Wan 2.2 model (the ``checkpoint_check`` of
the ``wan2_2`` and ``wan2_2_ti2v`` families).

``WanPipeline`` runs three kinds of checkpoint: Wan 2.1 (one transformer), Wan 2.2
TI2V-5B (one transformer, ``expand_timesteps``: per-token timesteps) and Wan 2.2 A14B
(two experts switched at ``boundary_ratio``). :func:`two_expert_wan` claims A14B for
``wan2_2``, :func:`ti2v_wan` claims TI2V-5B for ``wan2_2_ti2v``; Wan 2.1 is neither's. The
core has already checked that the family's trainable components are listed in
``model_index.json`` and have a ``config.json``; these read the rest with the standard
library only (they run while the configuration is resolved).
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


def _listed(model_index: Mapping[str, Any], component: str) -> bool:
    """Whether ``model_index.json`` lists ``component`` as loaded (``[library, class]``;
    diffusers writes ``[null, null]`` for an optional component that is absent)."""
    entry = model_index.get(component)
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry)


def ti2v_wan(directory: Path, model_index: Mapping[str, Any]) -> str | None:
    """None for a Wan 2.2 TI2V-5B pipeline (one transformer, ``expand_timesteps``, the
    transformer denoising the VAE's latent channels), else why the directory is not one."""
    if not model_index.get("expand_timesteps"):
        return "expand_timesteps is not set (Wan 2.1 or Wan 2.2 A14B; TI2V-5B gives every latent token its own timestep)"
    if _listed(model_index, EXPERTS[1]) or model_index.get("boundary_ratio") is not None:
        return f"it lists {EXPERTS[1]} or a boundary_ratio (a two-expert pipeline; TI2V-5B has one transformer)"
    transformer = component_config(directory, EXPERTS[0]) or {}
    vae = component_config(directory, "vae") or {}
    channels, z_dim = transformer.get("in_channels"), vae.get("z_dim")
    if not isinstance(channels, int) or channels != z_dim:
        return f"the transformer's in_channels {channels!r} differ from the VAE's z_dim {z_dim!r} (TI2V-5B denoises the VAE's latents)"
    return None
