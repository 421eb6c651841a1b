"""Engine servers of a ``--use-ray`` run as Ray actors.

Each :class:`EngineHost` actor sits on its engine's bundles of the placement group and
runs one ``miles-core serve-engine`` subprocess there (``--rollout-engine http
--rollout-num-engines N``; on a GPU node it sees exactly the GPUs Ray gave the actor).
The embedded engine (``--rollout-engine embedded``, the default) runs in an
:class:`EmbeddedEngineHost` actor instead: the engine the run would embed, built from the
run's configuration (its family loader and SDE backends), served in the actor by the
same HTTP server (:mod:`miles_core.engine.server`). Either binds the node's address so
the driver reaches it from another node, and requires the run's secret of every request
but ``GET /health``: a host gets it as a constructor argument (never through Ray's
``runtime_env``, which Ray's state API shows) and hands it to its server's environment
(``MILES_API_KEY``) or, for the embedded engine, to :func:`~miles_core.engine.server.create_app`. :class:`RayEngineFleet` has the interface of
:class:`~miles_core.engine.fleet.EngineFleet` (``urls``, ``restart``, ``stop``): the run's
HTTP client, weight sync and fault tolerance work on either.

An engine holds every bundle it was given, as the training ranks hold theirs: its host
actor sits on the first, a :class:`BundleHolder` on each other one keeps that bundle's
device. All of an engine's bundles must be on one node (:func:`engine_nodes`); the server
subprocess sees exactly their devices (``CUDA_VISIBLE_DEVICES``, the union of the GPU ids
Ray assigned them, when the bundles are GPUs). A restart starts a new server on the same
actors, so in the same bundles. :meth:`RayEngineFleet.placements` reports where each
engine is (:class:`EnginePlacement`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_core.cluster.placement import device_env, engine_nodes
from miles_core.cluster.runtime import task_result
from miles_core.errors import PlacementError

START_TIMEOUT = 300.0
"""Seconds an engine server may take to load its model and answer ``/health``."""


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine server of a Ray run is (:meth:`RayEngineFleet.placements`)."""

    index: int
    url: str
    node_id: str
    """The Ray node id of the node holding every bundle of the engine."""
    node_ip: str
    bundles: tuple[int, ...]
    """The engine's bundle indices in the run's placement group."""
    device_ids: tuple[str, ...]
    """The GPU ids Ray assigned the bundles (empty where CPUs stand in for GPUs)."""
    pid: int | None
    """The server's process (the host actor's own for the embedded engine)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """The variables placement sets for the server (``CUDA_VISIBLE_DEVICES``, the
    ``--deterministic-mode`` ones), as read back from the server process's environment."""


def _where() -> dict[str, Any]:
    """This actor's node and the GPU ids Ray assigned it."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
    }


def process_env(pid: int | None, names: Sequence[str]) -> dict[str, str]:
    """The values of ``names`` in process ``pid``'s environment (``/proc/PID/environ``; this
    process's own environment when ``pid`` is this process); those it lacks are left out."""
    if pid == os.getpid():
        return {name: os.environ[name] for name in names if name in os.environ}
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return {name: env[name] for name in names if name in env}


class BundleHolder:
    """Made a Ray actor on each bundle of an engine but its first: it holds the bundle's
    resources (its device) for the engine's server, which the host on the first bundle runs."""

    def where(self) -> dict[str, Any]:
        return _where()


class ServerHost:
    """What the hosts of a server subprocess share: where they are, the environment
    placement gives the server, its pid and what of that environment it has."""

    engine: Any
    env: dict[str, str]

    def where(self) -> dict[str, Any]:
        return _where()

    def place(self, env: Mapping[str, str]) -> None:
        """The environment the server gets over the actor's (its bundles' devices)."""
        self.env = dict(env)

    def pid(self) -> int | None:
        return None if self.engine is None else self.engine.process.pid

    def describe(self, names: Sequence[str]) -> dict[str, Any]:
        """Where the server runs and the values of ``names`` in its environment."""
        pid = self.pid()
        return {**_where(), "pid": pid, "env": process_env(pid, names) if pid is not None else {}}

    def stop(self) -> None:
        """Stop the server (a :class:`~miles_core.engine.fleet.ServedEngine`), if one runs."""
        if self.engine is not None:
            self.engine.stop(timeout=30)
            self.engine = None


class EngineHost(ServerHost):
    """Made a Ray actor by :class:`RayEngineFleet`."""

    def __init__(self, checkpoint: str, args: Sequence[str], log_path: str, api_key: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.args = list(args)
        self.log_path = log_path
        self.api_key = api_key
        """The run's secret, which each server it starts (a restart's too) requires."""
        self.engine: Any = None
        self.env: dict[str, str] = {}

    def start(self, timeout: float = START_TIMEOUT) -> str:
        """Start the server (after stopping a previous one) and wait until it is healthy;
        returns its URL. A server that fails raises FleetError naming its log."""
        import ray

        from miles_core.engine.fleet import start_engine
        from miles_core.model_loading import model_device

        self.stop()
        args = [*self.args, "--device", model_device(), "--host", ray.util.get_node_ip_address()]
        self.engine = start_engine(
            self.checkpoint,
            *args,
            log_path=self.log_path,
            timeout=timeout,
            healthy=True,
            threads=None,
            env=self.env,
            api_key=self.api_key,
        )
        return self.engine.url


SGLANG_START_TIMEOUT = 600.0
"""Seconds an sglang-diffusion server may take to load and answer ``/health``."""

PROBE_NAME = "placement-probe"
"""A file the driver writes in the sglang work directory; each host reads it back to
know the directory is the driver's (weight syncs go through it)."""


class SglangHost(ServerHost):
    """One sglang-diffusion server of a ``--use-ray`` run (``--rollout-engine sglang``),
    made a Ray actor by :meth:`RayEngineFleet.start_sglang`: started on this node's address,
    with its bundles' devices, its log under ``work_dir/logs`` (a restart's in
    ``engine-<i>.restart<k>.log``). With ``api_key`` (the run's secret, kept in this actor
    and given to the server's proxy in its environment) the node's address is an
    authenticating proxy's and sglang listens on 127.0.0.1 behind it
    (:func:`~miles_core.engine.sglang.spawn_server`); disk loads only from under the run's
    sync folder ``work_dir/weight-sync`` and ``allowed_weight_roots``. A restart keeps both."""

    def __init__(
        self,
        index: int,
        python: str,
        model_path: str,
        sglang_args: Sequence[str],
        work_dir: str,
        token: str,
        api_key: str | None = None,
        allowed_weight_roots: Sequence[str] = (),
    ) -> None:
        self.index = index
        self.python = python
        self.model_path = model_path
        self.sglang_args = list(sglang_args)
        self.work_dir = Path(work_dir)
        self.token = token
        self.api_key = api_key
        self.allowed_weight_roots = list(allowed_weight_roots)
        self.engine: Any = None
        self.env: dict[str, str] = {}
        self.process: Any = None
        self.starts = 0

    def start(self, timeout: float = SGLANG_START_TIMEOUT) -> str:
        import ray

        from miles_core.engine.sglang import free_port, spawn_server, wait_server
        from miles_core.errors import SglangEngineError

        self.stop()
        host = ray.util.get_node_ip_address()
        probe = self.work_dir / PROBE_NAME
        try:
            seen = probe.read_text()
        except OSError:
            seen = None
        if seen != self.token:
            raise SglangEngineError(
                f"sglang-diffusion engine {self.index} on node {host}: the run's sglang work directory {self.work_dir} is not "
                "the driver's there; weight syncs go through it, so on several nodes put --output-dir on a filesystem all "
                "nodes share"
            )
        restart = f".restart{self.starts}" if self.starts else ""
        self.starts += 1
        log_path = self.work_dir / "logs" / f"engine-{self.index}{restart}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        port = free_port(host)
        roots: list[str] = []
        if self.api_key is not None:  # SglangEngine's sync folder under work_dir (its re-syncs' are inside it)
            sync_root = self.work_dir / "weight-sync"
            sync_root.mkdir(parents=True, exist_ok=True)
            roots = [str(sync_root), *self.allowed_weight_roots]
        try:
            self.process = spawn_server(
                self.python,
                self.model_path,
                port,
                self.sglang_args,
                environment,
                log_path,
                host,
                api_key=self.api_key,
                allowed_weight_roots=roots,
            )
        except OSError as exc:
            raise SglangEngineError(f"sglang-diffusion engine {self.index} on node {host}: cannot start {self.python}: {exc}") from None
        url = f"http://{host}:{port}"
        wait_server(self.index, self.process, url, log_path, timeout)
        return url

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self) -> None:
        if self.process is not None:
            import signal
            import subprocess

            from miles_core.engine.sglang import kill_servers

            try:  # a graceful stop first, as SglangEngine.stop_servers does
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            kill_servers([self.process])
            self.process = None


class EmbeddedEngineHost:
    """The embedded engine of a ``--use-ray`` run on its own actor (made one by
    :meth:`RayEngineFleet.start_embedded`): the engine is built in this process, as
    ``--rollout-engine embedded`` builds it, and served on a thread of its own."""

    def __init__(self, config: Any, api_key: str | None = None) -> None:
        self.config = config
        self.api_key = api_key
        """The run's secret, which the server requires of every request but ``GET /health``."""
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
        app = create_app(self.engine, update_weight_buffer_size=self.config.update_weight_buffer_size, api_key=self.api_key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedded-engine-server", daemon=True)
        self._thread.start()
        host = ray.util.get_node_ip_address()
        self.server = asyncio.run_coroutine_threadsafe(start_server(app, host, 0), self._loop).result(timeout)
        state = app[STATE]
        if not state.ready.wait(timeout) or state.error is not None:
            raise FleetError(f"the embedded engine on its Ray actor did not become ready: {state.error}")
        return self.server.url

    def where(self) -> dict[str, Any]:
        return _where()

    def place(self, env: Mapping[str, str]) -> None:
        """Nothing to pass on: the engine runs in this actor, whose environment Ray set."""

    def pid(self) -> int:
        return os.getpid()

    def describe(self, names: Sequence[str]) -> dict[str, Any]:
        return {**_where(), "pid": os.getpid(), "env": process_env(os.getpid(), names)}

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

    def __init__(
        self,
        hosts: list[Any],
        urls: list[str],
        log_paths: list[Path],
        respawn: Any = None,
        *,
        bundles: Sequence[Sequence[int]] = (),
        holders: Sequence[Sequence[Any]] = (),
        device_ids: Sequence[Sequence[str]] = (),
        env_names: Sequence[str] = (),
    ) -> None:
        import ray

        self._ray = ray
        self.hosts = hosts
        self._urls = urls
        self.log_paths = log_paths
        self._respawn = respawn
        """Builds host ``index`` anew (the embedded engine's: a restart replaces the actor)."""
        self.bundles = [tuple(b) for b in bundles]
        self.holders = [list(h) for h in holders]
        self.device_ids = [tuple(d) for d in device_ids]
        self._env_names = list(env_names)

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    @classmethod
    def start(cls, config: Any, runtime: Any, log_dir: str | Path, *, api_key: str | None = None) -> RayEngineFleet:
        """Start the run's engines on the placement group's engine bundles, each requiring
        ``api_key`` (the run's secret); on a failure the ones started are stopped and
        :class:`~miles_core.engine.fleet.FleetError` names the failing server's log."""
        import ray

        from miles_core.engine.fleet import serve_arguments

        args = serve_arguments(config)
        actor = ray.remote(EngineHost)
        log_paths = [Path(log_dir) / f"engine_{index}.log" for index in range(len(runtime.plan.engines))]

        def spawn(index: int, options: dict[str, Any]) -> Any:
            return actor.options(**options).remote(str(config.hf_checkpoint), args, str(log_paths[index]), api_key)

        return cls.place(runtime, spawn, log_paths)

    @classmethod
    def place(cls, runtime: Any, spawn: Any, log_paths: list[Path], respawn: Any = None) -> RayEngineFleet:
        """Put engine ``i``'s host (``spawn(i, actor options)``) on its first bundle and a
        :class:`BundleHolder` on each other one, check they share one node, give each
        server its bundles' devices, then start the servers (all at once)."""
        import ray
        from ray.util.placement_group import placement_group_table

        plan = runtime.plan
        engines = [list(bundles) for bundles in plan.engines]
        engine_nodes(engines, placement_group_table(runtime.group)["bundles_to_node_id"])
        holder = ray.remote(BundleHolder)
        hosts, holders = [], []
        fleet = cls(hosts, [], log_paths, respawn, bundles=engines)
        fleet.holders = holders  # filled as they start, so that a failure stops those started
        try:
            for index, bundles in enumerate(engines):
                hosts.append(spawn(index, runtime.options(bundles[0], plan.engine_share)))
                holders.append([holder.options(**runtime.options(b, plan.engine_share)).remote() for b in bundles[1:]])
            places = [task_result([actor.where.remote() for actor in [host, *held]]) for host, held in zip(hosts, holders, strict=True)]
            envs = []
            for index, place in enumerate(places):
                nodes = list(dict.fromkeys(p["node_id"] for p in place))
                if len(nodes) > 1:  # Ray's table said otherwise: refuse rather than run an engine across nodes
                    raise PlacementError(
                        f"engine {index}: its bundles {engines[index]} hold actors on {len(nodes)} nodes ({', '.join(nodes)})"
                    )
                envs.append(device_env(plan.device, [p["gpu_ids"] for p in place]))
                fleet.device_ids.append(tuple(gpu for p in place for gpu in p["gpu_ids"]))
            fleet._env_names = sorted({*runtime.env_vars, *(name for env in envs for name in env)})
            task_result([host.place.remote(env) for host, env in zip(hosts, envs, strict=True)])
            fleet._urls = fleet._call_all("start")
        except BaseException:
            fleet.stop()
            raise
        return fleet

    @classmethod
    def start_sglang(cls, config: Any, runtime: Any, work_dir: str | Path, *, api_key: str | None = None) -> RayEngineFleet:
        """The run's sglang-diffusion servers (``--rollout-engine sglang``), each on its
        engine's bundles with their devices (``--rollout-num-gpus-per-engine`` N passes
        ``--num-gpus N``, see :func:`~miles_core.engine.sglang.engine_device_args`), bound to
        its node's address. ``work_dir`` (the weight syncs', the logs') must be the same
        directory on every node the engines are on: a host that cannot read the driver's
        probe file there refuses to start. Each server requires ``api_key`` (the run's secret)
        and, with it, loads weights from disk only under ``work_dir/weight-sync``, where the
        syncs and re-syncs of :class:`~miles_core.engine.sglang.SglangEngine` go (see
        :class:`SglangHost`)."""
        import secrets

        import ray

        from miles_core.engine.sglang import check_python, engine_device_args, server_args

        python = check_python(config.get("sglang_python"))
        args = engine_device_args(config.sglang_args, int(config.rollout_num_gpus_per_engine or 1))
        server_args(args)  # framework-set arguments fail before anything starts
        work_dir = Path(work_dir).absolute()
        work_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        (work_dir / PROBE_NAME).write_text(token)
        actor = ray.remote(SglangHost)
        model = str(Path(config.hf_checkpoint).absolute()) if Path(config.hf_checkpoint).exists() else str(config.hf_checkpoint)

        def spawn(index: int, options: dict[str, Any]) -> Any:
            return actor.options(**options).remote(index, python, model, args, str(work_dir), token, api_key=api_key)

        log_paths = [work_dir / "logs" / f"engine-{index}.log" for index in range(len(runtime.plan.engines))]
        return cls.place(runtime, spawn, log_paths)

    @classmethod
    def start_embedded(cls, config: Any, runtime: Any, *, api_key: str | None = None) -> RayEngineFleet:
        """The run's embedded engine on its actor, on the placement group's engine bundle
        (a training device's share under ``--colocate``), requiring ``api_key``."""
        import ray

        actor = ray.remote(EmbeddedEngineHost)
        options: dict[int, dict[str, Any]] = {}

        def spawn(index: int, actor_options: dict[str, Any]) -> Any:
            options[index] = actor_options
            return actor.options(**actor_options).remote(config, api_key)

        return cls.place(runtime, spawn, [], respawn=lambda index: spawn(index, options[index]))

    def _call_all(self, method: str) -> list[Any]:
        return task_result([getattr(host, method).remote() for host in self.hosts])

    def pids(self) -> list[int | None]:
        return self._call_all("pid")

    def placements(self) -> list[EnginePlacement]:
        """Where each engine runs: its node, bundles, devices, server pid and the placement
        environment its server process has."""
        answers = task_result([host.describe.remote(self._env_names) for host in self.hosts])
        return [
            EnginePlacement(
                index=index,
                url=self._urls[index],
                node_id=answer["node_id"],
                node_ip=answer["node_ip"],
                bundles=self.bundles[index],
                device_ids=self.device_ids[index],
                pid=answer["pid"],
                env=answer["env"],
            )
            for index, answer in enumerate(answers)
        ]

    def restart(self, index: int) -> str:
        """Start engine ``index`` again (a fresh server on its bundles; for the embedded
        engine a fresh actor on the same bundle, since its server shares the actor's process); its new URL."""
        if self._respawn is not None:
            self._ray.kill(self.hosts[index])
            self.hosts[index] = self._respawn(index)
        url = task_result(self.hosts[index].start.remote())
        self._urls[index] = url
        return url

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every server (all at once: each takes about a second to exit), then the
        host actors and bundle holders."""
        stopping = [host.stop.remote() for host in self.hosts]
        deadline = time.monotonic() + timeout
        for host, stopped in zip(self.hosts, stopping):
            try:
                self._ray.get(stopped, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # a host that died took its server with it
                pass
            self._ray.kill(host)
        for held in self.holders:
            for actor in held:
                self._ray.kill(actor)
        self.hosts, self.holders = [], []


__all__ = [
    "BundleHolder",
    "EmbeddedEngineHost",
    "EnginePlacement",
    "EngineHost",
    "RayEngineFleet",
    "ServerHost",
    "SglangHost",
    "process_env",
]
