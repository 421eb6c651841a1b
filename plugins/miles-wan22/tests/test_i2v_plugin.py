"""The wan2_2_i2v family's registration: spec, checkpoint matching (which
WanImageToVideoPipeline directories it claims, and why it declines the others), name
patterns, the two-expert validation rules, ``make-tiny`` and ``list-plugins``."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import pytest

from miles_core import testing
from miles_core.api import ModelFamilySpec
from miles_core.cli.main import main
from miles_core.errors import FamilyMatchError
from miles_core.family_match import match_family, read_model_index
from miles_core.plugin_manager import PluginHost, get_host
from miles_wan22.checkpoint import i2v_wan
from miles_wan22.i2v import WanI2VFamily

NAME = "wan2_2_i2v"


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return testing.load_plugin("wan22", "miles-wan22")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``miles-core make-tiny wan2_2_i2v DIR`` (the CLI, which builds through the family)."""
    out = tmp_path_factory.mktemp("built") / "base"
    assert main(["make-tiny", NAME, str(out)]) == 0
    return out


@pytest.fixture
def copy(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(built, tmp_path_factory.mktemp("neutral") / "my-finetune"))


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_spec_values_agree_with_the_family(host: PluginHost) -> None:
    registration = host.registries.model_family.get(NAME)
    spec = registration.spec
    assert isinstance(spec, ModelFamilySpec) and registration.load() is WanI2VFamily
    assert spec.ref == "miles_wan22.i2v:WanI2VFamily"
    assert spec.pipeline_classes == ("WanImageToVideoPipeline",) == (WanI2VFamily.pipeline_class.split(":")[1],)
    assert spec.checkpoint_check == "miles_wan22.checkpoint:i2v_wan"
    assert spec.image_input == WanI2VFamily.image_input == "required"
    # wan2_2's experts, LoRA targets, groups and sampling options.
    a14b = host.registries.model_family.get("wan2_2").spec
    for field in ("trainable_components", "lora_target_modules", "n_samples_per_prompt", "rollout_microgroup_size", "generation_options"):
        assert getattr(spec, field) == getattr(a14b, field), field
    assert spec.trainable_components == ("transformer", "transformer_2")
    assert "guidance_scale_2" in spec.generation_options


def test_the_tiny_pipeline_is_claimed_by_content(built: Path, tmp_path: Path) -> None:
    index = read_model_index(built)
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["image_encoder"] == [None, None]
    assert i2v_wan(built, index) is None
    testing.assert_matched_by_content(built, NAME, tmp_path)
    testing.assert_import_is_light("miles_wan22.checkpoint", "miles_wan22.i2v")


@pytest.mark.parametrize(
    "index_changes, transformer_changes, reason",
    [
        ({"boundary_ratio": None}, {}, "boundary_ratio None (a two-expert Wan 2.2 pipeline switches experts at a ratio in (0, 1))"),
        ({"expand_timesteps": True}, {}, "expand_timesteps is set (Wan 2.2 TI2V-5B, a single-expert pipeline)"),
        (
            {"image_encoder": ["transformers", "CLIPVisionModel"]},
            {},
            "it lists an image_encoder (CLIP image embeddings: Wan 2.1 I2V; Wan 2.2 I2V-A14B conditions on VAE latents only)",
        ),
        ({}, {"image_dim": 1280}, "the transformer's image_dim is 1280 (CLIP image embeddings: Wan 2.1 I2V)"),
        (
            {},
            {"in_channels": 16},
            "the transformer's in_channels 16 / out_channels 16 are not 2 x z_dim + 4 / z_dim for the VAE's z_dim 16 "
            "(an I2V expert reads the latents, a 4-channel mask and the image latents)",
        ),
    ],
)
def test_other_image_to_video_pipelines_are_refused_with_the_reason(
    copy: Path, index_changes: dict[str, Any], transformer_changes: dict[str, Any], reason: str
) -> None:
    edit_json(copy / "model_index.json", **index_changes)
    for expert in ("transformer", "transformer_2"):  # both experts alike: the shared-shape check passes
        edit_json(copy / expert / "config.json", **transformer_changes)
    assert i2v_wan(copy, read_model_index(copy)) == reason
    with pytest.raises(FamilyMatchError) as caught:
        match_family(copy, get_host().registries.model_family)
    assert str(caught.value) == (
        f"--hf-checkpoint {copy}: its WanImageToVideoPipeline (model_index.json) is claimed by no installed model family "
        f"(considered {NAME}: {reason}); pass --diffusion-model-family to choose one"
    )


def test_a_wan21_i2v_layout_is_refused_in_one_line(copy: Path) -> None:
    # Wan 2.1 I2V: one transformer; the core refuses before the check runs.
    shutil.rmtree(copy / "transformer_2")
    edit_json(copy / "model_index.json", transformer_2=[None, None], boundary_ratio=None)
    with pytest.raises(FamilyMatchError) as caught:
        match_family(copy, get_host().registries.model_family)
    assert f"considered {NAME}: model_index.json lists no transformer_2, which it trains" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_name_patterns_pick_i2v_over_t2v(host: PluginHost) -> None:
    registry = get_host().registries.model_family
    for name in ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "org/my-wan-2.2-i2v-finetune", "org/I2V-A14B-lora"):
        assert match_family(name, registry).name == NAME, name
    # Controls: the text-to-video and TI2V-5B checkpoints stay theirs.
    assert match_family("Wan-AI/Wan2.2-T2V-A14B-Diffusers", registry).name == "wan2_2"
    assert match_family("Wan-AI/Wan2.2-TI2V-5B-Diffusers", registry).name == "wan2_2_ti2v"


def test_the_expert_rules_apply_to_this_family(host: PluginHost) -> None:
    def config(targets: str | None, scale_2: float | None, loss: str = "policy_loss") -> types.SimpleNamespace:
        return types.SimpleNamespace(
            model_family=NAME, diffusion_guidance_scale_2=scale_2, update_weight_target_module=targets, loss_type=loss
        )

    assert [m.split(" ", 1)[0] for m in host.validate(config(None, None))] == ["--diffusion-guidance-scale-2"]
    assert host.validate(config(None, 3.5)) == []
    assert host.validate(config("transformer", None)) == []  # control: the high-noise expert alone
    assert host.validate(config("transformer_2", 3.5, "sft_loss"))[0].startswith("--loss-type sft_loss and --update-weight-target-module")


def test_list_plugins_shows_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list-plugins", "--json"]) == 0
    (wan22,) = [p for p in json.loads(capsys.readouterr().out) if p["name"] == "wan22"]
    assert wan22["status"] == "ok" and wan22["registers"] == {"model_family": ["wan2_2", "wan2_2_ti2v", NAME]}
