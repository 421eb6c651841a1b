"""A ``--hf-checkpoint`` is matched to its model family by what it is (model_index.json
and the component configs), then by name; ``--diffusion-model-family`` overrides both.
A family's defaults resolve without error."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from miles_core.api import ModelFamilySpec
from miles_core.config.model import Source
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import CheckpointError, ConfigError, FamilyMatchError
from miles_core.family_match import checkpoint_problem, is_hub_id, match_family, most_specific, names_matching
from miles_core.hookspecs import ENTRY_POINT_GROUP
from miles_core.plugin_manager import PluginHost, get_host
from tests.fake_dists import entry_points_in, make_dist

REPO_FAMILIES = {"sd3", "wan2_2", "ltx", "qwen_image", "cosmos3", "flux"}
INSTALLED = get_host().registries.model_family.names()

REQUIRED = ["--rollout-batch-size", "1", "--diffusion-num-sde-steps", "2"]
"""The flags every training configuration needs: prompts per rollout, and SDE steps for
the default loss (policy_loss trains on them; the global default 0 trains none)."""
FAMILY_REQUIRED = {"wan2_2": ["--diffusion-guidance-scale-2", "3"], "wan2_2_i2v": ["--diffusion-guidance-scale-2", "3"]}
"""Flags a family requires and has no default for (miles-wan22 refuses to guess the
low-noise expert's guidance scale)."""


def override(family: str) -> list[str]:
    return ["--diffusion-model-family", family]


def errors_of(*argv: str, host: PluginHost | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        resolve_config(list(argv), host=host)
    return caught.value.messages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny(family)``: that family's tiny pipeline, built once for this module under a
    name no family's patterns match."""
    root = tmp_path_factory.mktemp("builds")
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            family_cls = get_host().registries.model_family.get(family).load()
            built[family] = Path(family_cls.build_tiny_pipeline(root / f"b{len(built)}", seed=0))
        return built[family]

    return build


@pytest.fixture
def neutral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder whose path matches no family's name patterns (pytest's tmp_path
    carries the test's name, which may)."""
    folder = tmp_path_factory.mktemp("neutral")
    assert names_matching(str(folder / "my-finetune"), get_host().registries.model_family) == []
    return folder


def copy_as(source: Path, folder: Path, name: str = "my-finetune") -> Path:
    return Path(shutil.copytree(source, folder / name))


def edit_model_index(directory: Path, **changes: Any) -> None:
    path = directory / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    index.update(changes)
    path.write_text(json.dumps(index), encoding="utf-8")


def test_the_repository_families_are_installed() -> None:
    assert set(INSTALLED) >= REPO_FAMILIES


# -- by content ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", INSTALLED)
@pytest.mark.exercises("--hf-checkpoint")
def test_a_tiny_pipeline_under_a_neutral_name_is_matched_by_content(family: str, tiny, neutral: Path) -> None:
    directory = copy_as(tiny(family), neutral)
    registry = get_host().registries.model_family
    assert names_matching(str(directory), registry) == []  # the control: the name alone matches nothing
    assert match_family(directory, registry).name == family
    config = resolve_config(["--hf-checkpoint", str(directory), *REQUIRED, *FAMILY_REQUIRED.get(family, [])])
    assert (config.model_family, config.source("diffusion_model_family")) == (family, Source.DERIVED)


def test_content_wins_over_a_misleading_name(tiny, neutral: Path) -> None:
    # A Wan 2.2 pipeline in a folder named like an SD3 checkpoint.
    directory = copy_as(tiny("wan2_2"), neutral, "sd3-finetune")
    registry = get_host().registries.model_family
    assert [reg.name for reg in names_matching(str(directory), registry)] == ["sd3"]
    assert match_family(directory, registry).name == "wan2_2"


NOT_TI2V = "expand_timesteps is not set (Wan 2.1 or Wan 2.2 A14B; TI2V-5B gives every latent token its own timestep)"
"""Why the wan2_2_ti2v family declines a Wan 2.1 layout (miles-wan22's checkpoint_check)."""


def wan21_like(directory: Path) -> Path:
    """Turn a Wan 2.2 A14B copy into Wan 2.1's layout: one transformer, no expert switch
    (diffusers writes an absent optional component as [null, null])."""
    shutil.rmtree(directory / "transformer_2")
    edit_model_index(directory, transformer_2=[None, None], boundary_ratio=None)
    return directory


def test_wan22_and_a_wan21_like_pipeline_are_told_apart(tiny, neutral: Path) -> None:
    registry = get_host().registries.model_family
    wan22 = copy_as(tiny("wan2_2"), neutral, "a14b")
    assert match_family(wan22, registry).name == "wan2_2"
    wan21 = wan21_like(copy_as(tiny("wan2_2"), neutral, "my-finetune"))
    with pytest.raises(FamilyMatchError) as caught:
        match_family(wan21, registry)
    assert str(caught.value) == (
        f"--hf-checkpoint {wan21}: its WanPipeline (model_index.json) is claimed by no installed model family "
        "(considered wan2_2: model_index.json lists no transformer_2, which it trains; "
        f"wan2_2_ti2v: {NOT_TI2V}); pass --diffusion-model-family to choose one"
    )
    # The same through the configuration: one line, no fallback to the name patterns.
    assert errors_of("--hf-checkpoint", str(wan21), *REQUIRED) == [str(caught.value)]


def test_a_pipeline_class_no_family_lists_falls_back_to_the_name(tiny, neutral: Path) -> None:
    registry = get_host().registries.model_family
    plain = copy_as(tiny("sd3"), neutral, "my-finetune")
    edit_model_index(plain, _class_name="StableDiffusion3Img2ImgPipeline")
    with pytest.raises(FamilyMatchError) as caught:
        match_family(plain, registry)
    installed = ", ".join(
        f"{reg.name} ({', '.join(reg.spec.pipeline_classes)})" if reg.spec.pipeline_classes else reg.name
        for reg in sorted(registry, key=lambda r: r.name)
    )
    assert str(caught.value) == (
        f"--hf-checkpoint {plain}: no installed model family serves its StableDiffusion3Img2ImgPipeline "
        f"(model_index.json) or matches its name (installed: {installed}); pass --diffusion-model-family to choose one"
    )
    assert "sd3 (StableDiffusion3Pipeline)" in installed
    named = copy_as(plain, neutral, "sd3-img2img")
    assert match_family(named, registry).name == "sd3"


# -- what is not a pipeline directory --------------------------------------------------------


@pytest.mark.exercises("--hf-checkpoint")
def test_a_missing_directory_is_reported_as_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "models" / "my-finetune"
    assert errors_of("--hf-checkpoint", str(missing), *REQUIRED) == [f"--hf-checkpoint {missing}: no such directory"]
    monkeypatch.chdir(tmp_path)
    for value in ("./my-finetune", "models/my-finetune/", "models/org/my-finetune", "~/no-such-model", "../x"):
        assert errors_of("--hf-checkpoint", value, *REQUIRED) == [f"--hf-checkpoint {value}: no such directory"], value
    # Control: org/name has a hub id's shape, so it goes to the name patterns instead.
    (message,) = errors_of("--hf-checkpoint", "models/my-finetune", *REQUIRED)
    assert message.startswith(
        "--hf-checkpoint models/my-finetune: no local directory of that name, and as a hub id no installed model "
        "family matches its name (installed: "
    )
    assert resolve_config(["--hf-checkpoint", "Qwen/Qwen-Image", *REQUIRED]).model_family == "qwen_image"


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert errors_of("--hf-checkpoint", str(file), *REQUIRED) == [
        f"--hf-checkpoint {file}: not a directory (a diffusers pipeline is a directory with model_index.json)"
    ]


@pytest.mark.parametrize(
    "value, hub",
    [
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", True),
        ("stabilityai/stable-diffusion-3.5-medium", True),
        ("sd3", True),
        ("/models/sd3", False),
        ("./sd3", False),
        ("~/sd3", False),
        ("a/b/c", False),
        ("org/name/", False),
        ("org--x/name", False),
        ("org/na..me", False),
        ("-org/name", False),
        ("org/name.", False),
        ("C:\\m\\sd3", False),
    ],
)
def test_the_hub_id_rule(value: str, hub: bool) -> None:
    assert is_hub_id(value) is hub


def _named(name: str, *patterns: str) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(name=name, spec=SimpleNamespace(checkpoint_patterns=patterns))


@pytest.mark.exercises("--hf-checkpoint")
def test_the_more_specific_name_pattern_wins() -> None:
    """A name that several families' patterns match goes to the family whose matching
    pattern contains the others' (Wan 2.2 TI2V-5B's `wan2.2-ti2v` over A14B's `wan2.2`)."""
    a14b, ti2v = _named("a14b", "wan2.2", "wan-2.2"), _named("ti2v", "wan2.2-ti2v", "ti2v-5b")
    assert [r.name for r in most_specific("Wan-AI/Wan2.2-TI2V-5B-Diffusers", [a14b, ti2v])] == ["ti2v"]
    assert [r.name for r in most_specific("Wan-AI/Wan2.2-T2V-A14B-Diffusers", [a14b])] == ["a14b"]
    # Controls: patterns that do not contain one another leave both (an error for match_family),
    # and so does a pattern of the other family that does not match this name.
    acme = _named("acme", "acme-wan")
    assert [r.name for r in most_specific("org/acme-wan2.2", [acme, a14b])] == ["acme", "a14b"]
    assert [r.name for r in most_specific("org/wan2.2-x-ti2v-5b", [a14b, ti2v])] == ["a14b", "ti2v"]
    registry = get_host().registries.model_family
    assert match_family("Wan-AI/Wan2.2-TI2V-5B-Diffusers", registry).name == "wan2_2_ti2v"
    assert match_family("Wan-AI/Wan2.2-T2V-A14B-Diffusers", registry).name == "wan2_2"


def test_a_directory_without_model_index(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    message = (
        f"--hf-checkpoint {folder}: no model_index.json, so it is not a diffusers pipeline directory and its model "
        "family cannot be read from it; point it at the pipeline's top folder or pass --diffusion-model-family to "
        "choose one"
    )
    assert errors_of("--hf-checkpoint", str(folder), *REQUIRED) == [message]
    # Not even a matching name makes it one.
    named = tmp_path / "sd3-weights"
    named.mkdir()
    assert errors_of("--hf-checkpoint", str(named), *REQUIRED) == [message.replace(str(folder), str(named))]


def test_a_model_index_without_a_class(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text('{"transformer": ["diffusers", "X"]}', encoding="utf-8")
    assert errors_of("--hf-checkpoint", str(tmp_path), *REQUIRED) == [
        f"--hf-checkpoint {tmp_path}: model_index.json names no pipeline class (_class_name); pass --diffusion-model-family to choose one"
    ]
    (tmp_path / "model_index.json").write_text("{not json", encoding="utf-8")
    (message,) = errors_of("--hf-checkpoint", str(tmp_path), *REQUIRED)
    assert message.startswith(f"--hf-checkpoint {tmp_path}: cannot read model_index.json: ")


# -- the override ----------------------------------------------------------------------------


@pytest.mark.exercises("--diffusion-model-family")
def test_the_override_flag_still_wins(tiny, neutral: Path, tmp_path: Path) -> None:
    wan = copy_as(tiny("wan2_2"), neutral)
    config = resolve_config(["--hf-checkpoint", str(wan), *REQUIRED, *override("sd3")])
    assert (config.model_family, config.source("diffusion_model_family")) == ("sd3", Source.COMMAND_LINE)
    wan21 = wan21_like(copy_as(tiny("wan2_2"), neutral, "w21"))
    assert resolve_config(["--hf-checkpoint", str(wan21), *REQUIRED, *override("sd3")]).model_family == "sd3"
    # No content is read with the override: a folder without model_index.json resolves.
    assert resolve_config(["--hf-checkpoint", str(tmp_path), *REQUIRED, *override("sd3")]).model_family == "sd3"
    # A missing path then resolves (a configuration may be written where the model is
    # not), and training refuses it.
    missing = tmp_path / "absent"
    config = resolve_config(["--hf-checkpoint", str(missing), *REQUIRED, *override("sd3")])
    assert training_errors(config) == [f"--hf-checkpoint {missing}: no such directory"]


def test_loading_a_missing_directory_says_so(tmp_path: Path) -> None:
    family_cls = get_host().registries.model_family.get("sd3").load()
    with pytest.raises(CheckpointError, match=rf"^SD3Family: checkpoint {tmp_path / 'absent'}: no such directory$"):
        family_cls.load_pipeline(tmp_path / "absent")


# -- several families, or a family's check ------------------------------------------------------

FAKE_FAMILY = """
from miles_core.api import ModelFamilySpec, hookimpl

@hookimpl
def miles_register_model_families():
    return [ModelFamilySpec(
        name="acme_wan", ref="miles_wan22.family:Wan22Family", checkpoint_patterns=("acme-wan",),
        pipeline_classes=("WanPipeline",), checkpoint_check=CHECK, lora_target_modules=("to_q",),
        n_samples_per_prompt=2, rollout_microgroup_size=1,
    )]

def refuses(directory, model_index):
    return "not an Acme checkpoint (no acme.json)" if not (directory / "acme.json").is_file() else None

def breaks(directory, model_index):
    raise KeyError("boom")

def answers_badly(directory, model_index):
    return True
"""


@pytest.fixture
def host_with_acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], PluginHost]:
    """``host_with_acme(check)``: the installed plugins plus a real distribution
    ``acme-wan`` whose family ``acme_wan`` also lists WanPipeline, with
    ``checkpoint_check`` ``check`` (a function of its entry-point module, or None)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = list(metadata.entry_points(group=ENTRY_POINT_GROUP))

    def make(check: str | None) -> PluginHost:
        root = tmp_path / f"dist-{check}"
        ref = "None" if check is None else repr(f"acme_wan_acmewan:{check}")
        make_dist(root, "acme-wan", "1.0", {"acmewan": FAKE_FAMILY.replace("CHECK", ref)})
        monkeypatch.syspath_prepend(str(root))
        sys.modules.pop("acme_wan_acmewan", None)
        return PluginHost(strict=True, disabled=(), entry_points=[*installed, *entry_points_in(root)])

    yield make
    sys.modules.pop("acme_wan_acmewan", None)


def test_two_families_claiming_a_directory_is_an_error(tiny, neutral: Path, host_with_acme) -> None:
    host = host_with_acme(None)
    wan = copy_as(tiny("wan2_2"), neutral)
    message = (
        f"--hf-checkpoint {wan}: its WanPipeline (model_index.json) is claimed by several model families "
        "(acme_wan, wan2_2); pass --diffusion-model-family to choose one"
    )
    with pytest.raises(FamilyMatchError) as caught:
        match_family(wan, host.registries.model_family)
    assert str(caught.value) == message
    assert errors_of("--hf-checkpoint", str(wan), *REQUIRED, host=host) == [message]
    config = resolve_config(["--hf-checkpoint", str(wan), *REQUIRED, *FAMILY_REQUIRED["wan2_2"], *override("wan2_2")], host=host)
    assert config.model_family == "wan2_2"
    # A Wan 2.1-like directory: only the family that trains one transformer claims it.
    wan21 = wan21_like(copy_as(tiny("wan2_2"), neutral, "w21"))
    assert match_family(wan21, host.registries.model_family).name == "acme_wan"


def test_a_family_check_decides_with_its_reason(tiny, neutral: Path, host_with_acme) -> None:
    registry = host_with_acme("refuses").registries.model_family
    wan21 = wan21_like(copy_as(tiny("wan2_2"), neutral))
    with pytest.raises(FamilyMatchError) as caught:
        match_family(wan21, registry)
    assert str(caught.value) == (
        f"--hf-checkpoint {wan21}: its WanPipeline (model_index.json) is claimed by no installed model family "
        "(considered acme_wan: not an Acme checkpoint (no acme.json); wan2_2: model_index.json lists no "
        f"transformer_2, which it trains; wan2_2_ti2v: {NOT_TI2V}); pass --diffusion-model-family to choose one"
    )
    (wan21 / "acme.json").write_text("{}", encoding="utf-8")  # the control: now the check agrees
    assert match_family(wan21, registry).name == "acme_wan"


@pytest.mark.parametrize(
    "check, error",
    [
        ("breaks", "failed: KeyError: 'boom'"),
        ("answers_badly", "returned True; expected None (the directory is the family's) or a non-empty reason"),
    ],
)
def test_a_broken_check_names_its_family_and_plugin(tiny, neutral: Path, host_with_acme, check: str, error: str) -> None:
    registry = host_with_acme(check).registries.model_family
    wan = copy_as(tiny("wan2_2"), neutral)
    with pytest.raises(FamilyMatchError) as caught:
        match_family(wan, registry)
    assert str(caught.value) == (
        f"--hf-checkpoint {wan}: the acme_wan family's checkpoint_check acme_wan_acmewan:{check} (acme-wan 1.0) {error}"
    )


# -- the spec record -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"pipeline_classes": ["WanPipeline"]}, "pipeline_classes must be a tuple of class names"),
        ({"pipeline_classes": ("diffusers:WanPipeline",)}, "pipeline_classes must be a tuple of class names"),
        ({"pipeline_classes": ("WanPipeline",), "checkpoint_check": "check_it"}, "must look like 'package.module:function'"),
        ({"checkpoint_check": "pkg.mod:check"}, "checkpoint_check needs pipeline_classes"),
        ({"default_guidance_scale": -1.0}, "default_guidance_scale -1.0 must be a finite number >= 0"),
        ({"default_guidance_scale": 4.0, "supports_cfg_training": False}, "samples with CFG"),
        ({"lora_target_modules_by_pipeline": (("WanPipeline", ("q",)),)}, "whose classes are among pipeline_classes ()"),
        (
            {"pipeline_classes": ("WanPipeline",), "lora_target_modules_by_pipeline": (("WanPipeline", ()),)},
            "lora_target_modules_by_pipeline must be (pipeline class, tuple of strings) pairs",
        ),
        (
            {"pipeline_classes": ("WanPipeline",), "lora_target_modules_by_pipeline": {"WanPipeline": ("q",)}},
            "lora_target_modules_by_pipeline must be (pipeline class, tuple of strings) pairs",
        ),
        ({"lora_target_modules_for": "targets"}, "lora_target_modules_for 'targets' must look like 'package.module:function'"),
        ({"default_guidance_scale_by_pipeline": (("WanPipeline", 4.0),)}, "whose classes are among pipeline_classes ()"),
        (
            {"pipeline_classes": ("WanPipeline",), "default_guidance_scale_by_pipeline": (("WanPipeline", -1.0),)},
            "default_guidance_scale_by_pipeline must be (pipeline class, finite number >= 0) pairs",
        ),
        (
            {"pipeline_classes": ("WanPipeline",), "default_guidance_scale_by_pipeline": {"WanPipeline": 4.0}},
            "default_guidance_scale_by_pipeline must be (pipeline class, finite number >= 0) pairs",
        ),
    ],
)
def test_spec_fields_are_checked(fields: dict[str, Any], error: str) -> None:
    base = dict(
        name="f", ref="a:b", checkpoint_patterns=("f",), lora_target_modules=("q",), n_samples_per_prompt=2, rollout_microgroup_size=1
    )
    with pytest.raises(ValueError) as caught:
        ModelFamilySpec(**base, **fields)
    assert error in str(caught.value)
    ModelFamilySpec(**base)  # the control: the same record without the field is fine


def test_a_missing_path_is_a_problem_and_a_hub_id_is_not(tmp_path: Path) -> None:
    assert checkpoint_problem(tmp_path) is None
    assert checkpoint_problem("org/name") is None
    assert checkpoint_problem(tmp_path / "x") == f"{tmp_path / 'x'}: no such directory"


# -- a family's defaults -----------------------------------------------------------------------


def default_argv(family: str, directory: Path) -> list[str]:
    return ["--hf-checkpoint", str(directory), *REQUIRED, *FAMILY_REQUIRED.get(family, [])]


@pytest.mark.parametrize("family", INSTALLED)
@pytest.mark.exercises("--diffusion-guidance-scale")
def test_the_default_configuration_of_each_family_is_valid(family: str, tiny, neutral: Path) -> None:
    """Only the checkpoint and the required flags: the configuration resolves, a training
    run would start, and the requests it sends pass the family's own checks."""
    import torch

    from miles_core.conditioning_image import check_request_image
    from miles_core.family_checks import write_conditioning_image
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup
    from miles_core.training.evaluation import eval_requests

    directory = copy_as(tiny(family), neutral)
    config = resolve_config(default_argv(family, directory))
    assert config.model_family == family
    assert training_errors(config) == []
    if family in ("wan2_2", "wan2_2_i2v"):
        # WanPipeline's (and WanImageToVideoPipeline's) size (480 x 832) is fixed in its signature; the tiny transformer's
        # RoPE grid reaches 512 px (the miles-wan22 suite pins that refusal), a real one 16384.
        config = resolve_config([*default_argv(family, directory), "--diffusion-height", "64", "--diffusion-width", "64"])
    registration = get_host().registries.model_family.get(family)
    loaded = registration.load().from_pretrained(directory, dtype=torch.float32)
    # An image-to-video family's rows carry a conditioning image (required or optional).
    image = None
    if registration.spec.image_input != "none":
        image = str(write_conditioning_image(neutral / "first-frame.png", height=config.diffusion_height, width=config.diffusion_width))
    settings = RolloutSettings.from_config(config)
    rollout = settings.request("a red cube", Microgroup(0, 0, config.rollout_microgroup_size, 0), (0, 1), (0,), image=image)
    for request in (rollout, *eval_requests(config, [PromptRecord("a red cube", image=image)])):
        request.validate()
        check_request_image(loaded, request)
        params = loaded.resolve_params(request)
        assert params.guidance_scale == config.diffusion_guidance_scale


@pytest.mark.exercises("--diffusion-guidance-scale")
def test_a_family_without_cfg_training_defaults_to_no_guidance(tiny, neutral: Path) -> None:
    directory = copy_as(tiny("ltx"), neutral)
    config = resolve_config(default_argv("ltx", directory))
    assert (config.diffusion_guidance_scale, config.source("diffusion_guidance_scale")) == (1.0, Source.FAMILY)
    # The control: the flag's own default (4.0) is what the family refuses to train with,
    # and a value the user sets is kept and refused.
    assert config.flag("diffusion_guidance_scale").default == 4.0
    config = resolve_config([*default_argv("ltx", directory), "--diffusion-guidance-scale", "4"])
    assert (config.diffusion_guidance_scale, config.source("diffusion_guidance_scale")) == (4.0, Source.COMMAND_LINE)
    (error,) = training_errors(config)
    assert error.startswith("--diffusion-guidance-scale 4.0: the ltx family does not train with classifier-free guidance")
    # Families that train with CFG keep the flag's default.
    sd3 = resolve_config(default_argv("sd3", copy_as(tiny("sd3"), neutral, "other")))
    assert (sd3.diffusion_guidance_scale, sd3.source("diffusion_guidance_scale")) == (4.0, Source.DEFAULT)


def test_default_lora_targets_follow_the_pipeline_class(tmp_path: Path) -> None:
    from miles_core.family_match import default_lora_targets

    spec = ModelFamilySpec(
        name="f",
        ref="a:b",
        checkpoint_patterns=("f",),
        pipeline_classes=("OnePipeline", "TwoPipeline"),
        lora_target_modules=("q",),
        lora_target_modules_by_pipeline=(("TwoPipeline", ("k", "v")),),
        n_samples_per_prompt=2,
        rollout_microgroup_size=1,
    )
    for name in ("OnePipeline", "TwoPipeline"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps({"_class_name": name}), encoding="utf-8")
    assert default_lora_targets(spec, tmp_path / "TwoPipeline") == ("k", "v")
    assert default_lora_targets(spec, tmp_path / "OnePipeline") == ("q",)  # the control: another class
    assert default_lora_targets(spec, "acme/two-pipeline") == ("q",)  # a hub id: nothing to read yet
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model_index.json").write_text("{", encoding="utf-8")
    assert default_lora_targets(spec, tmp_path / "broken") == ("q",)  # the match reports the file
