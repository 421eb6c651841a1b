"""FLUX.2 [klein] (``Flux2KleinPipeline``): the instance side of the ``flux`` family.

Each step is done exactly as ``Flux2KleinPipeline.__call__`` (diffusers 0.42) does it for
text-to-image:

- **Patchified, packed latents.** The engine's latents are the pipeline's tokens
  ``[B, (h/2)·(w/2), 4·C]``: the VAE latent's 2x2 patches stacked on channels
  (``_patchify_latents``), then flattened row-major (``_pack_latents``). Output *i*'s noise
  is drawn directly in the patchified layout ``[1, 4·C, h/2, w/2]`` from its own generator,
  then packed, as ``prepare_latents`` does with a list of generators.
- **Conditioning** (batch 1, the same shape for every prompt, so rows of different prompts
  concatenate): one key, ``encoder_hidden_states`` ``[1, L, 3·D]``: ``pipe.encode_prompt``'s
  Qwen3 hidden states after layers 9, 18 and 27, stacked per token, for the prompt in
  Qwen3's chat template with thinking off, padded by the tokenizer to
  ``L = max_sequence_length`` (512, the pipeline's default;
  ``extra_sampling_params.max_sequence_length`` changes it). The transformer gets no text
  mask, as in the pipeline. The 4-D position ids are not part of it: ``txt_ids``
  ``(0, 0, 0, token)`` and ``img_ids`` ``(0, row, column, 0)`` are rebuilt by
  :meth:`Flux2Family.predict` with the pipeline's own helpers.
- **Timestep input** ``timesteps / 1000`` in the latents' dtype; ``guidance`` None (klein is
  not guidance-distilled).
- **Guidance.** A step-distilled checkpoint (``is_distilled`` in ``model_index.json``, the
  released FLUX.2 [klein]) ignores ``guidance_scale``: one transformer call per step. The
  undistilled base runs real CFG when ``guidance_scale > 1``: two calls (conditional, then
  unconditional), ``neg + s·(pos − neg)``. The negative prompt is the pipeline's ``""``
  unless the request gives one, encoded the same way (what passing
  ``negative_prompt_embeds`` to the pipeline does). FLUX.1 [dev]'s ``true_cfg_scale`` is
  not a klein option and is refused.
- **Schedule**: the pipeline's ``sigmas = linspace(1, 1/T, T)`` through the scheduler with
  ``mu = compute_empirical_mu(image_seq_len, T)`` (FLUX.2's fit over image tokens and step
  count, not the scheduler config's base/max shift); an explicit ``flow_shift`` replaces
  the dynamic shift.
- **Decode**: unpack with the position ids, undo the VAE's BatchNorm normalisation
  (``x · sqrt(running_var + eps) + running_mean``), unpatchify, VAE decode,
  ``image · 0.5 + 0.5`` clamped to [0, 1]; :meth:`Flux2Family.encode_pixels` is the inverse
  (the posterior mode, as the pipeline encodes reference images), for SFT.

FLUX.2 [dev] (``Flux2Pipeline``) is refused when wrapped: see :data:`FLUX2_DEV_REFUSAL`.

Import-light on purpose: torch and diffusers are imported inside methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import (
    CheckpointError,
    Conditioning,
    GenerationParams,
    Latents,
    Schedule,
    per_output_noise,
    request_max_sequence_length,
    scheduler_copy,
)
from miles_flux.checkpoint import FLUX2, KLEIN, PIPELINES
from miles_flux.family import FluxFamily

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from miles_core.api import RolloutRequest

MAX_SEQUENCE_LENGTH = 512
"""``Flux2KleinPipeline.__call__``'s default ``max_sequence_length``: the tokenizer pads (or
cuts) the templated prompt to it. The pipeline sets no limit; the family's is the text
encoder's ``max_position_embeddings``."""

EMBEDS = "encoder_hidden_states"
"""Conditioning key: the stacked Qwen3 hidden states ``[1, max_sequence_length, 3·hidden]``."""

NAME = PIPELINES[KLEIN]

FLUX2_DEV_REFUSAL = (
    "FLUX.2 [dev] (Flux2Pipeline) is not served: its tokenizer component is transformers' PixtralProcessor, "
    "which requires torchvision (not a dependency of miles-core or miles-flux), so no Flux2Pipeline of real "
    "classes, tiny or released, loads and is tested here; the flux family serves FLUX.1 [dev] (FluxPipeline) "
    "and FLUX.2 [klein] (Flux2KleinPipeline)"
)
"""Why :class:`Flux2Family` refuses a ``Flux2Pipeline`` (one line, for a
:class:`~miles_core.api.CheckpointError`). Apart from its text encoder (Mistral 3 through
that processor, layers 10, 20 and 30, with a system prompt) FLUX.2 [dev] differs from klein
only in its embedded guidance and in having no CFG branch; the refusal is about what can be
built and tested, not about the sampling code."""


class Flux2Family(FluxFamily):
    """FLUX.2 [klein] (``Flux2KleinPipeline``): Qwen3 text, step-distilled or real CFG."""

    pipeline_class: ClassVar[str] = "diffusers:Flux2KleinPipeline"
    model_name: ClassVar[str] = NAME
    default_negative_prompt: ClassVar[str] = ""
    """Negative prompt of the base model's CFG when the request gives none: the pipeline's
    own (it always encodes ``""``)."""

    def __init__(self, pipeline: DiffusionPipeline, *, device: Any = "cpu", dtype: Any = None) -> None:
        if type(pipeline).__name__ == FLUX2:
            raise CheckpointError(FLUX2_DEV_REFUSAL)
        super().__init__(pipeline, device=device, dtype=dtype)

    # -- instance side: the prediction contract ---------------------------------------

    @property
    def step_distilled(self) -> bool:
        """``is_distilled`` of the pipeline's config: the guidance scale is ignored."""
        return bool(self.pipeline.config.get("is_distilled", False))

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import RequestError

        sizes, extra = self._image_request(request)
        if request.true_cfg_scale is not None:
            raise RequestError(
                "true_cfg_scale",
                f"{NAME} has no true CFG (a FLUX.1 [dev] option); leave it unset and use guidance_scale, "
                "which the undistilled base model applies as real CFG above 1 and a step-distilled checkpoint ignores",
            )
        limit = getattr(self.pipeline.text_encoder.config, "max_position_embeddings", None)
        length = request_max_sequence_length(extra, MAX_SEQUENCE_LENGTH, limit)
        return GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            # A step-distilled checkpoint ignores it, as the pipeline does; the base model
            # runs CFG above 1.
            guidance_scale=float(request.guidance_scale),
            extra={"max_sequence_length": length} if "max_sequence_length" in extra else {},
            flow_shift=request.flow_shift,
            # fps means nothing for an image: dropped, as the other image families drop it.
        )

    def _cfg(self, params: GenerationParams) -> bool:
        # Flux2KleinPipeline.do_classifier_free_guidance.
        return params.guidance_scale > 1 and not self.step_distilled

    def _encode_one(self, prompt: str, params: GenerationParams) -> dict[str, torch.Tensor]:
        """``Flux2KleinPipeline.encode_prompt`` for one prompt, with its default layers."""
        import torch

        length = int(params.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
        with torch.no_grad():  # a frozen text encoder; the conditioning is reused as data
            embeds, _ = self.pipeline.encode_prompt(prompt=prompt, device=self.device, num_images_per_prompt=1, max_sequence_length=length)
        return {EMBEDS: embeds.to(self.device, self.dtype)}

    def _plan_one(self, params: GenerationParams) -> dict[str, torch.Tensor]:
        """The Qwen3 prompt padded to ``max_sequence_length``, its stacked hidden layers
        (the transformer's ``joint_attention_dim``), as encode_prompt gives them."""
        import torch

        length = int(params.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))
        width = self.pipeline.transformer.config.joint_attention_dim
        return {EMBEDS: torch.zeros(1, length, width, device=self.device, dtype=self.dtype)}

    def _token_grid(self, params: GenerationParams) -> tuple[int, int]:
        """The packed token grid ``(h/2, w/2)``, with ``(h, w)`` the latent size as
        ``prepare_latents`` computes it."""
        s = self.pipeline.vae_scale_factor
        return params.height // (s * 2), params.width // (s * 2)

    def _latent_ids(self, batch: int, params: GenerationParams) -> torch.Tensor:
        """``_prepare_latent_ids``: ``(0, row, column, 0)`` per token, ``[batch, N, 4]``."""
        import torch

        rows, columns = self._token_grid(params)
        # The helper reads only the shape of the patchified latents it is given.
        return type(self.pipeline)._prepare_latent_ids(torch.empty(batch, 0, rows, columns)).to(self.device)

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        rows, columns = self._token_grid(params)
        channels = 4 * (self.pipeline.transformer.config.in_channels // 4)
        # randn_tensor with a list of generators draws [1, 4C, h/2, w/2] per row, as here;
        # then prepare_latents packs the batch into tokens (a transposed view, which the
        # engine's sampler makes contiguous before stepping).
        noise = per_output_noise((1, channels, rows, columns), generators)
        return {"latents": type(self.pipeline)._pack_latents(noise).to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:
        import numpy as np
        import torch
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        steps = params.num_inference_steps
        rows, columns = self._token_grid(params)
        # As Flux2KleinPipeline.__call__: custom sigmas unless the scheduler makes its own
        # flow sigmas; mu from the packed token count and the step count (ignored without
        # dynamic shifting, i.e. with an explicit flow_shift).
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=rows * columns, num_steps=steps)
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
        batch, tokens = x.shape[:2]
        # The pipeline: t.expand(B).to(latents.dtype), then / 1000.
        t = torch.as_tensor(timestep, device=self.device).reshape(-1).expand(batch).to(x.dtype) / 1000
        img_ids = self._latent_ids(batch, params)
        cache = getattr(transformer, "cache_context", None)

        def call(side: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            embeds = side[EMBEDS].to(self.device, self.dtype)
            if embeds.shape[0] != batch:
                raise ValueError(f"conditioning has {embeds.shape[0]} rows for {batch} latents")
            txt_ids = type(pipe)._prepare_text_ids(embeds).to(self.device)
            with cache(name) if cache is not None else contextlib.nullcontext():
                out = transformer(
                    hidden_states=x,
                    timestep=t,
                    guidance=None,  # Flux2KleinPipeline never passes one, whatever guidance_embeds says
                    encoder_hidden_states=embeds,
                    txt_ids=txt_ids,
                    img_ids=img_ids,
                    joint_attention_kwargs=None,
                    return_dict=False,
                )[0]
            return out[:, :tokens]  # the pipeline's cut (a no-op without reference images)

        v = call(cond.positive, "cond")
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"guidance_scale {params.guidance_scale} > 1 on the base model needs a negative conditioning")
            neg = call(cond.negative, "uncond")
            v = neg + params.guidance_scale * (v - neg)
        return {"latents": v.float()}

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE BatchNorm's mean and ``sqrt(running_var + eps)``, ``[1, 4C, 1, 1]``, as
        the pipeline computes them."""
        import torch

        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        x = latents["latents"].to(self.device, self.dtype)
        rows, columns = self._token_grid(params)
        x = type(pipe)._unpack_latents_with_ids(x, self._latent_ids(x.shape[0], params), rows, columns)
        mean, std = self._bn_stats(x)
        x = type(pipe)._unpatchify_latents(x * std + mean)  # the pipeline's exact arithmetic
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        # VaeImageProcessor.postprocess(output_type="pt"): denormalize only.
        return (image * 0.5 + 0.5).clamp(0, 1).float()

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """The inverse of :meth:`decode`: ``[B, 3, H, W]`` in [0, 1] to packed clean latents
        (the posterior mode, as ``_encode_vae_image`` encodes reference images: SFT targets
        are data, not a fresh draw per epoch)."""
        self._check_pixels(pixels)
        pipe = self.pipeline
        vae = pipe.vae
        x = pixels.to(self.device, vae.dtype) * 2 - 1  # [0, 1] -> [-1, 1], as VaeImageProcessor.preprocess
        latent = type(pipe)._patchify_latents(vae.encode(x).latent_dist.mode())
        mean, std = self._bn_stats(latent)
        packed = type(pipe)._pack_latents((latent - mean) / std)
        return {"latents": packed.to(self.dtype)}
