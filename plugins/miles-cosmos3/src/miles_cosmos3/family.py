"""The Cosmos 3 model family (``Cosmos3OmniPipeline`` / ``Cosmos3OmniTransformer``).

Import-light: torch and diffusers load only inside the methods that need them.

Cosmos3OmniTransformer is a mixture-of-transformers: every decoder layer carries two
parallel sets of weights, one for the causal text ("understanding") tokens and one for
the vision/sound/action ("generation") tokens. The generation tokens attend to the
understanding keys/values, so the understanding path conditions generation, but its own
outputs are never decoded by the diffusion pipeline. Parameter names (relative to the
transformer):

Generation path (trainable):
    layers.<i>.self_attn.add_q_proj / add_k_proj / add_v_proj / to_add_out   (LoRA targets)
    layers.<i>.self_attn.norm_added_q / norm_added_k
    layers.<i>.self_attn.k_norm_und_for_gen   (only when use_und_k_norm_for_gen: it normalises
                                              the understanding keys as the generation
                                              queries see them, so only generation uses it)
    layers.<i>.mlp_moe_gen.*
    layers.<i>.input_layernorm_moe_gen / post_attention_layernorm_moe_gen
    norm_moe_gen, proj_in, proj_out, time_embedder.*
    audio_proj_in / audio_proj_out / audio_modality_embed      (sound_gen checkpoints)
    action_proj_in / action_proj_out / action_modality_embed   (action_gen checkpoints)

Understanding tower (frozen):
    embed_tokens
    layers.<i>.self_attn.to_q / to_k / to_v / to_out / norm_q / norm_k
    layers.<i>.mlp.*
    layers.<i>.input_layernorm / post_attention_layernorm
    norm, lm_head   (unused by the diffusion forward)

Backpropagating the velocity reaches the understanding tower too (through the keys and
values it contributes; only ``norm`` and ``lm_head`` get no gradient), so full fine-tuning
freezes it explicitly (:meth:`Cosmos3Family.trainable_parameters`); the default LoRA
targets touch generation only.

The runtime follows ``Cosmos3OmniPipeline.__call__`` for text-to-image (``num_frames``
1) and text-to-video: one packed sample per transformer call (the joint sequence has no
batch dimension), classifier-free guidance as a second call on the negative prompt's
sequence, combined in fp32 as ``uncond + s * (cond - uncond)`` whenever ``s != 1``.
Image/video conditioning, sound and action generation are not part of the RL contract.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
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

# Cosmos3OmniPipeline.__call__ hard-codes these when height/width are None (and the run is
# not action-conditioned); they do not depend on any checkpoint configuration.
_DEFAULT_HEIGHT = 720
_DEFAULT_WIDTH = 1280
_DEFAULT_FPS = 24.0  # Cosmos3OmniPipeline.__call__'s fps default

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The file ``save_lora_adapter`` writes and ``load_lora_adapter`` reads."""

_GENERATION_PARAMETER = re.compile(
    r"(^|\.)(add_q_proj|add_k_proj|add_v_proj|to_add_out|norm_added_q|norm_added_k|k_norm_und_for_gen"
    r"|mlp_moe_gen|input_layernorm_moe_gen|post_attention_layernorm_moe_gen|norm_moe_gen"
    r"|proj_in|proj_out|time_embedder|audio_[a-z_]+|action_[a-z_]+)(\.|$)"
)


def is_generation_parameter(name: str) -> bool:
    """Whether the transformer parameter ``name`` belongs to the generation path (the
    module docstring lists both paths); everything else is the understanding tower."""
    return _GENERATION_PARAMETER.search(name) is not None


class Cosmos3Family(ModelFamily):
    """Cosmos 3: one packed sample per transformer call, CFG as two calls."""

    pipeline_class: ClassVar[str] = "diffusers:Cosmos3OmniPipeline"
    batched_outputs: ClassVar[bool] = False
    """The joint sequence packs one sample: the engine denoises outputs one at a time."""

    max_sequence_length: ClassVar[int] = 1024
    """Token ids are right-padded to this length (with an attention mask) so conditionings
    of different prompts stack into one micro-batch; the pipeline never truncates, so a
    longer prompt is a request error. ``extra_sampling_params.max_sequence_length`` sets it."""

    # -- instance side: the prediction contract ---------------------------------------

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer}

    def trainable_parameters(self, component: str) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Full fine-tuning trains the transformer's generation path only; the
        understanding tower (text embedding, causal attention, text MLPs) stays frozen."""
        for name, parameter in self.components()[component].named_parameters():
            if is_generation_parameter(name):
                yield name, parameter

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        spatial = int(pipe.vae_scale_factor_spatial)  # Cosmos3OmniPipeline.check_inputs
        temporal = int(pipe.vae_scale_factor_temporal)
        # The transformer pads the latent grid to its patch itself, as the pipeline relies on.
        sizes = {
            name: request_size(name, getattr(request, name), native, spatial, rule=" (the VAE's spatial factor)")
            for name, native in (("height", _DEFAULT_HEIGHT), ("width", _DEFAULT_WIDTH))
        }
        # None is an image, as the trainer sends --diffusion-output-num-frames 1 (the
        # pipeline's own default, 189 frames, is for its interactive use).
        frames = 1 if request.num_frames is None else request.num_frames
        if frames != 1 and (frames - 1) % temporal:
            got = (frames - 1) // temporal * temporal + 1
            raise RequestError(
                "num_frames",
                f"{frames}: a video has 1 + {temporal}k frames (the VAE compresses time {temporal}x; the pipeline would return {got})",
            )
        fps = request_fps(request.fps, _DEFAULT_FPS)
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "Cosmos 3 has no true CFG; use guidance_scale")
        extra = request_extras(request, ("max_sequence_length", FLOW_SHIFT), family="Cosmos 3")
        check_flow_shift(pipe.scheduler, request.flow_shift, what="flow shift")
        length = request_max_sequence_length(extra, self.max_sequence_length, None)
        return GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            num_frames=frames,
            fps=fps,
            extra={"max_sequence_length": length} if "max_sequence_length" in extra else {},
            flow_shift=request.flow_shift,
        )

    @staticmethod
    def _cfg(params: GenerationParams) -> bool:
        return params.guidance_scale != 1.0  # Cosmos3OmniPipeline.do_classifier_free_guidance

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """Token ids filling ``max_sequence_length`` (mask all ones: the longest prompt
        :meth:`encode` accepts), the negative side too under CFG; on the CPU, where
        :meth:`predict` selects them by the mask."""
        import torch

        length = int(params.extra.get("max_sequence_length", self.max_sequence_length))

        def side() -> dict[str, torch.Tensor]:
            return {"input_ids": torch.zeros(1, length, dtype=torch.long), "attention_mask": torch.ones(1, length, dtype=torch.long)}

        return Conditioning(side(), side() if self._cfg(params) else None)

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        """The pipeline's token ids (system prompt, duration/resolution templates, eos and
        ``<|vision_start|>``), right-padded to ``max_sequence_length`` with a mask. There
        is no text encoder: the transformer embeds the ids itself. A None negative prompt
        is the pipeline's ``""`` (with its inverse templates)."""
        import torch

        from miles_core.api import RequestError

        cond_ids, uncond_ids = self.pipeline.tokenize_prompt(
            prompt,
            negative_prompt,
            num_frames=params.num_frames or 1,
            height=params.height,
            width=params.width,
            fps=params.fps if params.fps is not None else _DEFAULT_FPS,
        )
        length = params.extra.get("max_sequence_length", self.max_sequence_length)

        def pack(ids: list[int], what: str) -> dict[str, torch.Tensor]:
            if len(ids) > length:
                raise RequestError(
                    what,
                    f"{len(ids)} tokens with the pipeline's templates, more than max_sequence_length {length} "
                    "(raise it with extra_sampling_params.max_sequence_length)",
                )
            padded = torch.zeros(1, length, dtype=torch.long)
            padded[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask = torch.zeros(1, length, dtype=torch.long)
            mask[0, : len(ids)] = 1
            return {"input_ids": padded.to(self.device), "attention_mask": mask.to(self.device)}

        positive = pack(cond_ids, "prompt")
        negative = pack(uncond_ids, "negative_prompt") if self._cfg(params) else None
        return Conditioning(positive, negative)

    def _latent_shape(self, params: GenerationParams) -> tuple[int, int, int, int]:
        pipe = self.pipeline
        spatial, temporal = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
        frames = params.num_frames or 1
        return (
            int(pipe.vae.config.z_dim),
            (frames - 1) // temporal + 1,
            params.height // spatial,
            params.width // spatial,
        )

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        shape = (1, *self._latent_shape(params))
        # One draw per output from its own generator (CPU by default), in fp32 as the pipeline's
        # prepare_latents (randn_tensor with sampling dtype fp32) draws it.
        noise = per_output_noise(shape, generators)
        return {"latents": noise.to(self.device, self.dtype)}

    def schedule(self, params: GenerationParams) -> Schedule:
        """The pipeline's ``set_timesteps`` on a private copy of its scheduler (with
        ``use_native_flow_schedule`` as the pipeline applies it; ``flow_shift`` rebuilds
        the scheduler with that shift). Timesteps are what the pipeline hands the
        transformer, as fp32 (UniPC's integer timesteps are exact in fp32). One
        deviation: UniPC lowers a first sigma of 1 by 1e-6 to keep its own log-SNR
        finite; the Flow-GRPO SDE needs the exact 1 there (``σ/(1-σ)`` would make the
        first step's noise ~1000x too large), so that sigma is restored to 1."""

        import numpy as np
        import torch

        pipe = self.pipeline
        scheduler = scheduler_copy(pipe.scheduler, params.flow_shift)
        steps = params.num_inference_steps
        if pipe.config.get("use_native_flow_schedule", False):
            sigmas = np.linspace(1.0 - 1.0 / scheduler.config.num_train_timesteps, 0.0, steps + 1)[:-1]
            scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas)
        else:
            scheduler.set_timesteps(steps, device=self.device)
        sigmas = exact_first_sigma(scheduler.sigmas.to(self.device, torch.float32))
        return Schedule(timesteps=scheduler.timesteps.to(self.device, torch.float32), sigmas=sigmas)

    def _velocity(self, x: torch.Tensor, timestep: float, ids: torch.Tensor, params: GenerationParams) -> torch.Tensor:
        """One transformer call on one sample (``x`` is ``[1, C, T, H, W]``), packed as
        Cosmos3OmniPipeline.__call__ packs its conditional or unconditional pass."""
        import torch

        pipe = self.pipeline
        transformer = pipe.transformer
        # The segments' index tensors are built on the host, where the pipeline reads some
        # of them back (tolist), then moved: the same values without a device sync, and
        # buildable while the model is on the meta device (the memory planner's).
        text = _on_device(pipe._prepare_text_segment(ids.tolist(), device="cpu"), self.device)
        vision = _on_device(
            pipe._prepare_vision_segment(
                input_vision_tokens=x,
                has_image_condition=False,
                mrope_offset=text["vision_start_temporal_offset"],
                vision_fps=params.fps if params.fps is not None else _DEFAULT_FPS,
                curr=text["und_len"],
                device="cpu",
                condition_frame_indexes=[],
            ),
            self.device,
        )
        # fp32 timesteps, one per noisy vision token (the pipeline's torch.full of t.item()).
        timesteps = torch.full((vision["num_noisy_vision_tokens"],), timestep, dtype=torch.float32, device=self.device)
        preds, _, _ = transformer(
            input_ids=text["input_ids"],
            text_indexes=text["text_indexes"],
            position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
            und_len=text["und_len"],
            sequence_length=text["und_len"] + vision["num_vision_tokens"],
            vision_tokens=[x.to(self.device, transformer.dtype)],
            vision_token_shapes=vision["vision_token_shapes"],
            vision_sequence_indexes=vision["vision_sequence_indexes"],
            vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
            vision_timesteps=timesteps,
            vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
            return_dict=False,
        )
        # No conditioning frame: the pipeline's _mask_velocity_predictions multiplies by a
        # noisy-position mask of ones, which changes no value (and reads the mask's sum,
        # which the memory planner's meta tensors cannot give), so the prediction is taken as is.
        return preds[0].float()

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        """One transformer call per row (two with CFG, conditional first), never batched:
        the packed sequence has no batch dimension."""
        import torch

        x = latents["latents"].to(self.device)
        batch = x.shape[0]
        t = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(batch)
        cfg = self._cfg(params)
        if cfg and cond.negative is None:
            raise ValueError(f"guidance_scale {params.guidance_scale} != 1 needs a negative conditioning")

        def ids(side: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            # The engine's denoising env stores them as fp32: exact for any vocabulary < 2**24.
            return side["input_ids"][i][side["attention_mask"][i] > 0].long()

        rows = []
        for i in range(batch):
            row, step = x[i : i + 1], float(t[i])
            v = self._velocity(row, step, ids(cond.positive, i), params)
            if cfg:
                uncond = self._velocity(row, step, ids(cond.negative, i), params)
                v = uncond + params.guidance_scale * (v - uncond)
            rows.append(v)
        return {"latents": torch.cat(rows)}

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        """As the pipeline decodes: un-normalise with the VAE's latent mean/std, decode one
        sample at a time, ``postprocess_video(output_type="pt")``. Images (1 frame)
        come back ``[B, C, H, W]``, videos ``[B, C, F, H, W]``."""
        import torch

        pipe = self.pipeline
        vae = pipe.vae
        mean = pipe._vae_latents_mean.to(self.device, vae.dtype).view(1, -1, 1, 1, 1)
        inv_std = pipe._vae_latents_inv_std.to(self.device, vae.dtype).view(1, -1, 1, 1, 1)
        outputs = []
        for row in latents["latents"]:
            z = row.unsqueeze(0).to(self.device, torch.float32)  # the pipeline's latents are fp32
            decoded = vae.decode(z.to(vae.dtype) / inv_std + mean).sample.to(torch.float32)
            frames = pipe.video_processor.postprocess_video(decoded, output_type="pt")  # [1, F, C, H, W]
            outputs.append(frames.permute(0, 2, 1, 3, 4))
        video = torch.cat(outputs).float()
        return video[:, :, 0] if (params.num_frames or 1) == 1 else video

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """Pixels in [0, 1] to normalised latents with the pipeline's ``_encode_video``
        (the VAE posterior's mode), one sample at a time; the inverse of :meth:`decode`."""
        import torch

        x = pixels.to(self.device, torch.float32) * 2 - 1
        if x.ndim == 4:
            x = x.unsqueeze(2)  # an image is a one-frame video
        z = torch.cat([self.pipeline._encode_video(row.unsqueeze(0)) for row in x])
        return {"latents": z.to(self.dtype)}

    def save_lora(self, directory: str | Path, modules: Mapping[str, torch.nn.Module]) -> Path:
        """The transformer's adapter with ``save_lora_adapter`` (Cosmos3OmniPipeline has
        no pipeline-level LoRA format): ``directory/pytorch_lora_weights.safetensors``,
        keys without a ``transformer.`` prefix; :meth:`load_lora` reads it back."""
        unknown = sorted(set(modules) - {"transformer"})
        if unknown:
            raise ValueError(f"Cosmos 3 trains only the transformer, got LoRA modules for {', '.join(unknown)}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        modules["transformer"].save_lora_adapter(str(directory), weight_name=LORA_WEIGHT_NAME)
        return directory

    def load_lora(self, directory: str | Path) -> int:
        """Load a :meth:`save_lora` directory into the pipeline's transformer
        (``load_lora_adapter(..., prefix=None)``: the default ``transformer`` prefix
        would silently match nothing); returns how many modules took the adapter, and
        raises when none did."""
        import torch

        transformer = self.pipeline.transformer
        before = set(getattr(transformer, "peft_config", {}) or {})
        transformer.load_lora_adapter(str(directory), weight_name=LORA_WEIGHT_NAME, prefix=None)
        added = set(getattr(transformer, "peft_config", {}) or {}) - before
        loaded = [
            name
            for name, module in transformer.named_modules()
            if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and added & set(module.lora_A)
        ]
        if not loaded:
            raise ValueError(f"{directory}: the LoRA matched no module of the Cosmos 3 transformer")
        return len(loaded)

    # -- class side -------------------------------------------------------------------

    @classmethod
    def plan_components(cls, checkpoint: str | Path) -> dict[str, Any]:
        """The planner's pipeline needs a tokenizer with the special tokens its constructor
        looks up (eos, ``<|vision_start|>``): a locally built Qwen2 one. Its vocabulary does
        not matter there: :meth:`plan_conditioning` gives ids of the longest prompt."""
        from miles_core.api import qwen2_tokenizer

        return {"text_tokenizer": qwen2_tokenizer()}

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a randomly initialised tiny Cosmos3OmniPipeline to ``out_dir``."""
        from miles_cosmos3.tiny import build

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(720, 1280)``: the pipeline's fixed defaults, whatever the checkpoint."""
        return (_DEFAULT_HEIGHT, _DEFAULT_WIDTH)


def _on_device(segment: dict[str, Any], device: Any) -> dict[str, Any]:
    """A segment dict of the pipeline's with its tensors (alone or in lists) on ``device``."""
    import torch

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, list) and value and all(isinstance(item, torch.Tensor) for item in value):
            return [item.to(device) for item in value]
        return value

    return {key: move(value) for key, value in segment.items()}
