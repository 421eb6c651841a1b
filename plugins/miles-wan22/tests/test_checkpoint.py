"""Which WanPipeline directories the wan2_2 family claims (its ``checkpoint_check``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from miles_core import testing
from miles_core.errors import FamilyMatchError
from miles_core.family_match import match_family, read_model_index
from miles_core.plugin_manager import get_host
from miles_wan22.checkpoint import two_expert_wan
from miles_wan22.family import Wan22Family


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(Wan22Family.build_tiny_pipeline(tmp_path_factory.mktemp("built") / "base", seed=0))


@pytest.fixture
def copy(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh copy of the tiny pipeline under a neutral name."""
    return Path(shutil.copytree(built, tmp_path_factory.mktemp("neutral") / "my-finetune"))


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_the_tiny_a14b_pipeline_is_claimed(copy: Path) -> None:
    assert two_expert_wan(copy, read_model_index(copy)) is None
    testing.assert_import_is_light("miles_wan22.checkpoint")


NOT_TI2V = "expand_timesteps is not set (Wan 2.1 or Wan 2.2 A14B; TI2V-5B gives every latent token its own timestep)"
TWO_EXPERTS = "it lists transformer_2 or a boundary_ratio (a two-expert pipeline; TI2V-5B has one transformer)"
"""The wan2_2_ti2v family's reasons (its own check) for declining these directories."""


@pytest.mark.parametrize(
    "index_changes, expert_changes, reason, ti2v_reason",
    [
        (
            {"boundary_ratio": None},
            {},
            "boundary_ratio None (a two-expert Wan 2.2 pipeline switches experts at a ratio in (0, 1))",
            NOT_TI2V,
        ),
        ({"boundary_ratio": 1.5}, {}, "boundary_ratio 1.5 (a two-expert Wan 2.2 pipeline switches experts at a ratio in (0, 1))", NOT_TI2V),
        ({"expand_timesteps": True}, {}, "expand_timesteps is set (Wan 2.2 TI2V-5B, a single-expert pipeline)", TWO_EXPERTS),
        ({}, {"in_channels": 48}, "the experts' in_channels differ (transformer: [16], transformer_2: [48])", NOT_TI2V),
    ],
)
def test_other_wan_pipelines_are_refused_with_the_reason(
    copy: Path, index_changes: dict[str, Any], expert_changes: dict[str, Any], reason: str, ti2v_reason: str
) -> None:
    edit_json(copy / "model_index.json", **index_changes)
    edit_json(copy / "transformer_2" / "config.json", **expert_changes)
    assert two_expert_wan(copy, read_model_index(copy)) == reason
    with pytest.raises(FamilyMatchError) as caught:
        match_family(copy, get_host().registries.model_family)
    assert str(caught.value) == (
        f"--hf-checkpoint {copy}: its WanPipeline (model_index.json) is claimed by no installed model family "
        f"(considered wan2_2: {reason}; wan2_2_ti2v: {ti2v_reason}); pass --diffusion-model-family to choose one"
    )


def test_a_single_transformer_wan_is_not_this_family(copy: Path) -> None:
    # Wan 2.1 and TI2V-5B: one transformer; the core refuses before the check runs.
    shutil.rmtree(copy / "transformer_2")
    edit_json(copy / "model_index.json", transformer_2=[None, None], boundary_ratio=None)
    with pytest.raises(FamilyMatchError, match="considered wan2_2: model_index.json lists no transformer_2, which it trains"):
        match_family(copy, get_host().registries.model_family)
