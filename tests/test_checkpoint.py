"""Checkpoints: round trips, bit-identical AdamW continuation, crash safety, clear errors,
and a pickle-free layout."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_core.errors import CheckpointError
from miles_core.training import checkpoint as ckpt
from miles_core.training.checkpoint import (
    available_iterations,
    capture_rng,
    latest_iteration,
    load_checkpoint,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
    restore_rng,
    save_checkpoint,
)
from miles_core.training.ema import EMA

REPO = Path(__file__).resolve().parents[1]


def _model_state(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "transformer": {
            "blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 8, generator=g),
            "blocks.0.attn.to_q.lora_B.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            # A non-contiguous view: saved as a full contiguous tensor.
            "proj.weight": torch.randn(6, 5, generator=g).t(),
        },
        "text_encoder": {"embed.weight": torch.randn(3, 2, generator=g).to(torch.float16)},
    }


def _trained_adamw(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    for i in range(steps):
        _step(model, optimizer, i)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(11, 5, generator=g), torch.randn(11, 3, generator=g)
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _save(root: Path, rollout_id: int, *, seed: int = 0, optimizer_state=None, extra=None) -> Path:
    return save_checkpoint(
        root,
        rollout_id,
        model_state=_model_state(seed),
        optimizer_state=optimizer_state,
        rng_state=capture_rng(),
        extra=extra if extra is not None else {"optimizer_steps": rollout_id * 2, "use_lora": True},
    )


def _assert_model_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensors in expected.items():
        assert loaded[name].keys() == tensors.keys()
        for key, t in tensors.items():
            assert loaded[name][key].dtype == t.dtype
            assert torch.equal(loaded[name][key], t), (name, key)


# ------------------------------------------------------------------ round trips
def test_round_trip_model_optimizer_rng_and_extra(tmp_path: Path) -> None:
    _, optimizer = _trained_adamw()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    rng = capture_rng()
    expected = (torch.randn(5), random.random(), np.random.rand(3))
    ema = EMA({"w": torch.randn(3, 3)})
    path = save_checkpoint(
        tmp_path,
        12,
        model_state=_model_state(),
        optimizer_state=optimizer.state_dict(),
        rng_state=rng,
        extra={
            "optimizer_steps": 24,
            "use_lora": True,
            "components": ["transformer"],
            "ema": ema.state_dict(),
            "lr": float("inf"),
            "pair": (1, 2),
        },
    )
    assert path == tmp_path / "iter_0000012"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    assert latest_iteration(tmp_path) == 12

    # Move every generator on, then restore from the loaded checkpoint.
    torch.randn(100), random.random(), np.random.rand(10)
    loaded = load_checkpoint(tmp_path)
    assert loaded.rollout_id == 12
    _assert_model_equal(loaded.model_state, _model_state())
    assert loaded.model_state["transformer"]["proj.weight"].is_contiguous()
    restore_rng(loaded.rng_state)
    assert torch.equal(torch.randn(5), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])

    assert loaded.extra["optimizer_steps"] == 24 and loaded.extra["use_lora"] is True
    assert loaded.extra["lr"] == float("inf") and loaded.extra["pair"] == (1, 2)
    restored = EMA({"w": torch.zeros(3, 3)})
    restored.load_state_dict(loaded.extra["ema"])
    assert torch.equal(restored.shadow["w"], ema.shadow["w"])

    sd = optimizer.state_dict()
    assert loaded.optimizer_state["param_groups"] == sd["param_groups"]
    assert loaded.optimizer_state["state"].keys() == sd["state"].keys()
    for index, state in sd["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded.optimizer_state["state"][index][key], value)
            assert loaded.optimizer_state["state"][index][key].dtype == value.dtype


def test_optimizer_state_flattens_to_named_tensors_and_json(tmp_path: Path) -> None:
    import json

    _, optimizer = _trained_adamw()
    tensors, structure = optimizer_state_to_tensors(optimizer.state_dict())
    assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step", "state.3.exp_avg"} <= tensors.keys()
    again = optimizer_state_from_tensors(tensors, json.loads(json.dumps(structure, allow_nan=False)))
    assert again["param_groups"][0]["betas"] == (0.8, 0.95)  # a tuple again, as AdamW made it
    assert again["state"].keys() == optimizer.state_dict()["state"].keys()


def test_adamw_continues_bit_identically(tmp_path: Path) -> None:
    model, optimizer = _trained_adamw(steps=3)
    save_checkpoint(
        tmp_path,
        3,
        model_state={"model": model.state_dict()},
        optimizer_state=optimizer.state_dict(),
        rng_state=capture_rng(),
        extra={"optimizer_steps": 3},
    )
    for i in range(3, 5):  # the uninterrupted run goes on
        _step(model, optimizer, i)
    reference = [p.detach().clone() for p in model.parameters()]

    def resumed(load_optimizer: bool) -> list[torch.Tensor]:
        fresh, fresh_opt = _trained_adamw(seed=99, steps=0)  # other weights until loaded
        loaded = load_checkpoint(tmp_path, 3)
        fresh.load_state_dict(loaded.model_state["model"])
        if load_optimizer:
            fresh_opt.load_state_dict(loaded.optimizer_state)
        for i in range(3, 5):
            _step(fresh, fresh_opt, i)
        return [p.detach().clone() for p in fresh.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(resumed(True), reference, strict=True))
    # Control: the same weights without the optimizer state diverge.
    assert not all(torch.equal(a, b) for a, b in zip(resumed(False), reference, strict=True))


def test_save_without_optimizer(tmp_path: Path) -> None:
    _save(tmp_path, 5, optimizer_state=None)
    names = {p.name for p in (tmp_path / "iter_0000005").iterdir()}
    assert not any(n.startswith("optimizer") for n in names)
    loaded = load_checkpoint(tmp_path, 5)
    assert loaded.optimizer_state is None
    _assert_model_equal(loaded.model_state, _model_state())


def test_layout_holds_no_pickle(tmp_path: Path) -> None:
    _, optimizer = _trained_adamw()
    _save(tmp_path, 1, optimizer_state=optimizer.state_dict(), extra={"ema": EMA({"w": torch.ones(2)}).state_dict()})
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".safetensors", ".json", ".txt"}
    for p in files:
        head = p.read_bytes()[:2]
        assert not head.startswith(b"\x80"), f"{p} looks like a pickle"  # pickle protocol 2+ opcode
        assert head != b"PK", f"{p} looks like a torch.save zip"
    rel = sorted(str(p.relative_to(tmp_path)) for p in files)
    assert rel == [
        "iter_0000001/extra.safetensors",
        "iter_0000001/meta.json",
        "iter_0000001/model/text_encoder.safetensors",
        "iter_0000001/model/transformer.safetensors",
        "iter_0000001/optimizer.json",
        "iter_0000001/optimizer.safetensors",
        "iter_0000001/rng.json",
        "iter_0000001/rng.safetensors",
        "latest_checkpointed_iteration.txt",
    ]


def test_non_json_extra_fails_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="without pickle"):
        _save(tmp_path, 1, extra={"path": Path("x")})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_resave_same_id_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 4, seed=1)
    _save(tmp_path, 4, seed=2)
    _assert_model_equal(load_checkpoint(tmp_path).model_state, _model_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]


# ------------------------------------------------------------------ crashes
def test_crash_before_latest_is_updated_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1, seed=1)

    def boom(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(ckpt.os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2, seed=2)
    monkeypatch.undo()
    assert latest_iteration(tmp_path) == 1
    _assert_model_equal(load_checkpoint(tmp_path).model_state, _model_state(1))
    assert not any(p.name.startswith(".latest") for p in tmp_path.iterdir())


def test_crash_while_writing_files_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1, seed=1)
    real = ckpt.write_tensors
    calls = {"n": 0}

    def flaky(path, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real(path, tensors)

    monkeypatch.setattr(ckpt, "write_tensors", flaky)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, seed=2)
    monkeypatch.undo()
    assert not (tmp_path / "iter_0000002").exists()
    assert available_iterations(tmp_path) == [1]
    assert latest_iteration(tmp_path) == 1


@pytest.mark.parametrize("rename_back_fails", [False, True])
def test_crash_between_renames_of_a_same_id_replacement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rename_back_fails: bool) -> None:
    _save(tmp_path, 3, seed=1)
    real_rename = os.rename
    calls = {"n": 0}

    def crash_on_second(src, dst):
        calls["n"] += 1
        # 1: the old one is renamed away; 2: the new one fails to go in; 3: the rename back.
        if calls["n"] == 2 or (calls["n"] == 3 and rename_back_fails):
            raise OSError("simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_on_second)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 3, seed=2)
    monkeypatch.undo()
    # When even the rename back fails (a crash at the worst moment) only the renamed-away
    # copy is left; readers fall back to it.
    assert (tmp_path / "iter_0000003").exists() is not rename_back_fails
    assert latest_iteration(tmp_path) == 3
    assert available_iterations(tmp_path) == [3]
    _assert_model_equal(load_checkpoint(tmp_path).model_state, _model_state(1))
    # The next save of that id cleans up.
    _save(tmp_path, 3, seed=3)
    _assert_model_equal(load_checkpoint(tmp_path).model_state, _model_state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_killed_saving_process_leaves_a_loadable_latest(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, torch
        from miles_core.training.checkpoint import capture_rng, save_checkpoint
        root = sys.argv[1]
        for i in range(1, 1000):
            big = torch.full((1 << 21,), float(i))  # 8 MB so a kill lands inside a save
            save_checkpoint(root, i, model_state={"transformer": {"w": big}}, optimizer_state={"state": {}, "param_groups": []},
                            rng_state=capture_rng(), extra={"optimizer_steps": i})
            print(i, flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        saved = 0
        while saved < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            saved = int(line)
        assert saved >= 2, "the saving subprocess did not get two checkpoints done"
        time.sleep(random.Random(0).uniform(0.01, 0.08))  # mid-way through a later save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    latest = latest_iteration(tmp_path)
    assert latest is not None and latest >= saved
    loaded = load_checkpoint(tmp_path)
    assert loaded.rollout_id == latest and loaded.extra["optimizer_steps"] == latest
    assert torch.equal(loaded.model_state["transformer"]["w"], torch.full((1 << 21,), float(latest)))


# ------------------------------------------------------------------ errors
def test_missing_step_lists_available(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, 7)
    message = str(info.value)
    assert "iter_0000007" in message and "available: 1, 2" in message and "\n" not in message


def test_empty_root(tmp_path: Path) -> None:
    assert latest_iteration(tmp_path) is None
    assert available_iterations(tmp_path / "nope") == []
    with pytest.raises(CheckpointError, match="nothing to resume from"):
        load_checkpoint(tmp_path)


def test_corrupt_safetensors_is_a_checkpoint_error(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    target = tmp_path / "iter_0000001" / "model" / "transformer.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped bit of tensor data: only the hash sees it
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="transformer.safetensors: sha256 differs") as info:
        load_checkpoint(tmp_path)
    assert "\n" not in str(info.value)

    target.write_bytes(b"\xff" * len(data))  # garbage header, same size
    with pytest.raises(CheckpointError, match="transformer.safetensors: corrupt safetensors file") as info:
        load_checkpoint(tmp_path, verify=False)
    assert "\n" not in str(info.value)


def test_truncated_or_missing_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    rng_file = tmp_path / "iter_0000002" / "rng.safetensors"
    rng_file.write_bytes(rng_file.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"rng.safetensors: \d+ bytes, the manifest records"):
        load_checkpoint(tmp_path, 2)
    # latest names the broken one: a clear error, which says what else there is.
    with pytest.raises(CheckpointError, match=r"names iteration 2.*available: 1"):
        latest_iteration(tmp_path)
    (tmp_path / "iter_0000001" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint, meta.json is missing"):
        load_checkpoint(tmp_path, 1)


def test_bad_latest_file(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        latest_iteration(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match=r"names iteration 9.*no such checkpoint directory.*available: 1"):
        load_checkpoint(tmp_path)
