"""The SD3 / SD3.5 model family.

Import-light on purpose: the core resolves this class while validating a configuration
(for example to read :meth:`SD3Family.native_size`), before any model code is needed.
"""

from __future__ import annotations

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
    per_output_noise,
    read_component_config,
    request_extras,
    request_max_sequence_length,
    request_size,
    scheduler_copy,
)

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

# Fallbacks mirror diffusers: SD3Transformer2DModel's default sample_size and
# AutoencoderKL's default block_out_channels, used when a config omits the key.
_DEFAULT_SAMPLE_SIZE = 128
_DEFAULT_VAE_BLOCKS: tuple[int, ...] = (64,)


class SD3Family(ModelFamily):
    """Stable Diffusion 3 / 3.5 checkpoints in the diffusers layout."""

    pipeline_class: ClassVar[str] = "diffusers:StableDiffusion3Pipeline"

    # -- instance side: the prediction contract ---------------------------------------

    max_sequence_length: ClassVar[int] = 256
    """T5 prompt length: StableDiffusion3Pipeline.__call__'s default; a request may set
    ``extra_sampling_params.max_sequence_length`` (the pipeline's argument of that name)."""
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt used when CFG is on and the request gives none. The reference
    engine's default; diffusers itself would use ``""`` (a different encoding)."""

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer}

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        native = pipe.default_sample_size * pipe.vae_scale_factor  # the pipeline's own default
        multiple = pipe.vae_scale_factor * pipe.patch_size  # StableDiffusion3Pipeline.check_inputs
        # The transformer's positional embedding is cropped from a fixed grid: larger
        # sizes would only fail inside the forward.
        max_embed = pipe.transformer.config.get("pos_embed_max_size")
        limit = None if max_embed is None else max_embed * multiple
        sizes = {name: request_size(name, getattr(request, name), native, multiple, limit=limit) for name in ("height", "width")}
        if request.num_frames not in (None, 1):
            raise RequestError("num_frames", f"SD3 generates images (1 frame), got {request.num_frames}")
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "SD3 has no true CFG; use guidance_scale")
        extra = request_extras(request, ("max_sequence_length", FLOW_SHIFT), family="SD3")
        check_flow_shift(pipe.scheduler, request.flow_shift)
        length = request_max_sequence_length(extra, self.max_sequence_length, 512)
        return GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            extra={"max_sequence_length": length} if "max_sequence_length" in extra else {},
            flow_shift=request.flow_shift,
            # fps means nothing for an image: dropped rather than rejected, so clients
            # that always send it keep working.
        )

    @staticmethod
    def _cfg(params: GenerationParams) -> bool:
        return params.guidance_scale > 1  # diffusers' do_classifier_free_guidance

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        import torch

        cfg = self._cfg(params)
        if cfg and negative_prompt is None:
            negative_prompt = self.default_negative_prompt
        with torch.no_grad():  # frozen text encoders; the conditioning is reused as data
            embeds, neg_embeds, pooled, neg_pooled = self.pipeline.encode_prompt(
                prompt=prompt,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=cfg,
                negative_prompt=negative_prompt if cfg else None,
                max_sequence_length=params.extra.get("max_sequence_length", self.max_sequence_length),
            )

        def pack(hidden: torch.Tensor, pooled_: torch.Tensor) -> dict[str, torch.Tensor]:
            return {
                "encoder_hidden_states": hidden.to(self.device, self.dtype),
                "pooled_projections": pooled_.to(self.device, self.dtype),
            }

        return Conditioning(pack(embeds, pooled), pack(neg_embeds, neg_pooled) if cfg else None)

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """77 CLIP tokens then the T5 prompt at its full length (encode_prompt pads both to
        it), of the transformer's ``joint_attention_dim``; the two CLIP poolings."""
        import torch

        config = self.pipeline.transformer.config
        length = 77 + int(params.extra.get("max_sequence_length", self.max_sequence_length))

        def side() -> dict[str, torch.Tensor]:
            return {
                "encoder_hidden_states": torch.zeros(1, length, config.joint_attention_dim, device=self.device, dtype=self.dtype),
                "pooled_projections": torch.zeros(1, config.pooled_projection_dim, device=self.device, dtype=self.dtype),
            }

        return Conditioning(side(), side() if self._cfg(params) else None)

    def _latent_shape(self, params: GenerationParams) -> tuple[int, int, int]:
        s = self.pipeline.vae_scale_factor
        return self.pipeline.transformer.config.in_channels, params.height // s, params.width // s

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        shape = (1, *self._latent_shape(params))
        # One draw per output from its own generator (a CPU one unless the request asks for
        # the device's): an output's noise depends only on its seed, not on its batch.
        noise = per_output_noise(shape, generators)
        # The pipeline casts given latents to the prompt-embedding dtype (the family dtype).
        return {"latents": noise.to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:

        import torch
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            # As StableDiffusion3Pipeline.__call__ (note its max_shift default 1.16).
            _, h, w = self._latent_shape(params)
            patch = self.pipeline.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, params.num_inference_steps, self.device, **kwargs)
        return Schedule(
            timesteps=timesteps.to(self.device, torch.float32),
            sigmas=scheduler.sigmas.to(self.device, torch.float32),
        )

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        x = latents["latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        # Timesteps stay fp32 as the pipeline passes them (the scheduler's dtype); the
        # transformer casts its timestep embedding itself.
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1).expand(batch)
        pos = {k: v.to(self.device, self.dtype) for k, v in cond.positive.items()}
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"guidance_scale {params.guidance_scale} > 1 needs a negative conditioning")
            neg = {k: v.to(self.device, self.dtype) for k, v in cond.negative.items()}
            # One call on [negative rows; positive rows], exactly as the pipeline batches CFG.
            out = self.pipeline.transformer(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([t, t]),
                encoder_hidden_states=torch.cat([neg["encoder_hidden_states"], pos["encoder_hidden_states"]]),
                pooled_projections=torch.cat([neg["pooled_projections"], pos["pooled_projections"]]),
                return_dict=False,
            )[0]
            uncond, text = out.chunk(2)
            # Combined in the transformer's dtype, as the pipeline does, then upcast.
            v = uncond + params.guidance_scale * (text - uncond)
        else:
            v = self.pipeline.transformer(
                hidden_states=x,
                timestep=t,
                encoder_hidden_states=pos["encoder_hidden_states"],
                pooled_projections=pos["pooled_projections"],
                return_dict=False,
            )[0]
        return {"latents": v.float()}

    def context_parallel_plan(self, component: str, module: torch.nn.Module, degree: int) -> dict | None:
        """SD3 has no plan in diffusers and its attention calls torch's directly: install
        processors that dispatch through diffusers' backends and pad the text, and return
        the plan that splits both streams (:mod:`miles_sd3.sequence_parallel`)."""
        from miles_sd3.sequence_parallel import install

        return install(module, degree)

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        vae = self.pipeline.vae
        # The pipeline's latents are in the family dtype when it decodes.
        x = latents["latents"].to(self.device, self.dtype)
        x = x / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        # VaeImageProcessor.postprocess(output_type="pt"): denormalize only.
        return (image * 0.5 + 0.5).clamp(0, 1).float()

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        vae = self.pipeline.vae
        x = pixels.to(self.device, vae.dtype) * 2 - 1  # VaeImageProcessor.preprocess: [0, 1] -> [-1, 1]
        # The distribution's mean: SFT targets are data, not a random draw per epoch.
        z = vae.encode(x).latent_dist.mean
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor  # the inverse of decode's first line
        return {"latents": z.to(self.dtype)}

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0, scale: str = "tiny", demo: bool = False) -> Path:
        """Write a tiny, randomly initialised SD3 pipeline (see :mod:`miles_sd3.tiny`);
        ``scale="bench"`` writes the larger one benchmarks use (~20M-parameter transformer,
        128x128); ``demo=True`` the demo variant of :mod:`miles_sd3.demo`, built once per
        seed and recipe version and then copied from the cache (``$MILES_CACHE_DIR``,
        default ``~/.cache/miles-core``)."""
        if demo:
            from miles_sd3.demo import cached_demo_pipeline

            return cached_demo_pipeline(out_dir, seed=seed)
        from miles_sd3.tiny import build  # heavy: torch, diffusers, transformers

        return build(out_dir, seed=seed, scale=scale)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(height, width)`` as StableDiffusion3Pipeline defaults them: transformer
        ``sample_size`` times the VAE scale factor ``2 ** (len(block_out_channels) - 1)``."""
        transformer = read_component_config(checkpoint, "transformer")
        if transformer is None:
            return None
        vae = read_component_config(checkpoint, "vae")
        # The pipeline falls back to a scale factor of 8 when it has no VAE.
        scale = 8 if vae is None else 2 ** (len(vae.get("block_out_channels", _DEFAULT_VAE_BLOCKS)) - 1)
        side = int(transformer.get("sample_size", _DEFAULT_SAMPLE_SIZE)) * scale
        return side, side
