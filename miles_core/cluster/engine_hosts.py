"""Engine servers of a ``--use-ray`` run as Ray actors.

Each :class:`EngineHost` actor sits on its engine's bundles of the placement group and
runs one ``miles-core serve-engine`` subprocess there (``--rollout-engine http
--rollout-num-engines N``; on a GPU node it sees exactly the GPUs Ray gave the actor).
The embedded engine (``--rollout-engine embedded``, the default) runs in an
:class:`EmbeddedEngineHost` actor instead: the engine the run would embed, built from the
run's configuration (its family loader and SDE backends), served in the actor by the
same HTTP server (:mod:`miles_core.engine.server`). Either binds the node's address so
the driver reaches it from another node. :class:`RayEngineFleet` has the interface of
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


class EmbeddedEngineHost:
    """The embedded engine of a ``--use-ray`` run on its own actor (made one by
    :meth:`RayEngineFleet.start_embedded`): the engine is built in this process, as
    ``--rollout-engine embedded`` builds it, and served on a thread of its own."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.server: Any = None
        self.engine: Any = None
        self._loop: Any = None
        self._thread: Any = None

    def start(self, timeout: float = START_TIMEOUT) -> str:
        """Load the engine and serve it; returns the URL once ``/health`` would answer 200."""
        import asyncio
        import threading

        import ray

        from miles_core.config.determinism import apply_deterministic_mode
        from miles_core.engine.embedded import EmbeddedEngine
        from miles_core.engine.server import STATE, create_app, start_server
        from miles_core.errors import FleetError

        self.stop()
        apply_deterministic_mode(self.config)  # as the one-process run does for its embedded engine
        self.engine = EmbeddedEngine.from_config(self.config)
        app = create_app(self.engine, update_weight_buffer_size=self.config.update_weight_buffer_size)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-engine-server", daemon=True)
        self._thread.start()
        host = ray.util.get_node_ip_address()
        self.server = asyncio.run_coroutine_threadsafe(start_server(app, host, 0), self._loop).result(timeout)
        state = app[STATE]
        if not state.ready.wait(timeout) or state.error is not None:
            raise FleetError(f"the embedded engine on its Ray actor did not become ready: {state.error}")
        return self.server.url

    def pid(self) -> int:
        import os

        return os.getpid()

    def stop(self) -> None:
        if self.server is not None:
            import asyncio

            asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(30)
            asyncio.run_coroutine_threadsafe(self.engine.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self.server = self.engine = self._loop = self._thread = None


class RayEngineFleet:
    """``count`` engine servers on their bundles (see the module docstring)."""

    def __init__(self, hosts: list[Any], urls: list[str], log_paths: list[Path], respawn: Any = None) -> None:
        import ray

        self._ray = ray
        self.hosts = hosts
        self._urls = urls
        self.log_paths = log_paths
        self._respawn = respawn
        """Builds host ``index`` anew (the embedded engine's: a restart replaces the actor)."""

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

    @classmethod
    def start_embedded(cls, config: Any, runtime: Any) -> RayEngineFleet:
        """The run's embedded engine on its actor, on the placement group's engine bundle
        (a training device's share under ``--colocate``)."""
        import ray

        bundle = runtime.plan.engines[0][0]
        actor = ray.remote(EmbeddedEngineHost)

        def spawn(index: int) -> Any:
            return actor.options(**runtime.options(bundle, runtime.plan.engine_share)).remote(config)

        fleet = cls([spawn(0)], [], [], respawn=spawn)
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
        """Start engine ``index`` again (a fresh server on its bundle; for the embedded
        engine a fresh actor, since its server shares the actor's process); its new URL."""
        if self._respawn is not None:
            self._ray.kill(self.hosts[index])
            self.hosts[index] = self._respawn(index)
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


__all__ = ["EmbeddedEngineHost", "EngineHost", "RayEngineFleet"]
