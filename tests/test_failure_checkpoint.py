"""The checkpoint a run keeps when it fails mid-run (``miles_core.training.checkpoint_on_failure``):
an infrastructure failure or a stop keeps the last rollout the trainer holds exactly, bit
for bit what an interval save would have written, and a resume from it goes on as the
uninterrupted run; a failure that may mean a bad state, or one in the middle of an
optimizer step, keeps nothing new.

Every comparison here is exact by construction: the runs are in this process (one torch
thread), the same seeds and shapes compute the same rollouts, and a checkpoint is a bit
copy of the trainer's state; the failure is injected at a chosen rollout by the run's own
hooks (a custom reward, data source or batch preparation) or by stopping the engine server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.server import create_app
from miles_core.errors import NonFiniteLogProbError, RewardWorkerDiedError, RunFailedError
from miles_core.launch import train
from miles_core.training.checkpoint import available_iterations, load_checkpoint
from miles_core.training.pairs import collate
from tests.custom_hooks_example import CursorSource
from tests.test_server import ServerThread, wait_healthy
from tests.tiny_runs import tiny_run_args

HERE = __name__
TRAIN = ("--use-lora", "--lora-rank", "4", "--lr", "1e-2", "--deterministic-mode", "--no-streaming-reward")
FAIL: dict[str, Any] = {}
"""The failure the hooks below inject at rollout ``at``: ``error`` (raised by the reward),
``source_error`` (raised by the data source when asked for the rollout's prompts) or
``stop`` (a server the reward stops); ``train`` (raised while preparing a training
batch once ``armed``); ``seen``: the checkpoints under ``save`` when it fired."""


async def reward(args: Any, samples: list[Any]) -> list[float]:
    """Each sample's mean pixel value; draws from torch's global RNG on every call (as a
    stochastic reward model would), so a checkpoint must not take the RNG of the moment
    it fails; fails as :data:`FAIL` says at its rollout."""
    torch.rand(1)
    if FAIL.get("at") == samples[0].rollout_id and "source_error" not in FAIL:
        FAIL["seen"] = available_iterations(Path(FAIL["save"]))
        if "stop" in FAIL:  # the engine goes away after generating: the rollout trains, its sync fails
            FAIL.pop("stop").close()
        else:
            raise FAIL["error"]
    return [float(np.asarray(s.pixels, dtype=np.float64).mean()) for s in samples]


class Source(CursorSource):
    """Prompts from a cursor that only its state remembers (so a checkpoint must hold the
    cursor of its rollout, not the one the failed rollout moved on); fails as :data:`FAIL` says."""

    def batch(self, rollout_id: int) -> list[Any]:
        if FAIL.get("at") == rollout_id and "source_error" in FAIL:
            raise FAIL["source_error"]
        return super().batch(rollout_id)


def prepare(batch: list[Any], config: Any) -> dict[str, Any]:
    """The built-in collation; raises ``FAIL["train"]`` once armed (mid-step)."""
    if FAIL.get("armed") and "train" in FAIL:
        raise FAIL.pop("train")
    return collate(batch)


def args(tiny_sd3: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    base = tiny_run_args(tiny_sd3, prompts, out, n=2, steps=3, sde_steps=1)
    at = base.index("--rm-type")  # the reward below replaces it
    return [
        *base[:at],
        *base[at + 2 :],
        *TRAIN,
        "--custom-rm-path",
        f"{HERE}.reward",
        "--custom-prepare-train-batch-path",
        f"{HERE}.prepare",
        "--disable-rollout-global-dataset",
        "--data-source-path",
        f"{HERE}.Source",
        *extra,
    ]


def run(argv: list[str], lines: list[str] | None = None, *, arm_after: int | None = None) -> Path:
    """Train in this process; log lines go to ``lines``; ``arm_after``: arm
    ``FAIL["train"]`` once rollout ``arm_after``'s record is written."""
    lines = [] if lines is None else lines

    def log(line: str) -> None:
        lines.append(line)
        if arm_after is not None and line.startswith(f"rollout {arm_after + 1}/"):
            FAIL["armed"] = True

    return asyncio.run(train(resolve_config(argv), log=log))


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{index}")
    else:
        assert a == b, where


def assert_same_checkpoint(root: Path, reference: Path, rollout: int) -> None:
    """Checkpoint ``rollout`` under ``root`` holds what ``reference`` holds: weights,
    optimizer, RNG streams and the rest, bit for bit."""
    got, want = load_checkpoint(root, rollout), load_checkpoint(reference, rollout)
    for part in ("model_state", "optimizer_state", "rng_state", "extra"):
        assert_same(getattr(got, part), getattr(want, part), part)


@pytest.fixture(autouse=True)
def no_failure():
    FAIL.clear()
    yield
    FAIL.clear()


@pytest.fixture(scope="module")
def reference(tiny_sd3, prompts, tmp_path_factory) -> Path:
    """An uninterrupted 3-rollout run with a checkpoint after every rollout (``--offload-train``,
    as the failing runs: the failure checkpoint must bring the offloaded state back)."""
    out = tmp_path_factory.mktemp("reference")
    run(args(tiny_sd3, prompts, out / "run", "--num-rollout", "3", "--offload-train", "--save", str(out / "ckpt"), "--save-interval", "1"))
    return out


@pytest.mark.exercises("--save", "--load")
def test_a_reward_worker_that_dies_keeps_the_last_rollout_and_the_run_resumes_from_it(tiny_sd3, prompts, tmp_path, reference):
    save, out = tmp_path / "ckpt", tmp_path / "run"
    common = ("--num-rollout", "3", "--offload-train", "--save", str(save), "--save-interval", "10")
    died = RewardWorkerDiedError("reward worker 0 of 1 on node 127.0.0.1 (5f3a1c2b) died: ClientConnectorError: Cannot connect to host")
    FAIL.update(at=2, error=died, save=save)
    lines: list[str] = []
    with pytest.raises(RewardWorkerDiedError) as info:
        run(args(tiny_sd3, prompts, out, *common), lines)
    assert info.value is died and info.value.exit_code == 1 and "\n" not in str(info.value)
    # Rollouts 0 and 1 trained; rollout 2 failed while scoring, before it trained: rollout
    # 1's checkpoint is kept, which the interval (10) would not have written.
    assert FAIL["seen"] == [] and available_iterations(save) == [1]
    assert lines[-1] == f"checkpoint kept at rollout 1: {save / 'iter_0000001'}"
    assert without_timings(records(out)) == without_timings(records(reference / "run"))[:2]
    # What an interval save after rollout 1 wrote, bit for bit: the optimizer state (offloaded
    # while rollout 2 generated) came back, and the RNG streams and the data source's cursor
    # are those of rollout 1's end, not the ones rollout 2 moved on since.
    assert_same_checkpoint(save, reference / "ckpt", 1)
    with pytest.raises(AssertionError):  # control: the state of another rollout differs
        assert_same(load_checkpoint(save, 1).model_state, load_checkpoint(reference / "ckpt", 0).model_state)

    # Resuming goes on at rollout 2 as the uninterrupted run did.
    FAIL.clear()
    run(args(tiny_sd3, prompts, out, *common, "--load", str(save)))
    assert [row["rollout_id"] for row in records(out)] == [0, 1, 2]
    assert without_timings(records(out)) == without_timings(records(reference / "run"))


def test_a_stopped_run_keeps_the_last_rollout(tiny_sd3, prompts, tmp_path, reference):
    """Ctrl-C: ``asyncio.run`` cancels the run's task, here once rollout 1's record is written."""
    save = tmp_path / "ckpt"
    lines: list[str] = []

    async def stopped() -> None:
        task = asyncio.current_task()

        def log(line: str) -> None:
            lines.append(line)
            if line.startswith("rollout 2/"):
                task.cancel()

        argv = args(tiny_sd3, prompts, tmp_path / "run", "--num-rollout", "3", "--offload-train", "--save", str(save))
        await train(resolve_config(argv), log=log)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stopped())
    assert lines[-1] == f"checkpoint kept at rollout 1: {save / 'iter_0000001'}"
    assert available_iterations(save) == [1]
    assert_same_checkpoint(save, reference / "ckpt", 1)


@pytest.mark.parametrize("failure", ["non-finite log-prob", "stopped mid-step"])
def test_a_failure_that_may_leave_a_bad_state_keeps_no_new_checkpoint(tiny_sd3, prompts, tmp_path, failure):
    """Controls: before rollout 2 trains (the point where a reward worker's death keeps
    rollout 1), a failure that may mean a bad policy; and a stop in the middle of rollout
    2's optimizer step (half applied: no rollout's end state)."""
    save = tmp_path / "ckpt"
    argv = args(tiny_sd3, prompts, tmp_path / "run", "--num-rollout", "3", "--save", str(save), "--save-interval", "10")
    lines: list[str] = []
    if failure == "non-finite log-prob":
        FAIL.update(at=2, source_error=NonFiniteLogProbError(1, [0, 3]))
        with pytest.raises(NonFiniteLogProbError):
            run(argv, lines)
        assert not any("checkpoint" in line for line in lines)
    else:
        FAIL.update(train=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            run(argv, lines, arm_after=1)
        assert lines[-1] == "no checkpoint kept: the run stopped while rollout 2 trained (its optimizer steps half applied)"
    assert [row["rollout_id"] for row in records(tmp_path / "run")] == [0, 1]
    assert available_iterations(save) == []


@pytest.mark.exercises("--rollout-engine-urls")
def test_an_engine_that_goes_away_before_the_sync_keeps_the_rollout_it_trained(tiny_sd3, prompts, tmp_path):
    """The engine server (serve-engine's app, served from a thread here) stops once rollout
    0 is generated: rollout 0 trains, its weight sync finds no engine. The trainer holds
    rollout 0's end state: that is the checkpoint kept, bit for bit what an interval save
    wrote in a run against the same server."""
    server = ServerThread(create_app(EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")))
    try:
        wait_healthy(server.url)
        remote = ("--num-rollout", "1", "--rollout-engine", "http", "--rollout-engine-urls", server.url)
        run(args(tiny_sd3, prompts, tmp_path / "calm", *remote, "--save", str(tmp_path / "calm-ckpt")))
        save = tmp_path / "ckpt"
        FAIL.update(at=0, stop=server, save=save)
        lines: list[str] = []
        with pytest.raises(RunFailedError) as info:
            run(args(tiny_sd3, prompts, tmp_path / "run", *remote, "--save", str(save)), lines)
    finally:
        if "stop" in FAIL:
            server.close()
    message = str(info.value)
    assert message.startswith(f"rollout engine failed: {server.url}/update_weights") and "\n" not in message
    assert info.value.exit_code == 1
    assert FAIL["seen"] == [] and available_iterations(save) == [0]
    assert (
        lines[-1]
        == f"checkpoint kept at rollout 0: {save / 'iter_0000000'} (its record is not in metrics.jsonl: the run failed after it trained)"
    )
    assert not records(tmp_path / "run")
    assert_same_checkpoint(save, tmp_path / "calm-ckpt", 0)
    assert load_checkpoint(save, 0).extra["optimizer_steps"] == 1
