"""The Qwen-Image model family (``QwenImagePipeline``).

What differs from SD3, each done exactly as ``QwenImagePipeline.__call__`` (diffusers 0.42)
does it:

- **Packed latents.** The engine's latents are the pipeline's packed tokens
  ``[B, (h/2)·(w/2), 4·C]`` (``_pack_latents``: 2x2 latent patches). Output *i*'s noise is
  drawn in the unpacked layout ``[1, 1, C, h, w]`` from its own generator, then packed,
  as ``prepare_latents`` does; :meth:`QwenImageFamily.decode` unpacks.
- **Text with a mask.** The conditioning carries ``encoder_hidden_states`` and
  ``encoder_hidden_states_mask`` (the pipeline's ``prompt_embeds`` / ``prompt_embeds_mask``),
  zero-padded to ``max_sequence_length`` tokens so that rows of different prompts
  concatenate (the trainer's micro-batches). :meth:`QwenImageFamily.predict` cuts the
  padding back to the batch's longest prompt and passes the mask only when some row is
  padded, which is what the pipeline does for the same prompts: one prompt is the
  pipeline's unpadded call, bit for bit.
- **Timestep input** ``timesteps / 1000`` in the latents' dtype; ``img_shapes`` for the
  RoPE grid; ``guidance`` only for a guidance-distilled transformer (``guidance_embeds``),
  otherwise ``guidance_scale`` is ignored, as the pipeline ignores it.
- **True CFG** (``true_cfg_scale > 1``): two transformer calls (conditional, then
  unconditional), ``comb = neg + s·(pos − neg)`` rescaled to the conditional prediction's
  norm over channels, ``comb · (‖pos‖ / ‖comb‖)``.
- **Schedule**: the pipeline's ``sigmas = linspace(1, 1/T, T)`` through the scheduler with
  the dynamic shift ``mu = calculate_shift(image_seq_len, ...)``; an explicit
  ``flow_shift`` replaces the dynamic shift (as for SD3).

Import-light on purpose: torch and diffusers are imported inside methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    ModelFamily,
    Schedule,
    check_flow_shift,
    read_component_config,
    request_extras,
    request_max_sequence_length,
    request_size,
    scheduler_copy,
)

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

DEFAULT_SAMPLE_SIZE = 128
"""``QwenImagePipeline.default_sample_size``, hard-coded in its ``__init__`` (diffusers 0.42);
multiplied by ``vae_scale_factor`` it gives the default output side."""

MAX_SEQUENCE_LENGTH = 512
"""``QwenImagePipeline.__call__``'s default ``max_sequence_length``: prompts are cut to it,
and the family pads every conditioning to it (``extra_sampling_params.max_sequence_length``
changes both, up to the pipeline's limit of 1024)."""
MAX_SEQUENCE_LIMIT = 1024
"""``QwenImagePipeline.check_inputs`` refuses a longer ``max_sequence_length``."""

EMBEDS = "encoder_hidden_states"
MASK = "encoder_hidden_states_mask"


class QwenImageFamily(ModelFamily):
    """Qwen-Image (``QwenImagePipeline``): 2x2-packed latents, masked text, true CFG."""

    pipeline_class: ClassVar[str] = "diffusers:QwenImagePipeline"
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt when true CFG is on and the request gives none: the engine-wide
    default (the pipeline itself needs *some* negative prompt to turn true CFG on; its
    docstring suggests ``" "``)."""

    # -- instance side: the prediction contract ---------------------------------------

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer}

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        import math

        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        native = pipe.default_sample_size * pipe.vae_scale_factor  # the pipeline's own default
        # QwenImagePipeline.check_inputs: the VAE factor times the 2x2 packing (it only warns
        # and rounds down; a request asking for a size it would not produce is refused).
        multiple = pipe.vae_scale_factor * 2
        sizes = {
            name: request_size(name, getattr(request, name), native, multiple, rule=" (VAE factor x 2x2 packing)")
            for name in ("height", "width")
        }
        if request.num_frames not in (None, 1):
            raise RequestError("num_frames", f"Qwen-Image generates images (1 frame), got {request.num_frames}")
        true_cfg = request.true_cfg_scale
        if true_cfg is not None and (not math.isfinite(true_cfg) or true_cfg < 0):
            raise RequestError("true_cfg_scale", f"must be a finite number >= 0, got {true_cfg}")
        scheduler = pipe.scheduler
        if request.num_inference_steps < 2 and scheduler.config.get("shift_terminal"):
            # One sigma stretched to the terminal value divides 0 by 0: the pipeline's
            # schedule would be NaN.
            raise RequestError(
                "num_inference_steps",
                f"must be at least 2: the scheduler's shift_terminal {scheduler.config.shift_terminal} makes a 1-step schedule NaN",
            )
        extra = request_extras(request, ("max_sequence_length", FLOW_SHIFT), family="Qwen-Image")
        check_flow_shift(scheduler, request.flow_shift)
        length = request_max_sequence_length(extra, MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LIMIT)
        return GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            # Read only by a guidance-distilled transformer (guidance_embeds); the
            # pipeline ignores it otherwise, and so does predict.
            guidance_scale=float(request.guidance_scale),
            true_cfg_scale=None if true_cfg is None else float(true_cfg),
            extra={"max_sequence_length": length} if "max_sequence_length" in extra else {},
            flow_shift=request.flow_shift,
            # fps means nothing for an image: dropped, as SD3 drops it.
        )

    @staticmethod
    def _cfg(params: GenerationParams) -> bool:
        # QwenImagePipeline: do_true_cfg = true_cfg_scale > 1 and a negative prompt; the
        # engine always supplies one (the default " ") when true CFG is on. Unset is off:
        # the pipeline's 4.0 default only acts with an explicit negative prompt.
        return params.true_cfg_scale is not None and params.true_cfg_scale > 1

    @staticmethod
    def _max_sequence_length(params: GenerationParams) -> int:
        return int(params.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """A prompt of ``max_sequence_length`` tokens (every mask entry 1, so the whole
        length reaches the transformer), of its ``joint_attention_dim``; the mask on the
        CPU, where :meth:`predict` reads it."""
        import torch

        length = self._max_sequence_length(params)
        width = self.pipeline.transformer.config.joint_attention_dim

        def side() -> dict[str, torch.Tensor]:
            return {
                EMBEDS: torch.zeros(1, length, width, device=self.device, dtype=self.dtype),
                MASK: torch.ones(1, length, dtype=torch.long),
            }

        return Conditioning(side(), side() if self._cfg(params) else None)

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        cfg = self._cfg(params)
        positive = self._encode_one(prompt, params)
        if not cfg:
            return Conditioning(positive, None)
        negative = self._encode_one(self.default_negative_prompt if negative_prompt is None else negative_prompt, params)
        return Conditioning(positive, negative)

    def _encode_one(self, prompt: str, params: GenerationParams) -> dict[str, torch.Tensor]:
        """``QwenImagePipeline.encode_prompt`` for one prompt, zero-padded to
        ``max_sequence_length`` with a 0/1 mask (1: a prompt token)."""
        import torch

        length = self._max_sequence_length(params)
        with torch.no_grad():  # a frozen text encoder; the conditioning is reused as data
            embeds, mask = self.pipeline.encode_prompt(
                prompt=prompt, device=self.device, num_images_per_prompt=1, max_sequence_length=length
            )
        embeds = embeds.to(self.device, self.dtype)
        tokens = embeds.shape[1]
        if mask is None:  # encode_prompt drops an all-ones mask
            mask = torch.ones(1, tokens, dtype=torch.long, device=self.device)
        padded = embeds.new_zeros(1, length, embeds.shape[2])
        padded[:, :tokens] = embeds
        full_mask = torch.zeros(1, length, dtype=torch.long, device=self.device)
        full_mask[:, :tokens] = mask.to(self.device, torch.long)
        return {EMBEDS: padded, MASK: full_mask}

    def _latent_grid(self, params: GenerationParams) -> tuple[int, int]:
        """Unpacked latent ``(h, w)`` as ``prepare_latents`` computes them."""
        s = self.pipeline.vae_scale_factor
        return 2 * (params.height // (s * 2)), 2 * (params.width // (s * 2))

    def _latent_channels(self) -> int:
        return self.pipeline.transformer.config.in_channels // 4

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        import torch

        h, w = self._latent_grid(params)
        channels = self._latent_channels()
        pack = type(self.pipeline)._pack_latents
        # One draw per output from its own generator (on its device) in the pipeline's unpacked layout
        # [1, 1, C, h, w] (randn_tensor with a generator list draws exactly this per row),
        # then packed into 2x2 tokens.
        noise = [
            pack(torch.randn((1, 1, channels, h, w), generator=g, device=g.device, dtype=torch.float32), 1, channels, h, w)
            for g in generators
        ]
        return {"latents": torch.cat(noise).to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:

        import numpy as np
        import torch
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        steps = params.num_inference_steps
        h, w = self._latent_grid(params)
        config = scheduler.config
        # As QwenImagePipeline.__call__ (its max_shift default 1.15, max_image_seq_len 4096).
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        return Schedule(
            timesteps=timesteps.to(self.device, torch.float32),
            sigmas=scheduler.sigmas.to(self.device, torch.float32),
        )

    def _text(self, tensors: dict[str, torch.Tensor], batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings and mask of one side, cut to the batch's longest prompt; the mask
        is None when no row is padded (``encode_prompt`` drops an all-ones mask)."""
        embeds = tensors[EMBEDS].to(self.device, self.dtype)
        # Read where the conditioning keeps the mask (long from encode, float through the
        # trainer): the memory planner's is on the CPU, its model on the meta device.
        mask = tensors[MASK] != 0
        if embeds.shape[0] != batch or mask.shape[0] != batch:
            raise ValueError(f"conditioning has {embeds.shape[0]} rows for {batch} latents")
        used = mask.any(dim=0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 1
        embeds, mask = embeds[:, :length], mask[:, :length]
        return embeds, (None if bool(mask.all()) else mask.long().to(self.device))

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        pipe = self.pipeline
        transformer = pipe.transformer
        x = latents["latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        # The pipeline: t.expand(B).to(latents.dtype), then / 1000.
        t = torch.as_tensor(timestep, device=self.device).reshape(-1).expand(batch).to(x.dtype) / 1000
        h, w = self._latent_grid(params)
        img_shapes = [[(1, h // 2, w // 2)]] * batch
        guidance = None
        if transformer.config.get("guidance_embeds", False):
            guidance = torch.full([1], params.guidance_scale, device=self.device, dtype=torch.float32).expand(batch)
        cache = getattr(transformer, "cache_context", None)

        def call(side: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            embeds, mask = self._text(side, batch)
            with cache(name) if cache is not None else contextlib.nullcontext():
                return transformer(
                    hidden_states=x,
                    timestep=t,
                    guidance=guidance,
                    encoder_hidden_states_mask=mask,
                    encoder_hidden_states=embeds,
                    img_shapes=img_shapes,
                    attention_kwargs={},
                    return_dict=False,
                )[0]

        v = call(cond.positive, "cond")
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"true_cfg_scale {params.true_cfg_scale} > 1 needs a negative conditioning")
            neg = call(cond.negative, "uncond")
            comb = neg + params.true_cfg_scale * (v - neg)
            cond_norm = torch.norm(v, dim=-1, keepdim=True)
            comb_norm = torch.norm(comb, dim=-1, keepdim=True)
            v = comb * (cond_norm / comb_norm)
        return {"latents": v.float()}

    def context_parallel_plan(self, component: str, module: torch.nn.Module, degree: int) -> dict | None:
        """diffusers' plan, with the text padded to a multiple of ``degree`` tokens
        (:mod:`miles_qwen_image.sequence_parallel`): a prompt's length is its own."""
        from miles_qwen_image.sequence_parallel import install

        return install(module, degree)

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        import torch

        pipe = self.pipeline
        vae = pipe.vae
        x = latents["latents"].to(self.device, self.dtype)
        x = type(pipe)._unpack_latents(x, params.height, params.width, pipe.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        x = x / inv_std + mean  # the pipeline's exact arithmetic
        image = vae.decode(x, return_dict=False)[0][:, :, 0]
        # VaeImageProcessor.postprocess(output_type="pt"): denormalize only.
        return (image * 0.5 + 0.5).clamp(0, 1).float()

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """The inverse of :meth:`decode`: ``[B, 3, H, W]`` in [0, 1] to packed clean latents
        (the posterior mean: SFT targets are data, not a fresh draw per epoch)."""
        import torch

        if pixels.ndim != 4:
            raise ValueError(f"Qwen-Image encodes images [B, C, H, W], got shape {tuple(pixels.shape)}")
        pipe = self.pipeline
        vae = pipe.vae
        x = (pixels.to(self.device, vae.dtype) * 2 - 1).unsqueeze(2)  # [0, 1] -> [-1, 1], one frame
        latent = vae.encode(x).latent_dist.mean  # [B, C, 1, h, w]
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latent.device, latent.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latent.device, latent.dtype)
        latent = (latent - mean) * inv_std
        batch, channels, _, h, w = latent.shape
        packed = type(pipe)._pack_latents(latent, batch, channels, h, w)
        return {"latents": packed.to(self.dtype)}

    # -- class side -------------------------------------------------------------------

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny random Qwen-Image pipeline to ``out_dir`` (see :mod:`.tiny`)."""
        from miles_qwen_image.tiny import build

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``default_sample_size * vae_scale_factor`` for both sides, where the pipeline
        takes ``vae_scale_factor = 2 ** len(vae.temperal_downsample)``."""
        vae = read_component_config(checkpoint, "vae")
        if vae is None:
            return None
        # The VAE's own default when the config omits it: [False, True, True].
        downsample = vae.get("temperal_downsample", [False, True, True])
        side = DEFAULT_SAMPLE_SIZE * 2 ** len(downsample)
        return side, side
