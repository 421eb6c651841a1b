"""The miles router a run starts (``--use-miles-router``): a ``miles-core router``
subprocess configured by the run's router flags, its stderr in a log file, stopped with
the run's engine servers. Nothing here imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles_core.engine.auth import API_KEY_ENV
from miles_core.engine.fleet import ServedEngine, wait_for
from miles_core.engine.router import ROUTER_FLAGS


class RouterProcess(ServedEngine):
    """A running ``miles-core router`` (its URL read from its log, as a served engine's)."""

    kind = "the miles router"


def router_arguments(config: Any) -> list[str]:
    """The ``miles-core router`` arguments of a run: each of :data:`ROUTER_FLAGS` it sets."""
    args: list[str] = []
    for name in ROUTER_FLAGS:
        value = config.get(name[2:].replace("-", "_"))
        if value is not None:
            args += [name, str(value)]
    return args


def start_router(
    args: list[str], log_path: str | Path, *, host: str = "127.0.0.1", timeout: float = 60.0, api_key: str | None = None
) -> RouterProcess:
    """Start ``miles-core router --host HOST --port 0 ARGS`` and wait (at most ``timeout``
    s) until it answers ``GET /health``; on failure it is killed and
    :class:`~miles_core.errors.FleetError` names its log. ``api_key`` (the run's secret)
    reaches the router in its environment only, never on its command line; without one
    the router runs without a key, whatever this process's environment holds."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "miles_core.cli.main", "router", "--host", host, "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    router = RouterProcess(process, log_path)
    try:
        wait_for([router], timeout, healthy=True)
    except BaseException:
        router.stop(timeout=5)
        raise
    return router


class RoutedFleet:
    """A run's engine servers and the router in front of them: the fleet's interface
    (``urls``, ``restart``, ``engines``), and :meth:`stop` stops the router too."""

    def __init__(self, fleet: Any, router: RouterProcess) -> None:
        self.fleet = fleet
        self.router = router

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fleet, name)

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.fleet.stop(timeout)
        finally:
            self.router.stop(timeout)


__all__ = ["RoutedFleet", "RouterProcess", "router_arguments", "start_router"]
