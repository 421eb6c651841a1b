"""Which ``WanPipeline`` directories are which Wan 2.2 model (the ``checkpoint_check`` of
the ``wan2_2`` and ``wan2_2_ti2v`` families), and which ``WanImageToVideoPipeline``
directories are Wan 2.2 I2V-A14B (``wan2_2_i2v``: :func:`i2v_wan`).

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


def i2v_wan(directory: Path, model_index: Mapping[str, Any]) -> str | None:
    """None for a Wan 2.2 I2V-A14B pipeline (two experts switched at ``boundary_ratio``, no
    CLIP image encoder, experts reading ``2 x z_dim + 4`` channels: the latents, the
    first-frame mask and the image latents), else why the directory is not one.
    ``WanImageToVideoPipeline`` also runs Wan 2.1 I2V (one transformer with CLIP image
    embeddings) and, with ``expand_timesteps``, TI2V-5B's image mode."""
    reason = two_expert_wan(directory, model_index)
    if reason is not None:
        return reason
    experts = {name: component_config(directory, name) or {} for name in EXPERTS}
    return i2v_configs_problem(
        image_encoder=_listed(model_index, "image_encoder"), experts=experts, vae=component_config(directory, "vae") or {}
    )


def i2v_configs_problem(*, image_encoder: bool, experts: Mapping[str, Mapping[str, Any]], vae: Mapping[str, Any]) -> str | None:
    """None when the configs are Wan 2.2 I2V-A14B's image input, else why not: no CLIP
    image encoder, no expert with an ``image_dim`` (both are Wan 2.1 I2V's CLIP image
    embeddings) and every expert reading ``2 x z_dim + mask`` channels (the latents, the
    first-frame mask of the VAE's ``scale_factor_temporal`` channels, the image latents)
    and predicting ``z_dim``. The one statement of these rules: :func:`i2v_wan` passes the
    JSON configs of a directory, :class:`~miles_wan22.i2v.WanI2VFamily` a loaded pipeline's
    (``experts`` maps each expert present to its config)."""
    if image_encoder:
        return "it lists an image_encoder (CLIP image embeddings: Wan 2.1 I2V; Wan 2.2 I2V-A14B conditions on VAE latents only)"
    for name, config in experts.items():
        if config.get("image_dim") is not None:
            return f"the {name}'s image_dim is {config['image_dim']!r} (CLIP image embeddings: Wan 2.1 I2V)"
    # The mask has WanImageToVideoPipeline's vae_scale_factor_temporal channels.
    z_dim, mask = vae.get("z_dim"), vae.get("scale_factor_temporal", 4)
    for name, config in experts.items():
        channels, out = config.get("in_channels"), config.get("out_channels")
        if not isinstance(z_dim, int) or not isinstance(mask, int) or channels != 2 * z_dim + mask or out != z_dim:
            return (
                f"the {name}'s in_channels {channels!r} / out_channels {out!r} are not 2 x z_dim + {mask} / z_dim for the "
                f"VAE's z_dim {z_dim!r} (an I2V expert reads the latents, a {mask}-channel mask and the image latents)"
            )
    return None
