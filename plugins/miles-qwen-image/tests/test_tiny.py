"""The tiny Qwen-Image pipeline: builds, loads with real classes, samples deterministically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from miles_core import testing
from miles_qwen_image.family import QwenImageFamily
from miles_qwen_image.plugin import LORA_TARGET_MODULES

SIZE = 32  # sides must be multiples of vae_scale_factor (4) x patch (2); even 8 works
STEPS = 2  # 1 step divides 0 by 0 in the pipeline's progress bookkeeping

tiny_dir, pipe = testing.tiny_pipeline_fixtures(QwenImageFamily)


def _sample(pipe: QwenImagePipeline, prompt: str | list[str], seed: int = 0, **kwargs) -> torch.Tensor:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    # The pipeline's own default is 4.0, which without a negative prompt only logs a warning.
    kwargs.setdefault("true_cfg_scale", 1.0)
    out = pipe(
        prompt,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type=kwargs.pop("output_type", "pt"),
        **kwargs,
    )
    return out.images


def test_loads_with_real_classes(tiny_dir: Path, pipe: QwenImagePipeline) -> None:
    direct = QwenImagePipeline.from_pretrained(tiny_dir)
    assert type(pipe) is QwenImagePipeline
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert type(getattr(direct, name)) is type(getattr(pipe, name))
    assert pipe.scheduler.config.use_dynamic_shifting
    assert pipe.scheduler.config.time_shift_type == "exponential"
    # The prompt template's prefix must be exactly the tokens the pipeline drops.
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34


def test_directory_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 2 * 1024 * 1024


def test_sample_shapes_and_true_cfg(pipe: QwenImagePipeline) -> None:
    plain = _sample(pipe, "a red apple")
    assert plain.shape == (1, 3, SIZE, SIZE)
    assert torch.isfinite(plain).all()
    cfg = _sample(pipe, "a red apple", negative_prompt="blurry", true_cfg_scale=4.0)
    assert cfg.shape == (1, 3, SIZE, SIZE)
    assert not torch.equal(plain, cfg)
    batch = _sample(pipe, "a red apple", num_images_per_prompt=2, output_type="np", width=2 * SIZE)
    assert isinstance(batch, np.ndarray) and batch.shape == (2, SIZE, 2 * SIZE, 3)


def test_deterministic_and_prompt_sensitive(pipe: QwenImagePipeline) -> None:
    a = _sample(pipe, "a red apple", negative_prompt="blurry", true_cfg_scale=4.0)
    again = _sample(pipe, "a red apple", negative_prompt="blurry", true_cfg_scale=4.0)
    other = _sample(pipe, "a blue car", negative_prompt="blurry", true_cfg_scale=4.0)
    assert torch.equal(a, again)
    assert not torch.equal(a, other)
    assert not torch.equal(a, _sample(pipe, "a red apple", seed=1, negative_prompt="blurry", true_cfg_scale=4.0))


def test_rebuild_is_deterministic(tmp_path: Path) -> None:
    reference, _ = testing.assert_build_is_deterministic(QwenImageFamily, tmp_path)
    assert {key.split("/")[0] for key in reference} >= {"transformer", "vae", "text_encoder"}


def test_lora_targets_are_linears_of_every_block(pipe: QwenImagePipeline) -> None:
    wrapped = testing.assert_lora_targets(pipe.transformer, LORA_TARGET_MODULES)
    n_blocks = len(pipe.transformer.transformer_blocks)
    for suffix in LORA_TARGET_MODULES:
        assert sum(name.endswith("." + suffix) for name in wrapped) == n_blocks, suffix
    assert len(wrapped) == len(LORA_TARGET_MODULES) * n_blocks


def test_native_size_matches_pipeline_default(tiny_dir: Path, pipe: QwenImagePipeline) -> None:
    height, width = QwenImageFamily.native_size(tiny_dir)
    # What QwenImagePipeline.__call__ falls back to without height/width.
    assert (height, width) == (pipe.default_sample_size * pipe.vae_scale_factor,) * 2
    assert pipe.vae_scale_factor == pipe.vae.spatial_compression_ratio == 4
    image = _sample(pipe, "a red apple", height=None, width=None)
    assert image.shape == (1, 3, height, width)


def test_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "qwen_image", tmp_path_factory.mktemp("neutral"))
