"""LtxFamily's runtime contract against LTX2Pipeline itself.

The family's encode / initial_latents / schedule / predict / decode / extra_outputs,
driven by a plain Euler loop over both latent streams, must reproduce
``LTX2Pipeline.__call__`` (STG and modality guidance off: one transformer call per step);
rows of a batch must be independent; noise is per output; conditioning is encoded once
per request; bad requests name their field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import LTX2Pipeline

from miles_core import family_checks, testing
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RequestError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from miles_ltx.family import LtxFamily

PROMPT = "a red cat dancing"
HEIGHT, WIDTH = 32, 64  # multiples of 32; latents 4 x 8
FRAMES = 9  # 1 + 8k; 5 latent frames
FPS = 24.0
STEPS = 4
SEQ = 32  # max_sequence_length: the default 1024 only pads
ONE_CALL = dict(  # LTX2Pipeline's extra guidance passes off: one transformer call per step
    stg_scale=0.0,
    audio_stg_scale=0.0,
    spatio_temporal_guidance_blocks=None,
    modality_scale=1.0,
    audio_modality_scale=1.0,
)
GUIDANCE = {
    "cfg": (3.0, {}),
    "no-cfg": (1.0, {}),
    # per-modality scales and guidance rescale, as extra_sampling_params
    "cfg-audio-rescale": (3.0, {"audio_guidance_scale": 7.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.5}),
}

tiny_dir, pipe = testing.tiny_pipeline_fixtures(LtxFamily)


@pytest.fixture(scope="module")
def family(pipe: LTX2Pipeline) -> LtxFamily:
    # The tiny VAEs normalise with mean 0 / std 1; non-trivial statistics make the
    # comparisons see the (de)normalisation of both streams.
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for vae in (pipe.vae, pipe.audio_vae):
            vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=generator) * 0.3)
            vae.latents_std.copy_(torch.rand(vae.latents_std.shape, generator=generator) + 0.5)
    return LtxFamily(pipe)


def _request(guidance: float = 1.0, extra: dict | None = None, **kwargs) -> RolloutRequest:
    fields = dict(
        prompt=PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        fps=FPS,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        extra_sampling_params={"max_sequence_length": SEQ, **(extra or {})},
    )
    return RolloutRequest(**{**fields, **kwargs})


def _params(family: LtxFamily, guidance: float = 1.0, extra: dict | None = None, **kwargs) -> GenerationParams:
    return family.resolve_params(_request(guidance, extra, **kwargs))


def _generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@torch.no_grad()
def _family_sample(family: LtxFamily, params: GenerationParams, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    cond = family.encode(PROMPT, None, params).expand(n)
    latents = family_checks.euler_sample(family, cond, params, family.initial_latents(params, _generators(seed, n)))
    return family.decode(latents, params), family.extra_outputs(latents, params)["audio"]


def _pipeline_sample(pipe: LTX2Pipeline, params: GenerationParams, seed: int, n: int, **overrides):
    extra = params.extra
    out = pipe(
        PROMPT,
        negative_prompt=" ",
        height=params.height,
        width=params.width,
        num_frames=params.num_frames,
        frame_rate=params.fps,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        audio_guidance_scale=extra.get("audio_guidance_scale"),  # None: the video scale
        guidance_rescale=extra.get("guidance_rescale", 0.0),
        audio_guidance_rescale=extra.get("audio_guidance_rescale", 0.0) or None,
        num_videos_per_prompt=n,
        generator=_generators(seed, n),  # one per output, as the engine draws
        max_sequence_length=extra["max_sequence_length"],
        output_type="pt",
        **{**ONE_CALL, **overrides},
    )
    # output_type "pt" gives [B, F, C, H, W]; the contract is [B, C, F, H, W].
    return out.frames.permute(0, 2, 1, 3, 4), out.audio


@pytest.mark.parametrize("case", list(GUIDANCE))
def test_euler_loop_over_the_family_equals_the_pipeline(family: LtxFamily, pipe: LTX2Pipeline, case: str) -> None:
    guidance, extra = GUIDANCE[case]
    params = _params(family, guidance, extra)
    video, audio = _family_sample(family, params, 7, 2)
    theirs_video, theirs_audio = _pipeline_sample(pipe, params, 7, 2)
    assert video.shape == theirs_video.shape == (2, 3, FRAMES, HEIGHT, WIDTH) and video.dtype == torch.float32
    assert audio.shape == theirs_audio.shape and audio.shape[:2] == (2, pipe.vocoder.config.out_channels)
    diff = (video - theirs_video).abs().max().item()
    audio_diff = (audio - theirs_audio).abs().max().item()
    print(f"{case}: max |family - pipeline| video {diff:.3e}, audio {audio_diff:.3e}")
    assert diff <= 1e-5 and audio_diff <= 1e-5

    # Control: the comparison sees the transformer. Nudge one weight of the transformer
    # only in the family run (the pipeline shares the module, so restore it).
    weight = family.components()["transformer"].transformer_blocks[0].attn1.to_q.weight
    with family_checks.nudged(weight):
        nudged, nudged_audio = _family_sample(family, params, 7, 2)
    assert (nudged - theirs_video).abs().max().item() > 1e-4
    assert (nudged_audio - theirs_audio).abs().max().item() > 0  # the audio branch reads the video too
    assert torch.equal(_family_sample(family, params, 7, 2)[0], video)  # restored


def test_the_guidance_cases_differ(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    """Control for the guidance cases above: each gives the pipeline another output, so
    matching all of them means following each setting."""
    outputs = {case: _pipeline_sample(pipe, _params(family, *GUIDANCE[case]), 7, 1) for case in GUIDANCE}
    cases = list(outputs)
    for i, first in enumerate(cases):
        for second in cases[i + 1 :]:
            (video_a, audio_a), (video_b, audio_b) = outputs[first], outputs[second]
            assert not torch.equal(video_a, video_b) and not torch.equal(audio_a, audio_b), (first, second)


@pytest.mark.parametrize("guidance", [3.0, 1.0], ids=["cfg", "no-cfg"])
def test_rows_of_a_batch_are_independent(family: LtxFamily, guidance: float) -> None:
    params = _params(family, guidance)
    latents = family.initial_latents(params, _generators(3, 3))
    schedule = family.schedule(params)
    t = schedule.timesteps[[0, 2, 3]]  # a different step per row, as the trainer mixes them
    cond = family.encode(PROMPT, None, params)
    for name, (batched, single) in family_checks.batched_and_rows(family, latents, t, cond, params).items():
        assert batched.dtype == torch.float32 and batched.shape == latents[name].shape
        diff = (batched - single).abs().max().item()
        print(f"guidance {guidance} {name}: max |batched - single rows| = {diff:.3e}")
        # Batch-size-dependent kernel rounding (~1e-7), magnified up to 1/sigma = 10x by the
        # pipeline's v -> x0 -> v conversion at the terminal sigma 0.1.
        assert torch.allclose(batched, single, atol=1e-5, rtol=0)


def test_initial_noise_is_per_output_in_the_pipelines_layout(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    params = _params(family)
    pair = family.initial_latents(params, _generators(11, 2))
    assert set(pair) == set(LtxFamily.latent_streams) == {"latents", "audio_latents"}
    # Packed as the pipeline denoises them: video [B, F*H*W tokens, C], audio [B, L, C*M].
    assert pair["latents"].shape == (2, 5 * (HEIGHT // 8) * (WIDTH // 8), pipe.transformer.config.in_channels)
    audio_frames = round(FRAMES / FPS * pipe.audio_sampling_rate / pipe.audio_hop_length / 4)
    assert pair["audio_latents"].shape == (2, audio_frames, pipe.transformer.config.audio_in_channels)
    first = family.initial_latents(params, _generators(11, 1))
    second = family.initial_latents(params, _generators(12, 1))
    for name in family.latent_streams:
        assert torch.equal(pair[name], torch.cat([first[name], second[name]])), name
        assert not torch.equal(pair[name][0], pair[name][1]), name
    # That the pipeline draws this same noise from the same generators (video first, then
    # audio) is what the Euler-loop test above relies on.


def test_resolve_params_defaults_and_errors(family: LtxFamily, pipe: LTX2Pipeline, tiny_dir) -> None:
    params = family.resolve_params(RolloutRequest(prompt=PROMPT, guidance_scale=3.0, num_inference_steps=5))
    assert (params.height, params.width) == LtxFamily.native_size(tiny_dir) == (512, 768)
    assert (params.num_frames, params.fps) == (121, 24.0)  # LTX2Pipeline's defaults
    assert (params.num_inference_steps, params.guidance_scale, dict(params.extra), params.flow_shift) == (5, 3.0, {}, None)
    ok = _params(family, 3.0, {"audio_guidance_scale": 7, "guidance_rescale": 0.7, "flow_shift": 3.0})
    assert dict(ok.extra) == {"max_sequence_length": SEQ, "audio_guidance_scale": 7.0, "guidance_rescale": 0.7}
    assert ok.flow_shift == 3.0
    assert _params(family, num_frames=1).num_frames == 1  # a one-frame video

    base = _request()
    bad = [
        ("height", replace(base, height=48), "48 must be a multiple of 32"),
        ("width", replace(base, width=40), "40 must be a multiple of 32"),
        # the tiny VAE compresses time 2x (the real one 8x)
        ("num_frames", replace(base, num_frames=10), f"10 must be 1 \\+ a multiple of {pipe.vae_temporal_compression_ratio}"),
        ("num_frames", replace(base, num_frames=1, fps=1000.0), "too short for one audio latent frame"),
        ("fps", replace(base, fps=float("inf")), "must be a finite number > 0"),
        ("true_cfg_scale", replace(base, true_cfg_scale=4.0), "no true CFG"),
        ("extra_sampling_params", replace(base, extra_sampling_params={"guidance_scale_2": 3.0}), "guidance_scale_2"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"guidance_rescale": 1.5}),
            r"guidance_rescale must be a number in \[0, 1\]",
        ),
        ("extra_sampling_params", replace(base, extra_sampling_params={"audio_guidance_scale": -1}), "audio_guidance_scale must be"),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"audio_guidance_scale": float("inf")}),
            "audio_guidance_scale must be",
        ),
        (
            "extra_sampling_params",
            replace(base, extra_sampling_params={"max_sequence_length": 0}),
            r"max_sequence_length must be an integer in \[1, 2048\]",
        ),
    ]
    for field, request, message in bad:
        with pytest.raises(RequestError, match=f"^{field}: .*{message}") as excinfo:
            family.resolve_params(request)
        assert excinfo.value.field == field
        assert "\n" not in str(excinfo.value)


def test_flow_shift_is_the_pipeline_with_that_shift(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    """``flow_shift`` replaces the dynamic (resolution-dependent) shift, as a scheduler
    diffusers builds from the config with that shift does; a scheduler without a shift
    refuses it."""
    params = _params(family, extra={"flow_shift": 3.0})
    schedule = family.schedule(params)
    shifted = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0, use_dynamic_shifting=False)
    shifted_pipe = LTX2Pipeline(**{**pipe.components, "scheduler": shifted})
    shifted_pipe.set_progress_bar_config(disable=True)
    theirs_video, theirs_audio = _pipeline_sample(shifted_pipe, params, 5, 1)
    assert torch.equal(schedule.sigmas, shifted.sigmas) and torch.equal(schedule.timesteps, shifted.timesteps)
    assert not torch.equal(schedule.sigmas, family.schedule(_params(family)).sigmas)  # the shift mattered
    video, audio = _family_sample(family, params, 5, 1)
    assert (video - theirs_video).abs().max().item() <= 1e-5 and (audio - theirs_audio).abs().max().item() <= 1e-5

    from diffusers import DDIMScheduler

    other = LtxFamily(LTX2Pipeline(**{**pipe.components, "scheduler": DDIMScheduler()}))
    with pytest.raises(RequestError, match="^extra_sampling_params: flow_shift: the pipeline's DDIMScheduler has no shift"):
        other.resolve_params(_request(extra={"flow_shift": 3.0}))


def test_conditioning_encoded_once_expands_to_repeated_encodings(family: LtxFamily) -> None:
    params = _params(family, 3.0)
    once = family.encode(PROMPT, None, params)
    keys = {"encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask"}
    assert once.negative is not None and set(once.positive) == set(once.negative) == keys
    assert once.positive["encoder_hidden_states"].shape[:2] == (1, SEQ)
    assert once.positive["encoder_attention_mask"].dtype == torch.float32
    family_checks.check_expand_matches_repeated(family, PROMPT, None, params, once)
    # The default negative prompt " " encodes as diffusers' "" (the pipeline strips prompts).
    empty = family.encode(PROMPT, "", params)
    assert torch.equal(empty.negative["encoder_hidden_states"], once.negative["encoder_hidden_states"])
    assert not torch.equal(once.negative["encoder_hidden_states"], once.positive["encoder_hidden_states"])
    # CFG is on when either modality's scale is above 1; off, there is no negative side.
    assert family.encode(PROMPT, "ignored", _params(family, 1.0)).negative is None
    assert family.encode(PROMPT, None, _params(family, 1.0, {"audio_guidance_scale": 4.0})).negative is not None


@pytest.mark.parametrize("guidance", [3.0, 1.0], ids=["cfg", "no-cfg"])
def test_the_engine_encodes_once_per_request(family: LtxFamily, pipe: LTX2Pipeline, guidance: float) -> None:
    """A three-output request runs the text encoder once per side (prompt, and the
    negative prompt under CFG), not once per output."""
    calls: list[int] = []
    handle = pipe.text_encoder.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0] if args else 1))
    try:
        outputs = EmbeddedEngine(family).generate_sync(_request(guidance, num_outputs_per_prompt=3, num_inference_steps=2))
    finally:
        handle.remove()
    assert len(outputs) == 3
    assert len(calls) == (2 if guidance > 1 else 1) and all(rows == 1 for rows in calls), calls


def test_schedule_is_the_pipelines(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    params = _params(family)
    schedule = family.schedule(params)
    sigmas, timesteps = schedule.sigmas, schedule.timesteps
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()
    # The transformer's timestep input is sigma x 1000: the "timestep divisor" of the family.
    assert LtxFamily.timestep_divisor == 1000.0
    assert torch.allclose(timesteps / LtxFamily.timestep_divisor, sigmas[:-1], atol=1e-7, rtol=0)
    assert abs(sigmas[-2].item() - pipe.scheduler.config.shift_terminal) < 1e-6  # the terminal stretch
    # The pipeline's own scheduler is left alone (each schedule works on a copy) ...
    before = pipe.scheduler.num_inference_steps
    family.schedule(replace(params, num_inference_steps=7))
    assert pipe.scheduler.num_inference_steps == before
    # ... and the pipeline's own call sets exactly the same schedule (its mu comes from
    # the video sequence length, so a larger video shifts it further).
    pipe(
        PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        frame_rate=FPS,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        max_sequence_length=SEQ,
        output_type="latent",
        **ONE_CALL,
    )
    assert torch.equal(pipe.scheduler.sigmas, sigmas) and torch.equal(pipe.scheduler.timesteps, timesteps)
    assert not torch.equal(family.schedule(_params(family, height=256, width=256)).sigmas, sigmas)


def test_decode_shape_and_range(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    params = _params(family)
    latents = family.initial_latents(params, _generators(0, 2))
    with torch.no_grad():
        video = family.decode(latents, params)
        audio = family.extra_outputs(latents, params)
    assert video.shape == (2, 3, FRAMES, HEIGHT, WIDTH) and video.dtype == torch.float32
    assert video.min() >= 0 and video.max() <= 1
    assert set(audio) == {"audio"}
    seconds = audio["audio"].shape[-1] / pipe.vocoder.config.output_sampling_rate
    assert audio["audio"].shape[:2] == (2, 2) and abs(seconds - FRAMES / FPS) < 0.1


def test_encode_pixels_and_encode_audio_invert_the_latent_handling_of_decode(family: LtxFamily, pipe: LTX2Pipeline) -> None:
    """SFT's encoders give the streams the pipeline denoises, in its packed layout: the
    video posterior's mean, normalised and packed (decode's unpacking and
    de-normalisation give it back), and the audio VAE's posterior mean of the clip's
    log-mel spectrogram, normalised and packed as extra_outputs reads it back."""
    from miles_ltx.log_mel import log_mel_spectrogram, resample

    params = _params(family)
    shapes = {name: x.shape for name, x in family.initial_latents(params, _generators(0, 2)).items()}
    pixels = torch.rand(2, 3, FRAMES, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(1))
    rate = 22050
    seconds = FRAMES / FPS
    waveform = torch.rand(2, 2, round(seconds * rate) + 100, generator=torch.Generator().manual_seed(2)) * 2 - 1
    geo = family._geometry(params)
    with torch.no_grad():
        video = family.encode_pixels(pixels, params)["latents"]
        audio = torch.cat([family.encode_audio(waveform[i : i + 1], rate, params)["audio_latents"] for i in range(2)])
        raw_video = pipe.vae.encode(pixels * 2 - 1).latent_dist.mean
        mel_frames = geo.audio_frames * 4
        samples = resample(waveform[..., : round((seconds + 0.1) * rate)], rate, 16000)[..., : mel_frames * 160]
        mel = log_mel_spectrogram(samples, 16000, 160, pipe.audio_vae.config.mel_bins)[:, :, :mel_frames]
        raw_audio = pipe.audio_vae.encode(mel).latent_dist.mean
    assert video.shape == shapes["latents"] and audio.shape == shapes["audio_latents"]
    unpacked = pipe._unpack_latents(video, geo.latent_frames, geo.latent_height, geo.latent_width, 1, 1)
    back = pipe._denormalize_latents(unpacked, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor)
    audio_back = pipe._unpack_audio_latents(
        pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std),
        geo.audio_frames,
        geo.latent_mel_bins,
    )
    print(f"round trip: video {(back - raw_video).abs().max():.2e}, audio {(audio_back - raw_audio).abs().max():.2e}")
    # (x - m) / s * s + m rounds twice: measured at most 1.2e-7 (video) and 4.1e-7 (audio) under the
    # kernel variants of docs/design.md, "Exactness in tests", on values of order 1.
    torch.testing.assert_close(back, raw_video, rtol=0, atol=1e-5)
    torch.testing.assert_close(audio_back, raw_audio, rtol=0, atol=1e-5)
    # An image is a one-frame clip; mono is both channels.
    one = replace(params, num_frames=1)
    assert family.encode_pixels(pixels[:, :, 0], one)["latents"].shape[1] == geo.latent_height * geo.latent_width
    mono = family.encode_audio(waveform[:1, :1], rate, params)["audio_latents"]
    assert torch.equal(mono, family.encode_audio(waveform[:1, :1].expand(1, 2, -1), rate, params)["audio_latents"])
    with pytest.raises(ValueError) as short:
        family.encode_audio(waveform[:1, :, :1000], rate, params)
    assert str(short.value) == f"lasts 0.045 s; the clip needs 0.375 s ({FRAMES} frames at 24 fps)"
    with pytest.raises(ValueError, match=r"^has 3 channels; the audio VAE takes 2 \(mono is duplicated\)$"):
        family.encode_audio(waveform[:1, :1].expand(1, 3, -1), rate, params)


def test_multi_output_invariant(family: LtxFamily) -> None:
    request = _request(
        3.0,
        num_outputs_per_prompt=3,
        seed=20,
        num_inference_steps=3,
        rollout_sde_type="cps",
        rollout_noise_level=0.8,
        rollout_return_dit_trajectory=True,
        rollout_sde_step_indices=(0, 1),
    )
    worst = family_checks.check_multi_output_invariant(family, request)
    print(f"multi-output invariant: max |batched - single| = {worst:.3e}")


def test_save_lora_is_loadable_by_the_pipeline(family: LtxFamily, tiny_dir, tmp_path) -> None:
    from peft import LoraConfig

    from miles_core.plugin_manager import get_host

    targets = list(get_host().registries.model_family.get("ltx").spec.lora_target_modules)
    trained = LtxFamily.from_pretrained(tiny_dir)
    transformer = trained.components()["transformer"]
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets, init_lora_weights=False))
    saved = trained.save_lora(tmp_path / "lora", {"transformer": transformer})
    assert (saved / "pytorch_lora_weights.safetensors").is_file()

    fresh = testing.load_tiny_pipeline(LtxFamily, tiny_dir)
    fresh.load_lora_weights(saved)
    loaded = dict(fresh.transformer.named_parameters())
    ours = {name: p for name, p in transformer.named_parameters() if "lora_" in name}
    assert ours, "no LoRA parameter"
    for name, parameter in ours.items():
        match = name.replace(".default.", ".default_0.")
        assert torch.equal(loaded[match], parameter), name
    params = _params(family)
    base = LtxFamily(testing.load_tiny_pipeline(LtxFamily, tiny_dir))
    assert not torch.allclose(_family_sample(LtxFamily(fresh), params, 0, 1)[0], _family_sample(base, params, 0, 1)[0])
