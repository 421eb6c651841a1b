"""The tiny FLUX pipelines: build, load with real classes, sample deterministically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from miles_core import testing
from miles_flux.family import FluxFamily
from miles_flux.plugin import KLEIN_LORA_TARGET_MODULES, LORA_TARGET_MODULES

# -- FLUX.1 [dev] (variant "dev", FluxPipeline) ---------------------------------------

SIZE = 32  # sides must be multiples of vae_scale_factor (4) x 2x2 packing
STEPS = 2

tiny_dir, pipe = testing.tiny_pipeline_fixtures(FluxFamily)


def _sample(pipe: FluxPipeline, prompt: str | list[str], seed: int = 0, **kwargs) -> torch.Tensor:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    out = pipe(
        prompt,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type=kwargs.pop("output_type", "pt"),
        **kwargs,
    )
    return out.images


def test_flux1_loads_with_real_classes(tiny_dir: Path, pipe: FluxPipeline) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    direct = FluxPipeline.from_pretrained(tiny_dir)
    assert type(pipe) is FluxPipeline
    expected = {
        "transformer": FluxTransformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,
        "text_encoder_2": T5EncoderModel,
        "scheduler": FlowMatchEulerDiscreteScheduler,
    }
    for name, cls in expected.items():
        assert type(getattr(pipe, name)) is cls is type(getattr(direct, name)), name
    for name in ("tokenizer", "tokenizer_2"):
        assert type(getattr(direct, name)) is type(getattr(pipe, name)), name
    # FLUX.1 [dev]'s traits: guidance embedded, 16 latent channels packed 2x2, its VAE
    # normalisation and its scheduler's dynamic shift.
    assert pipe.transformer.config.guidance_embeds
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels == 64
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (0.3611, 0.1159)
    config = pipe.scheduler.config
    assert config.use_dynamic_shifting and config.shift == 3.0
    assert (config.base_shift, config.max_shift, config.base_image_seq_len, config.max_image_seq_len) == (0.5, 1.15, 256, 4096)


def test_flux1_directory_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 2 * 1024 * 1024


def test_flux1_sample_shapes_guidance_and_true_cfg(pipe: FluxPipeline) -> None:
    plain = _sample(pipe, "a red apple")
    assert plain.shape == (1, 3, SIZE, SIZE)
    assert torch.isfinite(plain).all()
    # The embedded guidance is an input of the transformer: another value, another image.
    assert not torch.equal(plain, _sample(pipe, "a red apple", guidance_scale=1.0))
    cfg = _sample(pipe, "a red apple", negative_prompt="blurry", true_cfg_scale=4.0)
    assert cfg.shape == (1, 3, SIZE, SIZE)
    assert not torch.equal(plain, cfg)
    batch = _sample(pipe, "a red apple", num_images_per_prompt=2, output_type="np", width=2 * SIZE)
    assert isinstance(batch, np.ndarray) and batch.shape == (2, SIZE, 2 * SIZE, 3)


def test_flux1_deterministic_and_prompt_sensitive(pipe: FluxPipeline) -> None:
    a = _sample(pipe, "a red apple")
    assert torch.equal(a, _sample(pipe, "a red apple"))
    assert not torch.equal(a, _sample(pipe, "a blue car"))
    assert not torch.equal(a, _sample(pipe, "a red apple", seed=1))


def test_flux1_rebuild_is_deterministic(tmp_path: Path) -> None:
    reference, _ = testing.assert_build_is_deterministic(FluxFamily, tmp_path)
    assert {key.split("/")[0] for key in reference} == {"transformer", "vae", "text_encoder", "text_encoder_2"}


def test_flux1_lora_targets(pipe: FluxPipeline) -> None:
    transformer = pipe.transformer
    wrapped = testing.assert_lora_targets(transformer, LORA_TARGET_MODULES)
    doubles, singles = len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)
    # Every double-stream block: its joint attention (both streams) and both MLPs.
    for i in range(doubles):
        in_block = {name.removeprefix(f"transformer_blocks.{i}.") for name in wrapped if name.startswith(f"transformer_blocks.{i}.")}
        assert in_block == set(LORA_TARGET_MODULES), i
    # The single-stream blocks' attention has the same names for q, k and v (no output
    # projection: their proj_out mixes attention and MLP), so the suffixes reach them too.
    for i in range(singles):
        in_block = {
            name.removeprefix(f"single_transformer_blocks.{i}.") for name in wrapped if name.startswith(f"single_transformer_blocks.{i}.")
        }
        assert in_block == {"attn.to_q", "attn.to_k", "attn.to_v"}, i
    assert len(wrapped) == len(LORA_TARGET_MODULES) * doubles + 3 * singles


def test_flux1_native_size_matches_pipeline_default(tiny_dir: Path, pipe: FluxPipeline) -> None:
    height, width = FluxFamily.native_size(tiny_dir)
    # What FluxPipeline.__call__ falls back to without height/width.
    assert (height, width) == (pipe.default_sample_size * pipe.vae_scale_factor,) * 2 == (512, 512)
    assert pipe.vae_scale_factor == 2 ** (len(pipe.vae.config.block_out_channels) - 1) == 4
    # The packed latents of an unsized call: (512 / 4 / 2)^2 tokens (no VAE decode needed).
    latents = _sample(pipe, "a red apple", height=None, width=None, output_type="latent")
    assert latents.shape == (1, (height // 8) * (width // 8), 64)


def test_flux1_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "flux", tmp_path_factory.mktemp("neutral"))


# -- FLUX.2 [klein] (variants "klein" and "klein-base", Flux2KleinPipeline) -------------

KLEIN_PROMPT = "a red apple"


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(FluxFamily.build_tiny_pipeline(tmp_path_factory.mktemp("klein") / "tiny", variant="klein"))


@pytest.fixture(scope="module")
def klein_pipe(klein_dir: Path):
    # Through the family's loader: model_index.json names Flux2KleinPipeline.
    return testing.load_tiny_pipeline(FluxFamily, klein_dir)


def _klein_sample(pipe, prompt: str | list[str] = KLEIN_PROMPT, seed: int = 0, **kwargs) -> torch.Tensor:
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    out = pipe(
        prompt=prompt,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type=kwargs.pop("output_type", "pt"),
        **kwargs,
    )
    return out.images


def test_klein_loads_with_real_classes(klein_dir: Path, klein_pipe, tmp_path: Path) -> None:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

    from miles_flux.checkpoint import KLEIN, read_checkpoint

    direct = Flux2KleinPipeline.from_pretrained(klein_dir)
    assert type(klein_pipe) is Flux2KleinPipeline
    expected = {
        "transformer": Flux2Transformer2DModel,
        "vae": AutoencoderKLFlux2,
        "text_encoder": Qwen3ForCausalLM,
        "tokenizer": Qwen2Tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler,
    }
    for name, cls in expected.items():
        assert type(getattr(klein_pipe, name)) is cls is type(getattr(direct, name)), name
    # FLUX.2 [klein]'s traits: no guidance embedding, patchified latents normalised by the
    # VAE's BatchNorm (with statistics that are not the identity), three stacked Qwen3
    # layers, the deepest of them (27) an intermediate one, FLUX.2's scheduler config.
    transformer, vae, encoder = klein_pipe.transformer, klein_pipe.vae, klein_pipe.text_encoder
    assert not transformer.config.guidance_embeds
    assert transformer.config.in_channels == 4 * vae.config.latent_channels == vae.bn.num_features
    assert vae.bn.running_mean.abs().min() > 0 and (vae.bn.running_var - 1).abs().min() > 0
    assert transformer.config.joint_attention_dim == 3 * encoder.config.hidden_size
    assert encoder.config.num_hidden_layers == 28
    config = klein_pipe.scheduler.config
    assert config.use_dynamic_shifting and config.time_shift_type == "exponential" and config.num_train_timesteps == 1000
    # Qwen3's chat template as the pipeline renders it (thinking off), its think tokens whole.
    tokenizer = klein_pipe.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert len(tokenizer("<think></think>").input_ids) == 2
    # is_distilled round-trips through model_index.json, and is all that tells the variants
    # apart (the same seed builds the same weights).
    assert klein_pipe.config.is_distilled is True
    found = read_checkpoint(klein_dir)
    assert (found.pipeline, found.step_distilled, found.guidance_distilled, found.vae_scale_factor) == (KLEIN, True, False, 4)
    base_dir = FluxFamily.build_tiny_pipeline(tmp_path / "base", variant="klein-base")
    base = testing.load_tiny_pipeline(FluxFamily, base_dir)
    assert base.config.is_distilled is False and not read_checkpoint(base_dir).step_distilled
    base_weights, klein_weights = testing.saved_tensors(base_dir), testing.saved_tensors(klein_dir)
    assert base_weights.keys() == klein_weights.keys()
    assert all(torch.equal(value, klein_weights[key]) for key, value in base_weights.items())


def test_klein_directory_is_small(klein_dir: Path) -> None:
    assert testing.directory_size(klein_dir) < 2 * 1024 * 1024


def test_klein_sample_shapes_and_guidance(klein_pipe) -> None:
    from diffusers import Flux2KleinPipeline

    plain = _klein_sample(klein_pipe, guidance_scale=1.0)
    assert plain.shape == (1, 3, SIZE, SIZE) and torch.isfinite(plain).all()
    # Step-distilled: the guidance scale is ignored ...
    assert torch.equal(plain, _klein_sample(klein_pipe, guidance_scale=4.0))
    # ... while the undistilled base with the same weights runs CFG above 1.
    base = Flux2KleinPipeline(**klein_pipe.components, is_distilled=False)
    base.set_progress_bar_config(disable=True)
    assert torch.equal(plain, _klein_sample(base, guidance_scale=1.0))
    assert not torch.equal(plain, _klein_sample(base, guidance_scale=4.0))
    batch = _klein_sample(klein_pipe, num_images_per_prompt=2, output_type="np", width=2 * SIZE)
    assert isinstance(batch, np.ndarray) and batch.shape == (2, SIZE, 2 * SIZE, 3)


def test_klein_deterministic_and_prompt_sensitive(klein_pipe) -> None:
    a = _klein_sample(klein_pipe)
    assert torch.equal(a, _klein_sample(klein_pipe))
    assert not torch.equal(a, _klein_sample(klein_pipe, "a blue car"))
    assert not torch.equal(a, _klein_sample(klein_pipe, seed=1))


class _Klein:
    """FluxFamily building the klein variant, for :func:`testing.assert_build_is_deterministic`."""

    @staticmethod
    def build_tiny_pipeline(out_dir: Path, *, seed: int = 0) -> Path:
        return FluxFamily.build_tiny_pipeline(out_dir, seed=seed, variant="klein")


def test_klein_rebuild_is_deterministic(tmp_path: Path) -> None:
    reference, _ = testing.assert_build_is_deterministic(_Klein, tmp_path)
    assert {key.split("/")[0] for key in reference} == {"transformer", "vae", "text_encoder"}


def test_klein_lora_targets(klein_pipe) -> None:
    transformer = klein_pipe.transformer
    names = [name for name, _ in transformer.named_modules()]
    # FLUX.2's own default targets (the spec's lora_target_modules_by_pipeline): each wraps
    # something, and FLUX.1's MLP names would wrap nothing here.
    wrapped = testing.assert_lora_targets(transformer, KLEIN_LORA_TARGET_MODULES)
    assert not [t for t in LORA_TARGET_MODULES if t.startswith("ff") and any(name.endswith("." + t) for name in names)]

    def block_suffixes(prefix: str, i: int) -> set[str]:
        return {name.removeprefix(f"{prefix}.{i}.") for name in wrapped if name.startswith(f"{prefix}.{i}.")}

    doubles, singles = len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)
    double = block_suffixes("transformer_blocks", 0)
    single = block_suffixes("single_transformer_blocks", 0)
    # Every double-stream block's joint attention, both streams, is adapted; every block
    # of a kind gets the same adapters.
    joint = {f"attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")}
    assert joint <= double
    assert {"ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"} <= double
    assert single == {"attn.to_qkv_mlp_proj"}  # the fused input; its attn.to_out has no suffix of its own
    assert all(block_suffixes("transformer_blocks", i) == double for i in range(doubles))
    assert all(block_suffixes("single_transformer_blocks", i) == single for i in range(singles))
    assert len(wrapped) == len(double) * doubles + len(single) * singles


def test_klein_native_size_matches_pipeline_default(klein_dir: Path, klein_pipe) -> None:
    height, width = FluxFamily.native_size(klein_dir)
    # What Flux2KleinPipeline.__call__ falls back to without height/width.
    assert (height, width) == (klein_pipe.default_sample_size * klein_pipe.vae_scale_factor,) * 2 == (512, 512)
    assert klein_pipe.vae_scale_factor == 2 ** (len(klein_pipe.vae.config.block_out_channels) - 1) == 4
    # The pipeline's latent output of an unsized call: unpatchified [1, C, H/4, W/4] (no VAE decode).
    latents = _klein_sample(klein_pipe, height=None, width=None, output_type="latent")
    assert latents.shape == (1, klein_pipe.vae.config.latent_channels, height // 4, width // 4)


def test_klein_recognised_by_content_under_a_neutral_name(klein_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(klein_dir, "flux", tmp_path_factory.mktemp("neutral"))


# -- the command line ---------------------------------------------------------------------


def test_make_tiny_builds_each_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``miles-core make-tiny flux DIR --variant V`` writes the variant's pipeline class (and
    ``is_distilled``), which is what matching and loading read."""
    import json

    from miles_core.cli.main import main

    expected = {"klein-base": ("Flux2KleinPipeline", False), "dev": ("FluxPipeline", None)}
    for variant, (pipeline, distilled) in expected.items():
        assert main(["make-tiny", "flux", str(tmp_path / variant), "--variant", variant]) == 0
        index = json.loads((tmp_path / variant / "model_index.json").read_text(encoding="utf-8"))
        assert (index["_class_name"], index.get("is_distilled")) == (pipeline, distilled)
        assert f"wrote a tiny {variant} flux pipeline to {tmp_path / variant}" in capsys.readouterr().err
