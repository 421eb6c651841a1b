"""How many CPU threads each part of a run gets: a pure function of the machine and the
configuration (:func:`plan_threads`), applied at the start of a run.

Why a plan at all: torch runs each thread's parallel ops on an OpenMP team of its own,
so every Python thread that calls torch brings its own pool. With the embedded engine a
run has several such threads (the engine's worker, the trainer, reward scoring, response
decoding); with two pools of all cores on a 2-core machine, libgomp counts more busy
threads than cores and stops spinning between parallel regions, and every op then waits
on a futex wake-up: a 2-core run was 1.22x slower than the same run on one thread (1.91x
a hand-written loop at two). The plan gives the cores to ONE compute thread and one torch
thread to every other one; a thread that has had a team keeps it, idle or not, so the
other threads never get one.

- **Compute thread.** With the embedded engine in this process, generation, training and
  evaluation all run on the engine's worker thread, with :attr:`ThreadPlan.compute_threads`
  torch threads; otherwise (remote engines, SFT, a replay) the main thread computes.
- **Other threads** (reward scoring, response decoding, checksums, the main thread when it
  does not compute) run torch on :attr:`ThreadPlan.worker_threads` (one) thread.
- **On a CPU** the compute thread gets every usable core: reward and decode work that
  overlaps generation is short, and reserving a core for it would idle half of a 2-core
  machine for the whole run.
- **With GPUs** the heavy work is on the device; the compute thread's CPU threads are the
  cores left after the threads that feed it (in-process reward scoring, the response
  decoders of remote engines), so they do not compete with those.
- **Engine servers the run starts on this machine** (``--rollout-num-engines``) generate at
  the same time as each other: each gets an equal share of the cores.

The override is ``--cpu-threads N`` (else ``OMP_NUM_THREADS``, the variable torch and
OpenMP already read). A count above the machine's cores is honoured with a warning. The
OpenMP wait policy is left at libgomp's default (spin briefly, then sleep): with one pool
it spins between the ops of a step, and forcing ``OMP_WAIT_POLICY=ACTIVE`` would keep idle
threads burning cores that reward workers and other processes need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THREADS_ENV = "OMP_NUM_THREADS"
"""The variable a plan honours when ``--cpu-threads`` is unset."""


@dataclass(frozen=True)
class MachineShape:
    """What the plan needs to know of the machine."""

    cores: int
    """CPUs this process may use (affinity mask and cgroup quota)."""
    gpus: int
    """GPUs visible to this process."""


@dataclass(frozen=True)
class ThreadPlan:
    compute_threads: int
    """Torch intra-op threads of the compute thread."""
    worker_threads: int
    """Torch intra-op threads of every other thread that calls torch."""
    interop_threads: int
    """Torch's inter-op pool (miles-core schedules nothing on it)."""
    shared_compute_thread: bool
    """Generation and training run on one thread: the embedded engine's worker."""
    engine_server_threads: int | None
    """Torch threads of each engine server the run starts on this machine; None: it starts none."""
    source: str
    """Where :attr:`compute_threads` came from: ``--cpu-threads``, ``OMP_NUM_THREADS`` or ``auto``."""
    warning: str | None = None
    """A count above the machine's cores (honoured)."""

    def describe(self) -> str:
        """One line for the run's log."""
        where = "generation and training on the engine's thread" if self.shared_compute_thread else "on the main thread"
        line = f"threads: {self.compute_threads} for compute ({where}; {self.source}), {self.worker_threads} for every other thread"
        if self.engine_server_threads is not None:
            line += f", {self.engine_server_threads} per engine server"
        return line


def _requested(config: Any, environ: Mapping[str, str]) -> tuple[int | None, str]:
    if config.get("cpu_threads") is not None:
        return int(config.cpu_threads), "--cpu-threads"
    text = environ.get(THREADS_ENV, "").strip()
    if text.isdigit() and int(text) >= 1:
        return int(text), THREADS_ENV
    return None, "auto"


def _embedded_in_process(config: Any) -> bool:
    """The embedded engine runs in this process (not on a Ray actor)."""
    return config.get("rollout_engine") == "embedded" and not config.get("use_ray")


def _engine_servers_here(config: Any) -> int:
    """serve-engine servers the run starts as processes of this machine (not Ray actors)."""
    if config.get("use_ray") or config.get("rollout_engine") != "http" or config.get("rollout_engine_urls"):
        return 0
    return int(config.get("rollout_num_engines") or 0)


def plan_threads(machine: MachineShape, config: Any, environ: Mapping[str, str], *, rolls_out: bool = True) -> ThreadPlan:
    """The run's thread plan (see the module docstring). ``config`` needs ``get`` (a
    :class:`~miles_core.config.model.Config`); ``environ`` is read for ``OMP_NUM_THREADS``;
    ``rolls_out``: the loss trains on rollouts (false for SFT, which generates nothing)."""
    cores = max(1, machine.cores)
    generates = rolls_out and not (config.get("train_only") or config.get("load_debug_rollout_data"))
    shared = generates and _embedded_in_process(config)
    remote = generates and not shared
    requested, source = _requested(config, environ)
    if requested is not None:
        compute = requested
    elif machine.gpus:
        # The threads that feed the GPU work keep a core each: in-process reward scoring
        # (under Ray it runs on the reward workers) and the decoders of remote engines' responses.
        scoring = 1 if generates and not config.get("use_ray") else 0
        feeding = scoring + (int(config.get("rollout_parser_num_workers") or 1) if remote else 0)
        compute = max(1, cores - feeding)
    else:
        compute = cores
    warning = None
    if requested is not None and requested > cores:
        warning = (
            f"{source} {requested} is more than the {cores} core(s) this process may use: "
            "the threads will compete for them (running with it anyway)"
        )
    servers = _engine_servers_here(config) if rolls_out else 0
    return ThreadPlan(
        compute_threads=compute,
        worker_threads=1,
        interop_threads=1,
        shared_compute_thread=shared,
        engine_server_threads=max(1, compute // servers) if servers else None,
        source=source,
        warning=warning,
    )


def this_machine() -> MachineShape:
    """This process's :class:`MachineShape`."""
    from miles_core.machine import usable_cores, visible_gpu_count

    return MachineShape(cores=usable_cores(), gpus=visible_gpu_count())
