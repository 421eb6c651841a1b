"""What every Wan family of this plugin shares: diffusers' Wan pipelines, read the same way.

diffusers' ``WanPipeline`` runs Wan 2.2 A14B (two experts, :mod:`miles_wan22.family`)
and Wan 2.2 TI2V-5B (one transformer with per-token timesteps, :mod:`miles_wan22.ti2v`,
whose image mode follows ``WanImageToVideoPipeline``'s ``expand_timesteps`` path on the
same pipeline); ``WanImageToVideoPipeline`` runs Wan 2.2 I2V-A14B (the two experts with
an image condition, :mod:`miles_wan22.i2v`). They share the text encoder
call, the latent layout ``[B, C, F, H, W]`` (the VAE's ``z_dim`` channels,
``(F - 1) / scale_factor_temporal + 1`` latent frames, ``scale_factor_spatial`` pixels
per latent), the scheduler use and the VAE normalisation (``latents_mean`` /
``latents_std``), and the image-to-video families prepare the conditioning image and
encode it the same way. :class:`WanFamilyBase` holds that part once; the subclasses add
what differs (the trainable components, how a timestep and the image condition reach the
transformer, which sampling options a request may carry, the LoRA layout).

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    ModelFamily,
    Schedule,
    exact_first_sigma,
    per_output_noise,
    request_size,
    scheduler_copy,
)

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

# WanPipeline.__call__ defaults (diffusers 0.42): the size is fixed in the signature and
# not read from any config, so it is the same for every checkpoint (tests pin it).
WAN_DEFAULT_HEIGHT = 480
WAN_DEFAULT_WIDTH = 832
WAN_DEFAULT_NUM_FRAMES = 81
"""WanPipeline.__call__'s ``num_frames`` default, used when a request sets none."""
WAN_MAX_SEQUENCE_LENGTH = 512
"""WanPipeline.__call__'s ``max_sequence_length`` default (UMT5 prompt tokens)."""
MAX_SEQUENCE_LENGTH = "max_sequence_length"
IMAGE_LATENTS = "image_latents"
"""The key of an image-to-video family's image condition in ``Conditioning.positive``
(``wan2_2_i2v``'s mask and image latents, ``wan2_2_ti2v``'s image frame). It reaches the
trainer with the text embeddings; it is not a transformer kwarg: ``predict`` takes it out."""


class WanFamilyBase(ModelFamily):
    """The ``WanPipeline`` contract shared by the Wan 2.2 families (not registered itself)."""

    pipeline_class: ClassVar[str] = "diffusers:WanPipeline"
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt used when CFG is on and the request gives none: the engine's
    documented default (``--diffusion-negative-prompt``), as for SD3. diffusers itself
    would use ``""``."""
    family_name: ClassVar[str] = "wan"
    """The registered family's name, for messages."""

    def __init__(self, pipeline: Any, *, device: Any = "cpu", dtype: Any = None) -> None:
        super().__init__(pipeline, device=device, dtype=dtype)
        scheduler = pipeline.scheduler.config
        # Flow-matching schedulers: UniPC / DPM-Solver with use_flow_sigmas, or FlowMatch*
        # (which carry a shift); any other has no flow-matching sigmas to step with.
        if not (scheduler.get("use_flow_sigmas") or "shift" in scheduler):
            raise ValueError(
                f"the pipeline's {type(pipeline.scheduler).__name__} is not a flow-matching scheduler (neither "
                f"use_flow_sigmas nor a FlowMatch scheduler): the {self.family_name} family steps with flow-matching sigmas"
            )

    # -- requests -----------------------------------------------------------------------

    def _video_size(self, request: RolloutRequest) -> tuple[int, int, int]:
        """The request's ``(height, width, num_frames)``, WanPipeline's defaults filled in,
        checked against what the VAE and the transformer can take (a
        :class:`~miles_core.api.RequestError` naming the field otherwise)."""
        from miles_core.api import RequestError

        pipe = self.pipeline
        transformer = pipe.transformer
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        _, patch_h, patch_w = transformer.config.patch_size
        rope = transformer.config.get("rope_max_seq_len")
        # WanPipeline.check_inputs wants multiples of 16; patchification wants multiples of
        # the VAE factor x the patch (the pipeline would silently crop).
        sizes = {
            name: request_size(
                name,
                getattr(request, name),
                native,
                math.lcm(16, spatial * patch),
                limit=None if rope is None else rope * spatial * patch,
                limit_rule=f" (rope_max_seq_len {rope})",
            )
            for name, native, patch in (("height", WAN_DEFAULT_HEIGHT, patch_h), ("width", WAN_DEFAULT_WIDTH, patch_w))
        }
        frames = WAN_DEFAULT_NUM_FRAMES if request.num_frames is None else request.num_frames
        # The VAE encodes the first frame alone and then groups of `temporal` frames; the
        # pipeline would round any other count down (and SFT could not encode it).
        if (frames - 1) % temporal:
            raise RequestError(
                "num_frames",
                f"{frames}: Wan needs num_frames - 1 divisible by {temporal} (the VAE's temporal factor), "
                f"e.g. {frames - (frames - 1) % temporal}",
            )
        if rope is not None and ((frames - 1) // temporal + 1) // transformer.config.patch_size[0] > rope:
            raise RequestError("num_frames", f"{frames} gives more latent frames than the transformer's rope_max_seq_len {rope}")
        return sizes["height"], sizes["width"], frames

    @staticmethod
    def _cfg(params: GenerationParams) -> bool:
        # WanPipeline.do_classifier_free_guidance: guidance_scale alone decides.
        return params.guidance_scale > 1

    # -- the prediction contract ---------------------------------------------------------

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        import torch

        cfg = self._cfg(params)
        if cfg and negative_prompt is None:
            negative_prompt = self.default_negative_prompt
        with torch.no_grad():  # frozen text encoder; the conditioning is reused as data
            embeds, neg_embeds = self._encode_prompt(
                prompt=prompt,
                negative_prompt=negative_prompt if cfg else None,
                do_classifier_free_guidance=cfg,
                num_videos_per_prompt=1,
                max_sequence_length=params.extra.get(MAX_SEQUENCE_LENGTH, WAN_MAX_SEQUENCE_LENGTH),
                device=self.device,
            )
        # As WanPipeline.__call__: the embeddings are cast to the transformer's dtype.
        positive = {"encoder_hidden_states": embeds.to(self.device, self.dtype)}
        negative = {"encoder_hidden_states": neg_embeds.to(self.device, self.dtype)} if cfg else None
        return Conditioning(positive, negative)

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """UMT5's prompt padded to ``max_sequence_length`` (as the pipeline pads it), of the
        transformer's ``text_dim``; the negative one too under CFG."""
        import torch

        length = int(params.extra.get(MAX_SEQUENCE_LENGTH, WAN_MAX_SEQUENCE_LENGTH))
        width = self.pipeline.transformer.config.text_dim

        def side() -> dict[str, torch.Tensor]:
            return {"encoder_hidden_states": torch.zeros(1, length, width, device=self.device, dtype=self.dtype)}

        return Conditioning(side(), side() if self._cfg(params) else None)

    def _encode_prompt(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(prompt_embeds, negative_prompt_embeds)`` as the pipeline's ``encode_prompt``
        returns them for ``kwargs``; a family whose pipeline class cannot run its own
        (``WanImageToVideoPipeline`` without ftfy) encodes the same way here."""
        return self.pipeline.encode_prompt(**kwargs)

    def _latent_shape(self, params: GenerationParams) -> tuple[int, int, int, int]:
        pipe = self.pipeline
        frames = params.num_frames if params.num_frames is not None else WAN_DEFAULT_NUM_FRAMES
        spatial = pipe.vae_scale_factor_spatial
        return (
            pipe.transformer.config.in_channels,
            (frames - 1) // pipe.vae_scale_factor_temporal + 1,
            params.height // spatial,
            params.width // spatial,
        )

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        shape = (1, *self._latent_shape(params))
        # One fp32 draw per output from its own generator (CPU by default): what WanPipeline.prepare_latents
        # (randn_tensor with a list of generators) draws for each row.
        noise = per_output_noise(shape, generators)
        return {"latents": noise.to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:
        """The pipeline scheduler's timesteps and sigmas for ``num_inference_steps``
        (``scheduler.set_timesteps(n)``, as ``WanPipeline.__call__``), on a private copy.

        ``flow_shift`` rebuilds the scheduler from its config with that shift (UniPC /
        DPM-Solver's ``flow_shift``, FlowMatchEuler's ``shift``). The timesteps are the
        scheduler's own (UniPC's are integers, which is what the transformer sees). One
        deliberate difference: UniPC and DPM-Solver in flow mode lower a first sigma of
        1 to 1 - 1e-6 to keep their own multistep arithmetic finite; the family steps
        with Euler / Flow-GRPO SDE steps instead, where that guard would defeat the
        σ = 1 rule of the SDE (the noise scale would be η·sqrt(σ/(1−σ)) ≈ 1000·η on the
        first step), so the sigma is restored to exactly 1 (an Euler-step difference
        of 1e-6·v)."""

        import torch

        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        scheduler.set_timesteps(params.num_inference_steps, device=self.device)
        sigmas = exact_first_sigma(scheduler.sigmas.to(self.device, torch.float32))
        return Schedule(timesteps=scheduler.timesteps.to(self.device, torch.float32), sigmas=sigmas)

    def _guided_velocity(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        params: GenerationParams,
        scale: float,
    ) -> torch.Tensor:
        """``model``'s velocity with WanPipeline's CFG: the conditional call, then (CFG on)
        the unconditional one, ``uncond + scale·(cond − uncond)``. ``timestep`` is what
        the transformer takes: ``[B]``, or ``[B, tokens]`` (per-token timesteps)."""
        positive = cond.positive["encoder_hidden_states"].to(self.device, self.dtype)
        v = model(hidden_states=x, timestep=timestep, encoder_hidden_states=positive, return_dict=False)[0]
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"guidance_scale {params.guidance_scale} > 1 needs a negative conditioning")
            negative = cond.negative["encoder_hidden_states"].to(self.device, self.dtype)
            uncond = model(hidden_states=x, timestep=timestep, encoder_hidden_states=negative, return_dict=False)[0]
            v = uncond + scale * (v - uncond)
        return v

    # -- pixels ---------------------------------------------------------------------------

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents_mean, 1 / latents_std)`` shaped for broadcasting, as the pipeline builds them."""
        import torch

        vae = self.pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, inv_std

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        vae = self.pipeline.vae
        x = latents["latents"].to(self.device, vae.dtype)
        mean, inv_std = self._latent_stats(x)
        video = vae.decode(x / inv_std + mean, return_dict=False)[0]
        # VideoProcessor.postprocess_video(output_type="pt") denormalizes each frame;
        # the layout stays [B, C, F, H, W] (the pipeline would permute to [B, F, C, H, W]).
        return (video * 0.5 + 0.5).clamp(0, 1).float()

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """Pixels in [0, 1], ``[B, C, F, H, W]`` (or ``[B, C, H, W]``: one frame) to clean
        latents, the inverse of :meth:`decode`: the VAE posterior's mean, normalised with
        the VAE's ``latents_mean`` / ``latents_std``. Wan 2.2's own VAE (TI2V-5B)
        patchifies the pixels inside ``encode``, so one call serves both VAEs."""
        vae = self.pipeline.vae
        x = pixels.to(self.device, vae.dtype)
        if x.ndim == 4:
            x = x.unsqueeze(2)
        if x.ndim != 5:
            raise ValueError(f"Wan encodes [B, C, F, H, W] or [B, C, H, W] pixels, got shape {tuple(pixels.shape)}")
        return {"latents": self._normalised_latent_mean(x * 2 - 1).to(self.dtype)}

    def _normalised_latent_mean(self, video: torch.Tensor) -> torch.Tensor:
        """A ``[B, 3, F, H, W]`` video in [-1, 1] to the VAE posterior's mean, normalised
        with ``latents_mean`` / ``latents_std``, in fp32: SFT's targets (data, not a random
        draw per epoch) and the image condition of image-to-video, which
        ``WanImageToVideoPipeline.prepare_latents`` encodes the same way (``argmax``)."""
        import torch

        vae = self.pipeline.vae
        z = vae.encode(video.to(self.device, vae.dtype)).latent_dist.mean.to(torch.float32)
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std

    def _condition_pixels(self, params: GenerationParams) -> torch.Tensor:
        """The request's conditioning image as ``WanImageToVideoPipeline.__call__``
        prepares it: resized to the request's ``height x width`` and scaled to [-1, 1] by
        the pipeline's own ``video_processor``, ``[1, 3, H, W]`` in fp32."""
        import torch

        if params.image is None:
            raise ValueError(f"the {self.family_name} family needs the request's conditioning image here; it has none")
        pixels = self.pipeline.video_processor.preprocess(params.image.load(), height=params.height, width=params.width)
        return pixels.to(self.device, torch.float32)

    # -- LoRA -----------------------------------------------------------------------------

    def _save_adapter(self, directory: Path, name: str, module: torch.nn.Module) -> None:
        """Write ``module``'s one LoRA adapter to ``directory`` in diffusers' Wan LoRA format
        (``pytorch_lora_weights.safetensors``, keys ``transformer.*``), its adapter config
        (rank, alpha, targets) as metadata: without it diffusers loads the LoRA with
        alpha = rank, i.e. at the wrong strength."""
        from peft.utils import get_peft_model_state_dict

        configs = getattr(module, "peft_config", None) or {}
        if len(configs) != 1:
            raise ValueError(f"{name} must carry exactly one LoRA adapter to save, has {sorted(configs)}")
        ((adapter, config),) = configs.items()
        type(self.pipeline).save_lora_weights(
            str(directory),
            transformer_lora_layers=get_peft_model_state_dict(module, adapter_name=adapter),
            transformer_lora_adapter_metadata=config.to_dict(),
        )

    # -- class side -------------------------------------------------------------------

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(480, 832)``: WanPipeline's hard-coded default, whatever the checkpoint."""
        return (WAN_DEFAULT_HEIGHT, WAN_DEFAULT_WIDTH)
