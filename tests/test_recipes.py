"""Every recipe under ``recipes/`` loads through the validator, for its family: the
configuration resolves with a checkpoint name of that family and ``train`` would accept
it (no training error). A recipe names its family with a ``diffusion_model_family`` key,
or in its comments (``family `sd3```, ``family: sd3``), or by its file name (``wan22.yaml``
for ``wan2_2``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from miles_core.config.resolve import match_family, resolve_config, training_errors
from miles_core.errors import ConfigError
from miles_core.plugin_manager import get_host

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
COMMENT_FAMILY = re.compile(r"\bfamily\s*[:=]?\s*`?([A-Za-z0-9_.-]+)`?")


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def recipe_family(path: Path) -> str:
    """The family a recipe is for: its ``diffusion_model_family`` key, else the first
    registered family named in a comment, else the one its file name spells."""
    registry = get_host().registries.model_family
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    for key in ("diffusion_model_family", "diffusion-model-family"):
        if key in data:
            return str(data[key])
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    for match in COMMENT_FAMILY.finditer(comments):
        if match.group(1) in registry:
            return match.group(1)
    by_stem = [name for name in registry.names() if _key(name) == _key(path.stem)]
    assert by_stem, (
        f"{path.name}: names no family (set diffusion_model_family, or say `family NAME` in a comment; "
        f"installed: {', '.join(registry.names())})"
    )
    return by_stem[0]


def checkpoint_for(family: str) -> str:
    """A hub-style checkpoint name that the family's name patterns match (and no other's)."""
    registry = get_host().registries.model_family
    pattern = registry.get(family).spec.checkpoint_patterns[0]
    name = "org/" + re.sub(r"[*?\[\]]", "x", pattern) + "-model"
    assert match_family(name, registry).name == family, name
    return name


def validate_recipe(path: Path, *extra: str) -> object:
    """Resolve the recipe as ``miles-core train --hf-checkpoint NAME --custom-config-path
    PATH`` would (``--rollout-batch-size 1`` on the command line, for recipes that leave
    it to the user) and check the training rules; the resolved configuration."""
    family = recipe_family(path)
    config = resolve_config(
        [
            "--hf-checkpoint",
            checkpoint_for(family),
            "--rollout-batch-size",
            "1",
            "--custom-config-path",
            str(path),
            *extra,
        ]
    )
    assert config.model_family == family, f"{path.name}: resolved as {config.model_family}, written for {family}"
    errors = training_errors(config)
    assert errors == [], f"{path.name}: " + "; ".join(errors)
    return config


def recipe_paths() -> list[Path]:
    return sorted(RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("path", recipe_paths(), ids=lambda p: p.name)
def test_recipe_loads_through_the_validator(path: Path) -> None:
    config = validate_recipe(path)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict) and data, f"{path.name}: no keys"
    # Every key took effect (the file, not a default or the family, set it).
    for key in data:
        dest = str(key).replace("-", "_")
        assert config.source(dest).name == "CONFIG_FILE", (key, config.source(dest))
    assert "GPU" in path.read_text(encoding="utf-8"), f"{path.name}: say in a comment which parts need a GPU"


def test_every_family_has_a_recipe() -> None:
    families = {recipe_family(path) for path in recipe_paths()}
    missing = sorted(set(get_host().registries.model_family.names()) - families)
    assert not missing, f"no recipe under recipes/ for {', '.join(missing)}"


def test_the_sd3_recipe_has_the_published_values() -> None:
    config = validate_recipe(RECIPES / "sd3.yaml")
    assert (config.n_samples_per_prompt, config.rollout_microgroup_size) == (16, 8)
    assert (config.diffusion_num_steps, config.diffusion_num_sde_steps, config.diffusion_guidance_scale) == (10, 9, 4.5)
    assert (config.diffusion_noise_level, config.diffusion_clip_range, config.diffusion_kl_beta) == (0.7, 1e-4, 0.04)
    assert (config.lora_rank, config.lora_alpha, config.lr) == (32, 64, 3e-4)


def test_a_recipe_with_a_bad_key_or_value_fails(tmp_path: Path) -> None:
    """Controls: the validation above can fail."""
    text = (RECIPES / "sd3.yaml").read_text(encoding="utf-8")
    bad = tmp_path / "sd3.yaml"
    bad.write_text(text + "diffusion_clip_rnage: 1.0e-5\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unknown key 'diffusion_clip_rnage' \(did you mean 'diffusion_clip_range'\?\)"):
        validate_recipe(bad)
    bad.write_text(text + "diffusion_num_steps: ten\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"key 'diffusion_num_steps'"):
        validate_recipe(bad)
    # Valid keys that cannot train: the training rules are checked too.
    bad.write_text(text.replace("diffusion_num_sde_steps: 9", "diffusion_num_sde_steps: 0"), encoding="utf-8")
    with pytest.raises(AssertionError, match="--diffusion-num-sde-steps is 0"):
        validate_recipe(bad)
    # A recipe that names no family.
    nameless = tmp_path / "mystery.yaml"
    nameless.write_text("lr: 1.0e-4\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="names no family"):
        recipe_family(nameless)
