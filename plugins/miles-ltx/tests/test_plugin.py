"""Registration of the ``ltx`` family: entry point, spec values, import lightness."""

from __future__ import annotations

import pytest

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.family import ModelFamily
from miles_core.plugin_manager import PluginHost
from miles_ltx.family import LtxFamily


@pytest.fixture(scope="module")
def host() -> PluginHost:
    # Strict loading validates the hookimpls against the core's hookspecs.
    return testing.load_plugin("ltx", "miles-ltx")


def test_entry_point_registers_the_family_class(host: PluginHost) -> None:
    assert host.record("ltx").entry_point == "miles_ltx.plugin"
    assert host.record("ltx").registers == {"model_family": ["ltx"]}
    assert host.registries.model_family.get("ltx").load() is LtxFamily


def test_spec_values(host: PluginHost) -> None:
    spec = host.registries.model_family.get("ltx").spec
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_ltx.family:LtxFamily"
    assert spec.description
    assert spec.checkpoint_patterns == ("ltx",)
    assert spec.trainable_components == ("transformer",)
    assert spec.lora_target_modules == ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")
    assert spec.n_samples_per_prompt == 8
    assert spec.rollout_microgroup_size == 1
    assert spec.default_sde_type == "cps"
    assert spec.supports_cfg_training is False
    # Without CFG in training, rollouts sample without it unless the flag says otherwise.
    assert spec.default_guidance_scale == 1.0
    assert spec.pipeline_classes == ("LTX2Pipeline",) == (LtxFamily.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check is None


def test_family_class() -> None:
    assert issubclass(LtxFamily, ModelFamily)
    assert LtxFamily.pipeline_class == "diffusers:LTX2Pipeline"
    # LTX2Pipeline's __call__ defaults; test_tiny checks them against the signature.
    assert LtxFamily.native_size("Lightricks/LTX-2") == (512, 768)
    assert LtxFamily.native_size("/nonexistent") == (512, 768)


def test_plugin_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("ltx", "miles-ltx", checkpoint="/nonexistent")
