"""The plugin test helpers must be able to fail, or the plugin suites prove nothing."""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from miles_core import testing
from tests.fake_dists import make_dist


def test_load_plugin_checks_the_distribution():
    host = testing.load_plugin("core", "miles-core")
    assert "sde" in host.registries.sde_backend
    with pytest.raises(AssertionError, match="belongs to 'miles-core', expected 'miles-sd3'"):
        testing.load_plugin("core", "miles-sd3")
    with pytest.raises(AssertionError, match="found 0"):
        testing.load_plugin("no_such_plugin", "x")


def test_light_import_detects_heavy_modules():
    testing.assert_import_is_light("miles_core", "miles_core.plugin_manager")
    with pytest.raises(AssertionError, match="loads torch"):
        testing.assert_import_is_light("miles_core.sde")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


def test_lora_targets_must_exist():
    model = torch.nn.Sequential(_Block(), _Block())
    assert testing.assert_lora_targets(model, ["to_q"]) == ["0.to_q", "1.to_q"]
    with pytest.raises(AssertionError, match="'to_k' matches no nn.Linear"):
        testing.assert_lora_targets(model, ["to_q", "to_k"])
    assert not any(hasattr(m, "lora_A") for m in model.modules()), "the model itself is left untouched"


class _ConvBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Conv1d(4, 4, 1)  # PEFT wraps a convolution too: only the check stops it


def test_lora_targets_must_all_be_linear():
    model = torch.nn.Sequential(_Block(), _ConvBlock())
    message = r"'to_q' also matches modules that are not nn.Linear: \['1.to_q \(Conv1d\)'\]"
    with pytest.raises(AssertionError, match=message):
        testing.assert_lora_targets(model, ["to_q"])


class _SeedFamily:
    """A fake family that writes one tensor; ``ignore_seed`` makes it wrong."""

    ignore_seed = False

    @classmethod
    def build_tiny_pipeline(cls, out_dir, *, seed=0):
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True)
        generator = torch.Generator().manual_seed(0 if cls.ignore_seed else seed)
        save_file({"w": torch.randn(3, generator=generator)}, str(out_dir / "model.safetensors"))
        return out_dir


def test_deterministic_build_check_has_a_control(tmp_path):
    testing.assert_build_is_deterministic(_SeedFamily, tmp_path / "ok")

    class Broken(_SeedFamily):
        ignore_seed = True

    with pytest.raises(AssertionError, match="seed 1 built the same weights"):
        testing.assert_build_is_deterministic(Broken, tmp_path / "broken")


class _TwoComponentFamily:
    """A fake family with a transformer and a VAE; the class flags break one thing each."""

    vae_ignores_seed = False
    config_counter = None

    @classmethod
    def build_tiny_pipeline(cls, out_dir, *, seed=0):
        from safetensors.torch import save_file

        for component, component_seed in (("transformer", seed), ("vae", 0 if cls.vae_ignores_seed else seed)):
            (out_dir / component).mkdir(parents=True)
            weights = {"w": torch.randn(3, generator=torch.Generator().manual_seed(component_seed))}
            save_file(weights, str(out_dir / component / "model.safetensors"))
        config = {"layers": 1} if cls.config_counter is None else {"built": next(cls.config_counter)}
        (out_dir / "model_index.json").write_text(json.dumps(config))
        return out_dir


def test_deterministic_build_check_covers_every_file_and_component(tmp_path):
    first, other = testing.assert_build_is_deterministic(_TwoComponentFamily, tmp_path / "ok")
    assert sorted(first) == sorted(other) == ["transformer/model.safetensors:w", "vae/model.safetensors:w"]

    class SeedlessVae(_TwoComponentFamily):
        vae_ignores_seed = True

    with pytest.raises(AssertionError, match="seed 1 built the same weights as seed 0 in vae/model.safetensors"):
        testing.assert_build_is_deterministic(SeedlessVae, tmp_path / "seedless")

    class StampedConfig(_TwoComponentFamily):
        config_counter = itertools.count()

    with pytest.raises(AssertionError, match="same seed, different contents: model_index.json"):
        testing.assert_build_is_deterministic(StampedConfig, tmp_path / "stamped")


class _FakePipeline:
    def set_progress_bar_config(self, **kwargs):
        self.progress_bar = kwargs


class _FakePipelineFamily:
    """Builds a directory holding its seed; loads it as a ``_FakePipeline``."""

    @classmethod
    def build_tiny_pipeline(cls, out_dir, *, seed=0):
        out_dir.mkdir(parents=True)
        (out_dir / "seed").write_text(str(seed))
        return out_dir

    @classmethod
    def load_pipeline(cls, directory):
        pipe = _FakePipeline()
        pipe.seed = int((directory / "seed").read_text())
        return pipe

    @classmethod
    def resolve_pipeline_class(cls):
        return _FakePipeline


def test_load_tiny_pipeline_checks_the_class(tmp_path):
    directory = _FakePipelineFamily.build_tiny_pipeline(tmp_path / "tiny", seed=3)
    pipe = testing.load_tiny_pipeline(_FakePipelineFamily, directory)
    assert pipe.seed == 3 and pipe.progress_bar == {"disable": True}

    class WrongClass(_FakePipelineFamily):
        @classmethod
        def resolve_pipeline_class(cls):
            return dict

    with pytest.raises(AssertionError, match="WrongClass.load_pipeline gave a _FakePipeline, expected dict"):
        testing.load_tiny_pipeline(WrongClass, directory)


FIXTURE_TESTS = """
from miles_core import testing


class FakePipeline:
    def set_progress_bar_config(self, **kwargs):
        self.progress_bar = kwargs


class Family:
    builds = []

    @classmethod
    def build_tiny_pipeline(cls, out_dir, *, seed=0):
        cls.builds.append(seed)
        out_dir.mkdir(parents=True)
        return out_dir

    @classmethod
    def load_pipeline(cls, directory):
        return FakePipeline()

    @classmethod
    def resolve_pipeline_class(cls):
        return {pipeline_class}


tiny_dir, pipe = testing.tiny_pipeline_fixtures(Family, seed=5)


def test_first(tiny_dir, pipe):
    assert tiny_dir.is_dir() and pipe.progress_bar == {{"disable": True}}


def test_second_reuses_the_build(tiny_dir, pipe):
    assert Family.builds == [5]
"""


def test_tiny_pipeline_fixtures_build_once_and_check_the_class(tmp_path):
    for name, pipeline_class in (("good", "FakePipeline"), ("wrong", "dict")):
        (tmp_path / f"test_{name}.py").write_text(FIXTURE_TESTS.format(pipeline_class=pipeline_class))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rE", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    # The control: the family whose pipeline is not its pipeline_class errors in both tests.
    assert "2 passed, 2 errors" in result.stdout, result.stdout + result.stderr
    assert "Family.load_pipeline gave a FakePipeline, expected dict" in result.stdout


FAKE_FAMILY_PLUGIN = """
from miles_core.api import ModelFamilySpec, hookimpl


class Family:
    @classmethod
    def native_size(cls, checkpoint):
        if {heavy}:
            import torch  # what a family must not do before a model is needed
        return None


@hookimpl
def miles_register_model_families():
    return [
        ModelFamilySpec(
            name="fake",
            ref="{module}:Family",
            description="test family",
            checkpoint_patterns=("fake",),
            lora_target_modules=("to_q",),
            n_samples_per_prompt=2,
            rollout_microgroup_size=1,
        )
    ]
"""


def test_light_plugin_check_resolves_the_families(tmp_path, monkeypatch):
    testing.assert_plugin_is_light("core", "miles-core")
    for name, heavy in (("light", False), ("heavy", True)):
        # Distribution fake-<name>, entry point <name>, module fake_<name>_<name>.
        source = FAKE_FAMILY_PLUGIN.format(heavy=heavy, module=f"fake_{name}_{name}")
        make_dist(tmp_path / name, f"fake-{name}", "1.0", {name: source})
    paths = [str(tmp_path / "light"), str(tmp_path / "heavy"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    testing.assert_plugin_is_light("light", "fake-light")
    # The control: only native_size imports torch, so only resolving the family catches it.
    testing.assert_import_is_light("fake_heavy_heavy")
    with pytest.raises(AssertionError, match="loading plugin 'heavy' and resolving its families loads torch"):
        testing.assert_plugin_is_light("heavy", "fake-heavy")


def test_an_override_without_the_checkpoint_parameter_is_still_called(tmp_path) -> None:
    """``resolve_pipeline_class`` overrides written before it took the checkpoint keep working."""
    from miles_core.family import pipeline_class_for

    class Old(_FakePipelineFamily):
        @classmethod
        def resolve_pipeline_class(cls):
            return dict

    class New(_FakePipelineFamily):
        @classmethod
        def resolve_pipeline_class(cls, checkpoint=None):
            return list if checkpoint == str(tmp_path) else dict

    assert pipeline_class_for(Old, tmp_path) is dict
    assert pipeline_class_for(New, str(tmp_path)) is list  # the checkpoint reaches an override that takes it
    assert pipeline_class_for(New, "elsewhere") is dict
