"""Sequence parallelism on the tiny Wan 2.2 pipeline (both experts trained), through
diffusers' own context-parallel plan for ``WanTransformer3DModel``: two gloo ranks that
split each sample's video tokens (Ulysses 2) compute one process's loss and gradient;
with every attention made local (the control) they do not. See
:mod:`miles_core.sequence_parallel_checks`."""

from __future__ import annotations

import pytest

from miles_core import sequence_parallel_checks as checks
from miles_wan22.family import Wan22Family

FLAGS = (
    "--diffusion-height",
    "32",
    "--diffusion-width",
    "32",
    "--diffusion-output-num-frames",
    "5",
    "--diffusion-guidance-scale",
    "1",
    "--diffusion-guidance-scale-2",
    "1",
    "--update-weight-target-module",
    "transformer,transformer_2",
)
SP2 = ("--actor-num-nodes", "2", "--sequence-parallel-size", "2")
GRADIENT_RTOL = 1e-5
"""Relative to the largest gradient element; measured 9.3e-7 (fp32, gloo), the control 0.81."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tiny = Wan22Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-tiny")
    return checks.split_against_one_process(tiny, tmp_path_factory.mktemp("sp"), FLAGS, SP2)


@pytest.mark.exercises("--sequence-parallel-size", "--ulysses-degree")
def test_ulysses_2_equals_one_process(runs: dict) -> None:
    reference = runs["reference"]
    for rank, result in enumerate(runs["sp2"]):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
        assert result["dp_rank"] == 0 and result["mesh"] == (2,)
        # Both experts' gradients (one SDE step each sample, at the high-noise expert here).
        assert checks.gradient_error(result["gradients"], reference["gradients"]) <= GRADIENT_RTOL
        assert result["metrics"]["train/loss"] == pytest.approx(reference["metrics"]["train/loss"], abs=1e-6)


def test_local_attention_makes_the_comparison_fail(runs: dict) -> None:
    for result in runs["local_attention"]:
        assert "crash" not in result, result.get("crash")
        assert checks.gradient_error(result["gradients"], runs["reference"]["gradients"]) > 1000 * GRADIENT_RTOL
