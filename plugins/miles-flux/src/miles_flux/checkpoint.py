"""Which FLUX pipeline a checkpoint is, told from JSON alone.

The ``flux`` family serves three diffusers pipelines that share the FLUX contract
(guidance-distilled or not, 2x2-packed latents with position ids, a flow-matching Euler
schedule) but differ in their text encoders and latent layout:

- ``FluxPipeline``: FLUX.1 [dev] (T5 + CLIP, guidance embedded in the transformer);
- ``Flux2KleinPipeline``: FLUX.2 [klein] (Qwen3; step-distilled, or the base model with
  real CFG);
- ``Flux2Pipeline``: FLUX.2 [dev] (Mistral 3, guidance embedded).

This module reads ``model_index.json`` and the transformer's ``config.json`` with the
standard library only: the plugin's configuration check runs it while the command line is
resolved, before anything heavy is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FLUX1 = "FluxPipeline"
KLEIN = "Flux2KleinPipeline"
FLUX2 = "Flux2Pipeline"
PIPELINES: dict[str, str] = {
    FLUX1: "FLUX.1 [dev]",
    KLEIN: "FLUX.2 [klein]",
    FLUX2: "FLUX.2 [dev]",
}
"""The pipeline classes the family serves -> the model's name in messages."""

HUB_NAMES: tuple[tuple[str, str], ...] = (("klein", KLEIN), ("flux.2", FLUX2), ("flux2", FLUX2), ("flux", FLUX1))
"""A hub id's (lower-cased) substring -> its pipeline class, first match wins (``klein``
before ``flux2``: fine-tunes are named ``flux2-klein-...`` too): a hub id has no
``model_index.json`` to read before it is downloaded."""


@dataclass(frozen=True)
class FluxCheckpoint:
    """What the configuration needs to know about a FLUX checkpoint."""

    pipeline: str
    """One of :data:`PIPELINES`."""
    guidance_distilled: bool
    """The guidance scale is a transformer input (``guidance_embeds``); no unconditional
    branch exists unless true CFG is asked for."""
    step_distilled: bool
    """FLUX.2 [klein]'s ``is_distilled``: the pipeline ignores the guidance scale."""
    vae_scale_factor: int
    """``2 ** (len(vae.block_out_channels) - 1)``, as the pipelines compute it."""

    @property
    def name(self) -> str:
        """The model in messages; a ``FluxPipeline`` without a guidance input is not [dev]."""
        if self.pipeline == FLUX1 and not self.guidance_distilled:
            return "FLUX.1 without a guidance input ([schnell])"
        return PIPELINES[self.pipeline]

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: the VAE factor times the 2x2 packing."""
        return self.vae_scale_factor * 2


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_checkpoint(checkpoint: str | Path) -> FluxCheckpoint | None:
    """The FLUX checkpoint at ``checkpoint`` (a local directory or a hub id), or None when it
    is none of :data:`PIPELINES`. A hub id is told by its name, with the released models'
    settings (a FLUX.2 [klein] name without "base" read as the step-distilled release)."""
    directory = Path(checkpoint)
    index = _read(directory / "model_index.json") if directory.is_dir() else None
    if index is None:
        if directory.exists():
            return None
        lowered = str(checkpoint).lower()
        pipeline = next((cls for part, cls in HUB_NAMES if part in lowered), None)
        if pipeline is None:
            return None
        # The released names: FLUX.1 [schnell] has no guidance input, FLUX.2 [klein] base
        # ("FLUX.2-klein-base-4B") is not step-distilled.
        return FluxCheckpoint(
            pipeline,
            guidance_distilled=pipeline == FLUX2 or (pipeline == FLUX1 and "schnell" not in lowered),
            step_distilled=pipeline == KLEIN and "base" not in lowered,
            vae_scale_factor=8,
        )
    pipeline = index.get("_class_name")
    if pipeline not in PIPELINES:
        return None
    transformer = _read(directory / "transformer" / "config.json") or {}
    vae = _read(directory / "vae" / "config.json") or {}
    blocks = vae.get("block_out_channels")
    factor = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8
    return FluxCheckpoint(
        pipeline,
        guidance_distilled=bool(transformer.get("guidance_embeds", False)),  # config.json lists every init argument
        step_distilled=pipeline == KLEIN and bool(index.get("is_distilled", False)),
        vae_scale_factor=factor,
    )
