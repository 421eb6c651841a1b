"""The ``http`` engine: a client for servers speaking the ``/rollout/generate`` contract
(``miles-core serve-engine``, or sglang-diffusion for generation, disk updates and checksums).

Requests go to the base URL with the fewest requests in flight (ties: the least recently
chosen) among those with fewer than ``max_concurrency`` in flight
(``--sglang-server-concurrency``): each server carries at most that many at once, so E
servers carry up to E x ``max_concurrency``; when every server is full a request waits
for the first free place, whichever server it is on.
Response bodies (msgpack + safetensors) are decoded off the event loop, in a pool of
``decode_workers`` threads (``--rollout-parser-num-workers``). Weight updates and checksum requests go to
every URL. A failed request raises :class:`EngineRequestError` naming the URL, the HTTP
status and the server's message; ``request_timeout`` (``--miles-router-timeout``) bounds
each ``/rollout/generate`` request.

With ``fault_tolerance`` (``--use-fault-tolerance``) a
:class:`~miles_core.engine.health.Supervisor` health-checks the servers: a request whose
server dies or hangs is retried, unchanged, on a healthy one; weight updates skip servers
that are down (they are re-synced by ``prepare`` before they serve again).

With ``router`` (``--use-miles-router``) ``/rollout/generate`` requests go to the miles
router (:mod:`miles_core.engine.router`), which routes them as above in its own process;
weight updates, checksums and memory requests still go to every engine directly. Under
fault tolerance the router's view of the engines is the health check here: an engine it
took out of routing is restarted (or, given by URL, waited for) and re-synced here, then
registered with the router again (``POST /add_worker``).

With a :class:`Poster` (``--use-distributed-post``) the routing, retries and health checks
stay here, but each ``/rollout/generate`` POST and the decoding of its answer happen where
the poster does them (a Ray actor on the engine's node): only the decoded records come back.

With ``api_key`` every request carries ``Authorization: Bearer <key>`` (the servers require
it of all but ``GET /health``, :mod:`miles_core.engine.auth`): the run's secret for servers
it started, the user's key (``--api-key``, ``--api-key-file``, ``MILES_API_KEY``) for servers
given by URL, which :meth:`HttpEngine.check_api_key` tries at start-up.

``--offload-rollout``: :meth:`HttpEngine.release_memory` and
:meth:`HttpEngine.resume_memory` post ``/release_memory_occupation`` and
``/resume_memory_occupation`` to every server (``serve-engine``, or sglang-diffusion, which
has them since 0.5.23); a server without them answers 404, reported with that hint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol

import aiohttp
import msgpack
import torch

from miles_core.engine.auth import API_KEY_ENV, auth_headers
from miles_core.engine.base import RolloutEngine
from miles_core.engine.health import HEALTHY, FaultTolerance, Prepare, Restart, Supervisor
from miles_core.engine.routing import ENGINE_HEADER, GENERATE, RETRIES_HEADER, Balancer, Slot, health_status, post
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import ApiKeyError, EngineRequestError, WeightsMismatchError, WireError
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.weights import bucket_to_bytes, iter_buckets

DEFAULT_CONCURRENCY = 512
"""``--sglang-server-concurrency``'s default."""

_LOST = object()  # the answer of a server that went down during a weight request


class Poster(Protocol):
    """Posts one ``/rollout/generate`` request to ``url`` and decodes the answer elsewhere
    (``--use-distributed-post``: an actor on the engine's node); raises
    :class:`EngineRequestError` as :meth:`HttpEngine.generate` would."""

    async def generate(self, url: str, request: RolloutRequest, timeout: float | None) -> list[RolloutOutput]: ...


class HttpEngine(RolloutEngine):
    releases_memory: ClassVar[bool] = True
    caps_per_server: ClassVar[bool] = True

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_concurrency: int = DEFAULT_CONCURRENCY,
        request_timeout: float | None = None,
        connect_timeout: float = 30.0,
        decode_workers: int = 1,
        fault_tolerance: FaultTolerance | None = None,
        restart: Restart | None = None,
        prepare: Prepare | None = None,
        router: str | None = None,
        router_log: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        self.urls = [u.strip().rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("HttpEngine needs at least one base URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http:// or https:// base URL")
        self.max_concurrency = max_concurrency
        self.router = None if router is None else router.rstrip("/")
        """The miles router's base URL (``--use-miles-router``), where requests go."""
        self.router_log = router_log
        """Its log file, named when it stops answering."""
        self.api_key = api_key
        """What every request carries (``Authorization: Bearer``); None: nothing."""
        self._registered = False
        self._registering: asyncio.Future | None = None
        self.poster: Poster | None = None
        """Where each request's POST and decoding happen instead of here (``--use-distributed-post``)."""
        if decode_workers < 1:
            raise ValueError(f"decode_workers must be at least 1, got {decode_workers}")
        self.decode_workers = decode_workers
        self._decoder: concurrent.futures.ThreadPoolExecutor | None = None
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self._generate_timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.supervisor: Supervisor | None = None
        """The slot states and health checks under fault tolerance (None without)."""
        if fault_tolerance is not None:
            # It shares self.urls: a restart puts the new URL in the slot.
            if self.router is None:
                self.supervisor = Supervisor(self.urls, fault_tolerance, self._health_status, restart=restart, prepare=prepare)
            else:
                # The router already counted the failed checks that took an engine out.
                settings = replace(fault_tolerance, failure_threshold=1)
                self.supervisor = Supervisor(
                    self.urls, settings, self._routed_health, restart=restart, prepare=prepare, admit=self._register
                )
        elif restart is not None or prepare is not None:
            raise ValueError("restart and prepare go with fault_tolerance")
        # Per URL slot (a URL may be listed twice: two routes to one server).
        self.balancer = Balancer(self.urls, max_concurrency, self.supervisor)

    @classmethod
    def from_config(cls, config: Any) -> HttpEngine:
        """A client of the servers ``--rollout-engine-urls`` names (started by hand), with
        the user's key: ``--api-key``, ``--api-key-file`` or ``MILES_API_KEY`` (none: no key)."""
        from miles_core.engine.auth import resolve_api_key

        def warn(line: str) -> None:
            print(line, file=sys.stderr)

        return cls(
            config.rollout_engine_urls,
            max_concurrency=config.sglang_server_concurrency,
            decode_workers=config.rollout_parser_num_workers or 1,
            request_timeout=getattr(config, "miles_router_timeout", None),
            fault_tolerance=FaultTolerance.from_config(config),
            api_key=resolve_api_key(getattr(config, "api_key", None), getattr(config, "api_key_file", None), warn=warn),
        )

    @property
    def in_flight(self) -> list[int]:
        """Requests sent to each slot and not answered yet (at most ``max_concurrency``)."""
        return self.balancer.in_flight

    @property
    def sent(self) -> list[int]:
        """Requests sent to each slot (routed here, not through the router)."""
        return self.balancer.sent

    def view(self, url: str) -> HttpEngine:
        """A plain engine over ``url`` alone, with this one's limits and no fault
        tolerance: a restarted server is re-synced through it before it rejoins."""
        return HttpEngine(
            [url],
            max_concurrency=self.max_concurrency,
            request_timeout=self.request_timeout,
            connect_timeout=self.connect_timeout,
            api_key=self.api_key,
        )

    # -- plumbing ----------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A session and waiting futures belong to one event loop; start afresh on another.
            self._loop = loop
            self._session = None
            self.balancer.reset()
        if self._session is None or self._session.closed:
            # The slots bound concurrency; the connector must not add a lower cap.
            connector = aiohttp.TCPConnector(limit=0)
            # The key goes with every request of the session (the router's control calls too).
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=auth_headers(self.api_key))
        return self._session

    async def _post(
        self,
        url: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        content_type: str | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> tuple[int, bytes, str]:
        return await post(
            self._client(), url, path, json_body=json_body, data=data, content_type=content_type, timeout=timeout or self.timeout
        )

    @staticmethod
    def _message(body: bytes) -> str:
        text = body.decode("utf-8", "replace")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return text.strip()[:2000] or "(empty body)"
        if isinstance(data, dict):
            for key in ("error", "detail", "message"):
                if data.get(key):
                    return str(data[key])
        return text.strip()[:2000]

    def _check(self, url: str, status: int, body: bytes) -> None:
        if status != 200:
            raise EngineRequestError(url, status, self._message(body))

    async def _post_json_all(self, path: str, body: Any) -> dict[str, Any]:
        """Each server's JSON answer by URL (servers that went down on the way left out)."""

        async def one(url: str) -> Any:
            try:
                status, raw, _ = await self._post(url, path, json_body=body)
            except EngineRequestError as exc:
                if self._lost(url, exc):
                    return _LOST
                raise
            self._check(url + path, status, raw)
            return json.loads(raw) if raw else None

        urls = self.weight_urls()
        answers = await asyncio.gather(*(one(url) for url in urls))
        return {url: answer for url, answer in zip(urls, answers) if answer is not _LOST}

    def _distinct_urls(self) -> list[str]:
        return list(dict.fromkeys(self.urls))

    def weight_urls(self) -> list[str]:
        """Where weight updates and checksum requests go: every server, or under fault
        tolerance every healthy one (the others are re-synced before they serve again)."""
        if self.supervisor is None:
            return self._distinct_urls()
        return list(dict.fromkeys(self.urls[i] for i in self.supervisor.healthy()))

    def _lost(self, url: str, exc: EngineRequestError) -> bool:
        """Under fault tolerance, a server that gives no answer is marked down (and
        restarted or routed around): True. A server's own error answer is raised."""
        if self.supervisor is None or exc.status is not None:
            return False
        self.supervisor.mark_down(url, f"a request got no answer: {exc.message}")
        return True

    # -- the engine interface -------------------------------------------------------------

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        self._client()
        if self.router is not None:
            return await self._generate_routed(request)
        return await self.balancer.dispatch(lambda slot: self._generate_at(slot, request), GENERATE)

    async def _generate_at(self, slot: Slot, request: RolloutRequest) -> list[RolloutOutput]:
        """Send ``request`` through ``slot``; its place is given back once the server has
        answered (the decoding, in this process, does not hold it)."""
        url = self.urls[slot.index]
        if self.poster is not None:
            # The actor answers with the decoded records: the place is held until then.
            try:
                return await self.poster.generate(url, request, self.request_timeout)
            finally:
                slot.release()
        try:
            status, raw, _ = await self._post(url, GENERATE, json_body=request.to_json(), timeout=self._generate_timeout)
        finally:
            slot.release()
        self._check(url + GENERATE, status, raw)
        try:
            return await self._decode(raw)
        except WireError as exc:
            raise EngineRequestError(url + GENERATE, status, f"undecodable response: {exc}") from exc

    # -- through the miles router (--use-miles-router) -------------------------------------

    async def _generate_routed(self, request: RolloutRequest) -> list[RolloutOutput]:
        """Send ``request`` to the router, which picks the engine; an error names the
        engine that answered (the router's ``X-Miles-Engine`` header) or the router."""
        assert self.router is not None
        if self.supervisor is not None:
            self.supervisor.start()
        if not self._registered:
            # The engines join the router once the run's first weight sync reached them;
            # the requests of the first rollout share one registration.
            task = self._registering
            if (
                task is None
                or task.get_loop() is not asyncio.get_running_loop()
                or (task.done() and (task.cancelled() or task.exception() is not None))
            ):
                task = self._registering = asyncio.ensure_future(self.register())
            await asyncio.shield(task)
        url = self.router + GENERATE
        try:
            # No bound here: the router bounds each try (--miles-router-timeout) and retries.
            async with self._client().post(url, json=request.to_json(), timeout=self.timeout) as response:
                status, raw = response.status, await response.read()
                engine, retries = response.headers.get(ENGINE_HEADER), response.headers.get(RETRIES_HEADER)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
            log = f"; see its log {self.router_log}" if self.router_log else ""
            raise EngineRequestError(url, None, f"the miles router gave no answer ({detail}){log}") from exc
        if self.supervisor is not None and retries:
            self.supervisor.retries += int(retries)
        where = engine + GENERATE if engine else url
        self._check(where, status, raw)
        try:
            return await self._decode(raw)
        except WireError as exc:
            raise EngineRequestError(where, status, f"undecodable response: {exc}") from exc

    async def _router_call(self, method: str, path: str, url: str | None = None) -> Any:
        """``method`` ``router/path`` (with ``?url=``); its JSON answer."""
        assert self.router is not None
        params = None if url is None else {"url": url}
        try:
            async with self._client().request(method, self.router + path, params=params, timeout=self.timeout) as response:
                status, raw = response.status, await response.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise EngineRequestError(self.router + path, None, f"the miles router gave no answer ({type(exc).__name__}: {exc})") from exc
        self._check(self.router + path, status, raw)
        return json.loads(raw) if raw else None

    async def register(self) -> None:
        """Register every engine with the router (``POST /add_worker``); the first
        request does it, after the run's first weight sync."""
        await asyncio.gather(*(self._register(url, url) for url in self._distinct_urls()))
        self._registered = True

    async def _register(self, old: str, new: str) -> None:
        """Register ``new`` with the router (``POST /add_worker``), after its re-sync; a
        restarted engine's old URL is removed first."""
        if old != new:
            await self._router_call("POST", "/remove_worker", old)
        await self._router_call("POST", "/add_worker", new)

    async def workers(self) -> list[dict[str, Any]]:
        """The router's engines (``GET /list_workers``): URL, state, reason, requests."""
        return (await self._router_call("GET", "/list_workers"))["workers"]

    async def _routed_health(self, url: str, timeout: float) -> int | None:
        """The health check under the router: an engine the router routes to is healthy
        (200); one it took out is down here too (503); a server given by URL that is down
        here comes back when its own ``GET /health`` passes. A router that does not answer
        blames no engine (the requests report it)."""
        assert self.supervisor is not None
        try:
            workers = {w["url"]: w for w in await self.workers()}
        except EngineRequestError:
            return 200
        worker = workers.get(url)
        if not self._registered or (worker is not None and worker["state"] == HEALTHY):
            return 200  # not registered yet: nothing to judge
        if any(self.supervisor.state[i] == HEALTHY for i, slot_url in enumerate(self.urls) if slot_url == url):
            return 503  # the router took it out: down here too
        return await self._health_status(url, timeout)

    async def _decode(self, raw: bytes) -> list[RolloutOutput]:
        """``unpack_outputs(raw)`` in the decoder thread pool."""
        if self._decoder is None:
            self._decoder = concurrent.futures.ThreadPoolExecutor(self.decode_workers, thread_name_prefix="rollout-decode")
        return await asyncio.get_running_loop().run_in_executor(self._decoder, unpack_outputs, raw)

    async def _health_status(self, url: str, timeout: float) -> int | None:
        """The status of ``GET url/health`` (None: no answer within ``timeout`` s)."""
        return await health_status(self._client(), url, timeout)

    async def health(self) -> dict[str, int | None]:
        """The status of ``GET /health`` per URL (None: no answer)."""
        urls = self._distinct_urls()
        return dict(zip(urls, await asyncio.gather(*(self._health_status(url, 10.0) for url in urls))))

    async def check_api_key(self, what: str = "engine server") -> None:
        """At start-up: a request that changes nothing but needs the key (``POST
        /get_weights_checksum`` of no module) to every server; one that answers 401 raises
        :class:`~miles_core.errors.ApiKeyError` (exit status 2) naming it. Any other answer,
        or none, is left to the run's first request to report."""

        async def refusal(url: str) -> tuple[str, str] | None:
            probe = aiohttp.ClientTimeout(total=60.0, sock_connect=self.connect_timeout)
            try:
                status, raw, _ = await self._post(url, "/get_weights_checksum", json_body={"module_names": []}, timeout=probe)
            except EngineRequestError:
                return None
            return (url, self._message(raw)) if status == 401 else None

        refused = [answer for answer in await asyncio.gather(*map(refusal, self._distinct_urls())) if answer is not None]
        if refused:
            url, why = refused[0]
            cause = "it was started with another key" if self.api_key else "it requires an API key and the run has none"
            raise ApiKeyError(
                f"{what} {url} refused the run's requests with 401 ({' '.join(why.split())}): {cause}; give the run the "
                f"server's key with --api-key-file FILE or {API_KEY_ENV}"
            )

    async def wait_until_healthy(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """Poll ``GET /health`` until every URL answers 200; ``TimeoutError`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = await self.health()
            waiting = {url: status for url, status in statuses.items() if status != 200}
            if not waiting:
                return
            if time.monotonic() >= deadline:
                detail = ", ".join(f"{url} ({'no answer' if s is None else f'HTTP {s}'})" for url, s in waiting.items())
                raise TimeoutError(f"engine servers not healthy after {timeout:g} s: {detail}")
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    async def release_memory(self) -> None:
        await self._memory_occupation("/release_memory_occupation")

    async def resume_memory(self) -> None:
        await self._memory_occupation("/resume_memory_occupation")

    async def _memory_occupation(self, path: str) -> None:
        """Post ``path`` to every server; each must answer ``success``."""
        try:
            answers = await self._post_json_all(path, {})
        except EngineRequestError as exc:
            if exc.status == 404:
                raise EngineRequestError(
                    exc.url,
                    404,
                    f"{exc.message} (this server has no {path} endpoint: serve-engine or sglang-diffusion 0.5.23 or later has it)",
                ) from None
            raise
        for url, answer in answers.items():
            if not (isinstance(answer, dict) and answer.get("success")):
                raise EngineRequestError(url + path, 200, f"the server did not succeed: {answer!r}")

    async def update_weights_from_disk(
        self, model_path: str, *, target_modules: Sequence[str] | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """Every server loads ``model_path`` (a diffusers directory, or one module's flat
        folder); returns each server's answer by URL."""
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache}
        if target_modules is not None:
            body["target_modules"] = list(target_modules)
        answers = await self._post_json_all("/update_weights_from_disk", body)
        for url, answer in answers.items():
            if isinstance(answer, dict) and answer.get("success") is False:
                raise EngineRequestError(url + "/update_weights_from_disk", 200, str(answer.get("message")))
        return answers

    async def update_weights_from_tensors(
        self,
        module_name: str,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        buffer_size: int,
        lora_only: bool = False,
        lora_config: Mapping[str, Any] | None = None,
    ) -> int:
        """Send tensors to every server as safetensors buckets of at most ``buffer_size``
        bytes (one request per bucket); returns the number of tensors sent. LoRA-only
        updates carry only ``lora_A``/``lora_B`` tensors, and with ``lora_config``
        (``{r, lora_alpha, target_modules, init_lora_weights}``) a server whose module has
        no adapter yet adds that one first."""
        if lora_config is not None and not lora_only:
            raise ValueError("lora_config goes with lora_only updates")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        count = 0
        for bucket in iter_buckets(items, buffer_size):
            if lora_only:
                other = [n for n in bucket if "lora_A" not in n and "lora_B" not in n]
                if other:
                    raise ValueError(f"lora_only update holds {other[0]!r}, which is not a lora_A/lora_B tensor")
            payload = await asyncio.to_thread(_bucket_payload, module_name, bucket, lora_only, lora_config)
            await asyncio.gather(*(self._send_bucket(url, payload) for url in self.weight_urls()))
            count += len(bucket)
        return count

    async def _send_bucket(self, url: str, payload: bytes) -> None:
        path = "/update_weights_from_tensor"
        try:
            status, raw, _ = await self._post(url, path, data=payload, content_type="application/msgpack")
        except EngineRequestError as exc:
            if self._lost(url, exc):
                return
            raise
        self._check(url + path, status, raw)

    async def update_weights_from_ipc(self, body: Mapping[str, Any]) -> None:
        """Post one sglang-diffusion ``/update_weights_from_tensor`` JSON body (pickled
        CUDA-IPC handles, see :mod:`miles_core.engine.ipc_wire`) to every server; a server's
        refusal or ``success: false`` raises :class:`EngineRequestError`."""
        path = "/update_weights_from_tensor"

        async def one(url: str) -> None:
            try:
                status, raw, _ = await self._post(url, path, json_body=dict(body))
            except EngineRequestError as exc:
                if self._lost(url, exc):
                    return
                raise
            self._check(url + path, status, raw)
            answer = json.loads(raw) if raw else None
            if not (isinstance(answer, dict) and answer.get("success")):
                raise EngineRequestError(url + path, status, f"the server did not succeed: {answer!r}")

        await asyncio.gather(*(one(url) for url in self.weight_urls()))

    async def weights_checksums(self, module_names: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
        """Each server's ``{module: sha256}``, by URL (``None``: every module)."""
        body = {"module_names": None if module_names is None else list(module_names)}
        answers = await self._post_json_all("/get_weights_checksum", body)
        result = {}
        for url, answer in answers.items():
            if not isinstance(answer, dict):
                raise EngineRequestError(url + "/get_weights_checksum", 200, f"expected a JSON object, got {answer!r}")
            missing = [name for name, value in answer.items() if value == "not_found"]  # sglang-diffusion's answer
            if missing:
                raise EngineRequestError(url + "/get_weights_checksum", 200, f"module_names: unknown module {missing[0]!r}")
            result[url] = answer
        return result

    async def weights_checksum(self, module_names: Sequence[str]) -> dict[str, str]:
        """One SHA-256 per module; raises :class:`WeightsMismatchError` when servers disagree."""
        by_url = await self.weights_checksums(module_names)
        if not by_url:
            raise EngineRequestError(", ".join(self._distinct_urls()), None, "no healthy engine to ask for checksums")
        first_url, first = next(iter(by_url.items()))
        for url, answer in by_url.items():
            differing = sorted(name for name in set(first) | set(answer) if first.get(name) != answer.get(name))
            if differing:
                raise WeightsMismatchError(f"{url} and {first_url} hold different weights for {', '.join(differing)}")
        return first

    async def close(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)
            self._decoder = None

    async def __aenter__(self) -> HttpEngine:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _bucket_payload(
    module_name: str, bucket: Mapping[str, torch.Tensor], lora_only: bool, lora_config: Mapping[str, Any] | None = None
) -> bytes:
    body: dict[str, Any] = {"target_module": module_name, "bucket": bucket_to_bytes(bucket), "lora_only": lora_only}
    if lora_config is not None:
        body["lora_config"] = dict(lora_config)
    return msgpack.packb(body, use_bin_type=True)


__all__ = ["DEFAULT_CONCURRENCY", "EngineRequestError", "FaultTolerance", "HttpEngine", "WeightsMismatchError"]
