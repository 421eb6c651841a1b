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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    ModelFamily,
    Schedule,
    check_flow_shift,
    exact_first_sigma,
    per_output_noise,
    request_extras,
    request_fps,
    request_max_sequence_length,
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

EXPERTS = ("transformer", "transformer_2")
"""High-noise expert first, low-noise expert second."""
GUIDANCE_SCALE_2 = "guidance_scale_2"
MAX_SEQUENCE_LENGTH = "max_sequence_length"
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""diffusers' LoRA file name; :meth:`Wan22Family.save_lora` writes one per expert, in a
folder named after the expert."""


class Wan22Family(ModelFamily):
    """Wan 2.2 text-to-video: ``transformer`` (high noise) and ``transformer_2`` (low noise)."""

    pipeline_class: ClassVar[str] = "diffusers:WanPipeline"
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt used when CFG is on and the request gives none: the engine's
    documented default (``--diffusion-negative-prompt``), as for SD3. diffusers itself
    would use ``""``."""

    def __init__(self, pipeline: Any, *, device: Any = "cpu", dtype: Any = None) -> None:
        super().__init__(pipeline, device=device, dtype=dtype)
        config = pipeline.config
        missing = [name for name in EXPERTS if getattr(pipeline, name, None) is None]
        if config.get("boundary_ratio") is None or missing:
            raise ValueError(
                "the wan2_2 family needs a two-expert WanPipeline (boundary_ratio set, transformer and transformer_2 "
                f"present); this one has boundary_ratio={config.get('boundary_ratio')!r}"
                + (f" and no {', '.join(missing)}" if missing else "")
                + " (Wan 2.1 and Wan 2.2 TI2V-5B checkpoints are single-expert and not supported)"
            )
        if config.get("expand_timesteps"):
            raise ValueError("the wan2_2 family does not support expand_timesteps pipelines (Wan 2.2 TI2V-5B)")
        scheduler = pipeline.scheduler.config
        # Flow-matching schedulers: UniPC / DPM-Solver with use_flow_sigmas, or FlowMatch*
        # (which carry a shift); any other has no flow-matching sigmas to step with.
        if not (scheduler.get("use_flow_sigmas") or "shift" in scheduler):
            raise ValueError(
                f"the pipeline's {type(pipeline.scheduler).__name__} is not a flow-matching scheduler (neither "
                "use_flow_sigmas nor a FlowMatch scheduler): the wan2_2 family steps with flow-matching sigmas"
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
        if (frames - 1) % temporal:
            raise RequestError(
                "num_frames",
                f"{frames}: Wan needs num_frames - 1 divisible by {temporal} (the VAE's temporal factor), "
                f"e.g. {frames - (frames - 1) % temporal}",
            )
        if rope is not None and ((frames - 1) // temporal + 1) // transformer.config.patch_size[0] > rope:
            raise RequestError("num_frames", f"{frames} gives more latent frames than the transformer's rope_max_seq_len {rope}")
        fps = request_fps(request.fps, None)
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "Wan 2.2 has no true CFG; use guidance_scale and guidance_scale_2")
        extra = request_extras(request, sorted((GUIDANCE_SCALE_2, MAX_SEQUENCE_LENGTH, FLOW_SHIFT)), family="Wan 2.2")
        resolved: dict[str, Any] = {}
        scale_2 = extra.get(GUIDANCE_SCALE_2)
        if scale_2 is None:
            if request.guidance_scale > 1:
                # diffusers would silently reuse guidance_scale for the low-noise expert;
                # like the reference we refuse to guess (no effect without CFG, so not needed then).
                raise RequestError(
                    "extra_sampling_params",
                    f"{GUIDANCE_SCALE_2} is required for Wan 2.2 when CFG is on (guidance_scale {request.guidance_scale} > 1): "
                    "the low-noise expert (transformer_2) has its own guidance scale and there is no fallback "
                    "(--diffusion-guidance-scale-2)",
                )
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
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            num_frames=frames,
            fps=fps,
            extra=resolved,
            flow_shift=shift,
        )

    @staticmethod
    def _cfg(params: GenerationParams) -> bool:
        # WanPipeline.do_classifier_free_guidance: guidance_scale alone decides, for both experts.
        return params.guidance_scale > 1

    def _expert_scale(self, expert: str, params: GenerationParams) -> float:
        if expert == EXPERTS[0]:
            return params.guidance_scale
        scale = params.extra.get(GUIDANCE_SCALE_2)
        if scale is None:
            raise ValueError(f"{GUIDANCE_SCALE_2} is required for the low-noise expert when CFG is on")
        return float(scale)

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        import torch

        cfg = self._cfg(params)
        if cfg and negative_prompt is None:
            negative_prompt = self.default_negative_prompt
        with torch.no_grad():  # frozen text encoder; the conditioning is reused as data
            embeds, neg_embeds = self.pipeline.encode_prompt(
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
        # One fp32 draw per output from its own CPU generator: what WanPipeline.prepare_latents
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

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        x = latents["latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1).expand(batch)
        high = t >= self.boundary_timestep
        if bool(high.all()) or not bool(high.any()):
            expert = EXPERTS[0] if bool(high[0]) else EXPERTS[1]
            return {"latents": self._expert_velocity(expert, x, t, cond, params).float()}
        # Rows on both sides of the boundary (the trainer never sends this; other callers
        # may): one forward per expert, rows put back in place.
        out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        for expert, rows in ((EXPERTS[0], high.nonzero().flatten()), (EXPERTS[1], (~high).nonzero().flatten())):
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
        model = getattr(self.pipeline, expert)
        positive = cond.positive["encoder_hidden_states"].to(self.device, self.dtype)
        # WanPipeline.__call__: the conditional call, then (CFG) the unconditional one.
        v = model(hidden_states=x, timestep=t, encoder_hidden_states=positive, return_dict=False)[0]
        if self._cfg(params):
            if cond.negative is None:
                raise ValueError(f"guidance_scale {params.guidance_scale} > 1 needs a negative conditioning")
            negative = cond.negative["encoder_hidden_states"].to(self.device, self.dtype)
            uncond = model(hidden_states=x, timestep=t, encoder_hidden_states=negative, return_dict=False)[0]
            v = uncond + self._expert_scale(expert, params) * (v - uncond)
        return v

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
        the VAE's ``latents_mean`` / ``latents_std``."""
        vae = self.pipeline.vae
        x = pixels.to(self.device, vae.dtype)
        if x.ndim == 4:
            x = x.unsqueeze(2)
        if x.ndim != 5:
            raise ValueError(f"Wan encodes [B, C, F, H, W] or [B, C, H, W] pixels, got shape {tuple(pixels.shape)}")
        # The distribution's mean: SFT targets are data, not a random draw per epoch.
        z = vae.encode(x * 2 - 1).latent_dist.mean
        mean, inv_std = self._latent_stats(z)
        return {"latents": ((z - mean) * inv_std).to(self.dtype)}

    def save_lora(self, directory: str | Path, modules: Mapping[str, torch.nn.Module]) -> Path:
        """Write each expert's adapter as a diffusers LoRA in its own folder:
        ``DIRECTORY/transformer/pytorch_lora_weights.safetensors`` (high noise) and
        ``DIRECTORY/transformer_2/...`` (low noise), each with its adapter config as
        metadata (rank, alpha, targets). A plain ``WanPipeline`` loads them with::

            pipe.load_lora_weights(DIRECTORY, subfolder="transformer")
            pipe.load_lora_weights(DIRECTORY, subfolder="transformer_2", load_into_transformer_2=True)

        (diffusers' Wan LoRA format holds one transformer per file, keys ``transformer.*``;
        ``load_into_transformer_2`` routes a file to the second expert.)"""
        from peft.utils import get_peft_model_state_dict

        unknown = sorted(set(modules) - set(EXPERTS))
        if unknown:
            raise ValueError(f"Wan 2.2 LoRAs cover {', '.join(EXPERTS)}; got {', '.join(unknown)}")
        if not modules:
            raise ValueError("no module to save a LoRA of")
        root = Path(directory)
        pipeline_cls = type(self.pipeline)
        for name, module in modules.items():
            configs = getattr(module, "peft_config", None) or {}
            if len(configs) != 1:
                raise ValueError(f"{name} must carry exactly one LoRA adapter to save, has {sorted(configs)}")
            ((adapter, config),) = configs.items()
            pipeline_cls.save_lora_weights(
                str(root / name),
                transformer_lora_layers=get_peft_model_state_dict(module, adapter_name=adapter),
                transformer_lora_adapter_metadata=config.to_dict(),
            )
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

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(480, 832)``: WanPipeline's hard-coded default, whatever the checkpoint."""
        return (WAN_DEFAULT_HEIGHT, WAN_DEFAULT_WIDTH)


def _take_rows(cond: Conditioning, rows: torch.Tensor) -> Conditioning:
    def take(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        return None if tensors is None else {k: v[rows.to(v.device)] for k, v in tensors.items()}

    return Conditioning(take(cond.positive), take(cond.negative))  # type: ignore[arg-type]
