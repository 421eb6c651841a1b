"""The rollout engine of a run: the one ``--rollout-engine`` names, or the fleet of
``serve-engine`` servers the run starts itself (``--rollout-num-engines``).

A run that starts servers (that fleet, the embedded engine's or the sglang-diffusion
servers' Ray actors, the router, sglang-diffusion servers without Ray) makes a fresh
secret for them (:func:`start_fleet`, :func:`create_run_engine`); every
one of them requires it of each request but ``GET /health``, and the run's clients send
it. It lives in those clients and servers only: never on a command line, in a log, in
``config.yaml``, a metrics record or a checkpoint. Servers given by URL take the user's
key (``--api-key``, ``--api-key-file``, ``MILES_API_KEY``), which
:func:`check_engine_key` tries before the run loads its model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RunError


def starts_fleet(config: Config) -> bool:
    """``--rollout-engine http --rollout-num-engines N`` without URLs: the run starts its servers."""
    return config.rollout_engine == "http" and not config.rollout_engine_urls and bool(config.get("rollout_num_engines"))


def hosts_embedded(config: Config) -> bool:
    """Under ``--use-ray`` the embedded engine runs on an actor of its own, as an HTTP
    server the run starts, rather than in the driver."""
    return bool(config.get("use_ray")) and config.rollout_engine == "embedded"


def hosts_sglang(config: Config) -> bool:
    """Under ``--use-ray`` the sglang-diffusion servers are Ray actors on bundles of their
    own (without it :class:`~miles_core.engine.sglang.SglangEngine` starts them here)."""
    return bool(config.get("use_ray")) and config.rollout_engine == "sglang"


def started_servers(config: Config) -> int:
    """How many engine servers the run starts as a fleet: ``--rollout-num-engines`` for
    an http fleet or sglang-diffusion servers under ``--use-ray``, one for the embedded
    engine under ``--use-ray``, else none."""
    if starts_fleet(config):
        return int(config.rollout_num_engines)
    if hosts_sglang(config):
        return int(config.get("rollout_num_engines") or 1)
    return 1 if hosts_embedded(config) else 0


def starts_servers_itself(config: Config) -> bool:
    """``--rollout-engine sglang`` without ``--use-ray``: the engine starts its
    sglang-diffusion servers in its ``from_config``, which takes the run's secret."""
    return config.rollout_engine == "sglang" and not hosts_sglang(config)


def create_run_engine(config: Config) -> Any:
    """The engine ``--rollout-engine`` names (not a fleet the run starts); one that starts
    its own servers gets a fresh secret of the run for them."""
    from miles_core.engine.auth import new_secret
    from miles_core.engine.factory import create_engine

    engine = create_engine(config, api_key=new_secret()) if starts_servers_itself(config) else create_engine(config)
    if not isinstance(engine, EmbeddedEngine) and not hasattr(engine, "update_weights_from_tensors"):
        raise RunError(
            f"--rollout-engine {config.rollout_engine}: this engine takes no tensor weight updates, "
            "so the run cannot sync the trained weights to it"
        )
    return engine


async def check_engine_key(engine: Any) -> None:
    """Servers given by URL must take the run's key (or, without one, require none): one
    that answers 401 stops the run at start-up, exit status 2
    (:meth:`~miles_core.engine.http.HttpEngine.check_api_key`)."""
    check = getattr(engine, "check_api_key", None)
    if check is not None:
        await check()


def start_fleet(
    config: Config, out: Path, log: Callable[[str], None], cluster: Any = None, *, threads: int | None = None
) -> tuple[Any, Any]:
    """Start ``--rollout-num-engines`` serve-engine servers (logs under ``out/engines``;
    under ``--use-ray`` each on its Ray actor) and an
    :class:`~miles_core.engine.http.HttpEngine` over them; under ``--use-ray`` the
    sglang-diffusion servers on their actors (work directory ``out/sglang``) and an
    :class:`~miles_core.engine.sglang.SglangEngine` over them. They (and the router) all
    require a secret made here, which the client returned holds (``api_key``). ``threads``:
    torch threads of each serve-engine server started on this machine (the thread plan's)."""
    from miles_core.engine.auth import new_secret
    from miles_core.engine.fleet import EngineFleet
    from miles_core.engine.http import FaultTolerance, HttpEngine
    from miles_core.errors import FleetError
    from miles_core.training.prompt_embeddings import server_arguments

    try:
        fault_tolerance = FaultTolerance.from_config(config)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    sglang = hosts_sglang(config)
    log_dir = (out / "sglang").absolute() if sglang else out / "engines"
    if sglang:
        from miles_core.engine.sglang import SglangEngine

        options = SglangEngine.client_options(config)  # its settings' errors come before any server starts
        log(f"starting {started_servers(config)} sglang-diffusion server(s) of {config.hf_checkpoint} on Ray actors, logs in {log_dir}")
    elif hosts_embedded(config):
        log(f"starting the embedded engine of {config.hf_checkpoint} on its Ray actor")
    else:
        log(f"starting {config.rollout_num_engines} engine server(s) of {config.hf_checkpoint}, logs in {log_dir}")
    key = new_secret()  # this run's: every server it starts requires it
    # --use-miles-router: the router first, so that one that cannot start costs no engine start.
    router = _start_router(config, out, log, cluster, key) if config.get("use_miles_router") else None
    try:
        if cluster is None:
            preload = server_arguments(config, out)  # --precompute-prompt-embeddings: the run's store
            fleet = EngineFleet.from_config(config, log_dir, api_key=key, threads=threads, extra_args=preload)
        else:
            fleet = cluster.engine_fleet(log_dir, api_key=key)
    except BaseException as exc:
        if router is not None:
            router.stop(timeout=5)
        if isinstance(exc, FleetError):
            raise RunError(str(exc)) from None
        raise
    log(f"engine servers: {', '.join(fleet.urls)}")
    if router is not None:
        from miles_core.engine.router_process import RoutedFleet

        fleet = RoutedFleet(fleet, router)

    async def restart(index: int) -> str:  # --use-fault-tolerance: the run restarts the servers it started
        return await asyncio.to_thread(fleet.restart, index)

    try:
        if sglang:
            engine = SglangEngine(
                fleet.urls, [], [], log_dir, restart=restart if options["fault_tolerance"] is not None else None, api_key=key, **options
            )
            engine.model_path = str(config.hf_checkpoint)
            return _post_from_nodes(config, cluster, engine, fleet), fleet
        engine = HttpEngine(
            fleet.urls,
            max_concurrency=config.sglang_server_concurrency,
            decode_workers=config.rollout_parser_num_workers or 1,
            request_timeout=config.get("miles_router_timeout"),
            fault_tolerance=fault_tolerance,
            restart=restart if fault_tolerance is not None else None,
            router=None if router is None else router.url,
            router_log=None if router is None else str(router.log_path),
            api_key=key,
        )
        return _post_from_nodes(config, cluster, engine, fleet), fleet
    except ValueError as exc:
        fleet.stop(timeout=5)
        raise RunError(f"--miles-router-timeout: {exc}") from None
    except BaseException:  # servers the run started never outlive a failed set-up
        fleet.stop(timeout=5)
        raise


def _start_router(config: Config, out: Path, log: Callable[[str], None], cluster: Any, key: str) -> Any:
    """``--use-miles-router``: start the router (log ``out/router.log``; under ``--use-ray``
    bound to this node's IP, so that actors on other nodes reach it), requiring the run's
    ``key``, which it also sends to the engines."""
    from miles_core.engine.router_process import router_arguments, start_router
    from miles_core.errors import FleetError

    host = "127.0.0.1"
    if cluster is not None:
        host = cluster.node_address()
    log_path = (out / "router.log").absolute()
    try:
        router = start_router(router_arguments(config), log_path, host=host, api_key=key)
    except FleetError as exc:
        raise RunError(f"--use-miles-router: {exc}") from None
    log(f"miles router: {router.url}, log in {log_path}")
    return router


def _post_from_nodes(config: Config, cluster: Any, engine: Any, fleet: Any) -> Any:
    """``--use-distributed-post``: ``engine``'s requests posted by actors on the engines'
    nodes (:mod:`miles_core.cluster.post_actors`); the fleet is stopped if they cannot start."""
    if cluster is None or not config.get("use_distributed_post"):
        return engine
    try:
        engine.poster = cluster.poster(fleet, api_key=engine.api_key)
    except BaseException:
        fleet.stop(timeout=5)
        raise
    return engine
