"""Engine servers of a ``--use-ray`` run (``--rollout-num-engines N``) as Ray actors.

Each :class:`EngineHost` actor sits on its engine's bundles of the placement group and
runs one ``miles-core serve-engine`` subprocess there (so on a GPU node it sees exactly
the GPUs Ray gave the actor), bound to the node's address so the driver reaches it from
another node. :class:`RayEngineFleet` has the interface of
:class:`~miles_core.engine.fleet.EngineFleet` (``urls``, ``restart``, ``stop``): the run's
HTTP client, weight sync and fault tolerance work on either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_core.cluster.runtime import task_result

START_TIMEOUT = 300.0
"""Seconds an engine server may take to load its model and answer ``/health``."""


class EngineHost:
    """Made a Ray actor by :class:`RayEngineFleet`."""

    def __init__(self, checkpoint: str, args: Sequence[str], log_path: str) -> None:
        self.checkpoint = checkpoint
        self.args = list(args)
        self.log_path = log_path
        self.engine: Any = None

    def start(self, timeout: float = START_TIMEOUT) -> str:
        """Start the server (after stopping a previous one) and wait until it is healthy;
        returns its URL. A server that fails raises FleetError naming its log."""
        import ray

        from miles_core.engine.fleet import start_engine
        from miles_core.model_loading import model_device

        self.stop()
        args = [*self.args, "--device", model_device(), "--host", ray.util.get_node_ip_address()]
        self.engine = start_engine(self.checkpoint, *args, log_path=self.log_path, timeout=timeout, healthy=True, threads=None)
        return self.engine.url

    def pid(self) -> int | None:
        return None if self.engine is None else self.engine.process.pid

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop(timeout=30)
            self.engine = None


class RayEngineFleet:
    """``count`` engine servers on their bundles (see the module docstring)."""

    def __init__(self, hosts: list[Any], urls: list[str], log_paths: list[Path]) -> None:
        import ray

        self._ray = ray
        self.hosts = hosts
        self._urls = urls
        self.log_paths = log_paths

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    @classmethod
    def start(cls, config: Any, runtime: Any, log_dir: str | Path) -> RayEngineFleet:
        """Start the run's engines on the placement group's engine bundles; on a failure
        the ones started are stopped and :class:`~miles_core.engine.fleet.FleetError`
        names the failing server's log."""
        import ray

        from miles_core.engine.fleet import serve_arguments

        plan = runtime.plan
        args = serve_arguments(config)
        actor = ray.remote(EngineHost)
        log_paths = [Path(log_dir) / f"engine_{index}.log" for index in range(len(plan.engines))]
        hosts = [
            actor.options(**runtime.options(bundles[0], plan.engine_share)).remote(str(config.hf_checkpoint), args, str(log_paths[index]))
            for index, bundles in enumerate(plan.engines)
        ]
        fleet = cls(hosts, [], log_paths)
        try:
            fleet._urls = fleet._call_all("start")
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def _call_all(self, method: str) -> list[Any]:
        return task_result([getattr(host, method).remote() for host in self.hosts])

    def pids(self) -> list[int | None]:
        return self._call_all("pid")

    def restart(self, index: int) -> str:
        """Start engine ``index`` again (a fresh server on its bundle); its new URL."""
        url = task_result(self.hosts[index].start.remote())
        self._urls[index] = url
        return url

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every server, then the host actors."""
        for host in self.hosts:
            try:
                self._ray.get(host.stop.remote(), timeout=timeout)
            except Exception:  # a host that died took its server with it
                pass
            self._ray.kill(host)
        self.hosts = []


__all__ = ["EngineHost", "RayEngineFleet"]
