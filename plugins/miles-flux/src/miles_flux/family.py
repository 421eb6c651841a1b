"""The FLUX model family: one registered family (``flux``) for three diffusers pipelines.

``FluxFamily`` is what the ``flux`` spec names. Its class side loads whichever of
``FluxPipeline`` (FLUX.1 [dev]), ``Flux2KleinPipeline`` (FLUX.2 [klein]) or
``Flux2Pipeline`` (FLUX.2 [dev]) a checkpoint's ``model_index.json`` names, builds the tiny
pipelines and reads the native size. Its instance side differs by generation, so
constructing ``FluxFamily(pipeline)`` returns the subclass that serves that pipeline:
:class:`miles_flux.flux1.Flux1Family` or :class:`miles_flux.flux2.Flux2Family`. Code that
only holds the spec (the engine, the trainer) never needs to know which.

Import-light on purpose: torch and diffusers are imported inside methods.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import CheckpointError, Conditioning, ModelFamily
from miles_flux.checkpoint import FLUX1, FLUX2, KLEIN, PIPELINES, read_checkpoint
from miles_flux.tiny import VARIANTS

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from miles_core.api import GenerationParams, RolloutRequest

DEFAULT_SAMPLE_SIZE = 128
"""``default_sample_size`` of all three pipelines (hard-coded in their ``__init__``, diffusers
0.42): times ``vae_scale_factor`` it is the default output side."""

INSTANCE_CLASSES: dict[str, str] = {
    FLUX1: "miles_flux.flux1:Flux1Family",
    KLEIN: "miles_flux.flux2:Flux2Family",
    FLUX2: "miles_flux.flux2:Flux2Family",
}
"""Pipeline class name -> the subclass that serves it."""


def _instance_class(pipeline: Any) -> type[FluxFamily]:
    name = type(pipeline).__name__
    ref = INSTANCE_CLASSES.get(name)
    if ref is None:
        raise TypeError(f"the flux family serves {', '.join(PIPELINES)}; got a {name}")
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


class FluxFamily(ModelFamily):
    """FLUX.1 [dev] and FLUX.2 [klein] (and [dev]): guidance-distilled flow matching on
    2x2-packed latents. ``FluxFamily(pipeline)`` is a :class:`~miles_flux.flux1.Flux1Family`
    or a :class:`~miles_flux.flux2.Flux2Family`, chosen by the pipeline's class."""

    pipeline_class: ClassVar[str] = "diffusers:FluxPipeline"
    """The class loaded when the checkpoint does not say (a hub id matched by name)."""
    tiny_variants: ClassVar[tuple[str, ...]] = VARIANTS
    """``miles-core make-tiny flux DIR --variant V``: ``dev`` (FLUX.1 [dev], the default),
    ``klein`` (FLUX.2 [klein], step-distilled) and ``klein-base`` (its undistilled base,
    sampled with real CFG)."""

    def __new__(cls, pipeline: DiffusionPipeline, *args: Any, **kwargs: Any) -> FluxFamily:
        # The registered class stands for the three pipelines; the instance is the
        # subclass for the one loaded (its __init__ then runs as usual).
        target = _instance_class(pipeline) if cls is FluxFamily else cls
        return super().__new__(target)

    # -- instance side shared by the generations ------------------------------------

    model_name: ClassVar[str] = "FLUX"
    """The model in messages (``FLUX.1 [dev]``, ``FLUX.2 [klein]``)."""
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt when guidance needs one and the request gives none."""

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer}

    def _image_request(self, request: RolloutRequest) -> tuple[dict[str, int], dict[str, Any]]:
        """What both generations check alike: ``height`` / ``width`` (default: the
        pipeline's native size) as multiples of the VAE factor times the 2x2 packing
        (``check_inputs`` only warns and rounds down; a size it would not produce is
        refused), one frame, and the extras they read (``max_sequence_length``,
        ``flow_shift``, checked against the scheduler). Returns the sizes and the extras."""
        from miles_core.api import FLOW_SHIFT, RequestError, check_flow_shift, request_extras, request_size

        pipe = self.pipeline
        native = pipe.default_sample_size * pipe.vae_scale_factor
        multiple = pipe.vae_scale_factor * 2
        sizes = {
            name: request_size(name, getattr(request, name), native, multiple, rule=" (VAE factor x 2x2 packing)")
            for name in ("height", "width")
        }
        if request.num_frames not in (None, 1):
            raise RequestError("num_frames", f"{self.model_name} generates images (1 frame), got {request.num_frames}")
        extra = request_extras(request, ("max_sequence_length", FLOW_SHIFT), family=self.model_name)
        check_flow_shift(pipe.scheduler, request.flow_shift)
        return sizes, extra

    def _cfg(self, params: GenerationParams) -> bool:
        """Whether sampling with ``params`` makes an unconditional call per step."""
        raise NotImplementedError

    def _encode_one(self, prompt: str, params: GenerationParams) -> dict[str, torch.Tensor]:
        """The pipeline's ``encode_prompt`` for one prompt, batch 1."""
        raise NotImplementedError

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        positive = self._encode_one(prompt, params)
        if not self._cfg(params):
            return Conditioning(positive, None)
        negative = self._encode_one(self.default_negative_prompt if negative_prompt is None else negative_prompt, params)
        return Conditioning(positive, negative)

    def _plan_one(self, params: GenerationParams) -> dict[str, torch.Tensor]:
        """What :meth:`_encode_one` returns, by shape, at the full prompt length."""
        raise NotImplementedError

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        return Conditioning(self._plan_one(params), self._plan_one(params) if self._cfg(params) else None)

    def _check_pixels(self, pixels: torch.Tensor) -> None:
        """``encode_pixels``' input: images ``[B, C, H, W]`` whose sides the packing splits."""
        if pixels.ndim != 4:
            raise ValueError(f"{self.model_name} encodes images [B, C, H, W], got shape {tuple(pixels.shape)}")
        multiple = self.pipeline.vae_scale_factor * 2
        if pixels.shape[-2] % multiple or pixels.shape[-1] % multiple:
            raise ValueError(
                f"{self.model_name} encodes images whose sides are multiples of {multiple} (VAE factor x 2x2 packing), "
                f"got {tuple(pixels.shape[-2:])}"
            )

    def context_parallel_plan(self, component: str, module: torch.nn.Module, degree: int) -> dict | None:
        """diffusers' plan, behind a check that the split divides the text and image token
        counts (:mod:`miles_flux.sequence_parallel`: FLUX's text has no mask to pad with)."""
        from miles_flux.sequence_parallel import install

        return install(module, degree)

    # -- class side -------------------------------------------------------------------

    @classmethod
    def pipeline_class_for(cls, checkpoint: str | Path) -> str:
        """The diffusers class name of ``checkpoint``'s pipeline: what its
        ``model_index.json`` names, or a hub id's name tells (``FluxPipeline`` when it
        tells nothing, as for any hub id the family was chosen for by flag). A
        :class:`~miles_core.api.CheckpointError` for a local directory of another pipeline
        and for FLUX.2 [dev], refused before its weights are read."""
        found = read_checkpoint(checkpoint)
        if found is None:
            if not Path(checkpoint).exists():
                return FLUX1
            raise CheckpointError(
                f"--hf-checkpoint {checkpoint}: not a FLUX pipeline (the flux family serves "
                f"{', '.join(f'{c} ({n})' for c, n in PIPELINES.items() if c != FLUX2)}; model_index.json names neither)"
            )
        if found.pipeline == FLUX2:
            from miles_flux.flux2 import FLUX2_DEV_REFUSAL

            raise CheckpointError(f"--hf-checkpoint {checkpoint}: {FLUX2_DEV_REFUSAL}")
        return found.pipeline

    @classmethod
    def resolve_pipeline_class(cls, checkpoint: str | Path | None = None) -> type[DiffusionPipeline]:
        """The class :meth:`~miles_core.api.ModelFamily.load_pipeline` loads ``checkpoint``
        with: the one its ``model_index.json`` (or a hub id's name) names."""
        if checkpoint is None:
            return super().resolve_pipeline_class()
        import diffusers

        return getattr(diffusers, cls.pipeline_class_for(checkpoint))

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0, variant: str = "dev") -> Path:
        """Write a tiny random FLUX pipeline of ``variant`` (:attr:`tiny_variants`) to
        ``out_dir`` (see :mod:`miles_flux.tiny`)."""
        from miles_flux.tiny import build

        return build(out_dir, seed=seed, variant=variant)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``default_sample_size * vae_scale_factor`` on both sides, with the pipelines'
        ``vae_scale_factor = 2 ** (len(vae.block_out_channels) - 1)``; None for a hub id."""
        if not Path(checkpoint).is_dir():
            return None
        found = read_checkpoint(checkpoint)
        if found is None:
            return None
        side = DEFAULT_SAMPLE_SIZE * found.vae_scale_factor
        return side, side
