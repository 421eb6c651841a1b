"""Least-busy routing over engine servers, shared by the ``http`` engine (routing in the
run's own process) and the miles router (``miles-core router``, routing in a process of
its own, :mod:`miles_core.engine.router`).

:class:`Balancer` holds one place count per URL slot (a URL may be listed twice: two
routes to one server). A request goes to the slot with the fewest requests in flight
(ties: the least recently chosen) among those with fewer than ``max_concurrency`` in
flight (``--sglang-server-concurrency``): each server carries at most that many at once,
so E servers carry up to E x ``max_concurrency``; when every server is full a request
waits for the first free place, whichever server it is on (first in, first served).

With a :class:`~miles_core.engine.health.Supervisor` only healthy slots are chosen, and
:meth:`Balancer.dispatch` retries a request whose server gave no answer (dead, hung, or
past its timeout) on another one, unchanged: the same body, so the same seeds and the same
samples. An HTTP answer is the server's verdict on the request and is not retried.

Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from miles_core.engine.health import Supervisor
from miles_core.errors import EngineRequestError, NoHealthyEngineError

T = TypeVar("T")

GENERATE = "/rollout/generate"
ENGINE_HEADER = "X-Miles-Engine"
"""The miles router's response header naming the engine that answered."""
RETRIES_HEADER = "X-Miles-Retries"
"""The miles router's response header: how many engines gave no answer before this one."""


class Slot:
    """One request's place on server slot ``index``: released once, by whichever of the
    request's own code or its caller's clean-up gets there first (a task cancelled before
    it ran never reaches its own ``finally``)."""

    def __init__(self, balancer: Balancer, index: int) -> None:
        self.balancer = balancer
        self.index = index
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.balancer.release(self.index)


class Balancer:
    """The places of the URL slots ``urls`` (the caller's list, which a restart or a
    registration may change in place)."""

    def __init__(self, urls: list[str], max_concurrency: int, supervisor: Supervisor | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.urls = urls
        self.max_concurrency = max_concurrency
        self.supervisor = supervisor
        self.in_flight = [0] * len(urls)
        """Requests sent to each slot and not answered yet (at most ``max_concurrency``)."""
        self.sent = [0] * len(urls)
        """Requests sent to each slot, retries included."""
        self._tick = itertools.count()
        self._last_pick = [-1] * len(urls)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        if supervisor is not None:
            # A server back in service has free places: the waiting requests look again.
            supervisor.on_change = self.wake_all

    def add_slot(self) -> int:
        """Count places for a slot appended to ``urls`` (a newly registered server)."""
        self.in_flight.append(0)
        self.sent.append(0)
        self._last_pick.append(-1)
        return len(self.in_flight) - 1

    def reset(self) -> None:
        """Forget the waiting requests of another event loop (and the supervisor's tasks)."""
        self._waiting = collections.deque()
        if self.supervisor is not None:
            self.supervisor.reset()

    def _pick(self, candidates: list[int]) -> int:
        index = min(candidates, key=lambda i: (self.in_flight[i], self._last_pick[i]))
        self._last_pick[index] = next(self._tick)
        return index

    async def acquire(self) -> Slot:
        """A place for one request on the least busy server (with a supervisor: healthy
        one) with fewer than ``max_concurrency`` in flight; waits while all are full."""
        while True:
            choices = range(len(self.urls)) if self.supervisor is None else await self.supervisor.wait_for_healthy()
            free = [i for i in choices if self.in_flight[i] < self.max_concurrency]
            if free:
                index = self._pick(free)
                self.in_flight[index] += 1
                self.sent[index] += 1
                if any(self.in_flight[i] < self.max_concurrency for i in free):
                    self.wake_one()  # room left (a server came back, or several freed): pass it on
                return Slot(self, index)
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.wake_one()  # woken, then cancelled: the place goes to the next one
                raise

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1
        self.wake_one()

    def wake_one(self) -> None:
        """Wake the longest waiting request (first in, first served)."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        waiting, self._waiting = self._waiting, collections.deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def dispatch(self, send: Callable[[Slot], Awaitable[T]], path: str) -> T:
        """``send(slot)`` on a place from :meth:`acquire` (``send`` may release the place
        early, once its server answered). With a supervisor, a ``send`` that raises
        :class:`EngineRequestError` without an HTTP status (no answer) takes that server
        down and is tried again on another, up to ``max_attempts`` tries in all."""
        supervisor = self.supervisor
        if supervisor is None:
            slot = await self.acquire()
            try:
                return await send(slot)
            finally:
                slot.release()
        supervisor.start()
        attempt = 0
        while True:
            try:
                slot = await self.acquire()
            except NoHealthyEngineError as exc:
                raise EngineRequestError(", ".join(dict.fromkeys(self.urls)), None, str(exc)) from None
            url = self.urls[slot.index]
            if attempt:
                supervisor.retries += 1
            attempt += 1
            try:
                return await self._attempt(slot, send, supervisor.down_signal(slot.index), path)
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

    async def _attempt(self, slot: Slot, send: Callable[[Slot], Awaitable[T]], down: asyncio.Future, path: str) -> T:
        """``send(slot)``, given up when the slot goes down (a hung server never answers:
        the health checks are what notice it)."""
        url = self.urls[slot.index]
        attempt = asyncio.ensure_future(send(slot))
        try:
            await asyncio.wait({attempt, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
        if attempt.cancelled():
            raise EngineRequestError(url + path, None, f"the engine went down during the request ({down.result()})")
        return attempt.result()


async def post(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    *,
    timeout: aiohttp.ClientTimeout,
    json_body: Any = None,
    data: bytes | None = None,
    content_type: str | None = None,
) -> tuple[int, bytes, str]:
    """POST to ``url + path``: the status, body and content type of any answer;
    :class:`EngineRequestError` without a status when no answer came (refused, reset,
    past ``timeout``)."""
    headers = {"Content-Type": content_type} if content_type else None
    try:
        async with session.post(url + path, json=json_body, data=data, headers=headers, timeout=timeout) as response:
            return response.status, await response.read(), response.content_type
    except asyncio.TimeoutError as exc:
        detail = str(exc) or (f"no complete answer within {timeout.total:g} s" if timeout.total else "timed out")
        raise EngineRequestError(url + path, None, f"TimeoutError: {detail}") from exc
    except aiohttp.ClientError as exc:
        raise EngineRequestError(url + path, None, f"{type(exc).__name__}: {exc}") from exc


async def health_status(session: aiohttp.ClientSession, url: str, timeout: float) -> int | None:
    """The status of ``GET url/health`` (None: no answer within ``timeout`` s)."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


__all__ = ["ENGINE_HEADER", "GENERATE", "RETRIES_HEADER", "Balancer", "Slot", "health_status", "post"]
