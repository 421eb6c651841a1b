"""Tiny random FLUX pipelines (real diffusers/transformers classes), one per variant.

Reached only through :meth:`miles_flux.family.FluxFamily.build_tiny_pipeline`; the
builders (:mod:`miles_flux.tiny_flux1`, :mod:`miles_flux.tiny_flux2`) import torch,
diffusers and transformers.
"""

from __future__ import annotations

from pathlib import Path

VARIANTS = ("dev", "klein", "klein-base")
"""``dev``: FLUX.1 [dev] (``FluxPipeline``); ``klein``: FLUX.2 [klein], step-distilled;
``klein-base``: its undistilled base (``is_distilled`` false: real CFG)."""


def build(out_dir: str | Path, *, seed: int = 0, variant: str = "dev") -> Path:
    """Write the tiny pipeline of ``variant`` to ``out_dir``, deterministic in ``seed``."""
    if variant == "dev":
        from miles_flux.tiny_flux1 import build as build_flux1

        return build_flux1(out_dir, seed=seed)
    if variant in ("klein", "klein-base"):
        from miles_flux.tiny_flux2 import build_klein

        return build_klein(out_dir, seed=seed, distilled=variant == "klein")
    raise ValueError(f"variant {variant!r}: the flux family's tiny variants are {', '.join(VARIANTS)}")
