"""The tiny SD3 pipeline: builds offline, loads, samples, deterministic, small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from miles_core import testing
from miles_sd3.family import SD3Family

PROMPT = "a red cube on a blue table"
OTHER_PROMPT = "text that says miles"

tiny_dir, pipe = testing.tiny_pipeline_fixtures(SD3Family)


def _sample(pipe: StableDiffusion3Pipeline, prompt: str, seed: int = 0, **kwargs) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return pipe(prompt, num_inference_steps=2, generator=generator, output_type="pt", **kwargs).images


def test_loads_with_the_diffusers_class_and_the_family(tiny_dir: Path, pipe: StableDiffusion3Pipeline) -> None:
    direct = StableDiffusion3Pipeline.from_pretrained(tiny_dir)
    assert type(direct) is StableDiffusion3Pipeline and type(pipe) is StableDiffusion3Pipeline
    assert type(pipe.transformer).__name__ == "SD3Transformer2DModel"
    assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel"
    assert pipe.scheduler.config.shift == 3.0
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (1.5305, 0.0609)
    assert all(p.suffix != ".bin" for p in tiny_dir.rglob("*"))  # safetensors only
    # Every saved weight comes back as saved.
    states = {name: c.state_dict() for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    for key, value in testing.saved_tensors(tiny_dir).items():
        component, name = key.split("/", 1)[0], key.split(":", 1)[1]
        assert torch.equal(states[component][name], value), key


def test_sample_shape_and_determinism(pipe: StableDiffusion3Pipeline) -> None:
    first = _sample(pipe, PROMPT, height=64, width=64)
    assert first.shape == (1, 3, 64, 64)
    assert torch.isfinite(first).all()
    assert torch.equal(first, _sample(pipe, PROMPT, height=64, width=64))
    other = _sample(pipe, OTHER_PROMPT, height=64, width=64)
    assert not torch.allclose(first, other)


def test_native_size_matches_the_pipeline_default(tiny_dir: Path, pipe: StableDiffusion3Pipeline) -> None:
    size = SD3Family.native_size(tiny_dir)
    assert size == (64, 64)
    image = _sample(pipe, PROMPT)  # no height/width: the pipeline picks its default
    assert tuple(image.shape[-2:]) == size


def test_native_size_of_a_missing_checkpoint_is_none(tmp_path: Path) -> None:
    assert SD3Family.native_size(tmp_path / "does-not-exist") is None
    assert SD3Family.native_size("stabilityai/stable-diffusion-3.5-medium") is None


def test_build_is_deterministic_in_the_seed(tmp_path: Path) -> None:
    testing.assert_build_is_deterministic(SD3Family, tmp_path)


def test_saved_pipeline_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 2 * 1024 * 1024


def test_bench_scale_through_make_tiny(tmp_path: Path, capsys) -> None:
    """``miles-core make-tiny sd3 DIR --scale bench``: a pipeline where model compute
    dominates (benchmarks), loadable as usual, 128x128 native, and it samples."""
    from miles_core.cli import make_tiny

    out = tmp_path / "bench"
    assert make_tiny.run(["sd3", str(out), "--scale", "bench"]) == 0
    assert "wrote a bench-scale sd3 pipeline" in capsys.readouterr().err
    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    assert sum(p.numel() for p in pipe.transformer.parameters()) >= 10_000_000
    assert SD3Family.native_size(out) == (128, 128)
    image = _sample(pipe, PROMPT, max_sequence_length=16)
    assert image.shape == (1, 3, 128, 128) and torch.isfinite(image).all()


def test_unknown_scale_fails_before_writing(tmp_path: Path) -> None:
    import pytest

    from miles_sd3 import tiny

    with pytest.raises(ValueError, match="unknown scale 'huge'; choose one of tiny, bench"):
        tiny.build(tmp_path / "x", scale="huge")
    assert not (tmp_path / "x").exists()


def test_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "sd3", tmp_path_factory.mktemp("neutral"))
