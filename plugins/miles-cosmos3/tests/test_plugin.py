"""Registration of the cosmos3 family: entry point, spec values, light imports."""

from __future__ import annotations

import pytest

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.family import ModelFamily
from miles_core.plugin_manager import PluginHost
from miles_cosmos3 import plugin
from miles_cosmos3.family import Cosmos3Family

GENERATION_ATTENTION = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return testing.load_plugin("cosmos3", "miles-cosmos3")


def test_the_plugin_host_registers_the_family(host: PluginHost) -> None:
    assert host.record("cosmos3").entry_point == "miles_cosmos3.plugin"
    assert host.record("cosmos3").registers == {"model_family": ["cosmos3"]}
    registration = host.registries.model_family.get("cosmos3")
    assert [registration.spec] == plugin.miles_register_model_families()
    assert registration.load() is Cosmos3Family


def test_spec_values(host: PluginHost) -> None:
    spec = host.registries.model_family.get("cosmos3").spec
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_cosmos3.family:Cosmos3Family"
    assert spec.description
    assert spec.checkpoint_patterns == ("cosmos3", "cosmos-3")
    assert spec.trainable_components == ("transformer",)
    assert spec.lora_target_modules == GENERATION_ATTENTION
    assert spec.n_samples_per_prompt == 16
    assert spec.rollout_microgroup_size == 1
    assert spec.max_microgroup_size == 1
    assert spec.pipeline_classes == ("Cosmos3OmniPipeline",) == (Cosmos3Family.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check is None


def test_family_class() -> None:
    assert issubclass(Cosmos3Family, ModelFamily)
    assert Cosmos3Family.pipeline_class == "diffusers:Cosmos3OmniPipeline"
    # The pipeline's hard-coded defaults: nothing to read, so even a hub id has an answer.
    assert Cosmos3Family.native_size("nvidia/Cosmos3-Nano") == (720, 1280)


def test_plugin_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("cosmos3", "miles-cosmos3")
