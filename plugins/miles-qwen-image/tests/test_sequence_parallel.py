"""Sequence parallelism on the tiny Qwen-Image pipeline, through diffusers' own
context-parallel plan with the text padded to a multiple of the split
(:mod:`miles_qwen_image.sequence_parallel`: the test prompt has 13 text tokens): two gloo
ranks that split each sample's image and text tokens (Ulysses 2) compute one process's
loss and gradient; with every attention made local (the control) they do not. See
:mod:`miles_core.sequence_parallel_checks`."""

from __future__ import annotations

import pytest

from miles_core import sequence_parallel_checks as checks
from miles_qwen_image.family import QwenImageFamily

FLAGS = ("--diffusion-height", "32", "--diffusion-width", "32")
SP2 = ("--actor-num-nodes", "2", "--sequence-parallel-size", "2", "--ulysses-degree", "2")
GRADIENT_RTOL = 1e-5
"""Relative to the largest gradient element; measured 1.8e-7 (fp32, gloo), the control 0.66."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tiny = QwenImageFamily.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny")
    return checks.split_against_one_process(tiny, tmp_path_factory.mktemp("sp"), FLAGS, SP2, family="qwen_image")


@pytest.mark.exercises("--sequence-parallel-size", "--ulysses-degree")
def test_ulysses_2_equals_one_process(runs: dict) -> None:
    reference = runs["reference"]
    for rank, result in enumerate(runs["sp2"]):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
        assert result["dp_rank"] == 0 and result["mesh"] == (2,)
        assert checks.gradient_error(result["gradients"], reference["gradients"]) <= GRADIENT_RTOL
        assert result["metrics"]["train/loss"] == pytest.approx(reference["metrics"]["train/loss"], abs=1e-6)


def test_local_attention_makes_the_comparison_fail(runs: dict) -> None:
    for result in runs["local_attention"]:
        assert "crash" not in result, result.get("crash")
        assert checks.gradient_error(result["gradients"], runs["reference"]["gradients"]) > 1000 * GRADIENT_RTOL
