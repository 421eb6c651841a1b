"""The Wan 2.2 I2V-A14B model family (``wan2_2_i2v``): image-to-video, two experts.

diffusers' ``WanImageToVideoPipeline`` with ``boundary_ratio`` set runs Wan 2.2 I2V-A14B:
the two experts of :mod:`miles_wan22.family` (``transformer`` at or above the boundary,
``transformer_2`` below, ``guidance_scale`` / ``guidance_scale_2``), each reading the
noisy latents (the VAE's ``z_dim`` channels) with an image condition concatenated behind
them on the channel axis: ``2 x z_dim + 4`` input channels, ``z_dim`` out. The condition,
built once per request by ``prepare_latents``, is

- a 4-channel mask (the VAE's temporal factor: one channel per pixel frame a latent frame
  holds), 1 on latent frame 0 (the given image) and 0 on the frames to generate, then
- the normalised VAE posterior mode of the video ``[image, 0, ..., 0]`` (the image as
  frame 0, ``num_frames - 1`` black frames behind it).

Both CFG passes see the same condition; Wan 2.2 has no CLIP image embeddings (Wan 2.1
I2V's ``image_encoder`` / ``image_dim``), so the text embeddings are the only other input.

:class:`WanI2VFamily` is :class:`~miles_wan22.family.Wan22Family` (experts, guidance
scales, one-expert training, LoRA per expert) with the image: ``resolve_params`` puts the
request's image on the parameters, :meth:`WanI2VFamily.encode` turns it into the
condition (``Conditioning.positive["image_latents"]``, so the trainer conditions on the
engine's tensor), and each expert call concatenates it to the latents.

Import-light like :mod:`miles_core.family`: torch and diffusers are imported only
inside the methods that need them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.api import Conditioning, GenerationParams, request_image
from miles_wan22.checkpoint import i2v_configs_problem
from miles_wan22.family import EXPERTS, Wan22Family
from miles_wan22.wan_base import IMAGE_LATENTS, WAN_DEFAULT_NUM_FRAMES

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest


class WanI2VFamily(Wan22Family):
    """Wan 2.2 I2V-A14B: :class:`~miles_wan22.family.Wan22Family`'s two experts, each fed
    ``cat([latents, image condition])``."""

    pipeline_class = "diffusers:WanImageToVideoPipeline"
    family_name = "wan2_2_i2v"
    image_input = "required"
    _other_models = "Wan 2.1 I2V is not supported; Wan 2.2 TI2V-5B is family wan2_2_ti2v"

    def __init__(self, pipeline: Any, *, device: Any = "cpu", dtype: Any = None) -> None:
        # Checked first: Wan 2.1 I2V and TI2V-5B would otherwise be refused for a side reason.
        # The rules are checkpoint.i2v_wan's, read from the loaded components' configs.
        experts = {name: getattr(pipeline, name).config for name in EXPERTS if getattr(pipeline, name, None) is not None}
        reason = i2v_configs_problem(
            image_encoder=getattr(pipeline, "image_encoder", None) is not None, experts=experts, vae=pipeline.vae.config
        )
        if reason is not None:
            raise ValueError(
                f"the {self.family_name} family serves Wan 2.2 I2V-A14B; this {type(pipeline).__name__} is not one: "
                f"{reason}; {self._other_models}"
            )
        if pipeline.config.get("expand_timesteps"):
            raise ValueError(
                f"the {self.family_name} family does not support expand_timesteps pipelines "
                "(Wan 2.2 TI2V-5B's image-to-video: family wan2_2_ti2v)"
            )
        super().__init__(pipeline, device=device, dtype=dtype)

    # -- instance side: the prediction contract ---------------------------------------

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        # Every request gets the image field read (a request without one, a dummy or
        # size-limit request, resolves with image None; encode then refuses it).
        return dataclasses.replace(super().resolve_params(request), image=request_image(request))

    def _encode_prompt(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """WanPipeline.encode_prompt's result, computed with ``WanPipeline``'s
        ``_get_t5_prompt_embeds`` on this pipeline: ``WanImageToVideoPipeline``'s own prompt
        cleaning calls ftfy unconditionally (a NameError where ftfy is not installed);
        WanPipeline's is the same tokenisation and encoder call with ftfy optional."""
        from diffusers import WanPipeline

        def t5(text: str) -> torch.Tensor:
            return WanPipeline._get_t5_prompt_embeds(
                self.pipeline,
                prompt=text,
                num_videos_per_prompt=kwargs["num_videos_per_prompt"],
                max_sequence_length=kwargs["max_sequence_length"],
                device=kwargs["device"],
            )

        negative = t5(kwargs["negative_prompt"] or "") if kwargs["do_classifier_free_guidance"] else None
        return t5(kwargs["prompt"]), negative

    def image_condition(self, params: GenerationParams) -> torch.Tensor:
        """The request image's condition, ``[1, 4 + z_dim, F, h, w]`` in fp32, as
        ``WanImageToVideoPipeline.prepare_latents`` builds it: the first-frame mask, then the
        normalised VAE mode of ``cat([image, zeros x (num_frames - 1)])`` along time."""
        import torch

        pixels = self._condition_pixels(params).unsqueeze(2)  # [1, 3, 1, H, W]
        frames = params.num_frames if params.num_frames is not None else WAN_DEFAULT_NUM_FRAMES
        video = torch.cat([pixels, pixels.new_zeros(1, 3, frames - 1, params.height, params.width)], dim=2)
        latents = self._normalised_latent_mean(video)
        _, _, latent_frames, height, width = latents.shape
        # prepare_latents repeats frame 0's mask over the temporal factor and folds frames
        # into channels: 1 on every channel of latent frame 0, 0 after.
        mask = torch.zeros(1, self.pipeline.vae_scale_factor_temporal, latent_frames, height, width, device=latents.device)
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1)

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        """The text embeddings (:class:`~miles_wan22.wan_base.WanFamilyBase`'s) and the image
        condition under ``positive["image_latents"]``, in the transformer's dtype (the
        pipeline casts ``cat([latents, condition])`` to it, value for value the same)."""
        import torch

        cond = super().encode(prompt, negative_prompt, params)
        with torch.no_grad():  # frozen VAE; the condition is data
            condition = self.image_condition(params)
        cond.positive[IMAGE_LATENTS] = condition.to(self.device, self.dtype)
        return cond

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """The text embeddings' shapes and :meth:`image_condition`'s: ``[1, t + z, F, h, w]``
        (t the VAE's temporal factor: the first-frame mask folded into channels)."""
        import torch

        cond = super().plan_conditioning(params)
        z, frames, height, width = self._latent_shape(params)
        channels = self.pipeline.vae_scale_factor_temporal + z
        cond.positive[IMAGE_LATENTS] = torch.zeros(1, channels, frames, height, width, device=self.device, dtype=self.dtype)
        return cond

    def _latent_shape(self, params: GenerationParams) -> tuple[int, int, int, int]:
        # The noise has the VAE's channels; the experts' in_channels also hold the condition.
        return (self.pipeline.vae.config.z_dim, *super()._latent_shape(params)[1:])

    def _expert_velocity(
        self,
        expert: str,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: Conditioning,
        params: GenerationParams,
    ) -> torch.Tensor:
        # WanImageToVideoPipeline.__call__: cat([latents, condition], dim=1) for both CFG
        # passes. The condition comes from the conditioning: the trainer's parameters carry
        # no image.
        import torch

        image = cond.positive.get(IMAGE_LATENTS)
        if image is None:
            raise ValueError(f"the {self.family_name} family's conditioning has no {IMAGE_LATENTS} (encode puts them there)")
        model_input = torch.cat([x, image.to(self.device, self.dtype)], dim=1)
        return super()._expert_velocity(expert, model_input, t, cond, params)

    # -- class side -------------------------------------------------------------------

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a tiny, randomly initialised two-expert WanImageToVideoPipeline to ``out_dir``."""
        from miles_wan22.tiny import build_i2v

        return build_i2v(out_dir, seed=seed)
