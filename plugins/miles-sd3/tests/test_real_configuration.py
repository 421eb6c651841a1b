"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "stable-diffusion-3.5-medium",
            "sd3",
            "sd3.yaml",
            {"transformer": 2243171520},
            {
                "transformer": {
                    "attn.to_q": 24,
                    "attn.to_k": 24,
                    "attn.to_v": 24,
                    "attn.to_out.0": 24,
                    "attn.add_q_proj": 24,
                    "attn.add_k_proj": 24,
                    "attn.add_v_proj": 24,
                    "attn.to_add_out": 23,
                }
            },
        ),
        (
            "stable-diffusion-3.5-large",
            "sd3",
            "sd3.yaml",
            {"transformer": 8056627520},
            {
                "transformer": {
                    "attn.to_q": 38,
                    "attn.to_k": 38,
                    "attn.to_v": 38,
                    "attn.to_out.0": 38,
                    "attn.add_q_proj": 38,
                    "attn.add_k_proj": 38,
                    "attn.add_v_proj": 38,
                    "attn.to_add_out": 37,
                }
            },
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
