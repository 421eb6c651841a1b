"""The tiny LTX-2 pipeline: real classes, loadable, samples video and audio, deterministic.

Sampling runs with every extra guidance pass off, so there is one transformer call per
step: ``guidance_scale=1`` *and* ``audio_guidance_scale=1`` (the audio default is 7, which
alone turns CFG on), ``stg_scale=audio_stg_scale=0`` with no STG blocks,
``modality_scale=audio_modality_scale=1``, and no guidance rescale.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3ForConditionalGeneration, GemmaTokenizer

from miles_core import testing
from miles_ltx.family import LtxFamily

HEIGHT = WIDTH = 32  # LTX2Pipeline requires multiples of 32
NUM_FRAMES = 9  # 1 + 8k frames; 2x temporal compression gives 5 latent frames
STEPS = 2
SAMPLE_KWARGS = dict(
    height=HEIGHT,
    width=WIDTH,
    num_frames=NUM_FRAMES,
    frame_rate=24.0,
    num_inference_steps=STEPS,
    guidance_scale=1.0,
    audio_guidance_scale=1.0,
    stg_scale=0.0,
    audio_stg_scale=0.0,
    spatio_temporal_guidance_blocks=None,
    modality_scale=1.0,
    audio_modality_scale=1.0,
    guidance_rescale=0.0,
    audio_guidance_rescale=0.0,
    max_sequence_length=32,  # the default 1024 would pad every prompt to 1024 tokens
    output_type="pt",
)

tiny_dir, pipe = testing.tiny_pipeline_fixtures(LtxFamily)


def _sample(pipe: LTX2Pipeline, prompt: str = "a red cat dancing", seed: int = 0, **overrides):
    kwargs = {**SAMPLE_KWARGS, **overrides}
    return pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_loads_with_the_real_classes(tiny_dir: Path) -> None:
    pipe = LTX2Pipeline.from_pretrained(tiny_dir)
    assert isinstance(pipe.transformer, LTX2VideoTransformer3DModel)
    assert isinstance(pipe.text_encoder, Gemma3ForConditionalGeneration)
    assert isinstance(pipe.tokenizer, GemmaTokenizer)
    assert isinstance(pipe.connectors, LTX2TextConnectors)
    assert isinstance(pipe.vae, AutoencoderKLLTX2Video)
    assert isinstance(pipe.audio_vae, AutoencoderKLLTX2Audio)
    assert isinstance(pipe.vocoder, LTX2Vocoder)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.text_encoder.config.text_config.hidden_size == 16
    assert pipe.vae_spatial_compression_ratio == 8  # like the real VAE
    assert pipe.vae.config.patch_size == 4


def test_family_loads_the_pipeline(pipe: LTX2Pipeline) -> None:
    assert type(pipe) is LTX2Pipeline
    assert LtxFamily.resolve_pipeline_class() is LTX2Pipeline


def test_native_size_is_the_pipeline_default(tiny_dir: Path) -> None:
    params = inspect.signature(LTX2Pipeline.__call__).parameters
    expected = (params["height"].default, params["width"].default)
    assert LtxFamily.native_size(tiny_dir) == expected


def test_sample_video_and_audio(pipe: LTX2Pipeline) -> None:
    calls: list[int] = []
    handle = pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = _sample(pipe)
    finally:
        handle.remove()
    assert len(calls) == STEPS  # no CFG / STG / modality passes
    # output_type "pt": video is [batch, frames, channels, height, width] in [0, 1]
    assert out.frames.shape == (1, NUM_FRAMES, 3, HEIGHT, WIDTH)
    assert 0.0 <= out.frames.min() and out.frames.max() <= 1.0
    # audio is always a vocoder waveform tensor [batch, audio channels, samples]
    assert isinstance(out.audio, torch.Tensor)
    assert out.audio.ndim == 3 and out.audio.shape[:2] == (1, pipe.vocoder.config.out_channels)
    # waveform at the vocoder's rate, about as long as the video (the causal audio VAE
    # trims a few mel frames)
    seconds = out.audio.shape[2] / pipe.vocoder.config.output_sampling_rate
    assert abs(seconds - NUM_FRAMES / SAMPLE_KWARGS["frame_rate"]) < 0.1
    assert torch.isfinite(out.audio).all() and out.audio.std() > 0


def test_sample_numpy_output(pipe: LTX2Pipeline) -> None:
    out = _sample(pipe, output_type="np")
    assert isinstance(out.frames, np.ndarray)
    assert out.frames.shape == (1, NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert isinstance(out.audio, torch.Tensor)  # output_type does not apply to audio


def test_prompts_and_seeds(pipe: LTX2Pipeline) -> None:
    first = _sample(pipe, "a red cat dancing")
    again = _sample(pipe, "a red cat dancing")
    other = _sample(pipe, "a blue boat on the sea")
    reseeded = _sample(pipe, "a red cat dancing", seed=1)
    assert torch.equal(first.frames, again.frames) and torch.equal(first.audio, again.audio)
    assert not torch.equal(first.frames, other.frames)
    assert not torch.equal(first.audio, other.audio)
    assert not torch.equal(first.frames, reseeded.frames)


def test_rebuild_is_deterministic(tmp_path: Path) -> None:
    reference, other = testing.assert_build_is_deterministic(LtxFamily, tmp_path)
    proj_in = "transformer/diffusion_pytorch_model.safetensors:proj_in.weight"
    assert not torch.equal(other[proj_in], reference[proj_in])


def test_directory_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 3 * 1024 * 1024


def test_lora_targets_are_linear_layers(pipe: LTX2Pipeline) -> None:
    spec = testing.load_plugin("ltx", "miles-ltx").registries.model_family.get("ltx").spec
    wrapped = testing.assert_lora_targets(pipe.transformer, spec.lora_target_modules)
    # per block: 4 projections in each of 6 attentions (video/audio self and text, a2v, v2a)
    # plus 2 in each of the video and audio feed-forwards
    assert len(wrapped) == pipe.transformer.config.num_layers * (6 * 4 + 2 * 2)


def test_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "ltx", tmp_path_factory.mktemp("neutral"))
