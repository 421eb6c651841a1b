"""``--train-pipeline-config-path``: a family class of one's own, loaded by the engine and
the trainer instead of the registered family's, with the recipe defaults of the
registered family it derives from."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.factory import create_engine
from miles_core.errors import ConfigError
from miles_core.model_loading import load_family
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config

MIRRORED = "tests.custom_hooks_example.MirroredSD3"


def config_for(tiny_sd3, *extra):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "2",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            *extra,
        ]
    )


def pixels(config):
    engine = create_engine(config)
    (group,) = asyncio.run(
        generate_rollout(engine, RolloutSettings.from_config(config), 0, [PromptRecord("a red cube")], strategy_from_config(config))
    )
    return engine, torch.stack([s.pixels for s in group])


@pytest.mark.exercises("--train-pipeline-config-path")
def test_the_custom_family_class_is_what_engine_and_trainer_load(tiny_sd3):
    from tests.custom_hooks_example import MirroredSD3

    custom = config_for(tiny_sd3, "--train-pipeline-config-path", MIRRORED)
    plain = config_for(tiny_sd3)
    # The sd3 recipe defaults apply to a class derived from the sd3 family.
    assert custom.model_family is None and custom.components["model_family"].name == MIRRORED
    assert (custom.rollout_microgroup_size, custom.lora_target_modules) == (plain.rollout_microgroup_size, plain.lora_target_modules)
    engine, mirrored = pixels(custom)
    assert type(engine.family) is MirroredSD3 and type(load_family(custom)) is MirroredSD3
    _, reference = pixels(plain)
    assert torch.equal(mirrored, reference.flip(-1)) and not torch.equal(mirrored, reference)  # control


@pytest.mark.exercises("--train-pipeline-config-path")
def test_a_path_that_is_not_a_family_is_refused(tiny_sd3):
    with pytest.raises(ConfigError) as caught:
        config_for(tiny_sd3, "--train-pipeline-config-path", "tests.custom_hooks_example.NotAFamilyOfOurs")
    assert any(m.startswith("--train-pipeline-config-path tests.custom_hooks_example.NotAFamilyOfOurs") for m in caught.value.messages), (
        caught.value.messages
    )
