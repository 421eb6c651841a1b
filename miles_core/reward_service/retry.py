"""Calling a scoring server over HTTP: bounded time per attempt, retries with exponential
backoff, and the next URL on each retry. Shared by ``--rm-type remote`` (a
``miles-core serve-reward`` server) and the rewards that call other services
(the VLM judge's chat-completions endpoint), so both back off and give up alike.

What is retried: a transport error (refused, reset, DNS), an attempt that takes longer
than the policy's timeout, and the answers in :data:`RETRY_STATUSES` (rate limits and
server-side failures). Any other answer, 4xx included, is the caller's to read: a bad
request does not get better by sending it again.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from miles_core.errors import MilesError

T = TypeVar("T")

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another attempt: request timeout, rate limit, server-side failures."""


class CallFailed(MilesError):
    """A call that got no usable answer after all its attempts; ``str(exc)`` says where
    and why in one line."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long one attempt may take and how often to try again.

    Attributes:
        timeout: seconds one attempt may take, connecting and reading the answer included.
        retries: further attempts after the first (0: one attempt).
        backoff: seconds before the first retry; doubled before each further one.
        max_backoff: the longest wait between attempts (a server's ``Retry-After`` too).
    """

    timeout: float
    retries: int
    backoff: float = 0.5
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"RetryPolicy.timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if self.retries < 0:
            raise ValueError(f"RetryPolicy.retries must be >= 0, got {self.retries!r}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("RetryPolicy.backoff and max_backoff must be >= 0")

    @classmethod
    def from_config(cls, config: Any) -> RetryPolicy:
        """The policy of ``--rm-timeout``, ``--rm-max-retries`` and ``--rm-retry-backoff``."""
        get = config.get if hasattr(config, "get") else lambda key, default=None: getattr(config, key, default)
        return cls(
            timeout=float(get("rm_timeout", 60.0)),
            retries=int(get("rm_max_retries", 3)),
            backoff=float(get("rm_retry_backoff", 0.5)),
        )

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0 is the first): the server's
        ``Retry-After`` (in seconds) when it sent one, else ``backoff * 2**attempt``;
        at most ``max_backoff`` either way."""
        if retry_after is not None:
            try:
                seconds = float(retry_after)
            except ValueError:  # an HTTP date: not worth parsing for a capped wait
                seconds = math.nan
            if math.isfinite(seconds) and seconds >= 0:
                return min(seconds, self.max_backoff)
        return min(self.backoff * 2.0**attempt, self.max_backoff)


@dataclass(frozen=True)
class Answer:
    """A server's answer: which URL gave it, the status, the body and the headers."""

    url: str
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON; :class:`CallFailed` naming the URL when it is not."""
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CallFailed(f"{self.url}: answered {self.status} with a body that is not JSON ({exc})") from None

    def error_message(self) -> str:
        """The one-line reason of an error answer: the ``error`` of a JSON body (a string,
        or OpenAI's ``{"error": {"message": ...}}``), else the body's start."""
        try:
            body = json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            error = error.get("message")
        text = str(error) if error else self.body[:200].decode("utf-8", "replace")
        return " ".join(text.split()) or "(empty body)"


def _join(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path.lstrip("/") if path else url


async def post_with_retries(
    session: Any,
    urls: Sequence[str],
    path: str,
    *,
    first: int = 0,
    policy: RetryPolicy,
    json_body: Any = None,
    headers: Mapping[str, str] | None = None,
    on_retry: Callable[[str], None] | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> Answer:
    """POST ``json_body`` to ``path`` on ``urls[first]``, and on each retry to the next
    URL (attempt ``k`` goes to ``urls[(first + k) % len(urls)]``), so a dead server's
    calls move to a live one. Returns the first answer whose status is not in
    :data:`RETRY_STATUSES`; raises :class:`CallFailed` with the last attempt's cause
    after ``1 + policy.retries`` attempts. ``on_retry`` gets one line per retried attempt
    (for counters and logs). ``session``: an ``aiohttp.ClientSession``."""
    import aiohttp

    if not urls:
        raise ValueError("post_with_retries needs at least one URL")
    data = json.dumps(json_body, allow_nan=False).encode("utf-8")
    send_headers = {"Content-Type": "application/json", **(headers or {})}
    attempts = 1 + policy.retries
    cause = ""
    for attempt in range(attempts):
        url = _join(urls[(first + attempt) % len(urls)], path)
        retry_after = None
        try:
            timeout = aiohttp.ClientTimeout(total=policy.timeout)
            async with session.post(url, data=data, headers=send_headers, timeout=timeout) as response:
                body = await response.read()
                answer = Answer(url, response.status, body, dict(response.headers))
            if answer.status not in RETRY_STATUSES:
                return answer
            retry_after = answer.headers.get("Retry-After")
            cause = f"answered {answer.status}: {answer.error_message()}"
        except asyncio.TimeoutError:
            cause = f"no answer within {policy.timeout:g} s (--rm-timeout)"
        except aiohttp.ClientError as exc:
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        cause = " ".join(cause.split())
        if attempt + 1 < attempts:
            if on_retry is not None:
                on_retry(f"{url}: {cause}")
            await sleep(policy.delay(attempt, retry_after))
    raise CallFailed(f"{url}: {cause} (after {attempts} attempt{'s' if attempts != 1 else ''})")


async def gather_bounded(factories: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T | BaseException]:
    """Run the awaitables ``factories`` make, at most ``limit`` at once, and return their
    results in order; an awaitable that raises gives its exception in its place (the
    others still run), so one failed call fails only its own samples."""
    if limit < 1:
        raise ValueError(f"gather_bounded: limit must be >= 1, got {limit}")
    gate = asyncio.Semaphore(limit)

    async def one(factory: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await factory()

    return list(await asyncio.gather(*(one(f) for f in factories), return_exceptions=True))


def run_in_new_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to completion on a fresh event loop: a reward is called in a worker
    thread (docs/rewards.md), which has none of its own. Called from a thread whose loop is
    running (a reward built inside a run's coroutine), it runs in a thread of its own and
    this thread waits, as any synchronous constructor would."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="reward-call") as pool:
        return pool.submit(asyncio.run, coroutine).result()


__all__ = ["RETRY_STATUSES", "Answer", "CallFailed", "RetryPolicy", "gather_bounded", "post_with_retries", "run_in_new_loop"]
