"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "LTX-2.3",
            "ltx",
            "ltx.yaml",
            {"transformer": 18988838144},
            {"transformer": {"to_q": 288, "to_k": 288, "to_v": 288, "to_out.0": 288, "net.0.proj": 96, "net.2": 96}},
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
