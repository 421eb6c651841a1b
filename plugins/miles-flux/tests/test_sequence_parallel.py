"""Sequence parallelism on the tiny FLUX.1 pipeline, through diffusers' own context-parallel
plan (``FluxTransformer2DModel._cp_plan``, behind :mod:`miles_flux.sequence_parallel`'s
token-count check): two gloo ranks that split each sample's image tokens, its 512 text
tokens and their position ids (Ulysses 2) compute one process's loss and gradient; with
every attention made local (the control) they do not. A text length the split does not
divide is refused with the setting to change. See :mod:`miles_core.sequence_parallel_checks`."""

from __future__ import annotations

import pytest
import torch

from miles_core import sequence_parallel_checks as checks
from miles_flux.family import FluxFamily
from miles_flux.sequence_parallel import TokenCountCheck

FLAGS = ("--diffusion-height", "32", "--diffusion-width", "32")
SP2 = ("--actor-num-nodes", "2", "--sequence-parallel-size", "2", "--ulysses-degree", "2")
GRADIENT_RTOL = 1e-5
"""Relative to the largest gradient element; measured 1.1e-7 (fp32, gloo), the control 6.9e-3
(the 512 mostly-padding text tokens dominate every attention, so losing the other rank's
half moves the gradient less than for the other families)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tiny = FluxFamily.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny")
    return checks.split_against_one_process(tiny, tmp_path_factory.mktemp("sp"), FLAGS, SP2, family="flux")


@pytest.mark.exercises("--sequence-parallel-size", "--ulysses-degree")
def test_ulysses_2_equals_one_process(runs: dict) -> None:
    reference = runs["reference"]
    for rank, result in enumerate(runs["sp2"]):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
        assert result["dp_rank"] == 0 and result["mesh"] == (2,)
        error = checks.gradient_error(result["gradients"], reference["gradients"])
        print(f"rank {rank}: gradient error {error:.2e}")
        assert error <= GRADIENT_RTOL
        assert result["metrics"]["train/loss"] == pytest.approx(reference["metrics"]["train/loss"], abs=1e-6)


def test_local_attention_makes_the_comparison_fail(runs: dict) -> None:
    for result in runs["local_attention"]:
        assert "crash" not in result, result.get("crash")
        assert checks.gradient_error(result["gradients"], runs["reference"]["gradients"]) > 100 * GRADIENT_RTOL


def test_token_counts_the_split_does_not_divide_are_refused() -> None:
    check = TokenCountCheck(2)
    fine = {"hidden_states": torch.zeros(1, 16, 4), "encoder_hidden_states": torch.zeros(1, 512, 4)}
    assert check(torch.nn.Identity(), (), fine) is None
    with pytest.raises(ValueError, match=r"^--sequence-parallel-size 2: the prompt's 13 text tokens .*max_sequence_length"):
        check(torch.nn.Identity(), (), {**fine, "encoder_hidden_states": torch.zeros(1, 13, 4)})
    with pytest.raises(ValueError, match=r"^--sequence-parallel-size 2: the 9 packed image tokens .*--diffusion-height"):
        check(torch.nn.Identity(), (), {**fine, "hidden_states": torch.zeros(1, 9, 4)})
