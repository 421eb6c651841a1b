"""``miles-core serve-reward --rm-type NAME``: serve one reward over HTTP (``POST /score``,
``GET /info``, ``GET /health``), the server ``--rm-type remote`` calls (docs/rewards.md,
"Serving a reward").

Give the reward as a training run would (``--rm-type``, ``--reward-weights``,
``--custom-rm-path``, ``--reward-key``, ``--group-rm``, the rewards' own flags, or
``--custom-config-path``). The server listens at once and builds the reward in the
background; ``GET /health`` answers 200 when it is ready. A reward that cannot be built
stops the command with its one-line error. Binds 127.0.0.1 unless ``--host`` says
otherwise; SIGTERM or SIGINT stops it.

Access: with a key (``--api-key``, else ``--api-key-file``, else the environment variable
MILES_API_KEY) every request but ``GET /health`` must carry ``Authorization: Bearer KEY``.
With ``--allowed-weight-roots`` every path flag the served rewards' plugin sets must lie
under a root, links resolved; requests never name a path.

``--run-worker`` is how a ``--use-ray`` run starts its reward workers (docs/cluster.md,
"Reward workers"): the run's routes instead of ``POST /score``, its key from MILES_API_KEY.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from miles_core.config.parser import OneLineParser
from miles_core.engine.auth import API_KEY_ENV, is_loopback, resolve_api_key
from miles_core.engine.weight_roots import resolve_roots
from miles_core.errors import MilesError, UsageError
from miles_core.reward_service.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_SAMPLES, one_line

SERVE_DESTS = ("serve_host", "serve_port", "serve_allowed_weight_roots", "serve_max_samples", "serve_max_body_bytes", "serve_run_worker")


def add_serve_arguments(parser: OneLineParser) -> list[str]:
    """The command's own arguments, added to the training flags' parser (which already has
    the reward flags, ``--api-key`` and ``--api-key-file``)."""
    parser.description = __doc__.replace("``", "")
    group = parser.add_argument_group("Serving")
    group.add_argument("--host", dest="serve_host", metavar="HOST", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", dest="serve_port", metavar="PORT", type=int, default=0, help="port to listen on (default: 0, a free port)")
    group.add_argument(
        "--allowed-weight-roots",
        dest="serve_allowed_weight_roots",
        nargs="+",
        default=[],
        metavar="DIR",
        help="directories the served rewards' weights must lie under: every path flag of their plugin that is set "
        "(metavar PATH, DIR or FILE, or a name ending in -path) must name a local file or directory under one, links "
        "resolved, else the command exits 2 before building anything (default: no check)",
    )
    group.add_argument(
        "--max-samples",
        dest="serve_max_samples",
        type=int,
        default=DEFAULT_MAX_SAMPLES,
        metavar="N",
        help="most samples one POST /score may carry; more answers 413 (default: %(default)s)",
    )
    group.add_argument(
        "--max-body-bytes",
        dest="serve_max_body_bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest POST /score body; a larger one answers 413 (default: %(default)s, 256 MiB)",
    )
    group.add_argument(
        "--run-worker",
        dest="serve_run_worker",
        action="store_true",
        help="serve as a --use-ray run's reward worker, as the run starts them (--reward-num-workers): the /worker/* "
        "routes instead of POST /score, each sample scored as the run scores it (its metadata.rm_type included), the "
        "evaluation reward too; its key is the one its run sets in MILES_API_KEY (a --api-key-file it is given is "
        "then the run's, for a remote reward); not for clients of the reward wire",
    )
    return list(SERVE_DESTS)


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def open_warning(prog: str, host: str, key: str | None) -> str | None:
    """The one-line warning for a server listening beyond loopback without a key."""
    if key is not None or is_loopback(host):
        return None
    return (
        f"warning: {prog} listens on {host} without an API key: anyone who can reach it can use its reward "
        f"(and its GPU time); set {API_KEY_ENV} or --api-key-file"
    )


def run(argv: Sequence[str], prog: str = "miles-core serve-reward") -> int:
    from miles_core.config.resolve import resolve_config

    config = resolve_config(list(argv), prog=prog, scope="reward", extend=add_serve_arguments)
    for note in config.notes:
        _warn(f"{prog}: warning: {note}")
    own = config.command_arguments
    if not 0 <= own["serve_port"] < 65536:
        raise UsageError(f"--port {own['serve_port']}: must be in [0, 65535]")
    for dest in ("serve_max_samples", "serve_max_body_bytes"):
        if own[dest] < 1:
            raise UsageError(f"--{dest.removeprefix('serve_').replace('_', '-')} {own[dest]}: must be at least 1")
    if own["serve_run_worker"]:
        # A run's worker requires its run's secret, which its host sets in the environment;
        # the --api-key-file it was given is its run's, which a remote reward there uses.
        key = os.environ.get(API_KEY_ENV) or None
        if key is None:
            raise UsageError(f"--run-worker: {API_KEY_ENV} must hold the secret of the run that starts this worker")
    else:
        key = resolve_api_key(config.api_key, config.api_key_file, warn=_warn)
    roots = resolve_roots(own["serve_allowed_weight_roots"]) if own["serve_allowed_weight_roots"] else None
    # Read once; gone from the environment, so no process this one starts inherits it.
    os.environ.pop(API_KEY_ENV, None)
    from miles_core.reward_service.server import check_servable

    check_servable(config, roots, worker=own["serve_run_worker"])  # before the port is taken or anything is built
    from miles_core.config.determinism import apply_deterministic_mode

    apply_deterministic_mode(config)  # --deterministic-mode: the reward scores as in the run's own process
    warning = open_warning(prog, own["serve_host"], key)
    if warning is not None:
        _warn(warning)
    from miles_core.quiet import show_hub_libraries

    show_hub_libraries(config.get("log_level") or "info")  # reward models may come from the hub: their progress shows
    try:
        return asyncio.run(_serve(config, key, roots, prog))
    except OSError as exc:  # the address is taken or cannot be bound
        print(f"{prog}: error: cannot listen on {own['serve_host']}:{own['serve_port']}: {exc}", file=sys.stderr)
        return 1


PARENT_POLL_SECONDS = 1.0


async def _watch_parent(prog: str, stop: asyncio.Event, status: dict[str, int]) -> None:
    """A run's worker stops when the process that started it (its host actor) is gone:
    killed, it cannot stop its server, which would hold its device for nothing."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_SECONDS)
    _warn(f"{prog}: error: the process that started this worker (pid {parent}) is gone; stopping")
    status["code"] = 1
    stop.set()


async def _serve(config: Any, key: str | None, roots: Any, prog: str) -> int:
    from miles_core.reward_service.server import create_reward_app, start_reward_server

    own = config.command_arguments
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    status = {"code": 0}
    where: dict[str, str] = {}

    def ready(scorer: Any) -> None:  # from the builder thread; on the loop, the URL is known
        loop.call_soon_threadsafe(lambda: _warn(f"serving reward {scorer.name} on {where['url']}"))

    def failed(exc: BaseException) -> None:
        _warn(f"{prog}: error: {one_line(exc)}")
        status["code"] = exc.exit_code if isinstance(exc, MilesError) else 1
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from miles_core.reward_service.run_worker import create_worker_app

    app = (create_worker_app if own["serve_run_worker"] else create_reward_app)(
        config,
        api_key=key,
        allowed_weight_roots=roots,
        max_samples=own["serve_max_samples"],
        max_body_bytes=own["serve_max_body_bytes"],
        on_ready=ready,
        on_build_error=failed,
    )
    server = await start_reward_server(app, own["serve_host"], own["serve_port"])
    where["url"] = server.url
    _warn(f"listening on {server.url}; building the reward (GET /health answers 200 when it is ready)")
    watch = asyncio.create_task(_watch_parent(prog, stop, status)) if own["serve_run_worker"] else None
    try:
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        await server.close()
    return status["code"]
