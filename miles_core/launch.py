"""Starting a training run from a configuration, Ray or not: the entry point above the
run loop (:mod:`miles_core.training.run`) and the cluster (:mod:`miles_core.cluster`).

With ``--use-ray`` the training ranks, the reward and the engine servers the run starts
(the embedded engine's among them) are Ray actors in one placement group, started here
before the run and released when it ends; the driver keeps the run loop and loads no
model. Without it nothing imports Ray.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.plugin_manager import loss_spec
from miles_core.training.loops import rolls_out
from miles_core.training.run import train as train_run
from miles_core.training.run_engine import started_servers


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def start_session(config: Config, *, log: Callable[[str], None] = _stderr) -> Any:
    """The :class:`~miles_core.cluster.session.RaySession` a ``--use-ray`` run starts
    before its run (placement for the engine servers it starts and its reward worker);
    the caller closes it."""
    from miles_core.cluster.session import RaySession

    generates = rolls_out(loss_spec(config)) and not (config.train_only or config.load_debug_rollout_data)
    return RaySession.start(
        config,
        engines=started_servers(config) if generates else 0,
        reward_worker=generates,
        log=log,
    )


async def train(config: Config, *, log: Callable[[str], None] = _stderr, before_load: Callable[[Config, Any], None] | None = None) -> Path:
    """Run training; return the run directory. ``log`` is the console; every line also
    goes to ``RUN_DIR/train.log`` (:class:`~miles_core.training.run_log.RunLog`), the
    cluster's start and stop included: the run's own ``train`` attaches the same run log
    inside this block, and only this (outermost) block's end closes the file.
    ``before_load``: see :func:`miles_core.training.run.prepare_run`."""
    from miles_core.training.run_log import RunLog

    if not config.get("use_ray"):
        return await train_run(config, log=log, before_load=before_load)
    with RunLog.of(log, config).attached() as run_log:
        cluster = start_session(config, log=run_log)
        try:
            return await train_run(config, log=run_log, cluster=cluster, before_load=before_load)
        finally:
            cluster.close()


def run_sync(config: Config, *, before_load: Callable[[Config, Any], None] | None = None) -> Path:
    """:func:`train` in a fresh event loop; ``before_load``: see
    :func:`miles_core.training.run.prepare_run`."""
    return asyncio.run(train(config, before_load=before_load))
