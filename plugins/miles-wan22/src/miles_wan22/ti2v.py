"""The Wan 2.2 TI2V-5B model family (``wan2_2_ti2v``): text-to-video, one transformer.

TI2V-5B loads as diffusers' ``WanPipeline`` in its ``expand_timesteps`` mode: one dense
5B transformer (no ``transformer_2``, no ``boundary_ratio``) over the latents of Wan 2.2's
own VAE (48 channels, 16x spatial: 2x2 pixel patches in front of an 8x encoder, 4x
temporal). ``WanPipeline.__call__`` then gives the transformer one timestep per latent
token instead of one per sample: ``(mask[0][0][:, ::2, ::2] * t).flatten()``, with a mask
of ones for text-to-video, i.e. ``t`` repeated over the ``F x H/2 x W/2`` tokens, the same
row for every sample. The transformer embeds each token's timestep and modulates that
token with it.

:meth:`WanTI2VFamily.predict` takes the contract's ``[B]`` timestep (the engine's step, or
the trainer's per-row step of a micro-batch that mixes steps) and expands each row to its
tokens (:meth:`WanTI2VFamily.token_timesteps`) before the pipeline's transformer calls and
CFG. Image-to-video on this checkpoint conditions the first latent frame and gives its
tokens timestep 0; an image mode would override :meth:`WanTI2VFamily.token_timesteps`
(and the latents it denoises), nothing else.

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

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
from miles_wan22.wan_base import MAX_SEQUENCE_LENGTH, WAN_MAX_SEQUENCE_LENGTH, WanFamilyBase

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

TRANSFORMER = "transformer"


class WanTI2VFamily(WanFamilyBase):
    """Wan 2.2 TI2V-5B text-to-video: ``transformer`` with per-token timesteps."""

    family_name = "wan2_2_ti2v"

    def __init__(self, pipeline: Any, *, device: Any = "cpu", dtype: Any = None) -> None:
        super().__init__(pipeline, device=device, dtype=dtype)
        config = pipeline.config
        if not config.get("expand_timesteps") or getattr(pipeline, "transformer_2", None) is not None or pipeline.transformer is None:
            raise ValueError(
                "the wan2_2_ti2v family needs a one-transformer WanPipeline with expand_timesteps (Wan 2.2 TI2V-5B); "
                f"this one has expand_timesteps={config.get('expand_timesteps')!r}, "
                f"transformer_2 {'present' if getattr(pipeline, 'transformer_2', None) is not None else 'absent'}"
            )
        channels, z_dim = pipeline.transformer.config.in_channels, pipeline.vae.config.z_dim
        if channels != z_dim:
            raise ValueError(f"the transformer's in_channels {channels} differ from the VAE's z_dim {z_dim}")

    # -- instance side: the prediction contract ---------------------------------------

    def components(self) -> dict[str, torch.nn.Module]:
        return {TRANSFORMER: self.pipeline.transformer}

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        height, width, frames = self._video_size(request)
        fps = request_fps(request.fps, None)
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "Wan 2.2 TI2V-5B has no true CFG; use guidance_scale")
        # No guidance_scale_2: WanPipeline refuses it without a boundary_ratio (one transformer).
        extra = request_extras(request, sorted((MAX_SEQUENCE_LENGTH, FLOW_SHIFT)), family="Wan 2.2 TI2V-5B")
        resolved: dict[str, Any] = {}
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

    def token_timesteps(self, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """``[B]`` timesteps to the transformer's ``[B, tokens]``: row *b*'s timestep on
        each of its ``F/p_t x H/p_h x W/p_w`` latent tokens, in the transformer's token
        order (frame, row, column), as ``WanPipeline.__call__`` builds it in its
        ``expand_timesteps`` mode (a mask of ones times ``t``: the same values)."""
        _, _, frames, height, width = latents.shape
        p_t, p_h, p_w = self.pipeline.transformer.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        return timestep.reshape(-1, 1).expand(latents.shape[0], tokens)

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        x = latents["latents"].to(self.device, self.dtype)
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0])
        v = self._guided_velocity(self.pipeline.transformer, x, self.token_timesteps(t, x), cond, params, params.guidance_scale)
        return {"latents": v.float()}

    def save_lora(self, directory: str | Path, modules: Mapping[str, torch.nn.Module]) -> Path:
        """Write the transformer's adapter as a diffusers Wan LoRA
        (``DIRECTORY/pytorch_lora_weights.safetensors``, keys ``transformer.*``, the
        adapter config as metadata): ``pipe.load_lora_weights(DIRECTORY)`` loads it into
        a plain ``WanPipeline``, and so does :meth:`load_lora` (``generate --lora``)."""
        if set(modules) != {TRANSFORMER}:
            raise ValueError(f"Wan 2.2 TI2V-5B LoRAs cover {TRANSFORMER} only; got {', '.join(sorted(modules)) or 'nothing'}")
        root = Path(directory)
        self._save_adapter(root, TRANSFORMER, modules[TRANSFORMER])
        return root

    # -- class side -------------------------------------------------------------------

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny, randomly initialised TI2V-5B-like WanPipeline to ``out_dir``."""
        from miles_wan22.tiny import build_ti2v

        return build_ti2v(out_dir, seed=seed)
