"""The thread plan: a pure function of the machine and the configuration (CPU and GPU
machines alike, whatever this one is), and what a run does with it: generation and
training on the embedded engine's one compute thread, every other thread on one torch
thread, the caller's count back when the run ends."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.config.thread_plan import MachineShape, ThreadPlan, plan_threads
from miles_core.errors import ConfigError
from miles_core.launch import train
from miles_core.training.pairs import collate
from tests.tiny_runs import tiny_run_args

CPU2 = MachineShape(cores=2, gpus=0)
GPU16 = MachineShape(cores=16, gpus=1)


@pytest.fixture
def config_of(tiny_sd3: Path, prompts: Path, tmp_path: Path):
    def make(*extra: str) -> Any:
        return resolve_config([*tiny_run_args(tiny_sd3, prompts, tmp_path / "run"), "--num-rollout", "1", *extra])

    return make


def test_a_cpu_run_gives_every_core_to_one_compute_thread(config_of):
    plan = plan_threads(CPU2, config_of(), {})
    assert plan == ThreadPlan(
        compute_threads=2, worker_threads=1, interop_threads=1, shared_compute_thread=True, engine_server_threads=None, source="auto"
    )
    assert plan.describe() == "threads: 2 for compute (generation and training on the engine's thread; auto), 1 for every other thread"
    assert plan_threads(MachineShape(cores=64, gpus=0), config_of(), {}).compute_threads == 64


def test_a_gpu_run_leaves_cores_to_the_threads_that_feed_it(config_of):
    # In-process reward scoring keeps one core.
    assert plan_threads(GPU16, config_of(), {}).compute_threads == 15
    # Remote engines: the main thread computes; the reward and two response decoders keep three.
    remote = config_of("--rollout-engine", "http", "--rollout-engine-urls", "http://127.0.0.1:9", "--rollout-parser-num-workers", "2")
    plan = plan_threads(GPU16, remote, {})
    assert (plan.compute_threads, plan.shared_compute_thread) == (13, False)
    assert plan_threads(MachineShape(cores=2, gpus=1), remote, {}).compute_threads == 1  # never below one


@pytest.mark.exercises("--cpu-threads")
def test_the_override_and_its_precedence(config_of):
    assert plan_threads(CPU2, config_of("--cpu-threads", "1"), {"OMP_NUM_THREADS": "2"}).compute_threads == 1
    from_env = plan_threads(CPU2, config_of(), {"OMP_NUM_THREADS": "1"})
    assert (from_env.compute_threads, from_env.source, from_env.warning) == (1, "OMP_NUM_THREADS", None)
    for junk in ("0", "two", ""):  # not a thread count: the plan decides
        assert plan_threads(CPU2, config_of(), {"OMP_NUM_THREADS": junk}).source == "auto"
    # The override wins on a GPU machine too (no cores reserved).
    assert plan_threads(GPU16, config_of("--cpu-threads", "16"), {}).compute_threads == 16


def test_more_threads_than_cores_is_a_warning_not_an_error(config_of):
    plan = plan_threads(CPU2, config_of("--cpu-threads", "8"), {})
    assert plan.compute_threads == 8
    assert plan.warning == (
        "--cpu-threads 8 is more than the 2 core(s) this process may use: the threads will compete for them (running with it anyway)"
    )
    with pytest.raises(ConfigError, match="--cpu-threads 0: must be at least 1"):
        config_of("--cpu-threads", "0")


def test_who_computes_where(config_of, tiny_sd3):
    # Without an engine in this process the main thread computes (SFT, a replay); nothing
    # scores rewards either, so on a GPU no core is kept for it.
    sft = plan_threads(GPU16, config_of(), {}, rolls_out=False)
    assert (sft.shared_compute_thread, sft.compute_threads) == (False, 16)
    # serve-engine servers the run starts here split the cores (they generate at once).
    fleet = config_of("--rollout-engine", "http", "--rollout-num-engines", "2")
    assert plan_threads(MachineShape(cores=8, gpus=0), fleet, {}).engine_server_threads == 4
    assert plan_threads(CPU2, config_of("--rollout-engine", "http", "--rollout-num-engines", "3"), {}).engine_server_threads == 1
    assert plan_threads(CPU2, config_of(), {}).engine_server_threads is None


def test_the_plan_is_a_pure_function(config_of):
    config = config_of()
    assert plan_threads(CPU2, config, {}) == plan_threads(CPU2, config, {})
    assert plan_threads(CPU2, config, {}) != plan_threads(MachineShape(cores=3, gpus=0), config, {})  # control


SEEN: list[tuple[str, int]] = []


def recording_prepare(batch: list[Any], config: Any) -> dict[str, Any]:
    """The built-in collation, noting the thread that trains and its torch threads, and
    the torch threads of a thread started now (as reward scoring's are)."""
    SEEN.append((threading.current_thread().name, torch.get_num_threads()))
    other = threading.Thread(target=lambda: SEEN.append(("started", torch.get_num_threads())))
    other.start()
    other.join()
    return collate(batch)


@pytest.mark.exercises("--cpu-threads")
def test_a_run_trains_on_the_engine_thread_and_gives_the_caller_its_threads_back(tiny_sd3, prompts, tmp_path):
    SEEN.clear()
    argv = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", n=2, steps=2, sde_steps=1),
        "--num-rollout",
        "1",
        "--cpu-threads",
        "2",
        "--custom-prepare-train-batch-path",
        f"{__name__}.recording_prepare",
    ]
    lines: list[str] = []
    torch.set_num_threads(3)  # the caller's own count, which it gets back
    try:
        asyncio.run(train(resolve_config(argv), log=lines.append))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)
    trained = [(name, threads) for name, threads in SEEN if name != "started"]
    assert trained and {name.split("_")[0] for name, _ in trained} == {"embedded-engine"}
    assert {threads for _, threads in trained} == {2}
    assert {threads for name, threads in SEEN if name == "started"} == {1}  # one team only
    assert "threads: 2 for compute (generation and training on the engine's thread; --cpu-threads), 1 for every other thread" in lines
    assert after == 3


STOP: dict[str, Any] = {}


def stopping_prepare(batch: list[Any], config: Any) -> dict[str, Any]:
    """Stops the run (as Ctrl-C does: its task is cancelled) during the first micro-batch."""
    SEEN.append((threading.current_thread().name, torch.get_num_threads()))
    if len(SEEN) == 1:
        STOP["loop"].call_soon_threadsafe(STOP["task"].cancel)
        STOP["cancelled"].wait(30)  # the loop has handled it: the stop is requested
    return collate(batch)


def test_a_run_stopped_while_it_trains_stops_the_compute_thread_after_one_micro_batch(tiny_sd3, prompts, tmp_path):
    SEEN.clear()
    argv = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", n=4, steps=3, sde_steps=2),
        "--num-rollout",
        "1",
        "--micro-batch-size",
        "1",
        "--save",
        str(tmp_path / "ckpt"),
        "--custom-prepare-train-batch-path",
        f"{__name__}.stopping_prepare",
    ]
    lines: list[str] = []
    STOP["cancelled"] = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("no checkpoint kept"):
            STOP["cancelled"].set()

    async def run() -> None:
        STOP.update(loop=asyncio.get_running_loop(), task=asyncio.current_task())
        await train(resolve_config(argv), log=log)

    before = set(threading.enumerate())  # engine threads other tests left idle are not this run's
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("embedded-engine"):
            thread.join(30)
    # 2 prompts x 4 samples x 2 SDE steps = 16 micro-batches; the stop lands during the first.
    assert len(SEEN) == 1
    assert lines[-1] == "no checkpoint kept: the run stopped while rollout 0 trained (its optimizer steps half applied)"
