"""An authenticating proxy in front of a server that takes no API key: sglang-diffusion
0.5.23 has no such option, so a sglang server the run starts listens on 127.0.0.1 on a
private port and this proxy listens on the address the run's clients use.

The proxy answers 401 to every request but ``GET /health`` that does not carry the run's
key (:func:`~miles_core.engine.auth.bearer_middleware`), refuses (403) a
``/update_weights_from_disk`` whose ``model_path``, or a ``/v1/set_lora`` whose
``lora_path``, lies outside the allowed weight roots
(:mod:`~miles_core.engine.weight_roots`), and forwards everything else as it came: the
method, path and query, the headers but the hop-by-hop ones and ``Authorization``, and the
body streamed both ways, undecoded; the server's status, headers and body come back
unchanged. No size cap beyond the server's own. The proxy's own errors are one line of
``{"error": ...}`` JSON (502 when the server gives no answer).

It runs as a process of its own, the parent of the server it fronts
(:func:`run_supervised`): ``python -m miles_core.engine.auth_proxy --host H --port P
--upstream-port Q [--allowed-weight-roots DIR ...] -- SERVER COMMAND``, the key in its
environment (:data:`~miles_core.engine.auth.API_KEY_ENV`), never on its command line. The
server stays in the proxy's process group (a signal to the group stops both), does not
get the key, and dies with the proxy; the proxy exits with the server's status when the
server exits. A process of its own rather than a task in the run's event loop: the proxy
then cannot stall behind the run's own work (a training step holds the driver's loop and
its GIL), it works the same in the driver and in a Ray actor, and starting, restarting and
stopping a server keep working on one process as before.

Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from miles_core.engine.auth import API_KEY_ENV, bearer_middleware, resolve_api_key
from miles_core.engine.weight_roots import ROOTS_FLAG, resolve_roots, weight_path_refusal
from miles_core.errors import ApiKeyError, MilesError

CONFINED_PATHS = {"/update_weights_from_disk": "model_path", "/v1/set_lora": "lora_path", "/set_lora": "lora_path"}
"""The routes that load weights from a path in their JSON body, and the field that holds it."""
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
"""Headers of one connection, not of the message (RFC 9110, section 7.6.1)."""
NOT_FORWARDED = HOP_BY_HOP | {"host", "authorization", "expect"}
"""Request headers the proxy does not pass on: the server needs neither the key nor the
proxy's own host, and aiohttp answers ``Expect: 100-continue`` itself."""
BANNER = "auth proxy listening on"
"""The start of the line the proxy prints to stderr once it listens (then its URL)."""
STOP_GRACE = 20.0
"""Seconds the server gets to exit after the proxy passes it a SIGTERM or SIGINT."""
GROUP_SIGNAL_WAIT = 2.0
"""Seconds the proxy waits, once signalled, for the server to exit on the same signal
(sent to their process group) before it passes the signal on itself."""


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def confined_refusal(path: str, body: bytes, roots: Sequence[Path]) -> tuple[int, str] | None:
    """Why the weight-loading request ``path`` with ``body`` is refused (status, one line),
    or None when its path field is absent (the server answers that) or under ``roots``.
    A body that is not a JSON object is refused here rather than left to the server's
    parser, so that no difference between two parsers can carry a path past the check."""
    field = CONFINED_PATHS[path]
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return 400, f"{path}: the body is not JSON"
    if not isinstance(data, dict):
        return 400, f"{path}: the body is not a JSON object"
    value = data.get(field)
    values = value if isinstance(value, list) else [value]
    for item in values:
        if item is None or item == "":
            continue  # nothing to load from: the server answers as it does
        if not isinstance(item, str):
            return 400, f"{path}: {field} must be a string path, got {type(item).__name__}"
        why = weight_path_refusal(item, roots, field=field)
        if why is not None:
            return 403, why
    return None


def create_proxy_app(upstream: str, key: str, roots: Sequence[Path]) -> web.Application:
    """The proxy's aiohttp application: requests that carry ``key`` go to ``upstream``
    (``http://HOST:PORT``), weight loads only from under ``roots``."""
    upstream = upstream.rstrip("/")
    sessions: list[aiohttp.ClientSession] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        session = sessions[0]
        data: bytes | aiohttp.StreamReader | None = None
        # Any method, and the path as a router that ignores repeated or trailing slashes
        # would read it: no spelling of a weight-loading route escapes the check.
        parts = request.path.split("/")
        if "." in parts or ".." in parts:
            # aiohttp does not collapse dot segments and the path goes on as it came: a
            # server that did collapse them could be led past the check.
            return error(400, f"path {request.path!r}: '.' and '..' segments are not forwarded")
        route = "/" + "/".join(part for part in parts if part)
        if route in CONFINED_PATHS:
            data = await request.read()
            refused = confined_refusal(route, data, roots)
            if refused is not None:
                return error(*refused)
        elif request.body_exists:
            data = request.content  # streamed: the body is never held whole here
        headers = [(name, value) for name, value in request.headers.items() if name.lower() not in NOT_FORWARDED]
        if isinstance(data, bytes) and "Transfer-Encoding" in request.headers:
            headers.append(("Content-Length", str(len(data))))  # read whole: sent with its length
        response: web.StreamResponse | None = None
        try:
            async with session.request(
                request.method,
                URL(upstream + request.rel_url.raw_path_qs, encoded=True),  # the path and query as they came
                headers=headers,
                data=data,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            ) as answer:
                response = web.StreamResponse(status=answer.status, reason=answer.reason)
                for name, value in answer.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        response.headers.add(name, value)
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            if response is not None and response.prepared:
                raise  # the status went out already: the connection is dropped, as the server's own failure would
            detail = str(exc) or type(exc).__name__
            return error(502, f"the server behind this proxy ({upstream}) gave no answer: {type(exc).__name__}: {detail}")

    async def on_startup(app: web.Application) -> None:
        # auto_decompress off: bodies go through as the server sent them; no timeout: the
        # client's own bounds the request.
        sessions.append(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
            )
        )

    async def on_cleanup(app: web.Application) -> None:
        for session in sessions:
            await session.close()

    # client_max_size=0: no cap of the proxy's own (only the weight-load routes' small
    # JSON bodies are read whole, and only once the key was checked).
    app = web.Application(middlewares=[bearer_middleware(key)], client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(app: web.Application, host: str, port: int, stop: asyncio.Future) -> None:
    """Serve ``app`` on ``host:port``, print :data:`BANNER` and the URL, until ``stop`` is done."""
    # auto_decompress off: a compressed request body goes on as it came (with its
    # Content-Encoding and Content-Length), and the weight-load check reads those bytes.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True, auto_decompress=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        shown = f"[{host}]" if ":" in host else host
        print(f"{BANNER} http://{shown}:{port}", file=sys.stderr, flush=True)
        await stop
    finally:
        await runner.cleanup()


def _die_with_parent() -> None:
    """In the server's process before it runs (Linux): SIGKILL it when the proxy dies, so
    that a proxy killed alone never leaves the keyless server running."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_server(command: Sequence[str]) -> subprocess.Popen:
    """Start the server (``command``) in this process group, without the key in its
    environment, to die with this process."""
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    return subprocess.Popen(list(command), env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)


async def run_supervised(server: subprocess.Popen, host: str, port: int, upstream_port: int, key: str, roots: Sequence[Path]) -> int:
    """Proxy ``host:port`` to ``server`` (on 127.0.0.1:``upstream_port``) until it exits
    or this process gets SIGTERM or SIGINT (passed on to the server, which gets
    :data:`STOP_GRACE` s before SIGKILL); returns the server's exit status as a shell
    reports it."""
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    signalled: list[int] = []

    def on_signal(signum: int) -> None:
        signalled.append(signum)
        if not stop.done():
            stop.set_result(None)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    exited = asyncio.ensure_future(asyncio.to_thread(server.wait))
    exited.add_done_callback(lambda _: stop.done() or stop.set_result(None))
    try:
        await serve(create_proxy_app(f"http://127.0.0.1:{upstream_port}", key, roots), host, port, stop)
    finally:
        if server.poll() is None and signalled:
            # A signal to the process group reached the server too: let it stop on that one.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), GROUP_SIGNAL_WAIT)
        if server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                server.send_signal(signalled[0] if signalled else signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), STOP_GRACE)
            except asyncio.TimeoutError:
                server.kill()
        code = await exited
    return 128 - code if code < 0 else code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles_core.engine.auth_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", required=True, help="the address the clients use")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True, help="the server's port on 127.0.0.1")
    parser.add_argument(ROOTS_FLAG, nargs="*", default=[], metavar="DIR", help="directories weights may be loaded from")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the server's command line")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")
    prog = "auth proxy"
    try:
        key = resolve_api_key(None, None)
        if key is None:
            raise ApiKeyError(f"{API_KEY_ENV} is not set: the proxy has no key to require")
        roots = resolve_roots(args.allowed_weight_roots)
    except MilesError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        server = start_server(command)
    except OSError as exc:
        print(f"{prog}: error: cannot start the server {command[0]}: {exc}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(run_supervised(server, args.host, args.port, args.upstream_port, key, roots))
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


__all__ = ["BANNER", "CONFINED_PATHS", "confined_refusal", "create_proxy_app", "main", "run_supervised", "serve", "start_server"]


if __name__ == "__main__":
    sys.exit(main())
