"""Registration of the Wan 2.2 plugin: entry point, spec, validation, import weight."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.family import ModelFamily
from miles_core.plugin_manager import PluginHost
from miles_wan22 import plugin
from miles_wan22.family import Wan22Family


@pytest.fixture(scope="module")
def host() -> PluginHost:
    # Strict loading: pluggy checks each hookimpl against its hookspec, unknown hooks fail.
    return testing.load_plugin("wan22", "miles-wan22")


def _spec(host: PluginHost) -> ModelFamilySpec:
    return host.registries.model_family.get("wan2_2").spec


def test_entry_point_registers_the_family_class(host: PluginHost) -> None:
    assert host.record("wan22").entry_point == "miles_wan22.plugin"
    assert host.pm.get_plugin("wan22") is plugin
    assert host.record("wan22").registers == {"model_family": ["wan2_2", "wan2_2_ti2v", "wan2_2_i2v"]}
    assert host.registries.model_family.get("wan2_2").load() is Wan22Family
    assert issubclass(Wan22Family, ModelFamily)
    assert Wan22Family.pipeline_class == "diffusers:WanPipeline"


def test_family_spec_values(host: PluginHost) -> None:
    spec = _spec(host)
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_wan22.family:Wan22Family"
    assert spec.description
    assert spec.checkpoint_patterns == ("wan2.2", "wan-2.2")
    assert spec.trainable_components == ("transformer", "transformer_2")
    assert spec.lora_target_modules == ("to_q", "to_k", "to_v", "to_out.0")
    assert spec.n_samples_per_prompt == 16
    assert spec.rollout_microgroup_size == 8
    assert spec.supports_cfg_training is True
    # WanPipeline serves Wan 2.1, 2.2 A14B and TI2V-5B: the check tells A14B apart.
    assert spec.pipeline_classes == ("WanPipeline",) == (Wan22Family.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check == "miles_wan22.checkpoint:two_expert_wan"


def test_checkpoint_patterns_match_real_names(host: PluginHost) -> None:
    patterns = _spec(host).checkpoint_patterns
    for name in ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "/ckpt/my-wan-2.2-finetune"):
        assert any(p in name.lower() for p in patterns), name
    assert not any(p in "wan-ai/wan2.1-t2v-1.3b-diffusers" for p in patterns)


def test_validation_requires_guidance_scale_2_when_the_low_noise_expert_trains(host: PluginHost) -> None:
    def config(targets: str | None, scale_2: float | None) -> types.SimpleNamespace:
        return types.SimpleNamespace(model_family="wan2_2", diffusion_guidance_scale_2=scale_2, update_weight_target_module=targets)

    message = (
        "--diffusion-guidance-scale-2 is required when --update-weight-target-module trains transformer_2 (the "
        "low-noise expert): the guidance scale that expert is sampled and trained with is part of what it learns, "
        "so it is given, not copied from --diffusion-guidance-scale (diffusers' fallback, used while transformer_2 "
        "stays frozen)"
    )
    # Unset targets mean both experts (the family's trainable components).
    for targets in (None, "transformer,transformer_2", " transformer_2 ", "transformer_2"):
        assert host.validate(config(targets, None)) == [message], targets
        assert host.validate(config(targets, 3.0)) == []
        assert host.validate(config(targets, 0.0)) == []  # zero is a value, not "unset"
    # Control: the high-noise expert alone needs no second scale (diffusers' fallback),
    # nor does SFT, which samples nothing.
    assert host.validate(config("transformer", None)) == []
    sft = config("transformer,transformer_2", None)
    sft.loss_type = "sft_loss"
    assert host.validate(sft) == []


def test_validation_keeps_sft_on_both_experts(host: PluginHost) -> None:
    def config(targets: str, loss: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            model_family="wan2_2", diffusion_guidance_scale_2=3.0, update_weight_target_module=targets, loss_type=loss
        )

    for targets in ("transformer", "transformer_2"):
        assert host.validate(config(targets, "sft_loss")) == [
            f"--loss-type sft_loss and --update-weight-target-module {targets}: SFT draws each row's step over the whole "
            "schedule, so some rows would fall on the frozen expert; train both experts "
            "(--update-weight-target-module transformer,transformer_2)"
        ]
        assert host.validate(config(targets, "policy_loss")) == []  # control: the policy losses train one expert
    assert host.validate(config("transformer,transformer_2", "sft_loss")) == []


def test_validation_ignores_other_families(host: PluginHost) -> None:
    other = types.SimpleNamespace(model_family="sd3", diffusion_guidance_scale_2=None, update_weight_target_module="transformer")
    assert host.validate(other) == []


def test_native_size_is_wan_pipeline_default() -> None:
    from diffusers import WanPipeline

    params = inspect.signature(WanPipeline.__call__).parameters
    expected = (params["height"].default, params["width"].default)
    assert Wan22Family.native_size("Wan-AI/Wan2.2-T2V-A14B-Diffusers") == expected == (480, 832)


def test_registration_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("wan22", "miles-wan22")


RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "wan22.yaml"


@pytest.mark.skipif(not RECIPE.is_file(), reason="recipes/ ships with the miles-core checkout")
def test_the_recipe_has_the_published_values() -> None:
    from miles_core.config.resolve import resolve_config, training_errors

    config = resolve_config(
        ["--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "--rollout-batch-size", "1", "--custom-config-path", str(RECIPE)]
    )
    assert config.model_family == "wan2_2" and training_errors(config) == []
    assert (config.n_samples_per_prompt, config.rollout_microgroup_size) == (16, 8)  # reference recipe
    assert config.update_weight_target_module == "transformer,transformer_2"
    assert (config.diffusion_guidance_scale, config.diffusion_guidance_scale_2) == (4.0, 3.0)  # Wan 2.2 A14B
    # flow_grpo Wan 2.1: steps, size, frames, KL beta.
    assert (config.diffusion_num_steps, config.diffusion_eval_num_steps, config.diffusion_num_sde_steps) == (20, 50, 19)
    assert (config.diffusion_height, config.diffusion_width, config.diffusion_output_num_frames) == (240, 416, 33)
    assert config.diffusion_kl_beta == 0.004
    # flow_grpo SD3.5 (our choice for Wan): noise, clip, LoRA, lr.
    assert (config.diffusion_noise_level, config.diffusion_clip_range, config.diffusion_adv_clip_max) == (0.7, 1e-4, 5.0)
    assert (config.use_lora, config.lora_rank, config.lora_alpha, config.lr) == (True, 32, 64, 3e-4)
    assert list(config.lora_target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]  # the family's default
