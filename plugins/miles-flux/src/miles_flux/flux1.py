"""FLUX.1 [dev] (``FluxPipeline``): the instance side of the ``flux`` family.

Each step is done exactly as ``FluxPipeline.__call__`` (diffusers 0.42) does it:

- **Packed latents.** The engine's latents are the pipeline's packed tokens
  ``[B, (h/2)·(w/2), 4·C]`` (``_pack_latents``: 2x2 latent patches). Output *i*'s noise is
  drawn in the unpacked layout ``[1, C, h, w]`` from its own generator, then packed, as
  ``prepare_latents`` does with a list of generators; :meth:`Flux1Family.decode` unpacks.
- **Conditioning** (batch 1, the same shapes for every prompt, so rows of different
  prompts concatenate): ``encoder_hidden_states`` ``[1, L, D]``, T5's last hidden states,
  always padded to ``L = max_sequence_length`` tokens by the tokenizer (512, the pipeline's
  default; ``extra_sampling_params.max_sequence_length`` changes it, up to the pipeline's
  limit of 512), and ``pooled_projections`` ``[1, P]``, CLIP's pooled output. The
  transformer gets no text mask, as in the pipeline. The position ids are not part of it:
  ``txt_ids`` are zeros ``[L, 3]`` and ``img_ids`` the latent grid's ``(0, row, column)``,
  both rebuilt by :meth:`Flux1Family.predict` from the shapes.
- **Timestep input** ``timesteps / 1000`` in the latents' dtype. **Guidance**: a
  guidance-distilled transformer (``guidance_embeds``, FLUX.1 [dev]) gets
  ``guidance_scale`` as an input, one forward per step and no unconditional branch;
  otherwise ``guidance_scale`` is ignored, as the pipeline ignores it.
- **True CFG** (``true_cfg_scale > 1``): two transformer calls (conditional, then
  unconditional), ``neg + s·(pos − neg)``, without the norm rescale Qwen-Image adds. The
  pipeline runs it only with a negative prompt; the engine always supplies one:
  :attr:`Flux1Family.default_negative_prompt` (``" "``) when the request gives none.
- **Schedule**: the pipeline's ``sigmas = linspace(1, 1/T, T)`` through the scheduler with
  the dynamic shift ``mu = calculate_shift(image_seq_len, ...)`` read from the scheduler's
  config; an explicit ``flow_shift`` replaces the dynamic shift.
- **Decode**: unpack, ``latents / scaling_factor + shift_factor``, VAE decode,
  ``image · 0.5 + 0.5`` clamped to [0, 1]; :meth:`Flux1Family.encode_pixels` is the inverse
  (the posterior mean), for SFT.

Import-light on purpose: torch and diffusers are imported inside methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    Schedule,
    per_output_noise,
    request_max_sequence_length,
    scheduler_copy,
)
from miles_flux.family import FluxFamily

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

MAX_SEQUENCE_LENGTH = 512
"""``FluxPipeline.__call__``'s default ``max_sequence_length``: the T5 prompt is padded (or
cut) to it. It is also the pipeline's limit (``check_inputs`` refuses more)."""

EMBEDS = "encoder_hidden_states"
"""Conditioning key: T5's hidden states ``[1, max_sequence_length, joint_attention_dim]``."""
POOLED = "pooled_projections"
"""Conditioning key: CLIP's pooled output ``[1, pooled_projection_dim]``."""

NAME = "FLUX.1 [dev]"


class Flux1Family(FluxFamily):
    """FLUX.1 [dev] (``FluxPipeline``): T5 + CLIP, embedded guidance, optional true CFG."""

    pipeline_class: ClassVar[str] = "diffusers:FluxPipeline"
    model_name: ClassVar[str] = NAME
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt when true CFG is on and the request gives none: the engine-wide
    default (``FluxPipeline`` has none of its own and turns true CFG on only with one)."""

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        import math

        from miles_core.api import RequestError

        sizes, extra = self._image_request(request)
        true_cfg = request.true_cfg_scale
        if true_cfg is not None and (not math.isfinite(true_cfg) or true_cfg < 0):
            raise RequestError("true_cfg_scale", f"must be a finite number >= 0, got {true_cfg}")
        length = request_max_sequence_length(extra, MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH)
        return GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            # Read only by a guidance-distilled transformer (guidance_embeds); the pipeline
            # ignores it otherwise, and so does predict.
            guidance_scale=float(request.guidance_scale),
            true_cfg_scale=None if true_cfg is None else float(true_cfg),
            extra={"max_sequence_length": length} if "max_sequence_length" in extra else {},
            flow_shift=request.flow_shift,
            # fps means nothing for an image: dropped, as the other image families drop it.
        )

    def _cfg(self, params: GenerationParams) -> bool:
        # FluxPipeline: do_true_cfg = true_cfg_scale > 1 and a negative prompt; the engine
        # always supplies one when true CFG is on. Unset is off (the pipeline's default 1.0).
        return params.true_cfg_scale is not None and params.true_cfg_scale > 1

    def _encode_one(self, prompt: str, params: GenerationParams) -> dict[str, torch.Tensor]:
        """``FluxPipeline.encode_prompt`` for one prompt (the same prompt to CLIP and T5)."""
        import torch

        length = int(params.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
        with torch.no_grad():  # frozen text encoders; the conditioning is reused as data
            embeds, pooled, _ = self.pipeline.encode_prompt(
                prompt=prompt, prompt_2=None, device=self.device, num_images_per_prompt=1, max_sequence_length=length
            )
        return {EMBEDS: embeds.to(self.device, self.dtype), POOLED: pooled.to(self.device, self.dtype)}

    def _plan_one(self, params: GenerationParams) -> dict[str, torch.Tensor]:
        """T5's prompt padded to ``max_sequence_length`` and CLIP's pooling, as encode_prompt gives them."""
        import torch

        config = self.pipeline.transformer.config
        length = int(params.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
        return {
            EMBEDS: torch.zeros(1, length, config.joint_attention_dim, device=self.device, dtype=self.dtype),
            POOLED: torch.zeros(1, config.pooled_projection_dim, device=self.device, dtype=self.dtype),
        }

    def _latent_grid(self, params: GenerationParams) -> tuple[int, int]:
        """Unpacked latent ``(h, w)`` as ``prepare_latents`` computes them."""
        s = self.pipeline.vae_scale_factor
        return 2 * (params.height // (s * 2)), 2 * (params.width // (s * 2))

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        h, w = self._latent_grid(params)
        channels = self.pipeline.transformer.config.in_channels // 4
        # randn_tensor with a list of generators draws [1, C, h, w] per row, as here; then
        # prepare_latents packs the batch into 2x2 tokens.
        noise = per_output_noise((1, channels, h, w), generators)
        packed = type(self.pipeline)._pack_latents(noise, len(generators), channels, h, w)
        return {"latents": packed.to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:
        import numpy as np
        import torch
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        steps = params.num_inference_steps
        h, w = self._latent_grid(params)
        config = scheduler.config
        # As FluxPipeline.__call__: custom sigmas unless the scheduler makes its own flow
        # sigmas; mu from the packed token count (ignored without dynamic shifting).
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        return Schedule(
            timesteps=timesteps.to(self.device, torch.float32),
            sigmas=scheduler.sigmas.to(self.device, torch.float32),
        )

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        pipe = self.pipeline
        transformer = pipe.transformer
        x = latents["latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        # The pipeline: t.expand(B).to(latents.dtype), then / 1000.
        t = torch.as_tensor(timestep, device=self.device).reshape(-1).expand(batch).to(x.dtype) / 1000
        h, w = self._latent_grid(params)
        # Position ids in fp32: the pipeline builds them in the text encoders' dtype, but
        # the transformer reads them as .float() and small integers are exact either way.
        img_ids = type(pipe)._prepare_latent_image_ids(batch, h // 2, w // 2, self.device, torch.float32)
        guidance = None
        if transformer.config.get("guidance_embeds", False):
            guidance = torch.full([1], params.guidance_scale, device=self.device, dtype=torch.float32).expand(batch)
        cache = getattr(transformer, "cache_context", None)

        def call(side: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            embeds = side[EMBEDS].to(self.device, self.dtype)
            pooled = side[POOLED].to(self.device, self.dtype)
            if embeds.shape[0] != batch or pooled.shape[0] != batch:
                raise ValueError(f"conditioning has {embeds.shape[0]} rows for {batch} latents")
            txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=torch.float32)
            with cache(name) if cache is not None else contextlib.nullcontext():
                return transformer(
                    hidden_states=x,
                    timestep=t,
                    guidance=guidance,
                    pooled_projections=pooled,
                    encoder_hidden_states=embeds,
                    txt_ids=txt_ids,
                    img_ids=img_ids,
                    joint_attention_kwargs={},
                    return_dict=False,
                )[0]

        v = call(cond.positive, "cond")
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"true_cfg_scale {params.true_cfg_scale} > 1 needs a negative conditioning")
            neg = call(cond.negative, "uncond")
            v = neg + params.true_cfg_scale * (v - neg)
        return {"latents": v.float()}

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        x = latents["latents"].to(self.device, self.dtype)
        x = type(pipe)._unpack_latents(x, params.height, params.width, pipe.vae_scale_factor)
        x = (x / vae.config.scaling_factor) + vae.config.shift_factor  # the pipeline's exact arithmetic
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        # VaeImageProcessor.postprocess(output_type="pt"): denormalize only.
        return (image * 0.5 + 0.5).clamp(0, 1).float()

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """The inverse of :meth:`decode`: ``[B, 3, H, W]`` in [0, 1] to packed clean latents
        (the posterior mean: SFT targets are data, not a fresh draw per epoch)."""
        self._check_pixels(pixels)
        pipe = self.pipeline
        vae = pipe.vae
        x = pixels.to(self.device, vae.dtype) * 2 - 1  # [0, 1] -> [-1, 1], as VaeImageProcessor.preprocess
        latent = vae.encode(x).latent_dist.mean
        latent = (latent - vae.config.shift_factor) * vae.config.scaling_factor
        batch, channels, h, w = latent.shape
        packed = type(pipe)._pack_latents(latent, batch, channels, h, w)
        return {"latents": packed.to(self.dtype)}
