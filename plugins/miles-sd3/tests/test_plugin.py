"""Registration of the sd3 family: entry point, spec values, light import, LoRA targets."""

from __future__ import annotations

import pytest
import torch

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.family import ModelFamily
from miles_core.plugin_manager import PluginHost
from miles_sd3.family import SD3Family

EXPECTED_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return testing.load_plugin("sd3", "miles-sd3")


def _spec(host: PluginHost) -> ModelFamilySpec:
    return host.registries.model_family.get("sd3").spec


def test_entry_point_registers_the_family_class(host: PluginHost) -> None:
    assert host.record("sd3").entry_point == "miles_sd3.plugin"
    assert host.record("sd3").registers == {"model_family": ["sd3"]}
    assert host.registries.model_family.get("sd3").load() is SD3Family
    assert issubclass(SD3Family, ModelFamily)
    assert SD3Family.pipeline_class == "diffusers:StableDiffusion3Pipeline"


def test_spec_values(host: PluginHost) -> None:
    spec = _spec(host)
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_sd3.family:SD3Family"
    assert spec.description
    assert spec.checkpoint_patterns == ("stable-diffusion-3", "sd3")
    assert spec.trainable_components == ("transformer",)
    assert spec.lora_target_modules == EXPECTED_TARGETS
    assert spec.n_samples_per_prompt == 16
    assert spec.rollout_microgroup_size == 8
    # Matched by content: the pipeline class the family loads, no further check.
    assert spec.pipeline_classes == ("StableDiffusion3Pipeline",) == (SD3Family.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check is None


def test_plugin_stays_light() -> None:
    testing.assert_plugin_is_light("sd3", "miles-sd3")


def test_lora_targets_leave_attn2_out(host: PluginHost) -> None:
    from miles_sd3.tiny import build_transformer

    transformer = build_transformer(seed=0)
    wrapped = testing.assert_lora_targets(transformer, _spec(host).lora_target_modules)
    # SD3.5's second, image-only attention exists but must stay out of the default targets.
    linears = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    assert any(".attn2." in name for name in linears)
    assert not any(".attn2." in name for name in wrapped)
