"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "Qwen-Image",
            "qwen_image",
            "qwen_image.yaml",
            {"transformer": 20430401088},
            {
                "transformer": {
                    "to_q": 60,
                    "to_k": 60,
                    "to_v": 60,
                    "to_out.0": 60,
                    "add_q_proj": 60,
                    "add_k_proj": 60,
                    "add_v_proj": 60,
                    "to_add_out": 60,
                    "img_mlp.net.0.proj": 60,
                    "img_mlp.net.2": 60,
                    "txt_mlp.net.0.proj": 60,
                    "txt_mlp.net.2": 60,
                }
            },
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
