"""The LTX-2 / LTX-2.3 model family (diffusers ``LTX2Pipeline``).

Two latent streams flow through the denoising loop together: ``latents`` (video) and
``audio_latents`` (audio), both in the pipeline's packed layout (``[B, tokens,
channels]``), both stepped with the same sigmas by the engine and scored jointly by the
trainer. :meth:`LtxFamily.decode` returns the video frames (what a reward sees);
:meth:`LtxFamily.extra_outputs` returns the audio waveform.

Guidance is what ``LTX2Pipeline.__call__`` does with spatio-temporal guidance (STG) and
modality-isolation guidance off: classifier-free guidance only, one transformer call per
step on ``[negative rows; positive rows]``, combined in x0 space with the pipeline's
"delta" formulation and optional guidance rescale.

Import-light like :mod:`miles_core.family`: torch and diffusers load only inside the
methods that need them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles_core.api import (
    Conditioning,
    GenerationParams,
    Latents,
    ModelFamily,
    Schedule,
    check_flow_shift,
    request_extras,
    request_fps,
    request_max_sequence_length,
    request_size,
    scheduler_copy,
)

if TYPE_CHECKING:
    import torch

    from miles_core.api import RolloutRequest

# LTX2Pipeline.__call__ defaults (height=512, width=768): hard-coded in the signature, not
# read from any component config, so they hold for every LTX-2 checkpoint.
_DEFAULT_HEIGHT = 512
_DEFAULT_WIDTH = 768
_DEFAULT_NUM_FRAMES = 121
"""LTX2Pipeline's fixed default for checkpoints without a duration head (LTX-2.0 / 2.3)."""
_DEFAULT_FPS = 24.0
"""LTX2Pipeline's ``frame_rate`` default."""
_SIZE_MULTIPLE = 32
"""LTX2Pipeline.check_inputs: height and width divisible by 32."""

_AUDIO_GUIDANCE_SCALE = "audio_guidance_scale"
_GUIDANCE_RESCALE = "guidance_rescale"
_AUDIO_GUIDANCE_RESCALE = "audio_guidance_rescale"
_MAX_SEQUENCE_LENGTH = "max_sequence_length"


@dataclass(frozen=True)
class _Geometry:
    """Latent sizes of one request, as LTX2Pipeline.__call__ derives them."""

    latent_frames: int
    latent_height: int
    latent_width: int
    video_channels: int
    audio_frames: int
    audio_channels: int
    latent_mel_bins: int
    fps: float
    """The frame rate the transformer's positional embeddings see (motion speed 1)."""


class LtxFamily(ModelFamily):
    """LTX-2 / LTX-2.3: video latents plus an audio latent branch, Gemma 3 text encoder."""

    pipeline_class: ClassVar[str] = "diffusers:LTX2Pipeline"
    latent_streams: ClassVar[tuple[str, ...]] = ("latents", "audio_latents")
    audio_latent_streams: ClassVar[tuple[str, ...]] = ("audio_latents",)

    timestep_divisor: ClassVar[float] = 1000.0
    """The transformer takes the scheduler's timesteps (``σ x 1000``) as both its
    ``timestep`` and its ``sigma`` input, as LTX2Pipeline passes them; the step math
    works in sigmas (:attr:`Schedule.sigmas`), and the x0-space guidance converts with
    ``σ = timestep / timestep_divisor``."""
    max_sequence_length: ClassVar[int] = 1024
    """Gemma prompt length: LTX2Pipeline.__call__'s default; a request may set
    ``extra_sampling_params.max_sequence_length``."""
    default_negative_prompt: ClassVar[str] = " "
    """Negative prompt when CFG is on and the request gives none: the reference engine's
    default. The pipeline strips prompts, so it encodes exactly as diffusers' ``""``."""
    extra_keys: ClassVar[tuple[str, ...]] = (
        _AUDIO_GUIDANCE_SCALE,
        _GUIDANCE_RESCALE,
        _AUDIO_GUIDANCE_RESCALE,
        _MAX_SEQUENCE_LENGTH,
        "flow_shift",
    )
    """``extra_sampling_params`` this family reads (LTX2Pipeline's arguments of those
    names; ``audio_guidance_scale`` defaults to ``guidance_scale`` as the pipeline does
    when it is None; both rescales default to 0, off)."""

    # -- instance side: the prediction contract ---------------------------------------

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer}

    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        from miles_core.api import FLOW_SHIFT, RequestError

        pipe = self.pipeline
        multiple = math.lcm(_SIZE_MULTIPLE, pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size)
        sizes = {
            name: request_size(name, getattr(request, name), default, multiple)
            for name, default in (("height", _DEFAULT_HEIGHT), ("width", _DEFAULT_WIDTH))
        }
        frames = _DEFAULT_NUM_FRAMES if request.num_frames is None else request.num_frames
        temporal = pipe.vae_temporal_compression_ratio
        patch_t = pipe.transformer_temporal_patch_size
        if (frames - 1) % temporal or ((frames - 1) // temporal + 1) % patch_t:
            raise RequestError("num_frames", f"{frames} must be 1 + a multiple of {temporal} (the VAE's temporal compression)")
        fps = request_fps(request.fps, _DEFAULT_FPS)
        if request.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", "LTX-2 has no true CFG; use guidance_scale")
        extra = request_extras(request, self.extra_keys, family="LTX-2")
        check_flow_shift(pipe.scheduler, request.flow_shift)
        for key in (_AUDIO_GUIDANCE_SCALE, _GUIDANCE_RESCALE, _AUDIO_GUIDANCE_RESCALE):
            if key not in extra:
                continue
            value = extra[key]
            upper = math.inf if key == _AUDIO_GUIDANCE_SCALE else 1.0
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or not 0 <= value <= upper:
                rule = "a finite number >= 0" if key == _AUDIO_GUIDANCE_SCALE else "a number in [0, 1]"
                raise RequestError("extra_sampling_params", f"{key} must be {rule}, got {value!r}")
            extra[key] = float(value)
        limit = int(self._text_config().get("max_position_embeddings", self.max_sequence_length))
        request_max_sequence_length(extra, self.max_sequence_length, limit, _MAX_SEQUENCE_LENGTH)
        extra.pop(FLOW_SHIFT, None)  # travels as GenerationParams.flow_shift
        params = GenerationParams(
            height=sizes["height"],
            width=sizes["width"],
            num_inference_steps=request.num_inference_steps,
            guidance_scale=float(request.guidance_scale),
            num_frames=frames,
            fps=fps,
            extra=extra,
            flow_shift=request.flow_shift,
        )
        if self._geometry(params).audio_frames < 1:
            raise RequestError("num_frames", f"{frames} frames at {fps:g} fps are too short for one audio latent frame")
        return params

    def _text_config(self) -> Mapping[str, Any]:
        """The Gemma text tower's config (empty without a text encoder)."""
        encoder = getattr(self.pipeline, "text_encoder", None)
        if encoder is None:
            return {}
        config = encoder.config
        return getattr(config, "text_config", config).to_dict()

    def _geometry(self, params: GenerationParams) -> _Geometry:
        pipe = self.pipeline
        frames = params.num_frames if params.num_frames is not None else _DEFAULT_NUM_FRAMES
        fps = params.fps if params.fps is not None else _DEFAULT_FPS
        # As LTX2Pipeline.__call__ (motion_speed 1: the conditioning frame rate is fps).
        audio_per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return _Geometry(
            latent_frames=(frames - 1) // pipe.vae_temporal_compression_ratio + 1,
            latent_height=params.height // pipe.vae_spatial_compression_ratio,
            latent_width=params.width // pipe.vae_spatial_compression_ratio,
            video_channels=pipe.transformer.config.in_channels,
            audio_frames=round(frames / fps * audio_per_second),
            audio_channels=pipe.audio_vae.config.latent_channels,
            latent_mel_bins=pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio,
            fps=fps / 1.0,
        )

    @staticmethod
    def _guidance(params: GenerationParams) -> tuple[float, float, float, float]:
        """(video scale, audio scale, video rescale, audio rescale)."""
        extra = params.extra
        audio = extra.get(_AUDIO_GUIDANCE_SCALE)
        return (
            params.guidance_scale,
            # LTX2Pipeline: ``audio_guidance_scale or guidance_scale``.
            float(audio) if audio else params.guidance_scale,
            float(extra.get(_GUIDANCE_RESCALE, 0.0)),
            float(extra.get(_AUDIO_GUIDANCE_RESCALE, 0.0)),
        )

    @classmethod
    def _cfg(cls, params: GenerationParams) -> bool:
        video, audio, _, _ = cls._guidance(params)
        return video > 1 or audio > 1  # LTX2Pipeline.do_classifier_free_guidance

    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        import torch

        pipe = self.pipeline
        cfg = self._cfg(params)
        if cfg and negative_prompt is None:
            negative_prompt = self.default_negative_prompt
        with torch.no_grad():  # frozen text encoder and connectors; the conditioning is reused as data
            embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
                prompt=prompt,
                negative_prompt=negative_prompt if cfg else None,
                do_classifier_free_guidance=cfg,
                num_videos_per_prompt=1,
                max_sequence_length=params.extra.get(_MAX_SEQUENCE_LENGTH, self.max_sequence_length),
                device=self.device,
            )
            padding_side = getattr(pipe.tokenizer, "padding_side", "left") if pipe.tokenizer is not None else "left"
            positive = self._connect(embeds, mask, padding_side)
            negative = self._connect(neg_embeds, neg_mask, padding_side) if cfg else None
        return Conditioning(positive, negative)

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """The connectors' outputs for a prompt padded to ``max_sequence_length`` (the
        connectors' registers fill the padding, so every position reaches the
        transformer): video and audio embeddings of the transformer's cross-attention
        widths and the float mask; the negative side too under CFG."""
        import torch

        config = self.pipeline.transformer.config
        length = int(params.extra.get(_MAX_SEQUENCE_LENGTH, self.max_sequence_length))

        def side() -> dict[str, torch.Tensor]:
            return {
                "encoder_hidden_states": torch.zeros(1, length, config.cross_attention_dim, device=self.device, dtype=self.dtype),
                "audio_encoder_hidden_states": torch.zeros(
                    1, length, config.audio_cross_attention_dim, device=self.device, dtype=self.dtype
                ),
                "encoder_attention_mask": torch.ones(1, length, device=self.device, dtype=self.dtype),
            }

        return Conditioning(side(), side() if self._cfg(params) else None)

    def _connect(self, embeds: torch.Tensor, mask: torch.Tensor, padding_side: str) -> dict[str, torch.Tensor]:
        """The text connectors (frozen, not trainable) as LTX2Pipeline runs them; the
        keys are the transformer's keyword arguments."""
        video, audio, connector_mask = self.pipeline.connectors(embeds, mask, padding_side=padding_side)
        # The binary mask as a float: the transformer turns it into an additive bias, and
        # a float survives the denoising environment's round trip unchanged.
        mask = connector_mask.to(self.device, self.dtype)
        return {
            "encoder_hidden_states": video.to(self.device, self.dtype),
            "audio_encoder_hidden_states": audio.to(self.device, self.dtype),
            "encoder_attention_mask": mask,
        }

    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        import torch

        pipe = self.pipeline
        geo = self._geometry(params)
        video_shape = (1, geo.video_channels, geo.latent_frames, geo.latent_height, geo.latent_width)
        audio_shape = (1, geo.audio_channels, geo.audio_frames, geo.latent_mel_bins)
        videos, audios = [], []
        for generator in generators:
            # Video first, then audio, from the output's own generator: the order in which
            # LTX2Pipeline draws them (prepare_latents, then prepare_audio_latents).
            videos.append(torch.randn(video_shape, generator=generator, device=generator.device, dtype=torch.float32))
            audios.append(torch.randn(audio_shape, generator=generator, device=generator.device, dtype=torch.float32))
        video = pipe._pack_latents(torch.cat(videos), pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        audio = pipe._pack_audio_latents(torch.cat(audios))
        # Packing leaves permuted views; contiguous copies make every later step (and the
        # log-prob's reductions) run over the memory layout the trainer's stacked
        # trajectory latents have, so the two sum in the same order.
        return {
            "latents": video.to(self.device, self.dtype).contiguous(),
            "audio_latents": audio.to(self.device, self.dtype).contiguous(),
        }

    def schedule(self, params: GenerationParams) -> Schedule:

        import numpy as np
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        # With a flow shift, the config's terminal stretch still applies.
        scheduler = scheduler_copy(self.pipeline.scheduler, params.flow_shift)
        steps = params.num_inference_steps
        geo = self._geometry(params)
        pipe = self.pipeline
        tokens = (
            (geo.latent_frames // pipe.transformer_temporal_patch_size)
            * (geo.latent_height // pipe.transformer_spatial_patch_size)
            * (geo.latent_width // pipe.transformer_spatial_patch_size)
        )
        # As LTX2Pipeline.__call__: explicit sigmas linspace(1, 1/N, N) and mu from the
        # video sequence length (note its own base/max defaults).
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            tokens,
            scheduler.config.get("base_image_seq_len", 1024),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.95),
            scheduler.config.get("max_shift", 2.05),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, None, sigmas=sigmas, mu=mu)
        return Schedule(
            timesteps=timesteps.to(self.device, torch.float32),
            sigmas=scheduler.sigmas.to(self.device, torch.float32),
        )

    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        import torch

        transformer = self.pipeline.transformer
        geo = self._geometry(params)
        x = latents["latents"].to(self.device, self.dtype)
        a = latents["audio_latents"].to(self.device, self.dtype)
        batch = x.shape[0]
        # Timesteps stay fp32 as the pipeline passes them (the scheduler's dtype).
        t = torch.as_tensor(timestep, dtype=torch.float32, device=self.device).reshape(-1).expand(batch)
        pos = {k: v.to(self.device, self.dtype) for k, v in cond.positive.items()}
        cfg = self._cfg(params)
        if cfg:
            if cond.negative is None:
                raise ValueError(f"guidance_scale {params.guidance_scale} > 1 needs a negative conditioning")
            neg = {k: v.to(self.device, self.dtype) for k, v in cond.negative.items()}
            # One call on [negative rows; positive rows], exactly as the pipeline batches CFG.
            text = {k: torch.cat([neg[k], pos[k]]) for k in pos}
            x_in, a_in, t_in = torch.cat([x, x]), torch.cat([a, a]), torch.cat([t, t])
        else:
            text, x_in, a_in, t_in = pos, x, a, t
        rows = x_in.shape[0]
        video_coords = transformer.rope.prepare_video_coords(
            rows, geo.latent_frames, geo.latent_height, geo.latent_width, self.device, fps=geo.fps
        )
        audio_coords = transformer.audio_rope.prepare_audio_coords(rows, geo.audio_frames, self.device)
        video_out, audio_out = transformer(
            hidden_states=x_in,
            audio_hidden_states=a_in,
            encoder_hidden_states=text["encoder_hidden_states"],
            audio_encoder_hidden_states=text["audio_encoder_hidden_states"],
            timestep=t_in,
            sigma=t_in,  # LTX2Pipeline passes the timestep as sigma too (used by LTX-2.3)
            encoder_attention_mask=text["encoder_attention_mask"],
            audio_encoder_attention_mask=text["encoder_attention_mask"],
            num_frames=geo.latent_frames,
            height=geo.latent_height,
            width=geo.latent_width,
            fps=geo.fps,
            audio_num_frames=geo.audio_frames,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=False,
            spatio_temporal_guidance_blocks=None,
            perturbation_mask=None,
            use_cross_timestep=True,
            return_dict=False,
        )
        video_out, audio_out = video_out.float(), audio_out.float()
        video_scale, audio_scale, video_rescale, audio_rescale = self._guidance(params)
        # The pipeline guides in x0 space with the step's sigma; the schedule's timesteps
        # are sigma x timestep_divisor, so the sigma of a row is its timestep / divisor.
        sigma = (t / self.timestep_divisor).view(batch, 1, 1)
        return {
            "latents": self._guide(x.float(), video_out, sigma, video_scale, video_rescale, cfg),
            "audio_latents": self._guide(a.float(), audio_out, sigma, audio_scale, audio_rescale, cfg),
        }

    @staticmethod
    def _guide(x: torch.Tensor, out: torch.Tensor, sigma: torch.Tensor, scale: float, rescale: float, cfg: bool) -> torch.Tensor:
        """LTX2Pipeline's guidance on one stream, in x0 space: ``x0 = x0_c + (s - 1)(x0_c -
        x0_u)`` under CFG, optionally rescaled toward ``x0_c``'s std, then back to a
        velocity. Without CFG the pipeline still converts v -> x0 -> v (the identity up
        to rounding); so do we, to give the pipeline's velocity bit for bit."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        if not cfg:
            return (x - (x - out * sigma)) / sigma
        uncond, text = out.chunk(2)
        x0_text = x - text * sigma
        x0_uncond = x - uncond * sigma
        guided = x0_text + (scale - 1) * (x0_text - x0_uncond)
        if rescale > 0:
            guided = rescale_noise_cfg(guided, x0_text, guidance_rescale=rescale)
        return (x - guided) / sigma

    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        import torch

        pipe = self.pipeline
        vae = pipe.vae
        geo = self._geometry(params)
        x = pipe._unpack_latents(
            latents["latents"].to(self.device, torch.float32),
            geo.latent_frames,
            geo.latent_height,
            geo.latent_width,
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        ).to(self.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            # The pipeline's defaults: decode_timestep 0 and decode_noise_scale 0, so the
            # latents are decoded as they are, conditioned on timestep 0.
            timestep = torch.zeros(x.shape[0], device=self.device, dtype=x.dtype)
        x = pipe._denormalize_latents(x, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(x.to(vae.dtype), timestep, return_dict=False)[0]
        # VideoProcessor.postprocess_video(output_type="pt") denormalizes to [0, 1]; we keep
        # the [B, C, F, H, W] layout (it returns [B, F, C, H, W]).
        return (video * 0.5 + 0.5).clamp(0, 1).float()

    def extra_outputs(self, latents: Latents, params: GenerationParams) -> dict[str, torch.Tensor]:
        """``audio``: the vocoder's waveform ``[B, channels, samples]`` at
        ``pipeline.vocoder.config.output_sampling_rate``, decoded as LTX2Pipeline does."""
        import torch

        pipe = self.pipeline
        geo = self._geometry(params)
        audio = latents["audio_latents"].to(self.device, torch.float32)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, geo.audio_frames, num_mel_bins=geo.latent_mel_bins)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        return {"audio": pipe.vocoder(mel).float()}

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """Pixels in [0, 1], ``[B, C, F, H, W]`` (or ``[B, C, H, W]``: one frame), to the
        packed, normalised video latents, the inverse of :meth:`decode`: the video VAE
        posterior's mean (SFT targets are data, not a draw), normalised with the VAE's
        ``latents_mean`` / ``latents_std`` and ``scaling_factor``, then packed into the
        transformer's tokens. The audio stream comes from :meth:`encode_audio`."""
        pipe = self.pipeline
        vae = pipe.vae
        x = pixels.to(self.device, vae.dtype)
        if x.ndim == 4:
            x = x.unsqueeze(2)
        if x.ndim != 5:
            raise ValueError(f"LTX-2 encodes [B, C, F, H, W] or [B, C, H, W] pixels, got shape {tuple(pixels.shape)}")
        z = vae.encode(x * 2 - 1).latent_dist.mean
        z = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        packed = pipe._pack_latents(z, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        return {"latents": packed.to(self.dtype).contiguous()}

    def encode_audio(self, waveform: torch.Tensor, sample_rate: int, params: GenerationParams) -> Latents:
        """A waveform ``[B, channels, samples]`` in [-1, 1] to the packed, normalised audio
        latents of the clip (the inverse of :meth:`extra_outputs` up to the vocoder, which
        has no inverse: the audio VAE encodes a mel spectrogram, :mod:`miles_ltx.log_mel`).

        The clip lasts ``num_frames / fps`` seconds (the same frame rate the transformer's
        positions see); its first that many seconds of audio are resampled to the audio
        VAE's rate and cut (or, for the last fraction of a latent frame, zero-padded) to
        ``audio_frames x 4`` mel frames, which the VAE's two 2x causal downsamplings turn
        into the pipeline's ``audio_frames``. Mono is duplicated to the VAE's two channels.
        The posterior's mean is normalised with the audio VAE's ``latents_mean`` /
        ``latents_std`` on the packed layout, as :meth:`extra_outputs` un-normalises it."""
        import torch

        from miles_ltx.log_mel import log_mel_spectrogram, resample

        pipe = self.pipeline
        vae = pipe.audio_vae
        geo = self._geometry(params)
        frames = params.num_frames if params.num_frames is not None else _DEFAULT_NUM_FRAMES
        seconds = frames / geo.fps
        if waveform.ndim != 3:
            raise ValueError(f"is not a [B, channels, samples] waveform (shape {tuple(waveform.shape)})")
        channels = int(vae.config.in_channels)
        x = waveform.float()
        if x.shape[1] == 1 and channels > 1:
            x = x.expand(-1, channels, -1)
        elif x.shape[1] != channels:
            raise ValueError(f"has {x.shape[1]} channels; the audio VAE takes {channels} (mono is duplicated)")
        if x.shape[-1] < round(seconds * sample_rate):
            raise ValueError(
                f"lasts {x.shape[-1] / sample_rate:.3f} s; the clip needs {seconds:.3f} s ({frames} frames at {geo.fps:g} fps)"
            )
        rate, hop = int(pipe.audio_sampling_rate), int(pipe.audio_hop_length)
        mel_frames = geo.audio_frames * int(pipe.audio_vae_temporal_compression_ratio)
        # A little past the clip goes through the resampler, whose wrap-around lands there.
        margin = min(x.shape[-1], math.ceil((seconds + 0.1) * sample_rate))
        x = resample(x[..., :margin], sample_rate, rate)[..., : mel_frames * hop]
        x = torch.nn.functional.pad(x, (0, mel_frames * hop - x.shape[-1]))
        mel = log_mel_spectrogram(x, rate, hop, int(vae.config.mel_bins))[:, :, :mel_frames]
        z = vae.encode(mel.to(self.device, vae.dtype)).latent_dist.mean
        expected = (geo.audio_channels, geo.audio_frames, geo.latent_mel_bins)
        if tuple(z.shape[1:]) != expected:
            raise ValueError(f"encodes to audio latents {tuple(z.shape[1:])}, but the pipeline denoises {expected}")
        packed = pipe._normalize_audio_latents(pipe._pack_audio_latents(z), vae.latents_mean, vae.latents_std)
        return {"audio_latents": packed.to(self.dtype).contiguous()}

    # -- class side -------------------------------------------------------------------

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write the tiny LTX-2 pipeline (see :mod:`miles_ltx.tiny`) to ``out_dir``."""
        from miles_ltx import tiny  # heavy: torch, diffusers, transformers

        return tiny.build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(512, 768)``: ``LTX2Pipeline``'s ``height`` / ``width`` defaults, which do not
        depend on the checkpoint."""
        return (_DEFAULT_HEIGHT, _DEFAULT_WIDTH)
