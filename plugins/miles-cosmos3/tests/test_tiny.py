"""The tiny Cosmos 3 pipeline: builds offline, loads with the real classes, samples
deterministically, and takes a LoRA on the generation path."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

from miles_core import testing
from miles_cosmos3.family import Cosmos3Family

SPEC = testing.load_plugin("cosmos3", "miles-cosmos3").registries.model_family.get("cosmos3").spec
TARGETS = list(SPEC.lora_target_modules)
UNDERSTANDING_ATTENTION = ("to_q", "to_k", "to_v", "to_out")

# The smallest working size: height and width are multiples of the VAE's 8x; 5 frames are
# two latent frames under the VAE's 4x temporal compression (1 + 4k frames).
HEIGHT = WIDTH = 8
FRAMES = 5

tiny_dir, pipe = testing.tiny_pipeline_fixtures(Cosmos3Family)


def _sample(pipeline: Cosmos3OmniPipeline, prompt: str, seed: int = 0) -> torch.Tensor:
    return pipeline(
        prompt,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).video


def test_real_classes_load_from_the_directory(tiny_dir: Path, pipe: Cosmos3OmniPipeline) -> None:
    direct = Cosmos3OmniPipeline.from_pretrained(tiny_dir)
    for pipeline in (direct, pipe):
        assert type(pipeline) is Cosmos3OmniPipeline
        assert isinstance(pipeline.transformer, Cosmos3OmniTransformer)
        assert isinstance(pipeline.vae, AutoencoderKLWan)
        assert isinstance(pipeline.scheduler, UniPCMultistepScheduler)
        assert pipeline.scheduler.config.use_flow_sigmas
        assert type(pipeline.text_tokenizer).__name__ == "Qwen2Tokenizer"
        assert pipeline.safety_checker is None and pipeline.sound_tokenizer is None
    config = pipe.transformer.config
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert (config.hidden_size, config.head_dim, heads) == (16, 8, (2, 1))
    assert sum(config.rope_axes_dim) == config.head_dim // 2
    assert config.latent_channel == pipe.vae.config.z_dim == 16
    # The transformer embeds the token ids directly: every id the tokenizer emits must exist.
    assert config.vocab_size == len(pipe.text_tokenizer)


def test_directory_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 2 * 1024 * 1024


def test_sample_shape(pipe: Cosmos3OmniPipeline) -> None:
    video = _sample(pipe, "a red apple on a wooden table")
    assert video.shape == (FRAMES, 3, HEIGHT, WIDTH)
    assert torch.isfinite(video).all() and video.min() >= 0 and video.max() <= 1


def test_sampling_is_deterministic_and_prompt_dependent(pipe: Cosmos3OmniPipeline) -> None:
    first = _sample(pipe, "a red apple on a wooden table")
    assert torch.equal(first, _sample(pipe, "a red apple on a wooden table"))
    assert not torch.allclose(first, _sample(pipe, "three brown dogs on a beach"))
    assert not torch.allclose(first, _sample(pipe, "a red apple on a wooden table", seed=1))


def test_native_size_is_what_the_pipeline_uses(pipe: Cosmos3OmniPipeline) -> None:
    class _Stop(Exception):
        pass

    # Stop the call at its input check, which receives the resolved height and width.
    with mock.patch.object(pipe, "check_inputs", side_effect=_Stop) as check:
        with pytest.raises(_Stop):
            pipe("a cat")
    args = check.call_args.args
    assert (args[3], args[4]) == Cosmos3Family.native_size("any checkpoint")


def test_build_is_deterministic_in_the_seed(tmp_path: Path) -> None:
    reference, _ = testing.assert_build_is_deterministic(Cosmos3Family, tmp_path)
    assert {key.split("/")[0] for key in reference} >= {"transformer", "vae"}


def test_lora_targets_are_the_generation_attention(pipe: Cosmos3OmniPipeline) -> None:
    wrapped = testing.assert_lora_targets(pipe.transformer, TARGETS)
    modules = dict(pipe.transformer.named_modules())
    layers = pipe.transformer.config.num_hidden_layers
    for target in TARGETS:
        assert sum(name.endswith("." + target) for name in wrapped) == layers, target
    assert len(wrapped) == len(TARGETS) * layers
    assert all(type(modules[name]) is torch.nn.Linear for name in wrapped)  # not even a subclass
    # The understanding projections stay out of the adapter.
    assert not any(name.rsplit(".", 1)[-1] in UNDERSTANDING_ATTENTION for name in wrapped)


def _lora_weights(transformer: Cosmos3OmniTransformer) -> dict[str, torch.Tensor]:
    """LoRA parameters keyed without the adapter name (loading renames "default" to "default_0")."""
    return {
        re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", name): param.detach().clone()
        for name, param in transformer.named_parameters()
        if "lora_" in name
    }


def test_lora_save_load_roundtrip(tiny_dir: Path, pipe: Cosmos3OmniPipeline, tmp_path: Path) -> None:
    from peft import LoraConfig

    transformer = Cosmos3OmniTransformer.from_pretrained(tiny_dir, subfolder="transformer")
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=TARGETS))
    # lora_B starts at zero: nudge it so the adapter changes the model.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    saved = _lora_weights(transformer)
    transformer.save_lora_adapter(tmp_path)

    fresh = Cosmos3OmniTransformer.from_pretrained(tiny_dir, subfolder="transformer")
    # prefix=None: the saved keys carry no "transformer." prefix; the default prefix
    # would silently match (and load) nothing.
    fresh.load_lora_adapter(tmp_path, weight_name="pytorch_lora_weights.safetensors", prefix=None)
    loaded = [name for name, module in fresh.named_modules() if hasattr(module, "lora_A") and module.lora_A]
    assert len(loaded) == len(TARGETS) * fresh.config.num_hidden_layers > 0
    restored = _lora_weights(fresh)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[name], saved[name]) for name in saved)

    # The adapter reaches the output: sampling with it differs from the base pipeline.
    with_lora = Cosmos3OmniPipeline.from_pretrained(tiny_dir, transformer=fresh)
    with_lora.set_progress_bar_config(disable=True)
    assert not torch.allclose(_sample(with_lora, "a cat"), _sample(pipe, "a cat"))


def test_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "cosmos3", tmp_path_factory.mktemp("neutral"))
