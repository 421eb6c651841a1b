"""Fault tolerance for the ``http`` and ``sglang`` engines (``--use-fault-tolerance``) and
the miles router's health checks (:mod:`miles_core.engine.router`).

:class:`Supervisor` keeps one state per URL slot of an
:class:`~miles_core.engine.http.HttpEngine` (or of the router): ``healthy`` (requests and
weight syncs go there), ``down`` (dead, hung or failing its health checks: nothing goes
there), ``restarting`` (being restarted, or re-admitted, and re-synced), ``failed`` (its
restart failed: out for the rest of the run) and, in the router, ``removed`` (``POST
/remove_worker``). A background task polls every URL's
``GET /health`` (:attr:`FaultTolerance.first_wait`, then every
:attr:`FaultTolerance.interval` s, each check bounded by :attr:`FaultTolerance.timeout`);
:attr:`FaultTolerance.failure_threshold` failures in a row mark the engine down, and so
does a request that gets no answer from it. Marking an engine down cancels the requests
in flight there, and the engine retries them elsewhere (the same request: the same seeds,
so the same samples).

A down engine comes back two ways. With a ``restart`` callback (engines the run started)
it is restarted at once; the callback returns its new URL. Without one (servers given by
URL) it stays out of routing until its health check passes again. Either way the
``prepare`` callback (the run's weight re-sync) runs before it serves again, then the
``admit`` callback (under ``--use-miles-router``: the engine's registration with the
router). The miles router's own supervisor (``readmit=False``) never brings an engine back
by itself: :meth:`Supervisor.admit` does, when the run registers the engine again.

Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles_core.errors import NoHealthyEngineError

log = logging.getLogger(__name__)

HEALTHY = "healthy"
DOWN = "down"
RESTARTING = "restarting"
FAILED = "failed"
REMOVED = "removed"

Restart = Callable[[int], Awaitable[str]]
"""``restart(slot)``: stop the engine behind URL slot ``slot`` if it still runs, start a
new one, wait until it is healthy; return its URL."""

Prepare = Callable[[str], Awaitable[None]]
"""``prepare(url)``: make a restarted or re-admitted engine ready to serve (the run syncs
its current weights and checks their checksum); an exception keeps it out."""

Admit = Callable[[str, str], Awaitable[None]]
"""``admit(old_url, new_url)``: after ``prepare``, put a restarted or re-admitted engine
back where requests are routed (the registration with the miles router)."""

HealthCheck = Callable[[str, float], Awaitable["int | None"]]
"""``check(url, timeout)``: the status of ``GET url/health`` (None: no answer in time)."""


@dataclass(frozen=True)
class FaultTolerance:
    """The settings of ``--use-fault-tolerance``."""

    interval: float = 30.0
    """``--rollout-health-check-interval``: seconds between two rounds of health checks."""
    timeout: float = 30.0
    """``--rollout-health-check-timeout``: seconds one health check may take."""
    first_wait: float = 0.0
    """``--rollout-health-check-first-wait``: seconds before the first round."""
    failure_threshold: int = 3
    """``--miles-router-health-check-failure-threshold``: failed checks in a row that mark
    an engine down."""
    engine_wait: float = 600.0
    """Seconds a request waits for an engine to come back when none is healthy."""
    max_attempts: int = 4
    """Tries of one request; a request that every try loses to a dying engine fails."""

    def __post_init__(self) -> None:
        for name in ("interval", "timeout", "engine_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fault tolerance: {name} must be positive, got {getattr(self, name)}")
        if self.first_wait < 0:
            raise ValueError(f"fault tolerance: first_wait must not be negative, got {self.first_wait}")
        if self.failure_threshold < 1:
            raise ValueError(f"--miles-router-health-check-failure-threshold must be at least 1, got {self.failure_threshold}")
        if self.max_attempts < 1:
            raise ValueError(f"fault tolerance: max_attempts must be at least 1, got {self.max_attempts}")

    @classmethod
    def from_config(cls, config: Any) -> FaultTolerance | None:
        """The run's settings; None without ``--use-fault-tolerance``."""
        if not getattr(config, "use_fault_tolerance", False):
            return None
        return cls(
            interval=float(config.rollout_health_check_interval),
            timeout=float(config.rollout_health_check_timeout),
            first_wait=float(config.rollout_health_check_first_wait or 0.0),
            failure_threshold=int(config.miles_router_health_check_failure_threshold),
        )


class Supervisor:
    """The slot states of one engine, its health-check task and its restarts.

    ``urls`` is the engine's own list: a restart replaces the slot's URL in it. Every
    asyncio object here belongs to the loop of the first call; :meth:`reset` forgets them
    when the engine moves to another loop."""

    def __init__(
        self,
        urls: list[str],
        settings: FaultTolerance,
        check: HealthCheck,
        *,
        restart: Restart | None = None,
        prepare: Prepare | None = None,
        admit: Admit | None = None,
        readmit: bool = True,
    ) -> None:
        self.urls = urls
        self.settings = settings
        self.check = check
        self.restart = restart
        self.prepare = prepare
        self.admit_callback = admit
        self.readmit = readmit
        """Whether a down engine without ``restart`` comes back once its health check passes
        (False: only through :meth:`admit`)."""
        self.state = [HEALTHY] * len(urls)
        self.reason = [""] * len(urls)
        """Why a slot is not healthy (the last reason it went down, or its failed restart)."""
        self.failures: dict[str, int] = {}
        """Failed health checks in a row, by URL."""
        self.retries = 0
        """Requests tried again on another engine after theirs went down."""
        self.restarts = 0
        """Engines back in service after a restart or a re-admission."""
        self.checks = 0
        """Rounds of health checks done."""
        self.on_change: Callable[[], None] | None = None
        """Called whenever a slot's state changes (the engine's waiting requests look again)."""
        self.reset()

    def reset(self) -> None:
        """Forget the tasks and asyncio objects of the current loop. A restart or
        re-admission cut short starts over on the next loop (see :meth:`start`)."""
        self.state = [DOWN if state == RESTARTING else state for state in self.state]
        self._monitor: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._down: list[asyncio.Future | None] = [None] * len(self.urls)
        self._changed: asyncio.Event | None = None

    # -- states ---------------------------------------------------------------------------

    def healthy(self) -> list[int]:
        return [i for i, state in enumerate(self.state) if state == HEALTHY]

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()
        if self._changed is not None:
            self._changed.set()
        self._changed = None

    def down_signal(self, index: int) -> asyncio.Future:
        """A future that completes (with the reason) when slot ``index`` goes down."""
        future = self._down[index]
        if future is None or future.done():
            future = self._down[index] = asyncio.get_running_loop().create_future()
        return future

    def mark_down(self, url: str, reason: str) -> None:
        """Take every healthy slot of ``url`` out of service: cancel its requests in flight
        (they are retried elsewhere), and restart it when a ``restart`` callback is set."""
        for index, slot_url in enumerate(self.urls):
            if slot_url != url or self.state[index] != HEALTHY:
                continue
            self.state[index], self.reason[index] = DOWN, reason
            log.warning(
                "rollout engine %s is down (%s)%s", url, reason, "; restarting it" if self.restart is not None else "; routing around it"
            )
            future = self._down[index]
            if future is not None and not future.done():
                future.set_result(reason)
            if self.restart is not None:
                self._spawn(self._restart(index))
        self._notify()

    def add_slot(self, url: str) -> int:
        """Append a healthy slot for ``url`` (a newly registered engine); its index."""
        self.urls.append(url)
        self.state.append(HEALTHY)
        self.reason.append("")
        self._down.append(None)
        self._notify()
        return len(self.urls) - 1

    def admit(self, url: str) -> list[int]:
        """Put every slot of ``url`` that is not healthy back in service (the engine was
        registered again, its weights re-synced); the slots."""
        slots = [i for i, slot_url in enumerate(self.urls) if slot_url == url]
        for index in slots:
            if self.state[index] != HEALTHY:
                self._back(index)
        return slots

    def remove(self, url: str) -> list[int]:
        """Take every slot of ``url`` out of routing for good (requests in flight there
        finish); the slots."""
        slots = [i for i, slot_url in enumerate(self.urls) if slot_url == url]
        for index in slots:
            self.state[index], self.reason[index] = REMOVED, "removed"
        self.failures.pop(url, None)
        self._notify()
        return slots

    def _back(self, index: int) -> None:
        self.state[index], self.reason[index] = HEALTHY, ""
        self.failures.pop(self.urls[index], None)
        self.restarts += 1
        self._notify()

    # -- the health checks ------------------------------------------------------------------

    def start(self) -> None:
        """Start the health-check task on the running loop (once), and the restarts that
        a previous loop's :meth:`close` cut short."""
        if self._monitor is None:
            self._monitor = asyncio.ensure_future(self._run_monitor())
            if self.restart is not None:
                for index, state in enumerate(self.state):
                    if state == DOWN:
                        self._spawn(self._restart(index))

    async def _run_monitor(self) -> None:
        await asyncio.sleep(self.settings.first_wait)
        while True:
            try:
                await self.check_once()
            except Exception:  # a broken round must not end the health checks for the run
                log.exception("rollout engine health checks: a round failed")
            await asyncio.sleep(self.settings.interval)

    async def check_once(self) -> None:
        """One round: ``GET /health`` on every healthy URL, and on down ones that come
        back by themselves (no ``restart`` callback)."""
        comes_back = self.restart is None and self.readmit
        watched = [i for i, state in enumerate(self.state) if state == HEALTHY or (state == DOWN and comes_back)]
        urls = list(dict.fromkeys(self.urls[i] for i in watched))
        statuses = await asyncio.gather(*(self.check(url, self.settings.timeout) for url in urls))
        self.checks += 1
        for url, status in zip(urls, statuses):
            slots = [i for i, slot_url in enumerate(self.urls) if slot_url == url]
            if status == 200:
                self.failures.pop(url, None)
                for index in slots:
                    if self.state[index] == DOWN and comes_back:
                        self.state[index] = RESTARTING
                        self._spawn(self._readmit(index))
                continue
            if not any(self.state[i] == HEALTHY for i in slots):
                continue
            failures = self.failures[url] = self.failures.get(url, 0) + 1
            if failures >= self.settings.failure_threshold:
                answer = f"no answer within {self.settings.timeout:g} s" if status is None else f"HTTP {status}"
                self.mark_down(url, f"{failures} failed health checks in a row, the last: {answer}")

    # -- coming back ------------------------------------------------------------------------

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, index: int) -> None:
        assert self.restart is not None
        self.state[index] = RESTARTING
        old = self.urls[index]
        try:
            url = await self.restart(index)
            self.urls[index] = url
            if self.prepare is not None:
                await self.prepare(url)
            if self.admit_callback is not None:
                await self.admit_callback(old, url)
        except Exception as exc:  # the slot stays out; a request waiting for it gets the reason
            self.state[index], self.reason[index] = FAILED, f"restart failed: {' '.join(str(exc).split())}"
            log.error("rollout engine %s: %s", old, self.reason[index])
            self._notify()
            return
        log.warning("rollout engine %s restarted as %s", old, url)
        self._back(index)

    async def _readmit(self, index: int) -> None:
        url = self.urls[index]
        try:
            if self.prepare is not None:
                await self.prepare(url)
            if self.admit_callback is not None:
                await self.admit_callback(url, url)
        except Exception as exc:  # down again; the next passing health check tries again
            self.state[index], self.reason[index] = DOWN, f"re-admission failed: {' '.join(str(exc).split())}"
            log.warning("rollout engine %s: %s", url, self.reason[index])
            self._notify()
            return
        log.warning("rollout engine %s is healthy again", url)
        self._back(index)

    # -- waiting for an engine -----------------------------------------------------------

    async def wait_for_healthy(self) -> list[int]:
        """The healthy slots; when there are none, wait (at most
        :attr:`FaultTolerance.engine_wait` s) for one to come back, or raise
        :class:`NoHealthyEngineError` naming every engine and its state."""
        deadline = time.monotonic() + self.settings.engine_wait
        while True:
            healthy = self.healthy()
            if healthy:
                return healthy
            remaining = deadline - time.monotonic()
            if remaining <= 0 or all(state == FAILED for state in self.state):
                raise NoHealthyEngineError(
                    f"no healthy engine within {self.settings.engine_wait:g} s: "
                    + "; ".join(
                        f"{url} {state} ({reason})" if reason else f"{url} {state}"
                        for url, state, reason in zip(self.urls, self.state, self.reason)
                    )
                )
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        tasks = [t for t in (self._monitor, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.reset()


__all__ = ["DOWN", "FAILED", "HEALTHY", "REMOVED", "RESTARTING", "FaultTolerance", "NoHealthyEngineError", "Supervisor"]
