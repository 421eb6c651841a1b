"""A Ray cluster of several nodes on this machine, for tests: ``ray start --head`` and one
``ray start --address`` per further node, each node with its own CPUs and a custom
resource naming it (``test_node_<i>``), all under one temporary directory of the test's.

Every port is a free one picked here (or 0: the OS picks), so the cluster does not meet
another Ray instance on the machine. It is stopped by ending the processes it started, found
by that directory (the head's and nodes' daemons name it on their command lines) with their
process trees (the workers, and what the workers started): ``ray stop`` would end every Ray
process on the machine. The driver joins with ``ray.init(address=...)``; a run joins with
``--ray-address``.

:func:`two_node_cluster` is the module-scoped fixture: import it into a test module. The
suite's one-node cluster (tests/conftest.py's ``ray_head``, shared by the modules that use
``ray_cluster``) is started here too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

SOCKET_PATH_LIMIT = 107
"""Unix socket paths (Ray's raylet and object store sockets live under the temp dir)."""
SESSION_AND_SOCKET = len("/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store.10")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _port_flags(*, head: bool) -> list[str]:
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port"]
    names += ["--runtime-env-agent-port", "--metrics-export-port"]
    if head:
        names += ["--port", "--dashboard-port"]
    flags = [part for name, port in zip(names, _free_ports(len(names))) for part in (name, str(port))]
    # Workers take ports the OS picks (0 and 0); the Ray client server needs ray[client],
    # which is not installed, so none starts.
    return [*flags, "--min-worker-port", "0", "--max-worker-port", "0"]


def _names(arg: str, directory: str) -> bool:
    """Whether a command-line argument names ``directory`` or a path under it (not a
    sibling that merely starts with the same characters)."""
    return arg == directory or arg.endswith("=" + directory) or directory + "/" in arg


@dataclass
class LocalRayCluster:
    """Nodes started with ``ray start`` under ``temp_dir`` (see the module docstring)."""

    temp_dir: Path
    address: str = ""
    node_ids: list[str] = field(default_factory=list)
    """The Ray node id of each node, in the order started (``test_node_<i>``)."""
    one_thread: bool = True
    """Start the nodes with ``OMP_NUM_THREADS=1`` (else their processes take the threads Ray
    gives each task and actor, as under a plain ``ray.init``)."""
    _starting: threading.Thread | None = None
    _failure: BaseException | None = None
    _count: int = 0

    def _ray_start(self, *args: str) -> None:
        # No usage reports; no token auth, as for every Ray instance of the suite
        # (tests/conftest.py sets RAY_AUTH_MODE); one thread per process unless told otherwise,
        # as the suite pins its own.
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        if self.one_thread:
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # Actors inherit the environment their node starts with: keep out what a one-process
        # --deterministic-mode run earlier in this process set.
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        ray = str(Path(sys.executable).with_name("ray"))
        # No log monitor (a process per node): the suite's drivers take no worker logs
        # (log_to_driver=False).
        done = subprocess.run(
            [ray, "start", "--temp-dir", str(self.temp_dir), "--disable-usage-stats", "--include-log-monitor", "false", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed: {done.stderr[-3000:]}")

    def start(self, cpus: list[int], *, wait: bool = True) -> None:
        """One node per entry of ``cpus`` (its CPU count); the first is the head. Without
        ``wait`` the nodes start on a thread of their own (``ray start`` is a process per
        node), so that other work can go on meanwhile; :meth:`wait` joins them."""
        import ray

        assert len(str(self.temp_dir)) + SESSION_AND_SOCKET <= SOCKET_PATH_LIMIT, f"{self.temp_dir}: too long for Ray's sockets"
        assert not ray.is_initialized(), "another Ray instance is connected in this process"
        head_flags = _port_flags(head=True)
        self.address = f"{ray.util.get_node_ip_address()}:{head_flags[head_flags.index('--port') + 1]}"
        self._count = len(cpus)

        def start_nodes() -> None:
            try:
                for index, count in enumerate(cpus):
                    resources = json.dumps({f"test_node_{index}": 1})
                    node = ["--num-cpus", str(count), "--num-gpus", "0", "--resources", resources]
                    if index == 0:
                        self._ray_start("--head", "--include-dashboard", "false", *node, *head_flags)
                    else:
                        self._ray_start("--address", self.address, *node, *_port_flags(head=False))
            except BaseException as exc:
                self._failure = exc

        self._starting = threading.Thread(target=start_nodes, name="ray-start", daemon=True)
        self._starting.start()
        if wait:
            self.wait()

    def wait(self) -> LocalRayCluster:
        """Every node started, registered and alive (:attr:`node_ids` filled)."""
        if not self.node_ids:
            assert self._starting is not None, "start() first"
            self._starting.join()
            try:
                if self._failure is not None:
                    raise self._failure
                self.node_ids = self._wait_for_nodes(self._count)
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_for_nodes(self, count: int, timeout: float = 60.0) -> list[str]:
        """Every node registered and alive: their ids by ``test_node_<i>``."""
        import ray

        ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            deadline = time.monotonic() + timeout
            while True:
                alive = {
                    name: node["NodeID"]
                    for node in ray.nodes()
                    if node["Alive"]
                    for name in node["Resources"]
                    if name.startswith("test_node_")
                }
                if len(alive) == count:
                    return [alive[f"test_node_{i}"] for i in range(count)]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {sorted(alive)} of {count} Ray nodes came up within {timeout:g} s")
                time.sleep(0.2)
        finally:
            ray.shutdown()

    def processes(self) -> list[psutil.Process]:
        """The processes of this cluster: those naming its directory, and their descendants."""
        mine = str(self.temp_dir)
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            try:
                if process.pid != os.getpid() and any(_names(arg, mine) for arg in process.info["cmdline"] or ()):
                    for p in (process, *process.children(recursive=True)):
                        found.setdefault(p.pid, p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return [p for pid, p in found.items() if pid != os.getpid()]

    def raylet_pid(self, node_id: str) -> int:
        """The raylet process of node ``node_id``, as Ray reports the node (its socket)."""
        import ray

        (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
        flag = f"--raylet_socket_name={node['RayletSocketName']}"
        pids = [p.pid for p in self.processes() if flag in p.cmdline()]
        assert len(pids) == 1, (node_id, pids)
        return pids[0]

    def stop(self, grace: float = 0.5) -> None:
        """End this cluster's processes (and only those): SIGTERM, then after ``grace`` s
        SIGKILL (the GCS server and raylets take seconds to drain, with nothing to keep)."""
        import ray

        if self._starting is not None:
            self._starting.join()  # a node still starting would be missed
        if ray.is_initialized():
            ray.shutdown()
        processes = self.processes()
        for signal in ("terminate", "kill"):
            for process in processes:
                try:
                    getattr(process, signal)()
                except psutil.NoSuchProcess:
                    pass
            processes = wait_gone(processes, grace if signal == "terminate" else 30.0)
            if not processes:
                return


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after ``timeout`` s. A daemon's parent is
    init, which may not reap it here: an ended one stays a zombie, which counts as gone."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def kill_actor(actor: Any, probe: Callable[[], Any], timeout: float = 30.0) -> None:
    """Kill ``actor`` and return once Ray says it is dead: ``ray.kill`` only asks, and a call
    made right after it may still be served. ``probe`` calls one of the actor's methods
    (returning its object ref); it is called until that call fails as an actor that died."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(probe(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the actor still answers {timeout} s after ray.kill")
        time.sleep(0.05)


def start_local_cluster(temp_dir: Path, cpus: list[int], *, wait: bool = True, one_thread: bool = True) -> LocalRayCluster:
    cluster = LocalRayCluster(temp_dir, one_thread=one_thread)
    cluster.start(cpus, wait=wait)
    return cluster


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory: Any) -> Any:
    """Two nodes of 2 CPUs each (``test_node_0`` the head, ``test_node_1``), still starting
    when the fixture is given: call :meth:`LocalRayCluster.wait` before joining. Nothing
    is connected to it between tests (each run joins and leaves)."""
    cluster = start_local_cluster(tmp_path_factory.mktemp("ray"), [2, 2], wait=False)
    try:
        yield cluster
    finally:
        cluster.stop()


__all__ = ["LocalRayCluster", "kill_actor", "start_local_cluster", "two_node_cluster", "wait_gone"]
