"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "Wan2.2-T2V-A14B-Diffusers",
            "wan2_2",
            "wan22.yaml",
            {"transformer": 14288491584, "transformer_2": 14288491584},
            {
                "transformer": {"to_q": 80, "to_k": 80, "to_v": 80, "to_out.0": 80},
                "transformer_2": {"to_q": 80, "to_k": 80, "to_v": 80, "to_out.0": 80},
            },
        ),
        (
            "Wan2.2-I2V-A14B-Diffusers",
            "wan2_2_i2v",
            "wan22_i2v.yaml",
            {"transformer": 14288901184, "transformer_2": 14288901184},
            {
                "transformer": {"to_q": 80, "to_k": 80, "to_v": 80, "to_out.0": 80},
                "transformer_2": {"to_q": 80, "to_k": 80, "to_v": 80, "to_out.0": 80},
            },
        ),
        (
            "Wan2.2-TI2V-5B-Diffusers",
            "wan2_2_ti2v",
            "wan22_ti2v.yaml",
            {"transformer": 4999787712},
            {"transformer": {"to_q": 60, "to_k": 60, "to_v": 60, "to_out.0": 60}},
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
