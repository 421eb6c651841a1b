"""A randomly initialised, tiny LTX-2 pipeline built from the real diffusers classes.

Heavy module (torch, diffusers, transformers): import it only when a tiny pipeline is
actually wanted. Sizes follow diffusers' own LTX-2 fast tests, except where the real
checkpoint's layout matters to us (patch-size-4 VAE giving 8x spatial compression, the
real LTX-2 scheduler configuration, a locally built Gemma tokenizer).
"""

from __future__ import annotations

from pathlib import Path

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
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from miles_core.api import gemma_tokenizer, mark_tiny

TEXT_HIDDEN = 16
"""Gemma hidden size; also the connectors' width and the transformer's caption channels."""
TEXT_LAYERS = 2
VIDEO_LATENT_CHANNELS = 4
AUDIO_LATENT_CHANNELS = 2
AUDIO_MEL_BINS = 8
AUDIO_LATENT_MEL_BINS = AUDIO_MEL_BINS // 4  # the audio VAE compresses mel bins by a fixed 4
AUDIO_PACKED_CHANNELS = AUDIO_LATENT_CHANNELS * AUDIO_LATENT_MEL_BINS
AUDIO_SAMPLE_RATE = 16000
AUDIO_HOP_LENGTH = 160
VOCODER_SAMPLE_RATE = 24000

# The real LTX-2 scheduler configuration (dynamic exponential shift, terminal sigma 0.1):
# the pipeline always passes `mu`, so the tiny one should shift the same way.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
}


def _text_encoder(vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int | None) -> Gemma3ForConditionalGeneration:
    """Gemma 3 with a 16-wide text tower and a token-sized vision tower (required by the class)."""
    text = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=64,
        max_position_embeddings=2048,  # covers the pipeline's default max_sequence_length 1024
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    # Vision tower is unused for text-to-video; 16 px / 4 px patches pooled to 2x2 tokens.
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(config).eval()


def _transformer() -> LTX2VideoTransformer3DModel:
    return LTX2VideoTransformer3DModel(
        in_channels=VIDEO_LATENT_CHANNELS,
        out_channels=VIDEO_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        vae_scale_factors=(2, 8, 8),  # must match the tiny VAE so RoPE coordinates are in pixels
        audio_in_channels=AUDIO_PACKED_CHANNELS,
        audio_out_channels=AUDIO_PACKED_CHANNELS,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        audio_sampling_rate=AUDIO_SAMPLE_RATE,
        audio_hop_length=AUDIO_HOP_LENGTH,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=TEXT_HIDDEN,
        rope_type="split",
    )


def _connectors() -> LTX2TextConnectors:
    # LTX-2.0 layout: one shared projection to caption_channels, so each connector's
    # heads x head_dim must equal the text hidden size.
    return LTX2TextConnectors(
        caption_channels=TEXT_HIDDEN,
        text_proj_in_factor=TEXT_LAYERS + 1,  # every hidden state plus the embeddings
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_type="split",
    )


def _vae() -> AutoencoderKLLTX2Video:
    # patch_size 4 and one 2x spatio-temporal stage: 8x spatial, 2x temporal compression.
    return AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=VIDEO_LATENT_CHANNELS,
        block_out_channels=(8,),
        down_block_types=("LTX2VideoDownBlock3D",),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )


def _audio_vae() -> AutoencoderKLLTX2Audio:
    # base_channels doubles as the length of latents_mean/std, which the pipeline applies
    # to packed audio latents (channels x latent mel bins), so the two must agree. Three
    # levels, as the real VAE: two 2x causal downsamplings give the 4x time and mel-bin
    # compression the pipeline assumes, so encoding a clip's mel spectrogram (SFT) gives
    # the latent shape the pipeline denoises.
    return AutoencoderKLLTX2Audio(
        base_channels=AUDIO_PACKED_CHANNELS,
        output_channels=2,
        ch_mult=(1, 2, 4),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=AUDIO_SAMPLE_RATE,
        mel_hop_length=AUDIO_HOP_LENGTH,
        is_causal=True,
        mel_bins=AUDIO_MEL_BINS,
    )


def _vocoder() -> LTX2Vocoder:
    # Upsamples mel frames by 240 = hop 160 x 24 kHz / 16 kHz, as the real vocoder does, so
    # the waveform's length matches the video's duration at `output_sampling_rate`.
    return LTX2Vocoder(
        in_channels=2 * AUDIO_MEL_BINS,  # audio VAE output channels x mel bins
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[12, 11, 16],
        upsample_factors=[6, 5, 8],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=VOCODER_SAMPLE_RATE,
    )


def build_pipeline(*, seed: int = 0) -> LTX2Pipeline:
    """The tiny pipeline in memory; every module is seeded separately, so a change to one
    module's size leaves the others' weights as they were."""
    tokenizer = gemma_tokenizer()
    modules = {}
    for name, factory in (
        (
            "text_encoder",
            lambda: _text_encoder(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id),
        ),
        ("transformer", _transformer),
        ("connectors", _connectors),
        ("vae", _vae),
        ("audio_vae", _audio_vae),
        ("vocoder", _vocoder),
    ):
        torch.manual_seed(seed)
        modules[name] = factory()
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        tokenizer=tokenizer,
        **modules,
    )


def build(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny pipeline to ``out_dir`` with ``save_pretrained``; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_pipeline(seed=seed).save_pretrained(out)
    mark_tiny(out, family="ltx")  # commands load it without the hub libraries' notices
    return out
