"""The reference's PickScore worker flags, ``--pickscore-num-workers`` and
``--pickscore-num-gpus-per-worker``: other names (``Flag.alias_of``) for the core's
``--reward-num-workers`` and ``--reward-num-gpus-per-worker``, which size the reward
workers of a ``--use-ray`` run; and the unset GPU count, 1 for the rewards that run a
model (``RewardSpec.uses_gpu``), 0 for the weight-free ones."""

from __future__ import annotations

import pytest

from miles_core.cluster.placement import plan_placement
from miles_core.config.model import Source
from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
]
PICKSCORE = ("--rm-type", "pickscore", "--pickscore-model-path", "org/model", "--pickscore-processor-path", "org/processor")


def resolve(*extra: str):
    return resolve_config([*BASE, *extra])


@pytest.mark.exercises("--pickscore-num-workers", "--pickscore-num-gpus-per-worker")
def test_the_pickscore_flags_set_the_reward_worker_flags(tmp_path):
    config = resolve(*PICKSCORE, "--use-ray", "--pickscore-num-workers", "3", "--pickscore-num-gpus-per-worker", "0.5")
    assert (config.reward_num_workers, config.reward_num_gpus_per_worker) == (3, 0.5)
    assert (config.pickscore_num_workers, config.pickscore_num_gpus_per_worker) == (3, 0.5)
    assert config.source("reward_num_workers") is Source.COMMAND_LINE
    plan = plan_placement(config, gpus=True)
    assert plan.rewards == [1, 2, 3] and plan.bundles[1:] == [{"GPU": 0.5, "CPU": 1.0}] * 3
    # Unset, an alias holds the value of the flag it names; the same value twice is no conflict.
    config = resolve("--reward-num-workers", "2", "--pickscore-num-workers", "2")
    assert (config.pickscore_num_workers, config.pickscore_num_gpus_per_worker) == (2, 0.0)
    # A YAML key of the alias works as the flag does.
    yaml = tmp_path / "workers.yaml"
    yaml.write_text("pickscore_num_workers: 4\n")
    assert resolve("--custom-config-path", str(yaml)).reward_num_workers == 4
    # Without Ray the note names the flag that was given.
    (note,) = [n for n in resolve("--pickscore-num-workers", "2").notes if "reward workers" in n]
    assert note.startswith(
        "--pickscore-num-workers 2: with the hardware it needs, it starts that many reward workers (under --use-ray), serve-reward processes"
    )


def test_an_alias_and_its_flag_with_different_values_is_one_line_naming_both():
    with pytest.raises(ConfigError) as info:
        resolve("--pickscore-num-workers", "3", "--reward-num-workers", "2")
    assert str(info.value) == (
        "--pickscore-num-workers 3 and --reward-num-workers 2 disagree: --pickscore-num-workers is another name for "
        "--reward-num-workers; give one of them"
    )
    assert info.value.exit_code == 2
    # The alias's own range, checked once.
    with pytest.raises(ConfigError) as info:
        resolve("--pickscore-num-gpus-per-worker", "-1")
    assert str(info.value) == "--pickscore-num-gpus-per-worker -1.0: must not be negative"


def test_a_model_reward_gets_a_gpu_per_worker_unless_told_otherwise():
    assert resolve(*PICKSCORE).reward_num_gpus_per_worker == 1.0
    mixture = ("--reward-weights", '{"brightness": 1, "pickscore": 1}', *PICKSCORE[2:])
    assert resolve(*mixture).reward_num_gpus_per_worker == 1.0
    assert resolve("--rm-type", "jpeg_compressibility").reward_num_gpus_per_worker == 0.0
    assert resolve(*PICKSCORE, "--pickscore-num-gpus-per-worker", "0").reward_num_gpus_per_worker == 0.0
