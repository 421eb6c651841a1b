"""The Wan 2.2 model family: two denoising experts, text-to-video.

``WanPipeline`` with ``boundary_ratio`` set runs ``transformer`` (the high-noise expert)
while the timestep is at or above ``boundary_ratio x num_train_timesteps`` and
``transformer_2`` (the low-noise expert) below, each with its own guidance scale
(``guidance_scale`` and ``guidance_scale_2``). This family reproduces that call for
call: :meth:`Wan22Family.predict` picks the expert by timestep and applies CFG as two
transformer calls (conditional first, then unconditional), exactly as
``WanPipeline.__call__`` does; :meth:`Wan22Family.denoiser_for` tells the trainer which
expert a step belongs to, so a micro-batch never mixes the two.

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    check_flow_shift,
    request_extras,
    request_fps,
    request_max_sequence_length,
)
from miles_wan22.wan_base import (
    MAX_SEQUENCE_LENGTH,
    WAN_DEFAULT_HEIGHT,
    WAN_DEFAULT_NUM_FRAMES,
    WAN_DEFAULT_WIDTH,
    WAN_MAX_SEQUENCE_LENGTH,
    WanFamilyBase,
)

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

__all__ = [
    "EXPERTS",
    "WAN_DEFAULT_HEIGHT",
    "WAN_DEFAULT_NUM_FRAMES",
    "WAN_DEFAULT_WIDTH",
    "WAN_MAX_SEQUENCE_LENGTH",
    "Wan22Family",
]

EXPERTS = ("transformer", "transformer_2")
"""High-noise expert first, low-noise expert second."""
GUIDANCE_SCALE_2 = "guidance_scale_2"
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""diffusers' LoRA file name; :meth:`Wan22Family.save_lora` writes one per expert, in a
folder named after the expert."""


class Wan22Family(WanFamilyBase):
    """Wan 2.2 text-to-video: ``transformer`` (high noise) and ``transformer_2`` (low noise).

    Text encoding, latents, schedule, decoding and ``encode_pixels`` are
    :class:`~miles_wan22.wan_base.WanFamilyBase`'s."""

    family_name = "wan2_2"
    _other_models: str = "Wan 2.2 TI2V-5B is family wan2_2_ti2v; Wan 2.1 is not supported"
    """What a refused pipeline may be instead, for the two-expert check's message."""

    def __init__(self, pipeline: Any, *, device: Any = "cpu", dtype: Any = None) -> None:
        super().__init__(pipeline, device=device, dtype=dtype)
        config = pipeline.config
        missing = [name for name in EXPERTS if getattr(pipeline, name, None) is None]
        if config.get("boundary_ratio") is None or missing:
            raise ValueError(
                f"the {self.family_name} family needs a two-expert {type(pipeline).__name__} (boundary_ratio set, "
                f"transformer and transformer_2 present); this one has boundary_ratio={config.get('boundary_ratio')!r}"
                + (f" and no {', '.join(missing)}" if missing else "")
                + f" ({self._other_models})"
            )
        if config.get("expand_timesteps"):
            raise ValueError(
                f"the {self.family_name} family does not support expand_timesteps pipelines (Wan 2.2 TI2V-5B: family wan2_2_ti2v)"
            )

    # -- instance side: the prediction contract ---------------------------------------

    def components(self) -> dict[str, torch.nn.Module]:
        return {name: getattr(self.pipeline, name) for name in EXPERTS}

    @property
    def boundary_timestep(self) -> float:
        """``boundary_ratio x num_train_timesteps``: the first expert at or above it."""
        return float(self.pipeline.config.boundary_ratio) * float(self.pipeline.scheduler.config.num_train_timesteps)

    def denoiser_for(self, timestep: torch.Tensor | float, params: GenerationParams) -> str:
        """``transformer`` at or above :attr:`boundary_timestep`, ``transformer_2`` below
        (``WanPipeline.__call__``'s ``t >= boundary_timestep``)."""
        return EXPERTS[0] if float(timestep) >= self.boundary_timestep else EXPERTS[1]

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        height, width, frames = self._video_size(request)
        fps = request_fps(request.fps, None)
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "Wan 2.2 has no true CFG; use guidance_scale and guidance_scale_2")
        extra = request_extras(request, sorted((GUIDANCE_SCALE_2, MAX_SEQUENCE_LENGTH, FLOW_SHIFT)), family="Wan 2.2")
        resolved: dict[str, Any] = {}
        scale_2 = extra.get(GUIDANCE_SCALE_2)
        if scale_2 is None:
            # WanPipeline.__call__: with boundary_ratio set, an unset guidance_scale_2 is
            # guidance_scale. Recorded, so the trainer rebuilds the same value from the
            # denoising_env.
            resolved[GUIDANCE_SCALE_2] = float(request.guidance_scale)
        elif isinstance(scale_2, bool) or not isinstance(scale_2, (int, float)) or not math.isfinite(scale_2) or scale_2 < 0:
            raise RequestError("extra_sampling_params", f"{GUIDANCE_SCALE_2} must be a finite number >= 0, got {scale_2!r}")
        else:
            resolved[GUIDANCE_SCALE_2] = float(scale_2)
        if MAX_SEQUENCE_LENGTH in extra:
            limit = pipe.tokenizer.model_max_length if pipe.tokenizer is not None else WAN_MAX_SEQUENCE_LENGTH
            resolved[MAX_SEQUENCE_LENGTH] = request_max_sequence_length(extra, None, limit, MAX_SEQUENCE_LENGTH)
        shift = request.flow_shift
        check_flow_shift(pipe.scheduler, shift)
        return GenerationParams(
            height=height,
            width=width,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            num_frames=frames,
            fps=fps,
            extra=resolved,
            flow_shift=shift,
        )

    def _expert_scale(self, expert: str, params: GenerationParams) -> float:
        if expert == EXPERTS[0]:
            return params.guidance_scale
        # Parameters built without resolve_params (an sglang denoising_env lacks it) take
        # diffusers' fallback too.
        return float(params.extra.get(GUIDANCE_SCALE_2, params.guidance_scale))

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        x = latents["latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        given = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(batch)
        # The expert is chosen where the caller keeps the timesteps (the memory planner's
        # are on the CPU while its model is on the meta device, which holds no values).
        high = given >= self.boundary_timestep
        t = given.to(self.device)
        if bool(high.all()) or not bool(high.any()):
            expert = EXPERTS[0] if bool(high[0]) else EXPERTS[1]
            return {"latents": self._expert_velocity(expert, x, t, cond, params).float()}
        # Rows on both sides of the boundary (the trainer never sends this; other callers
        # may): one forward per expert, rows put back in place.
        out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        for expert, rows in ((EXPERTS[0], high.nonzero().flatten()), (EXPERTS[1], (~high).nonzero().flatten())):
            rows = rows.to(self.device)
            part = _take_rows(cond, rows)
            out[rows] = self._expert_velocity(expert, x[rows], t[rows], part, params).float()
        return {"latents": out}

    def _expert_velocity(
        self,
        expert: str,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: Conditioning,
        params: GenerationParams,
    ) -> torch.Tensor:
        # WanPipeline.__call__: the expert's conditional call, then (CFG) its unconditional one.
        scale = self._expert_scale(expert, params) if self._cfg(params) else 1.0
        return self._guided_velocity(getattr(self.pipeline, expert), x, t, cond, params, scale)

    def save_lora(self, directory: str | Path, modules: Mapping[str, torch.nn.Module]) -> Path:
        """Write each expert's adapter as a diffusers LoRA in its own folder:
        ``DIRECTORY/transformer/pytorch_lora_weights.safetensors`` (high noise) and
        ``DIRECTORY/transformer_2/...`` (low noise), each with its adapter config as
        metadata (rank, alpha, targets). A plain ``WanPipeline`` loads them with::

            pipe.load_lora_weights(DIRECTORY, subfolder="transformer")
            pipe.load_lora_weights(DIRECTORY, subfolder="transformer_2", load_into_transformer_2=True)

        (diffusers' Wan LoRA format holds one transformer per file, keys ``transformer.*``;
        ``load_into_transformer_2`` routes a file to the second expert.)"""
        unknown = sorted(set(modules) - set(EXPERTS))
        if unknown:
            raise ValueError(f"Wan 2.2 LoRAs cover {', '.join(EXPERTS)}; got {', '.join(unknown)}")
        if not modules:
            raise ValueError("no module to save a LoRA of")
        root = Path(directory)
        for name, module in modules.items():
            self._save_adapter(root / name, name, module)
        return root

    def load_lora(self, directory: str | Path) -> Any:
        """Load what :meth:`save_lora` wrote (``generate --lora``): each expert's folder
        into that expert. A directory without those folders is handed to diffusers as is
        (a plain Wan LoRA file loads into ``transformer``, as ``load_lora_weights`` does)."""
        root = Path(directory)
        found = [name for name in EXPERTS if (root / name / LORA_WEIGHT_NAME).is_file()]
        if not found:
            return self.pipeline.load_lora_weights(str(root))
        for name in found:
            self.pipeline.load_lora_weights(
                str(root),
                weight_name=LORA_WEIGHT_NAME,
                subfolder=name,
                load_into_transformer_2=name == EXPERTS[1],
            )
        return None

    # -- class side -------------------------------------------------------------------

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny, randomly initialised two-expert WanPipeline to ``out_dir``."""
        from miles_wan22.tiny import build

        return build(out_dir, seed=seed)


def _take_rows(cond: Conditioning, rows: torch.Tensor) -> Conditioning:
    def take(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        return None if tensors is None else {k: v[rows.to(v.device)] for k, v in tensors.items()}

    return Conditioning(take(cond.positive), take(cond.negative))  # type: ignore[arg-type]
