"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "Cosmos3-Nano",
            "cosmos3",
            "cosmos3.yaml",
            {"transformer": 15173669120},
            {"transformer": {"add_q_proj": 36, "add_k_proj": 36, "add_v_proj": 36, "to_add_out": 36}},
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
