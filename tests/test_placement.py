"""The placement of a ``--use-ray`` run, from the cluster flags alone (no Ray needed):
bundles per role, colocation shares, CPUs standing in for GPUs, and one-line errors for
placements that cannot exist."""

from __future__ import annotations

import pytest

from miles_core.cluster.placement import plan_placement
from miles_core.config.resolve import resolve_config
from miles_core.errors import PlacementError

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
    "--use-ray",
]


def config(*extra: str):
    return resolve_config([*BASE, *extra])


@pytest.mark.exercises("--actor-num-nodes", "--actor-num-gpus-per-node")
def test_one_bundle_per_training_rank_then_the_reward_worker():
    plan = plan_placement(config("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"), gpus=False)
    assert plan.train == [0, 1, 2, 3] and plan.engines == [] and plan.reward == 4
    # CPUs stand in for GPUs on a machine without them; the reward worker takes a CPU.
    assert plan.bundles == [{"CPU": 1.0}] * 5 and plan.device == "CPU" and plan.cpus == 5
    gpu = plan_placement(config("--actor-num-gpus-per-node", "2"), gpus=True, reward_worker=False)
    assert gpu.bundles == [{"GPU": 1.0, "CPU": 1.0}] * 2 and gpu.reward is None and gpu.device == "GPU"
    assert "CPUs stand in for GPUs" in plan.describe() and "CPUs stand in" not in gpu.describe()


@pytest.mark.exercises("--rollout-num-gpus-per-engine", "--rollout-num-gpus")
def test_engines_take_their_own_bundles_and_must_match_the_rollout_gpus():
    # sglang-diffusion servers take several devices each (a serve-engine server is refused them).
    sglang = ("--rollout-engine", "sglang")
    plan = plan_placement(config(*sglang, "--rollout-num-gpus-per-engine", "2"), gpus=True, engines=2)
    assert plan.train == [0] and plan.engines == [[1, 2], [3, 4]] and plan.reward == 5
    assert plan.bundles[1:5] == [{"GPU": 1.0, "CPU": 1.0}] * 4 and plan.bundles[5] == {"CPU": 1.0}
    same = plan_placement(config(*sglang, "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "4"), gpus=True, engines=2)
    assert same.engines == plan.engines
    with pytest.raises(PlacementError) as info:
        plan_placement(config(*sglang, "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "3"), gpus=True, engines=2)
    assert str(info.value) == "--rollout-num-gpus 3 does not match 2 engine(s) x --rollout-num-gpus-per-engine 2 = 4"


@pytest.mark.exercises("--colocate", "--colocate-reward")
def test_colocated_engines_and_reward_share_the_training_devices():
    plan = plan_placement(config("--actor-num-gpus-per-node", "2", "--colocate"), gpus=True, engines=2)
    assert len(plan.bundles) == 3 and plan.engines == [[0], [1]] and plan.reward == 2
    assert (plan.train_share, plan.engine_share) == (0.7, 0.25)
    shared = plan_placement(config("--actor-num-gpus-per-node", "2", "--colocate", "--colocate-reward"), gpus=True, engines=2)
    assert len(shared.bundles) == 2 and shared.reward == 0 and shared.reward_share == 0.05
    # The shares of one device add up to at most one.
    assert shared.train_share + shared.engine_share + shared.reward_share <= 1.0
    with pytest.raises(PlacementError, match=r"--colocate: 3 engine\(s\) x --rollout-num-gpus-per-engine 1 = 3 devices"):
        plan_placement(config("--actor-num-gpus-per-node", "2", "--colocate"), gpus=True, engines=3)


@pytest.mark.exercises("--num-gpus-per-node")
def test_a_node_cannot_hold_more_devices_than_it_has():
    with pytest.raises(PlacementError) as info:
        plan_placement(config("--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "2"), gpus=True)
    assert str(info.value).startswith("--actor-num-gpus-per-node 4 exceeds --num-gpus-per-node 2")
    with pytest.raises(PlacementError, match="--rollout-num-gpus-per-engine 4 exceeds --num-gpus-per-node 2"):
        plan_placement(
            config("--rollout-engine", "sglang", "--rollout-num-gpus-per-engine", "4", "--num-gpus-per-node", "2"), gpus=True, engines=1
        )
    assert plan_placement(config("--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2"), gpus=True).train == [0, 1]


def test_placement_flags_are_not_noted_as_hardware_only_under_ray():
    """Under --use-ray they size the placement group; without Ray a one-process run notes them."""
    argv = ["--rollout-engine", "sglang", "--rollout-num-gpus-per-engine", "2", "--colocate"]
    without = resolve_config([*BASE[:-1], *argv])
    assert any(note.startswith("--colocate: with the hardware it needs") for note in _notes(without))
    assert not any("--colocate" in note for note in _notes(config(*argv)))


def _notes(config) -> list[str]:
    from miles_core.config.availability import hardware_notes

    return hardware_notes(config)
