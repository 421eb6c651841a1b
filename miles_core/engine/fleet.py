"""Engine servers a run starts itself (``--rollout-engine http --rollout-num-engines N``):
each a ``miles-core serve-engine`` subprocess of ``--hf-checkpoint`` on a free loopback
port, with its stderr in a log file. :func:`start_engine` starts one and waits until it
listens; :class:`EngineFleet` starts several at once, waits until each answers
``GET /health`` with 200, restarts one that died or hung (``--use-fault-tolerance``), and
stops them all (SIGTERM, then SIGKILL after a timeout).

A fleet started with an ``api_key`` (a run's, :func:`~miles_core.engine.auth.new_secret`)
gives it to each server, a restarted one too, in that process's environment only
(``MILES_API_KEY``), never on its command line; a server started without one gets no
``MILES_API_KEY`` at all, whatever this process's environment holds. The servers get no
``--allowed-weight-roots``: a run syncs serve-engines over HTTP or a weight-update group,
never from disk, so their ``/update_weights_from_disk`` refuses every directory.

Failures are :class:`FleetError` with a one-line message naming the engine's log file.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_core.engine.auth import API_KEY_ENV
from miles_core.errors import FleetError

_BANNER_URL = re.compile(r"^serving .* on (https?://[^\s/]+)$")
"""A server's banner, ``serving ... on URL``: the URL it listens on (a whole line only,
never one another thread's output was written into)."""


class ServedEngine:
    """A running ``miles-core serve-engine`` subprocess (see :func:`start_engine`)."""

    kind = "engine server"
    """What its errors call it."""

    def __init__(self, process: subprocess.Popen, log_path: Path) -> None:
        self.process = process
        self.log_path = Path(log_path)
        self.url: str | None = None
        self.banner: str | None = None
        """The line it printed when listening: ``serving <family> <checkpoint> on <url>``."""

    def poll_banner(self) -> bool:
        """Read the log for the ``serving ... on URL`` line; True once it is there."""
        if self.url is None:
            try:
                text = self.log_path.read_text(errors="replace")
            except FileNotFoundError:
                return False
            for line in text.splitlines():
                found = _BANNER_URL.match(line)
                if line.startswith("serving ") and found is not None:
                    self.banner, self.url = line, found[1]
                    break
        return self.url is not None

    def healthy(self, timeout: float = 5.0) -> bool:
        if self.url is None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _failure(self, what: str) -> FleetError:
        last = ""
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
            last = f" (last line: {lines[-1].strip()})" if lines else ""
        except FileNotFoundError:
            pass
        return FleetError(f"{self.kind} {self.url or f'pid {self.process.pid}'} {what}; see {self.log_path}{last}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL after ``timeout`` seconds. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=10)


def launch_engine(
    checkpoint: str | Path,
    *args: str,
    log_path: str | Path,
    threads: int | None = 1,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> ServedEngine:
    """Start ``miles-core serve-engine --hf-checkpoint CHECKPOINT --port 0 ARGS`` (see
    :func:`launch_server`); does not wait."""
    return launch_server(
        "serve-engine",
        "--hf-checkpoint",
        str(checkpoint),
        "--port",
        "0",
        *args,
        log_path=log_path,
        threads=threads,
        env=env,
        api_key=api_key,
    )


def launch_server(
    command: str,
    *args: str,
    log_path: str | Path,
    threads: int | None = 1,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
    kind: str = ServedEngine.kind,
) -> ServedEngine:
    """Start ``miles-core COMMAND ARGS``, a server that prints ``serving ... URL`` once it
    serves (``serve-engine``, ``serve-reward``), in a session of its own (stderr to
    ``log_path``; ``threads``: its torch threads, None to leave them alone; ``env``: set
    over this process's environment, e.g. the devices of a Ray actor's bundles;
    ``api_key``: the key it requires, in its ``MILES_API_KEY``, which is otherwise taken
    from ``env`` only; ``kind``: what its errors call it); does not wait."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    extra_env, env = env, dict(os.environ)
    env.pop(API_KEY_ENV, None)  # the server's key is the one given, not one this process happens to hold
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra_env or {})
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "miles_core.cli.main", command, *args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    server = ServedEngine(process, log_path)
    server.kind = kind
    return server


def wait_for(engines: Sequence[ServedEngine], timeout: float, *, healthy: bool, interval: float = 0.1) -> None:
    """Wait until every engine listens (and, with ``healthy``, answers ``/health`` 200);
    :class:`FleetError` naming the first one's log file when it exits or times out."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.process.poll() is not None:
                raise engine._failure(f"exited with status {engine.process.returncode} before it was healthy")
            if engine.poll_banner() and (not healthy or engine.healthy()):
                pending.remove(engine)
        if pending:
            if time.monotonic() > deadline:
                state = "healthy" if healthy else "listening"
                raise pending[0]._failure(f"was not {state} within {timeout:g} s")
            time.sleep(interval)


def start_engine(
    checkpoint: str | Path,
    *args: str,
    log_path: str | Path,
    timeout: float = 90.0,
    healthy: bool = False,
    threads: int | None = 1,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> ServedEngine:
    """:func:`launch_engine`, then wait (at most ``timeout`` s) until it listens (and with
    ``healthy``, until its model is loaded); on failure it is killed and
    :class:`FleetError` names its log."""
    engine = launch_engine(checkpoint, *args, log_path=log_path, threads=threads, env=env, api_key=api_key)
    try:
        wait_for([engine], timeout, healthy=healthy)
    except BaseException:
        engine.stop(timeout=5)
        raise
    return engine


def serve_arguments(config: Any) -> list[str]:
    """The ``serve-engine`` arguments of a run's engines, but the device (each host's
    own): the run's family, dtype, weight-update bucket size, ``--deterministic-mode`` and
    ``--compile``."""
    args = ["--update-weight-buffer-size", str(config.update_weight_buffer_size)]
    if config.diffusion_model_family:
        args += ["--diffusion-model-family", config.diffusion_model_family]
    if config.diffusion_forward_dtype in ("fp32", "bf16", "fp16"):
        args += ["--dtype", config.diffusion_forward_dtype]
    if config.deterministic_mode:
        args.append("--deterministic-mode")
    if config.get("compile"):
        args.append("--compile")
    if accepts_ipc_weights(config):
        args.append("--accept-ipc-weights")
    return args


def accepts_ipc_weights(config: Any, *, cuda: bool | None = None) -> bool:
    """Whether the run's serve-engines take pickled CUDA-IPC weight updates: only when its
    syncs take the ``cuda-ipc`` path, which needs the engine on the trainer's GPU
    (``--colocate`` with CUDA; ``cuda``: whether there is one, default torch's answer);
    every other engine refuses that format."""
    from miles_core.config.sync_path import run_sync_path

    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return run_sync_path(config, cuda=cuda) == "cuda-ipc"


class EngineFleet:
    """``count`` serve-engine processes of one checkpoint, started together."""

    def __init__(
        self,
        engines: Sequence[ServedEngine],
        *,
        checkpoint: str | Path | None = None,
        args: Sequence[str] = (),
        log_dir: str | Path | None = None,
        threads: int | None = None,
        api_key: str | None = None,
    ) -> None:
        self.engines = list(engines)
        # How the engines were launched, so that restart() can launch one again.
        self.checkpoint = checkpoint
        self.args = list(args)
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.threads = threads
        self.api_key = api_key
        """The key every engine (a restarted one too) requires; None: none."""
        self.restarts = [0] * len(self.engines)
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines if engine.url]

    @classmethod
    def start(
        cls,
        checkpoint: str | Path,
        count: int,
        log_dir: str | Path,
        *args: str,
        timeout: float = 300.0,
        threads: int | None = None,
        api_key: str | None = None,
    ) -> EngineFleet:
        """Start ``count`` engines (logs ``log_dir/engine_<i>.log``), each requiring
        ``api_key`` when given, and wait until all are healthy; on any failure, stop those
        started and raise :class:`FleetError`."""
        if count < 1:
            raise ValueError(f"an engine fleet needs at least one engine, got {count}")
        fleet = cls([], checkpoint=checkpoint, args=args, log_dir=log_dir, threads=threads, api_key=api_key)
        try:
            for index in range(count):
                log_path = Path(log_dir) / f"engine_{index}.log"
                fleet.engines.append(launch_engine(checkpoint, *args, log_path=log_path, threads=threads, api_key=api_key))
            fleet.restarts = [0] * count
            wait_for(fleet.engines, timeout, healthy=True)
        except BaseException:
            fleet.stop(timeout=5)
            raise
        return fleet

    @classmethod
    def from_config(
        cls, config: Any, log_dir: str | Path, *, api_key: str | None = None, threads: int | None = None, extra_args: Sequence[str] = ()
    ) -> EngineFleet:
        """The run's fleet: ``--rollout-num-engines`` servers of ``--hf-checkpoint`` with the
        run's family, dtype and weight-update bucket size, on this machine's device,
        requiring ``api_key`` (the run's secret), each with ``threads`` torch threads (the
        thread plan's share; None: torch's default). ``extra_args``: further serve-engine
        arguments (the run's ``--prompt-embeddings`` manifest)."""
        from miles_core.model_loading import model_device

        args = ["--device", model_device(), *serve_arguments(config), *extra_args]
        return cls.start(config.hf_checkpoint, config.rollout_num_engines, log_dir, *args, api_key=api_key, threads=threads)

    def restart(self, index: int, timeout: float = 300.0) -> str:
        """Replace engine ``index``: SIGKILL it if it still runs (it is dead or hung: nothing
        on it is worth a graceful stop), launch a new one with the same arguments and key (log
        ``engine_<index>.restart<k>.log``, so the old log keeps what went wrong), wait until
        it is healthy and return its URL. Blocking; :class:`FleetError` naming the new log
        when it does not come up, or when the fleet is stopped meanwhile."""
        if self.checkpoint is None or self.log_dir is None:
            raise FleetError("this fleet was not started by EngineFleet.start: it cannot restart an engine")
        old = self.engines[index]
        if old.process.poll() is None:
            old.process.kill()
        old.process.wait(timeout=30)
        with self._lock:  # stop() must not miss an engine launched while it runs
            if self._stopped:
                raise FleetError(f"engine server {old.url}: not restarted, the fleet is stopping")
            self.restarts[index] += 1
            log_path = self.log_dir / f"engine_{index}.restart{self.restarts[index]}.log"
            engine = self.engines[index] = launch_engine(
                self.checkpoint, *self.args, log_path=log_path, threads=self.threads, api_key=self.api_key
            )
        try:
            wait_for([engine], timeout, healthy=True)
        except BaseException:
            engine.stop(timeout=5)
            raise
        assert engine.url is not None
        return engine.url

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every engine, then wait; SIGKILL those still running after ``timeout`` s."""
        with self._lock:
            self._stopped = True
        for engine in self.engines:
            if engine.process.poll() is None:
                engine.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for engine in self.engines:
            try:
                engine.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                engine.process.kill()
                engine.process.wait(timeout=10)


__all__ = [
    "EngineFleet",
    "FleetError",
    "ServedEngine",
    "accepts_ipc_weights",
    "launch_engine",
    "launch_server",
    "serve_arguments",
    "start_engine",
    "wait_for",
]
