"""The tiny two-expert Wan 2.2 pipeline: builds, loads, samples, switches experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel

from miles_core import testing
from miles_wan22.family import Wan22Family

EXPERTS = ("transformer", "transformer_2")
HEIGHT = WIDTH = 32
FRAMES = 5
STEPS = 4

tiny_dir, pipe = testing.tiny_pipeline_fixtures(Wan22Family)


def _sample(pipe: WanPipeline, prompt: str, seed: int) -> torch.Tensor:
    return pipe(
        prompt=prompt,
        negative_prompt="blurry",
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).frames


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_loads_with_both_experts(tiny_dir: Path, pipe: WanPipeline) -> None:
    direct = WanPipeline.from_pretrained(tiny_dir)
    for loaded in (direct, pipe):
        assert type(loaded) is WanPipeline
        assert loaded.config.boundary_ratio == 0.875
        for name in EXPERTS:
            assert isinstance(getattr(loaded, name), WanTransformer3DModel)
    a, b = _state(pipe.transformer), _state(pipe.transformer_2)
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # Loading twice gives the same weights (nothing random happens at load time).
    for name in EXPERTS:
        left, right = _state(getattr(direct, name)), _state(getattr(pipe, name))
        assert all(torch.equal(left[k], right[k]) for k in left)


def test_sample_shape_and_determinism(pipe: WanPipeline) -> None:
    video = _sample(pipe, "a red apple on a table", seed=0)
    assert video.shape == (1, FRAMES, 3, HEIGHT, WIDTH)
    assert torch.isfinite(video).all()
    assert torch.equal(video, _sample(pipe, "a red apple on a table", seed=0))
    assert not torch.equal(video, _sample(pipe, "a white horse in a field", seed=0))
    assert not torch.equal(video, _sample(pipe, "a red apple on a table", seed=1))


def test_both_experts_run_on_their_side_of_the_boundary(pipe: WanPipeline) -> None:
    seen: dict[str, list[float]] = {name: [] for name in EXPERTS}

    def recorder(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            seen[name].extend(kwargs["timestep"].flatten().tolist())

        return hook

    handles = [getattr(pipe, name).register_forward_pre_hook(recorder(name), with_kwargs=True) for name in EXPERTS]
    try:
        _sample(pipe, "a red apple on a table", seed=0)
    finally:
        for handle in handles:
            handle.remove()
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    assert seen["transformer"] and seen["transformer_2"]
    assert all(t >= boundary for t in seen["transformer"])
    assert all(t < boundary for t in seen["transformer_2"])
    # CFG on: two calls per step, and every step goes to exactly one expert.
    assert len(seen["transformer"]) + len(seen["transformer_2"]) == 2 * STEPS


def test_build_is_deterministic_in_seed(tmp_path: Path) -> None:
    weights, _ = testing.assert_build_is_deterministic(Wan22Family, tmp_path)
    # Both experts are among the seeded weights.
    assert {key.split("/")[0] for key in weights} >= {"text_encoder", "vae", *EXPERTS}


def test_directory_is_small(tiny_dir: Path) -> None:
    assert testing.directory_size(tiny_dir) < 2 * 1024 * 1024


def test_lora_targets_are_linear_in_each_expert(pipe: WanPipeline) -> None:
    spec = testing.load_plugin("wan22", "miles-wan22").registries.model_family.get("wan2_2").spec
    for name in EXPERTS:
        testing.assert_lora_targets(getattr(pipe, name), spec.lora_target_modules)


def test_recognised_by_content_under_a_neutral_name(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # "my-finetune" matches no family's name patterns: model_index.json and the configs decide.
    testing.assert_matched_by_content(tiny_dir, "wan2_2", tmp_path_factory.mktemp("neutral"))
