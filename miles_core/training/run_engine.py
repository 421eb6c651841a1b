"""The rollout engine of a run: the one ``--rollout-engine`` names, or the fleet of
``serve-engine`` servers the run starts itself (``--rollout-num-engines``)."""

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


def started_servers(config: Config) -> int:
    """How many engine servers the run starts: ``--rollout-num-engines`` for a fleet,
    one for the embedded engine under ``--use-ray``, else none."""
    if starts_fleet(config):
        return int(config.rollout_num_engines)
    return 1 if hosts_embedded(config) else 0


def create_run_engine(config: Config) -> Any:
    from miles_core.engine.factory import create_engine

    engine = create_engine(config)
    if not isinstance(engine, EmbeddedEngine) and not hasattr(engine, "update_weights_from_tensors"):
        raise RunError(
            f"--rollout-engine {config.rollout_engine}: this engine takes no tensor weight updates, "
            "so the run cannot sync the trained weights to it"
        )
    return engine


def start_fleet(config: Config, out: Path, log: Callable[[str], None], cluster: Any = None) -> tuple[Any, Any]:
    """Start ``--rollout-num-engines`` serve-engine servers (logs under ``out/engines``;
    under ``--use-ray`` each on its Ray actor) and an
    :class:`~miles_core.engine.http.HttpEngine` over them."""
    from miles_core.engine.fleet import EngineFleet
    from miles_core.engine.http import FaultTolerance, HttpEngine
    from miles_core.errors import FleetError

    try:
        fault_tolerance = FaultTolerance.from_config(config)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    log_dir = out / "engines"
    if hosts_embedded(config):
        log(f"starting the embedded engine of {config.hf_checkpoint} on its Ray actor")
    else:
        log(f"starting {config.rollout_num_engines} engine server(s) of {config.hf_checkpoint}, logs in {log_dir}")
    try:
        fleet = EngineFleet.from_config(config, log_dir) if cluster is None else cluster.engine_fleet(log_dir)
    except FleetError as exc:
        raise RunError(str(exc)) from None
    log(f"engine servers: {', '.join(fleet.urls)}")

    async def restart(index: int) -> str:  # --use-fault-tolerance: the run restarts the servers it started
        return await asyncio.to_thread(fleet.restart, index)

    try:
        engine = HttpEngine(
            fleet.urls,
            max_concurrency=config.sglang_server_concurrency,
            decode_workers=config.rollout_parser_num_workers or 1,
            request_timeout=config.get("miles_router_timeout"),
            fault_tolerance=fault_tolerance,
            restart=restart if fault_tolerance is not None else None,
        )
    except ValueError as exc:
        fleet.stop(timeout=5)
        raise RunError(f"--miles-router-timeout: {exc}") from None
    return engine, fleet
