"""``miles-core router``: the miles router, least-busy routing of ``POST /rollout/generate``
over engine servers registered with ``POST /add_worker?url=URL`` (or given with
``--worker-urls``), with health checks, a cap per engine, retries of unanswered requests on
another engine, ``POST /remove_worker`` and ``GET /list_workers``. A run with
``--use-miles-router`` starts one itself. Binds 127.0.0.1 unless ``--host`` says
otherwise; SIGTERM or SIGINT stops it. Loads no model and imports no torch.

With a key (``--api-key``, else ``--api-key-file``, else the environment variable
``MILES_API_KEY``) every route but ``GET /health`` requires ``Authorization: Bearer KEY``
(else 401), and the router sends the key to the engines; without one it warns at start-up
when it listens beyond loopback."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import Any

from miles_core.config.parser import OneLineParser
from miles_core.engine.router import ROUTER_FLAGS


def _reference(name: str) -> Any:
    from miles_core.config.reference_flags import FLAGS

    return next(flag for flag in FLAGS if flag.name == name)


def build_parser(prog: str = "miles-core router") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: 0, a free port)")
    parser.add_argument("--worker-urls", nargs="*", default=[], metavar="URL", help="engine base URLs to register at start")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="the key clients must send and the engines require; a command line shows in ps to every user of the "
        "machine, so prefer MILES_API_KEY or --api-key-file",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file holding the key, readable by its owner only (chmod 600; a looser one is used with a warning)",
    )
    for name in ROUTER_FLAGS:
        flag = _reference(name)
        kind = {"int": int, "float": float}[flag.type]
        default = "unset" if flag.default is None else flag.default
        metavar = "N" if flag.type == "int" else "S"
        parser.add_argument(name, type=kind, default=flag.default, metavar=metavar, help=f"{flag.help} (default: {default})")
    return parser


def parse_args(argv: Sequence[str], prog: str = "miles-core router") -> argparse.Namespace:
    """The checked arguments; a bad one exits with status 2 and a one-line error."""
    from miles_core.engine.auth import resolve_api_key
    from miles_core.engine.health import FaultTolerance
    from miles_core.engine.router import RouterSettings
    from miles_core.errors import ApiKeyError

    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    try:
        args.api_key = resolve_api_key(args.api_key, args.api_key_file, warn=_warn)
    except ApiKeyError as exc:
        parser.error(str(exc))
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port}: must be in [0, 65535]")
    for url in args.worker_urls:
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
            parser.error(f"--worker-urls: {url!r} is not an http:// or https:// base URL")
    try:
        health = FaultTolerance(
            interval=args.rollout_health_check_interval,
            timeout=args.rollout_health_check_timeout,
            first_wait=args.rollout_health_check_first_wait,
            failure_threshold=args.miles_router_health_check_failure_threshold,
        )
        args.settings = RouterSettings(
            max_concurrency=args.sglang_server_concurrency,
            max_connections=args.miles_router_max_connections,
            request_timeout=args.miles_router_timeout,
            health=health,
        )
    except ValueError as exc:
        parser.error(_flag_message(str(exc)))
    return args


def _warn(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def _flag_message(message: str) -> str:
    """A settings error in the words of the flags (``fault tolerance: interval ...`` ->
    ``--rollout-health-check-interval ...``)."""
    for field, flag in (
        ("interval", "--rollout-health-check-interval"),
        ("timeout", "--rollout-health-check-timeout"),
        ("first_wait", "--rollout-health-check-first-wait"),
    ):
        prefix = f"fault tolerance: {field} "
        if message.startswith(prefix):
            return f"{flag} {message[len(prefix) :]}"
    return message


def run(argv: Sequence[str], prog: str = "miles-core router") -> int:
    args = parse_args(argv, prog)
    try:
        return asyncio.run(_serve(args))
    except OSError as exc:  # the address is taken or cannot be bound
        import sys

        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


async def _serve(args: argparse.Namespace) -> int:
    from miles_core.engine.auth import open_server_warning
    from miles_core.engine.router import Router, serve

    warning = open_server_warning("miles-core router", args.host, args.api_key)
    if warning is not None:
        _warn(warning)
    router = Router(args.settings, api_key=args.api_key)
    for url in args.worker_urls:
        router.add(url.rstrip("/"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(router, args.host, args.port, stop)
    return 0
