"""A randomly initialised, tiny FLUX.2 [klein] pipeline (``Flux2KleinPipeline``, real classes).

Heavy module: imports torch, diffusers and transformers. Reached only through
:func:`miles_flux.tiny.build` (``FluxFamily.build_tiny_pipeline(..., variant="klein")`` or
``variant="klein-base"``).

What is kept from FLUX.2 [klein]: a transformer without guidance embedding (klein is not
guidance-distilled: the base model runs real CFG, the step-distilled one ignores guidance),
latents seen 2x2-patchified (``in_channels = 4 * latent_channels``), an ``AutoencoderKLFlux2``
whose BatchNorm statistics normalise those patchified latents, a Qwen3 causal LM whose hidden
states after layers 9, 18 and 27 are stacked into the text conditioning (so it has 28
layers: index 27 is an intermediate layer, not the final normed output, as in the real
36-layer encoder; the pipeline is called with its default ``text_encoder_out_layers``), a
Qwen2 byte-level BPE tokenizer rendering Qwen3's chat template, FLUX.2's scheduler config,
and ``is_distilled`` in ``model_index.json``. Everything else is shrunk.

The tokenizer is :func:`miles_core.api.qwen2_tokenizer` given Qwen3's two thinking tokens
and a chat template that renders what Qwen3's does for the pipeline's call (one user
message, ``add_generation_prompt=True``, ``enable_thinking=False``)::

    <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

It differs from Qwen3's template only in what the pipeline never asks for: tool calls,
``reasoning_content`` and the stripping of earlier turns' thinking are not rendered. Its
vocabulary is the tiny BPE's, not Qwen3's 151k tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from miles_core.api import mark_tiny, qwen2_tokenizer

LATENT_CHANNELS = 8
"""VAE latent channels (FLUX.2's has 32); the transformer sees 2x2-patchified latents,
``in_channels = 4 * LATENT_CHANNELS``, which is also the VAE BatchNorm's width."""
TEXT_HIDDEN = 16
"""Qwen3's hidden size: three stacked layers make the transformer's ``joint_attention_dim``."""
TEXT_LAYERS = 28
"""Enough for ``hidden_states[27]`` (the pipeline's deepest layer) to be an intermediate one."""
OUT_LAYERS = (9, 18, 27)
"""``Flux2KleinPipeline``'s default ``text_encoder_out_layers``."""
VAE_CHANNELS = (8, 8, 8)
"""Three levels, two downsamplings: ``vae_scale_factor`` 4, the VAE's true compression, so
sides must be multiples of 8 (VAE factor x 2x2 packing) and 32x32 images work."""

# FLUX.2 [klein]'s scheduler config (black-forest-labs/FLUX.2-klein-4B
# scheduler/scheduler_config.json): 1000 training timesteps, dynamic exponential shifting, no
# Karras / exponential / beta sigmas. The pipeline computes its own mu (compute_empirical_mu:
# image tokens and step count), so the base/max shift values, FLUX's, are never read.
SCHEDULER_CONFIG: dict[str, object] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

THINK_TOKENS = ("<think>", "</think>")
"""Qwen3's thinking delimiters: added tokens, not special ones (decoding keeps them)."""

QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
"""Qwen3's chat template for plain string messages: no default system prompt (Qwen2.5's
has one), an empty thinking block when thinking is off."""


def _tokenizer() -> PreTrainedTokenizerBase:
    from tokenizers import AddedToken

    tokenizer = qwen2_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def _transformer() -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=2,  # double-stream blocks
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=len(OUT_LAYERS) * TEXT_HIDDEN,
        timestep_guidance_channels=256,  # FLUX.2's sinusoidal width
        axes_dims_rope=(4, 4, 4, 4),  # (t, h, w, l): sums to attention_head_dim, as (32,) * 4 sums to 128
        guidance_embeds=False,  # klein is not guidance-distilled
    ).eval()


def _vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=128 * 2 ** (len(VAE_CHANNELS) - 1),  # the pipeline's native side
    ).eval()
    # Fresh BatchNorm statistics are 0 and 1, which would make the pipeline's
    # de-normalisation the identity; give them values a swapped or missing step would show.
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) * 1.5 + 0.5)
    return vae


def _text_encoder(tokenizer: PreTrainedTokenizerBase) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,  # as Qwen3-4B
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config).eval()


def build_klein(out_dir: str | Path, *, seed: int = 0, distilled: bool) -> Path:
    """Write a tiny random ``Flux2KleinPipeline`` to ``out_dir``, deterministic in ``seed``:
    step-distilled (``is_distilled``: guidance ignored) or the undistilled base (real CFG
    for ``guidance_scale > 1``)."""
    out = Path(out_dir)
    tokenizer = _tokenizer()
    # fork_rng leaves the caller's global RNG untouched; one seed per component, so changing
    # one component's config leaves the others' weights alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _transformer()
        torch.manual_seed(seed + 1)
        vae = _vae()
        torch.manual_seed(seed + 2)
        text_encoder = _text_encoder(tokenizer)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    mark_tiny(out, family="flux")  # commands load it without the hub libraries' notices
    return out
