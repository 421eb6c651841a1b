"""The entry point and the spec record, without importing any model code."""

from __future__ import annotations

import json

import pytest

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.plugin_manager import PluginHost
from miles_qwen_image import plugin
from miles_qwen_image.family import QwenImageFamily


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return testing.load_plugin("qwen_image", "miles-qwen-image")


def test_entry_point_registers_the_family_class(host: PluginHost) -> None:
    assert host.record("qwen_image").entry_point == "miles_qwen_image.plugin"
    assert host.pm.get_plugin("qwen_image") is plugin
    assert host.record("qwen_image").registers == {"model_family": ["qwen_image"]}
    assert host.registries.model_family.get("qwen_image").load() is QwenImageFamily


def test_spec_values(host: PluginHost) -> None:
    spec = host.registries.model_family.get("qwen_image").spec
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_qwen_image.family:QwenImageFamily"
    assert spec.checkpoint_patterns == ("qwen-image",)
    assert spec.trainable_components == ("transformer",)
    assert spec.n_samples_per_prompt == 16
    assert spec.rollout_microgroup_size == 8
    assert spec.supports_cfg_training
    assert spec.lora_target_modules == plugin.LORA_TARGET_MODULES == (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )  # fmt: skip
    assert spec.pipeline_classes == ("QwenImagePipeline",) == (QwenImageFamily.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check is None


def test_plugin_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("qwen_image", "miles-qwen-image")


def test_native_size_without_local_checkpoint(tmp_path) -> None:
    assert QwenImageFamily.native_size("Qwen/Qwen-Image") is None
    assert QwenImageFamily.native_size(tmp_path) is None
    # The real checkpoint's VAE config: three temporal-downsample flags, 8x, so 1024 px.
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"temperal_downsample": [False, True, True]}))
    assert QwenImageFamily.native_size(tmp_path) == (1024, 1024)
