"""The miles router (``miles-core router``, ``--use-miles-router``): least-busy routing of
``/rollout/generate`` requests over registered engine servers, in a process of its own.

Routes:

- ``POST /rollout/generate``: the body goes unchanged to the least busy healthy engine
  (:class:`~miles_core.engine.routing.Balancer`: at most ``--sglang-server-concurrency``
  requests in flight on each), and the engine's answer comes back unchanged (status, body,
  content type; the router never decodes it), with the headers ``X-Miles-Engine`` (the
  engine that answered) and ``X-Miles-Retries`` (how many other engines gave no answer
  first). An engine that gives no answer (dead, hung, or past ``--miles-router-timeout``)
  is taken out of routing and the same body goes to another: the same seeds, the same
  samples. When none answers, or none is registered, the router answers 502 or 503 with
  ``{"error": ...}``.
- ``POST /add_worker?url=URL`` registers an engine, or puts back one that was taken out
  (its weights re-synced by whoever registers it); ``POST /remove_worker?url=URL`` takes one
  out for good (its requests in flight finish); ``GET /list_workers`` answers ``{"urls":
  [routed URLs], "workers": [{"url", "state", "reason", "in_flight", "sent"}], "retries":
  N}``; ``GET /health`` answers 200 while the router runs. The worker routes are named as
  sglang-router names them; a ``url`` may also come as a JSON body ``{"url": URL}``.

Health checks (:class:`~miles_core.engine.health.Supervisor`, ``readmit=False``): every
``--rollout-health-check-interval`` s (after ``--rollout-health-check-first-wait`` s) each
routed engine's ``GET /health`` must answer 200 within ``--rollout-health-check-timeout``
s; ``--miles-router-health-check-failure-threshold`` failures in a row take it out. The
router never puts an engine back by itself: an engine that was out may hold stale weights,
so it comes back when it is registered again. Health checks use a connection pool of
their own, so a full request pool (``--miles-router-max-connections``) cannot make a
healthy engine miss its checks.

With an API key (``miles-core router`` reads it as serve-engine does: ``--api-key``,
``--api-key-file`` or ``MILES_API_KEY``) every route but ``GET /health`` answers 401 to a
request that does not carry ``Authorization: Bearer <key>``
(:func:`~miles_core.engine.auth.bearer_middleware`), and the router sends the same key to
the engines, with every forwarded request and health check: a run's router and engines
share the run's secret.

Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from miles_core.engine.auth import auth_headers, bearer_middleware
from miles_core.engine.health import REMOVED, FaultTolerance, Supervisor
from miles_core.engine.limits import DEFAULT_MAX_BODY_BYTES
from miles_core.engine.routing import ENGINE_HEADER, GENERATE, RETRIES_HEADER, Balancer, Slot, health_status, post

ROUTER_FLAGS = (
    "--sglang-server-concurrency",
    "--miles-router-max-connections",
    "--miles-router-timeout",
    "--rollout-health-check-interval",
    "--rollout-health-check-timeout",
    "--rollout-health-check-first-wait",
    "--miles-router-health-check-failure-threshold",
)
"""The run's flags that configure its router, passed on to ``miles-core router`` as they are."""
BANNER = "serving the miles router on"
"""The start of the line the router prints to stderr once it listens (then its URL)."""


@dataclass(frozen=True)
class RouterSettings:
    """What ``miles-core router``'s flags set."""

    max_concurrency: int = 512
    """``--sglang-server-concurrency``: requests in flight on one engine."""
    max_connections: int | None = None
    """``--miles-router-max-connections``: connections open to the engines at once, all
    together (None: no cap beyond engines x ``max_concurrency``)."""
    request_timeout: float | None = None
    """``--miles-router-timeout``: seconds one forwarded request may take (None: no limit)."""
    connect_timeout: float = 30.0
    health: FaultTolerance = field(default_factory=FaultTolerance)
    """The health-check settings (interval, timeout, first wait, failure threshold)."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"--sglang-server-concurrency must be at least 1, got {self.max_concurrency}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--miles-router-max-connections must be at least 1, got {self.max_connections}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--miles-router-timeout must be positive, got {self.request_timeout}")


class Router:
    """The workers, their places and health, and the forwarding of requests; with
    ``api_key`` the router requires it and sends it to the engines."""

    def __init__(self, settings: RouterSettings, api_key: str | None = None) -> None:
        self.settings = settings
        self.api_key = api_key
        self.urls: list[str] = []
        self.supervisor = Supervisor(self.urls, settings.health, self._health, readmit=False)
        self.balancer = Balancer(self.urls, settings.max_concurrency, self.supervisor)
        self._timeout = aiohttp.ClientTimeout(total=settings.request_timeout, sock_connect=settings.connect_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._health_session: aiohttp.ClientSession | None = None
        self._connections: asyncio.Semaphore | None = None

    async def start(self) -> None:
        # limit=0: no cap (the per-engine places bound the connections already). The pool's
        # limit alone can be passed by one when a freed connection is taken by a new request
        # while a waiting one also wakes (measured with aiohttp 3.14), so a semaphore of the
        # same size is what holds the cap.
        limit = self.settings.max_connections
        self._connections = None if limit is None else asyncio.Semaphore(limit)
        connector = aiohttp.TCPConnector(limit=limit or 0)
        headers = auth_headers(self.api_key)  # the engines take the router's key: the run's
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=headers)
        self._health_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
        self.supervisor.start()

    async def close(self) -> None:
        await self.supervisor.close()
        for session in (self._session, self._health_session):
            if session is not None:
                await session.close()

    async def _health(self, url: str, timeout: float) -> int | None:
        assert self._health_session is not None
        return await health_status(self._health_session, url, timeout)

    # -- workers ----------------------------------------------------------------------------

    def add(self, url: str) -> bool:
        """Register ``url`` (True), or put it back in routing if it was out (False)."""
        if url in self.urls:
            self.supervisor.admit(url)
            return False
        self.balancer.add_slot()
        self.supervisor.add_slot(url)
        return True

    def remove(self, url: str) -> bool:
        """Take ``url`` out of routing for good; False when it is not registered."""
        return bool(self.supervisor.remove(url))

    def workers(self) -> list[dict[str, Any]]:
        supervisor = self.supervisor
        return [
            {
                "url": url,
                "state": supervisor.state[i],
                "reason": supervisor.reason[i],
                "in_flight": self.balancer.in_flight[i],
                "sent": self.balancer.sent[i],
            }
            for i, url in enumerate(self.urls)
            if supervisor.state[i] != REMOVED
        ]

    # -- forwarding ---------------------------------------------------------------------------

    async def forward(self, body: bytes, content_type: str | None) -> tuple[int, bytes, str, str, int]:
        """Send ``body`` to the least busy healthy engine, trying others while they give
        no answer: ``(status, body, content type, engine URL, retries)`` of the answer;
        :class:`~miles_core.errors.EngineRequestError` when none answered."""
        assert self._session is not None
        session = self._session
        tries: list[str] = []

        async def send(slot: Slot) -> tuple[int, bytes, str, str]:
            url = self.urls[slot.index]
            tries.append(url)
            try:
                async with self._connections or contextlib.nullcontext():
                    status, raw, kind = await post(session, url, GENERATE, data=body, content_type=content_type, timeout=self._timeout)
            finally:
                slot.release()  # answered: the place is free while the answer goes back
            return status, raw, kind, url

        status, raw, kind, url = await self.balancer.dispatch(send, GENERATE)
        return status, raw, kind, url, len(tries) - 1


def create_app(router: Router) -> web.Application:
    """The router's aiohttp application (starts and stops ``router`` with itself)."""
    from miles_core.errors import EngineRequestError

    def error(status: int, message: str) -> web.Response:
        return web.json_response({"error": message}, status=status)

    async def generate(request: web.Request) -> web.StreamResponse:
        if not any(state != REMOVED for state in router.supervisor.state):
            return error(503, "no engine is registered with the router (POST /add_worker?url=URL)")
        body = await request.read()
        try:
            status, raw, kind, url, retries = await router.forward(body, request.content_type)
        except EngineRequestError as exc:
            return error(502, str(exc))
        headers = {ENGINE_HEADER: url, RETRIES_HEADER: str(retries)}
        return web.Response(status=status, body=raw, content_type=kind, headers=headers)

    async def worker_url(request: web.Request) -> str | web.Response:
        url = request.query.get("url")
        if url is None and request.can_read_body:
            try:
                data = json.loads(await request.read())
            except json.JSONDecodeError:
                return error(400, "body: not JSON")
            url = data.get("url") if isinstance(data, dict) else None
        if not url:
            return error(400, 'url: missing (POST /add_worker?url=URL or a JSON body {"url": URL})')
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
            return error(400, f"url: {url!r} is not an http:// or https:// base URL")
        return url

    async def add_worker(request: web.Request) -> web.Response:
        url = await worker_url(request)
        if isinstance(url, web.Response):
            return url
        added = router.add(url)
        return web.json_response({"url": url, "added": added, "state": "healthy"})

    async def remove_worker(request: web.Request) -> web.Response:
        url = await worker_url(request)
        if isinstance(url, web.Response):
            return url
        if not router.remove(url):
            return error(404, f"url: {url} is not a registered worker")
        return web.json_response({"url": url, "removed": True})

    async def list_workers(request: web.Request) -> web.Response:
        workers = router.workers()
        urls = [w["url"] for w in workers if w["state"] == "healthy"]
        return web.json_response({"urls": urls, "workers": workers, "retries": router.supervisor.retries})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"healthy_workers": len(router.supervisor.healthy())})

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.close()

    # The engines' own default body limit: the router refuses (413) what they would. The
    # key is checked before any handler reads a body.
    middlewares = [] if router.api_key is None else [bearer_middleware(router.api_key)]
    app = web.Application(client_max_size=DEFAULT_MAX_BODY_BYTES, middlewares=middlewares)
    app.router.add_post(GENERATE, generate)
    app.router.add_post("/add_worker", add_worker)
    app.router.add_post("/remove_worker", remove_worker)
    app.router.add_get("/list_workers", list_workers)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(router: Router, host: str, port: int, stop: asyncio.Event) -> None:
    """Listen on ``host:port`` (0: a free port), print :data:`BANNER` and the URL to
    stderr, and serve until ``stop`` is set."""
    import sys

    # Not serve-engine's start_server: its module imports torch, which the router never needs.
    runner = web.AppRunner(create_app(router), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        sys.stderr.write(f"{BANNER} http://{shown}:{bound}\n")  # one write: the fleet reads this line whole
        sys.stderr.flush()
        await stop.wait()
    finally:
        await runner.cleanup()


__all__ = ["BANNER", "ROUTER_FLAGS", "ENGINE_HEADER", "GENERATE", "RETRIES_HEADER", "Router", "RouterSettings", "create_app", "serve"]
