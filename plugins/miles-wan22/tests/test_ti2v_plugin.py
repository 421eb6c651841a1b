"""The ``wan2_2_ti2v`` family's registration: its spec, how a checkpoint is matched to it
(by content, and a hub id by name, never to ``wan2_2``), its tiny pipeline and its recipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from miles_core import testing
from miles_core.errors import FamilyMatchError
from miles_core.family_match import match_family, names_matching, read_model_index
from miles_core.plugin_manager import get_host
from miles_wan22.checkpoint import ti2v_wan, two_expert_wan
from miles_wan22.family import Wan22Family
from miles_wan22.ti2v import WanTI2VFamily

TI2V_HUB_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
A14B_HUB_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "wan22_ti2v.yaml"

tiny_dir, pipe = testing.tiny_pipeline_fixtures(WanTI2VFamily)


def _spec(name: str = "wan2_2_ti2v") -> Any:
    return get_host().registries.model_family.get(name).spec


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def copy(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh copy of the tiny TI2V pipeline under a neutral name."""
    return Path(shutil.copytree(tiny_dir, tmp_path_factory.mktemp("neutral") / "my-finetune"))


def test_the_plugin_registers_both_wan_families() -> None:
    host = testing.load_plugin("wan22", "miles-wan22")
    assert host.record("wan22").registers == {"model_family": ["wan2_2", "wan2_2_ti2v", "wan2_2_i2v"]}
    registration = host.registries.model_family.get("wan2_2_ti2v")
    assert registration.load() is WanTI2VFamily and WanTI2VFamily.pipeline_class == "diffusers:WanPipeline"
    spec = registration.spec
    assert spec.pipeline_classes == ("WanPipeline",) and spec.checkpoint_check == "miles_wan22.checkpoint:ti2v_wan"
    assert spec.trainable_components == ("transformer",)
    assert spec.lora_target_modules == _spec("wan2_2").lora_target_modules == ("to_q", "to_k", "to_v", "to_out.0")
    assert (spec.n_samples_per_prompt, spec.rollout_microgroup_size) == (16, 8)
    # wan2_2's options minus the second expert's guidance scale.
    assert set(spec.generation_options) == set(_spec("wan2_2").generation_options) - {"guidance_scale_2"} == {"num_frames", "fps"}
    testing.assert_plugin_is_light("wan22", "miles-wan22", checkpoint=TI2V_HUB_ID)


def test_the_hub_ids_are_matched_by_name_to_their_own_family() -> None:
    registry = get_host().registries.model_family
    # The TI2V id matches both families' patterns ("wan2.2" and "wan2.2-ti2v") ...
    assert sorted(reg.name for reg in names_matching(TI2V_HUB_ID, registry)) == ["wan2_2", "wan2_2_ti2v"]
    # ... and the more specific pattern decides; the A14B ids match wan2_2's alone.
    assert match_family(TI2V_HUB_ID, registry).name == "wan2_2_ti2v"
    assert match_family("FastVideo/FastWan2.2-TI2V-5B-Diffusers", registry).name == "wan2_2_ti2v"
    for name in (A14B_HUB_ID, "org/my-wan-2.2-finetune"):
        assert match_family(name, registry).name == "wan2_2", name


def test_the_tiny_pipeline_is_matched_by_content(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    copy = testing.assert_matched_by_content(tiny_dir, "wan2_2_ti2v", tmp_path_factory.mktemp("neutral"))
    index = read_model_index(copy)
    assert ti2v_wan(copy, index) is None
    assert two_expert_wan(copy, index) == "boundary_ratio None (a two-expert Wan 2.2 pipeline switches experts at a ratio in (0, 1))"
    testing.assert_import_is_light("miles_wan22.checkpoint")


def test_a14b_is_not_claimed_by_the_ti2v_family(tmp_path: Path) -> None:
    a14b = Path(Wan22Family.build_tiny_pipeline(tmp_path / "my-finetune"))
    assert ti2v_wan(a14b, read_model_index(a14b)) == (
        "expand_timesteps is not set (Wan 2.1 or Wan 2.2 A14B; TI2V-5B gives every latent token its own timestep)"
    )
    edit_json(a14b / "model_index.json", expand_timesteps=True)
    assert ti2v_wan(a14b, read_model_index(a14b)) == (
        "it lists transformer_2 or a boundary_ratio (a two-expert pipeline; TI2V-5B has one transformer)"
    )


@pytest.mark.parametrize(
    "index_changes, transformer_changes, reason",
    [
        (
            {"expand_timesteps": False},
            {},
            "expand_timesteps is not set (Wan 2.1 or Wan 2.2 A14B; TI2V-5B gives every latent token its own timestep)",
        ),
        ({}, {"in_channels": 16}, "the transformer's in_channels 16 differ from the VAE's z_dim 48 (TI2V-5B denoises the VAE's latents)"),
    ],
)
def test_other_single_transformer_wans_are_refused_with_the_reason(
    copy: Path, index_changes: dict[str, Any], transformer_changes: dict[str, Any], reason: str
) -> None:
    edit_json(copy / "model_index.json", **index_changes)
    edit_json(copy / "transformer" / "config.json", **transformer_changes)
    assert ti2v_wan(copy, read_model_index(copy)) == reason
    with pytest.raises(FamilyMatchError) as caught:
        match_family(copy, get_host().registries.model_family)
    assert str(caught.value) == (
        f"--hf-checkpoint {copy}: its WanPipeline (model_index.json) is claimed by no installed model family "
        f"(considered wan2_2: model_index.json lists no transformer_2, which it trains; wan2_2_ti2v: {reason}); "
        "pass --diffusion-model-family to choose one"
    )


def test_build_is_deterministic_small_and_loads(tmp_path: Path, pipe: Any) -> None:
    weights, _ = testing.assert_build_is_deterministic(WanTI2VFamily, tmp_path)
    assert {key.split("/")[0] for key in weights} == {"text_encoder", "vae", "transformer"}
    assert testing.directory_size(tmp_path / "seed0-a") < 1024 * 1024
    assert pipe.config.expand_timesteps is True and pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    assert (pipe.vae.config.z_dim, pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (48, 16, 4)
    assert pipe.vae.config.is_residual and pipe.vae.config.patch_size == 2


def test_lora_targets_are_linear(pipe: Any) -> None:
    testing.assert_lora_targets(pipe.transformer, _spec().lora_target_modules)


@pytest.mark.exercises("--diffusion-guidance-scale-2")
def test_the_second_experts_guidance_scale_is_refused() -> None:
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError

    base = ["--hf-checkpoint", TI2V_HUB_ID, "--rollout-batch-size", "1"]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*base, "--diffusion-guidance-scale-2", "3"])
    assert caught.value.messages == [
        "--diffusion-guidance-scale-2 3.0: the wan2_2_ti2v family does not read it "
        "(it reads --diffusion-output-num-frames, --diffusion-fps)"
    ]
    config = resolve_config(base)  # control: without it the configuration resolves
    assert (config.model_family, config.update_weight_target_module) == ("wan2_2_ti2v", "transformer")


@pytest.mark.skipif(not RECIPE.is_file(), reason="recipes/ ships with the miles-core checkout")
def test_the_recipe_has_the_published_values() -> None:
    from miles_core.config.resolve import resolve_config, training_errors

    config = resolve_config(["--hf-checkpoint", TI2V_HUB_ID, "--rollout-batch-size", "1", "--custom-config-path", str(RECIPE)])
    assert config.model_family == "wan2_2_ti2v" and training_errors(config) == []
    assert config.update_weight_target_module == "transformer"
    # Wan's published TI2V-5B sampling: 704x1280, 121 frames at 24 fps, guidance 5, 50 steps.
    assert (config.diffusion_height, config.diffusion_width, config.diffusion_output_num_frames) == (704, 1280, 121)
    assert (config.diffusion_fps, config.diffusion_guidance_scale, config.diffusion_eval_num_steps) == (24.0, 5.0, 50)
    # The RL settings of recipes/wan22.yaml (reference group sizes, flow_grpo's Wan and SD3.5 values).
    assert (config.n_samples_per_prompt, config.rollout_microgroup_size) == (16, 8)
    assert (config.diffusion_num_steps, config.diffusion_num_sde_steps, config.diffusion_kl_beta) == (20, 19, 0.004)
    assert (config.diffusion_noise_level, config.diffusion_clip_range, config.diffusion_adv_clip_max) == (0.7, 1e-4, 5.0)
    assert (config.use_lora, config.lora_rank, config.lora_alpha, config.lr) == (True, 32, 64, 3e-4)
