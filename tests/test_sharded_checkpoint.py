"""Checkpoint rotation (``--save-keep-last``) and the sharded format's one-process side:
DCP shards written and read without a process group, and DCP's pickled metadata read
without executing code. The two-rank saves, reloads and continuations are in
``tests/test_fsdp.py`` (the shared two-rank spawn)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import miles_core.training.checkpoint as checkpoint
from miles_core.config.resolve import resolve_config
from miles_core.errors import CheckpointError, ConfigError
from miles_core.training.checkpoint import available_iterations, latest_iteration, rotate_checkpoints
from miles_core.training.run_state import restore_run_state, save_run_state
from miles_core.training.sharded_checkpoint import SHARD_DIR, read_metadata, read_shards, write_shards
from tests.test_flags_run import SD35, TinyTrainer


def _config(root: Path, *flags: str):
    return resolve_config([*SD35, "--save", str(root), *flags])


# -- rotation --------------------------------------------------------------------------------


@pytest.mark.exercises("--save-keep-last")
def test_save_keep_last_keeps_the_newest_and_never_the_resumed_one(tmp_path):
    root = tmp_path / "ckpt"
    trainer = TinyTrainer(seed=0)
    for rollout_id in range(4):
        trainer.step()
        save_run_state(_config(root, "--save-keep-last", "2"), trainer, rollout_id)
    assert available_iterations(root) == [2, 3] and latest_iteration(root) == 3

    # Resumed from 2 into the same directory: 2 stays whatever comes after it.
    config = _config(root, "--save-keep-last", "2", "--load", str(root), "--ckpt-step", "2")
    resumed = TinyTrainer(seed=1)
    assert restore_run_state(config, resumed) == 3
    for rollout_id in (3, 4, 5):
        resumed.step()
        save_run_state(config, resumed, rollout_id, resumed_from=2)
    assert available_iterations(root) == [2, 4, 5] and latest_iteration(root) == 5
    # Control: without the protection the same rotation deletes it.
    assert rotate_checkpoints(root, 2, newest=5) == [2]
    assert available_iterations(root) == [4, 5]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]


def test_rotation_leaves_later_checkpoints_and_runs_only_after_the_publication(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    trainer = TinyTrainer(seed=0)
    for rollout_id in range(6):  # an earlier run that went to 5, keeping everything
        trainer.step()
        save_run_state(_config(root), trainer, rollout_id)
    # Resumed from 2 with --save-keep-last 1: 3 replaces the old 3, 0 and 1 go, 2 is the
    # resumed one, and 4 and 5 (beyond the new latest) are left alone.
    config = _config(root, "--save-keep-last", "1", "--load", str(root), "--ckpt-step", "2")
    save_run_state(config, trainer, 3, resumed_from=2)
    assert available_iterations(root) == [2, 3, 4, 5] and latest_iteration(root) == 3

    # A save that fails deletes nothing.
    def failing(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_checkpoint", failing)
    with pytest.raises(OSError):
        save_run_state(_config(root, "--save-keep-last", "1"), trainer, 6)
    assert available_iterations(root) == [2, 3, 4, 5]
    monkeypatch.undo()

    # The debris of an interrupted deletion is not a checkpoint and goes on the next rotation.
    (root / ".iter_0000002.del-0000").mkdir()
    assert rotate_checkpoints(root, 1, newest=3, protect=[2]) == []
    assert not (root / ".iter_0000002.del-0000").exists()


def test_save_keep_last_requires_save():
    with pytest.raises(ConfigError) as info:
        resolve_config([*SD35, "--save-keep-last", "2"])
    assert str(info.value) == "--save-keep-last requires --save (the checkpoints it rotates)"


# -- DCP shards in one process ---------------------------------------------------------------


class Linear:
    """What the sharded save and load use of a Trainer, around one linear layer."""

    def __init__(self, seed: int, lr: float = 0.1) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self.ema = None

    def named_trainable(self) -> dict[str, torch.Tensor]:
        return {f"transformer.{name}": p for name, p in self.module.named_parameters()}

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.module(torch.ones(1, 3)).square().sum().backward()
        self.optimizer.step()


def test_shards_round_trip_without_a_process_group(tmp_path):
    saver = Linear(seed=0)
    saver.step()
    part = write_shards(saver, tmp_path / SHARD_DIR)
    assert part.world_size == 1 and part.model_keys == ["transformer.weight", "transformer.bias"]
    assert set(part.files) == {f"{SHARD_DIR}/.metadata", f"{SHARD_DIR}/__0_0.distcp"}

    loader = Linear(seed=1, lr=0.5)
    assert not torch.equal(loader.module.weight, saver.module.weight)  # control
    read_shards(loader, tmp_path / SHARD_DIR, part)
    assert torch.equal(loader.module.weight, saver.module.weight) and torch.equal(loader.module.bias, saver.module.bias)
    assert loader.optimizer.param_groups[0]["lr"] == 0.1  # the saved hyperparameters
    saved, loaded = saver.optimizer.state_dict(), loader.optimizer.state_dict()
    for index, entry in saved["state"].items():
        assert all(torch.equal(loaded["state"][index][key], value) for key, value in entry.items())
    # The same next step, bit for bit.
    saver.step()
    loader.step()
    assert torch.equal(loader.module.weight, saver.module.weight)


def test_dcp_metadata_is_read_without_executing_code(tmp_path):
    saver = Linear(seed=0)
    part = write_shards(saver, tmp_path / SHARD_DIR, optimizer=False)
    assert "transformer.weight" in {k.removeprefix("model.") for k in read_metadata(tmp_path / SHARD_DIR).state_dict_metadata}

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    metadata = tmp_path / SHARD_DIR / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError) as info:
        read_metadata(tmp_path / SHARD_DIR)
    assert str(info.value) == f"{metadata}: not DCP metadata (UnpicklingError: refusing posix.system, which DCP metadata does not contain)"
    assert not (tmp_path / "pwned").exists()
    # The manifest catches the replaced file before the unpickler is reached.
    with pytest.raises(CheckpointError, match=r"\.metadata: \d+ bytes, the manifest records \d+ \(truncated or replaced\)$"):
        read_shards(Linear(seed=1), tmp_path / SHARD_DIR, part)
