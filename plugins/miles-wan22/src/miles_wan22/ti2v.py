"""The Wan 2.2 TI2V-5B model family (``wan2_2_ti2v``): text- and image-to-video, one transformer.

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
CFG.

Image-to-video (a request with ``image_path``; ``image_input = "optional"``) is what
``WanImageToVideoPipeline(expand_timesteps=True)`` does with the same checkpoint: the
image, resized to the video and scaled to [-1, 1], is encoded alone to one latent frame
(the VAE posterior's mode, normalised), which :meth:`WanTI2VFamily.encode` puts in the
conditioning as ``image_latents`` (``[1, z, 1, h, w]``; it travels to the trainer with the
text embeddings). The transformer's input is that frame followed by the noisy frames,
with timestep 0 on the image frame's tokens and ``t`` on the others, for both CFG passes.

One deliberate difference from diffusers: the denoised state in image mode is latent
frames ``1..`` only. The pipeline draws noise over all frames, steps frame 0 too and
overwrites it with the image latent before every call and after the loop, so its frame 0
never matters; here it is not part of the state at all, so the image frame (never noised)
does not enter the SDE's log-probabilities, the trajectory or the trainer's pairs.
:meth:`WanTI2VFamily.initial_latents` draws the pipeline's full noise per output and keeps
frames ``1..``; :meth:`WanTI2VFamily.predict` returns the velocity of frames ``1..``;
:meth:`WanTI2VFamily.final_latents` puts the image frame back in front before decoding.
The Euler (ODE) path is therefore the pipeline's, frame for frame. ``predict`` decides
the mode from the conditioning (``image_latents`` present), never from
``GenerationParams.image``: the trainer's parameters carry no image.

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    check_flow_shift,
    request_extras,
    request_fps,
    request_image,
    request_max_sequence_length,
)
from miles_wan22.wan_base import IMAGE_LATENTS, MAX_SEQUENCE_LENGTH, WAN_MAX_SEQUENCE_LENGTH, WanFamilyBase

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

TRANSFORMER = "transformer"


class WanTI2VFamily(WanFamilyBase):
    """Wan 2.2 TI2V-5B text- and image-to-video: ``transformer`` with per-token timesteps."""

    family_name = "wan2_2_ti2v"
    image_input: ClassVar[str] = "optional"

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
        image = request_image(request)
        temporal = pipe.vae_scale_factor_temporal
        if image is not None and frames <= temporal:
            # One latent frame would be the image itself: nothing left to denoise.
            raise RequestError(
                "num_frames",
                f"{frames}: image-to-video needs frames after the conditioning image, at least {temporal + 1} "
                f"(1 + the VAE's temporal factor {temporal})",
            )
        return GenerationParams(
            height=height,
            width=width,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            num_frames=frames,
            fps=fps,
            extra=resolved,
            flow_shift=shift,
            image=image,
        )

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        """The text embeddings (:meth:`WanFamilyBase.encode`) and, with an image, its latent
        frame as ``positive["image_latents"]``: ``[1, z, 1, h, w]`` in fp32, the normalised
        VAE mode of the image alone, as ``WanImageToVideoPipeline.prepare_latents`` builds
        its ``condition`` in ``expand_timesteps`` mode."""
        import torch

        cond = super().encode(prompt, negative_prompt, params)
        if params.image is not None:
            with torch.no_grad():  # frozen VAE; the latent is data, like the text embeddings
                cond.positive[IMAGE_LATENTS] = self._normalised_latent_mean(self._condition_pixels(params).unsqueeze(2))
        return cond

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """The text embeddings' shapes and, with an image, its latent frame's
        ``[1, z, 1, h, w]`` in fp32 (as :meth:`encode` gives them)."""
        import torch

        cond = super().plan_conditioning(params)
        if params.image is not None:
            z, _, height, width = self._latent_shape(params)
            cond.positive[IMAGE_LATENTS] = torch.zeros(1, z, 1, height, width, device=self.device, dtype=torch.float32)
        return cond

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        """The pipeline's noise over all latent frames, one draw per output; in image mode
        the state keeps frames ``1..`` (frame 0 is the image, see the module docstring)."""
        latents = super().initial_latents(params, generators)
        if params.image is None:
            return latents
        return {"latents": latents["latents"][:, :, 1:].contiguous()}

    def token_timesteps(self, timestep: torch.Tensor, latents: torch.Tensor, *, image_frame: bool = False) -> torch.Tensor:
        """``[B]`` timesteps to the transformer's ``[B, tokens]``: row *b*'s timestep on
        each of its ``F/p_t x H/p_h x W/p_w`` latent tokens, in the transformer's token
        order (frame, row, column), as ``WanPipeline.__call__`` builds it in its
        ``expand_timesteps`` mode (a mask of ones times ``t``: the same values).

        ``image_frame``: ``latents`` is the image-mode model input (the image's latent
        frame first); its tokens get timestep 0, as ``WanImageToVideoPipeline`` builds it
        (``first_frame_mask`` zero on frame 0, sampled at the patch stride, times ``t``)."""
        import torch

        _, _, frames, height, width = latents.shape
        p_t, p_h, p_w = self.pipeline.transformer.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        if not image_frame:
            return timestep.reshape(-1, 1).expand(latents.shape[0], tokens)
        mask = torch.ones(frames, height, width, dtype=timestep.dtype, device=timestep.device)
        mask[0] = 0
        return timestep.reshape(-1, 1) * mask[::p_t, ::p_h, ::p_w].flatten()

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        """The guided velocity of the state. Image mode (``cond`` carries
        ``image_latents``): the transformer sees the image frame then the state, the image
        frame's tokens at timestep 0, and the velocity of the state's frames comes back."""
        import torch

        x = latents["latents"].to(self.device, self.dtype)
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0])
        image = cond.positive.get(IMAGE_LATENTS)
        if image is None:
            v = self._guided_velocity(self.pipeline.transformer, x, self.token_timesteps(t, x), cond, params, params.guidance_scale)
            return {"latents": v.float()}
        if image.shape[0] != x.shape[0] or image.shape[2] != 1 or image.shape[3:] != x.shape[3:]:
            raise ValueError(f"image latents of shape {tuple(image.shape)} do not fit the latents' {tuple(x.shape)} (batch, 1 frame, h, w)")
        model_input = torch.cat([image.to(self.device, self.dtype), x], dim=2)
        timesteps = self.token_timesteps(t, model_input, image_frame=True)
        v = self._guided_velocity(self.pipeline.transformer, model_input, timesteps, cond, params, params.guidance_scale)
        return {"latents": v[:, :, 1:].float().contiguous()}

    def final_latents(self, latents: Latents, cond: Conditioning, params: GenerationParams) -> Latents:
        """Image mode: the image's latent frame (from ``cond``) in front of the denoised
        frames, the whole video's latents, as the pipeline's last overwrite of frame 0;
        text mode: the state itself."""
        import torch

        image = cond.positive.get(IMAGE_LATENTS)
        if image is None:
            return latents
        x = latents["latents"]
        return {"latents": torch.cat([image.to(x.device, x.dtype), x], dim=2)}

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
