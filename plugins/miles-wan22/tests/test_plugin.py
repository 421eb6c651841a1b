"""Registration of the Wan 2.2 plugin: entry point, spec, validation, import weight."""

from __future__ import annotations

import inspect
import types

import pytest

from miles_core import ModelFamilySpec, testing
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
    assert host.record("wan22").registers == {"model_family": ["wan2_2"]}
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


def test_checkpoint_patterns_match_real_names(host: PluginHost) -> None:
    patterns = _spec(host).checkpoint_patterns
    for name in ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "/ckpt/my-wan-2.2-finetune"):
        assert any(p in name.lower() for p in patterns), name
    assert not any(p in "wan-ai/wan2.1-t2v-1.3b-diffusers" for p in patterns)


def test_validation_requires_guidance_scale_2(host: PluginHost) -> None:
    bad = types.SimpleNamespace(model_family="wan2_2", diffusion_guidance_scale_2=None)
    assert host.validate(bad) == [
        "--diffusion-guidance-scale-2 is required for the Wan 2.2 family: the low-noise expert "
        "(transformer_2) has its own guidance scale and there is no fallback"
    ]
    good = types.SimpleNamespace(model_family="wan2_2", diffusion_guidance_scale_2=3.0)
    assert host.validate(good) == []
    # Zero is a real value, not "unset".
    zero = types.SimpleNamespace(model_family="wan2_2", diffusion_guidance_scale_2=0.0)
    assert host.validate(zero) == []


def test_validation_ignores_other_families(host: PluginHost) -> None:
    other = types.SimpleNamespace(model_family="sd3", diffusion_guidance_scale_2=None)
    assert host.validate(other) == []


def test_native_size_is_wan_pipeline_default() -> None:
    from diffusers import WanPipeline

    params = inspect.signature(WanPipeline.__call__).parameters
    expected = (params["height"].default, params["width"].default)
    assert Wan22Family.native_size("Wan-AI/Wan2.2-T2V-A14B-Diffusers") == expected == (480, 832)


def test_registration_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("wan22", "miles-wan22")
