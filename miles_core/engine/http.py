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

``--offload-rollout``: :meth:`HttpEngine.release_memory` and
:meth:`HttpEngine.resume_memory` post ``/release_memory_occupation`` and
``/resume_memory_occupation`` to every server (``serve-engine``, or sglang-diffusion, which
has them since 0.5.23); a server without them answers 404, reported with that hint.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import aiohttp
import msgpack
import torch

from miles_core.engine.base import RolloutEngine
from miles_core.engine.health import FaultTolerance, Prepare, Restart, Supervisor
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import EngineRequestError, NoHealthyEngineError, WeightsMismatchError, WireError
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.weights import bucket_to_bytes, iter_buckets

DEFAULT_CONCURRENCY = 512
"""``--sglang-server-concurrency``'s default."""

GENERATE = "/rollout/generate"
_LOST = object()  # the answer of a server that went down during a weight request


class _Slot:
    """One request's place on server slot ``index``: released once, by whichever of the
    request's own code or its caller's clean-up gets there first (a task cancelled before
    it ran never reaches its own ``finally``)."""

    def __init__(self, engine: HttpEngine, index: int) -> None:
        self.engine = engine
        self.index = index
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.engine._release(self.index)


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
    ) -> None:
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        self.urls = [u.strip().rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("HttpEngine needs at least one base URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http:// or https:// base URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
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
        # Per URL slot (a URL may be listed twice: two routes to one server).
        self.in_flight = [0] * len(self.urls)
        """Requests sent to each slot and not answered yet (at most ``max_concurrency``)."""
        self.sent = [0] * len(self.urls)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._tick = itertools.count()
        self._last_pick = [-1] * len(self.urls)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.supervisor: Supervisor | None = None
        """The slot states and health checks under fault tolerance (None without)."""
        if fault_tolerance is not None:
            # It shares self.urls: a restart puts the new URL in the slot.
            self.supervisor = Supervisor(self.urls, fault_tolerance, self._health_status, restart=restart, prepare=prepare)
            # A server back in service has free places: the waiting requests look again.
            self.supervisor.on_change = self._wake_all
        elif restart is not None or prepare is not None:
            raise ValueError("restart and prepare go with fault_tolerance")

    @classmethod
    def from_config(cls, config: Any) -> HttpEngine:
        return cls(
            config.rollout_engine_urls,
            max_concurrency=config.sglang_server_concurrency,
            decode_workers=config.rollout_parser_num_workers or 1,
            request_timeout=getattr(config, "miles_router_timeout", None),
            fault_tolerance=FaultTolerance.from_config(config),
        )

    def view(self, url: str) -> HttpEngine:
        """A plain engine over ``url`` alone, with this one's limits and no fault
        tolerance: a restarted server is re-synced through it before it rejoins."""
        return HttpEngine(
            [url], max_concurrency=self.max_concurrency, request_timeout=self.request_timeout, connect_timeout=self.connect_timeout
        )

    # -- plumbing ----------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A session and waiting futures belong to one event loop; start afresh on another.
            self._loop = loop
            self._session = None
            self._waiting = collections.deque()
            if self.supervisor is not None:
                self.supervisor.reset()
        if self._session is None or self._session.closed:
            # The slots bound concurrency; the connector must not add a lower cap.
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    def _pick(self, candidates: Sequence[int]) -> int:
        index = min(candidates, key=lambda i: (self.in_flight[i], self._last_pick[i]))
        self._last_pick[index] = next(self._tick)
        return index

    async def _acquire(self) -> _Slot:
        """A place for one request on the least busy server (under fault tolerance: healthy
        one) with fewer than ``max_concurrency`` in flight; waits while all are full."""
        while True:
            choices = range(len(self.urls)) if self.supervisor is None else await self.supervisor.wait_for_healthy()
            free = [i for i in choices if self.in_flight[i] < self.max_concurrency]
            if free:
                index = self._pick(free)
                self.in_flight[index] += 1
                self.sent[index] += 1
                if any(self.in_flight[i] < self.max_concurrency for i in free):
                    self._wake_one()  # room left (a server came back, or several freed): pass it on
                return _Slot(self, index)
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the place goes to the next one
                raise

    def _release(self, index: int) -> None:
        self.in_flight[index] -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        """Wake the longest waiting request (first in, first served)."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        waiting, self._waiting = self._waiting, collections.deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

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
        headers = {"Content-Type": content_type} if content_type else None
        try:
            async with self._client().post(
                url + path, json=json_body, data=data, headers=headers, timeout=timeout or self.timeout
            ) as response:
                return response.status, await response.read(), response.content_type
        except asyncio.TimeoutError as exc:
            limit = (timeout or self.timeout).total
            detail = str(exc) or (f"no complete answer within {limit:g} s" if limit else "timed out")
            raise EngineRequestError(url + path, None, f"TimeoutError: {detail}") from exc
        except aiohttp.ClientError as exc:
            raise EngineRequestError(url + path, None, f"{type(exc).__name__}: {exc}") from exc

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
        supervisor = self.supervisor
        if supervisor is None:
            slot = await self._acquire()
            try:
                return await self._generate_at(slot, request)
            finally:
                slot.release()
        supervisor.start()
        attempt = 0
        while True:
            try:
                slot = await self._acquire()
            except NoHealthyEngineError as exc:
                raise EngineRequestError(", ".join(self._distinct_urls()), None, str(exc)) from None
            url = self.urls[slot.index]
            if attempt:
                supervisor.retries += 1
            attempt += 1
            try:
                return await self._attempt(slot, request, supervisor.down_signal(slot.index))
            except EngineRequestError as exc:
                # An HTTP answer is the server's verdict on the request (a bad request, a
                # model error): another server would give the same. Only silence is retried.
                if exc.status is not None:
                    raise
                supervisor.mark_down(url, f"a request got no answer: {exc.message}")
                if attempt >= supervisor.settings.max_attempts:
                    raise
            finally:
                slot.release()

    async def _attempt(self, slot: _Slot, request: RolloutRequest, down: asyncio.Future) -> list[RolloutOutput]:
        """:meth:`_generate_at` on ``slot``, given up when the slot goes down (a hung
        server never answers: the health checks are what notice it)."""
        url = self.urls[slot.index]
        attempt = asyncio.ensure_future(self._generate_at(slot, request))
        try:
            await asyncio.wait({attempt, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
        if attempt.cancelled():
            raise EngineRequestError(url + GENERATE, None, f"the engine went down during the request ({down.result()})")
        return attempt.result()

    async def _generate_at(self, slot: _Slot, request: RolloutRequest) -> list[RolloutOutput]:
        """Send ``request`` through ``slot``; its place is given back once the server has
        answered (the decoding, in this process, does not hold it)."""
        url = self.urls[slot.index]
        try:
            status, raw, _ = await self._post(url, GENERATE, json_body=request.to_json(), timeout=self._generate_timeout)
        finally:
            slot.release()
        self._check(url + GENERATE, status, raw)
        try:
            return await self._decode(raw)
        except WireError as exc:
            raise EngineRequestError(url + GENERATE, status, f"undecodable response: {exc}") from exc

    async def _decode(self, raw: bytes) -> list[RolloutOutput]:
        """``unpack_outputs(raw)`` in the decoder thread pool."""
        if self._decoder is None:
            self._decoder = concurrent.futures.ThreadPoolExecutor(self.decode_workers, thread_name_prefix="rollout-decode")
        return await asyncio.get_running_loop().run_in_executor(self._decoder, unpack_outputs, raw)

    async def _health_status(self, url: str, timeout: float) -> int | None:
        """The status of ``GET url/health`` (None: no answer within ``timeout`` s)."""
        try:
            async with self._client().get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def health(self) -> dict[str, int | None]:
        """The status of ``GET /health`` per URL (None: no answer)."""
        urls = self._distinct_urls()
        return dict(zip(urls, await asyncio.gather(*(self._health_status(url, 10.0) for url in urls))))

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
