"""The reward-server client's retries (miles_core.reward_service.retry) against real
servers on loopback: what is retried, where the retry goes, how long it waits, and what
a caller gets when every attempt failed."""

from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
import pytest
from aiohttp import web

from miles_core.reward_service.retry import CallFailed, RetryPolicy, gather_bounded, post_with_retries, run_in_new_loop


def test_delay_doubles_caps_and_honours_retry_after() -> None:
    policy = RetryPolicy(timeout=1.0, retries=5, backoff=0.25, max_backoff=1.5)
    assert [policy.delay(k) for k in range(5)] == [0.25, 0.5, 1.0, 1.5, 1.5]
    assert policy.delay(0, "0") == 0.0
    assert policy.delay(3, "1.25") == 1.25
    assert policy.delay(0, "120") == 1.5  # a server's wait is capped too
    assert policy.delay(1, "Wed, 21 Oct 2026 07:28:00 GMT") == 0.5  # a date: the backoff


@pytest.mark.parametrize(("kwargs", "word"), [({"timeout": 0, "retries": 1}, "timeout"), ({"timeout": 1, "retries": -1}, "retries")])
def test_policy_refuses_bad_values(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        RetryPolicy(**kwargs)


class Script:
    """A loopback server answering POST /score from a list of planned answers
    (status, headers, body) or "hang"; then 200 {"ok": name}. Records each request."""

    def __init__(self, name: str, plan: list) -> None:
        self.name, self.plan, self.seen = name, list(plan), []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        if self.plan:
            step = self.plan.pop(0)
            if step == "hang":
                await asyncio.sleep(30)
            status, headers, body = step
            return web.json_response(body, status=status, headers=headers)
        return web.json_response({"ok": self.name})


async def _serve(script: Script) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/score", script.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _run(scripts: list[Script], call) -> object:
    async def main():
        servers = [await _serve(s) for s in scripts]
        try:
            async with aiohttp.ClientSession() as session:
                return await call(session, [url for _, url in servers])
        finally:
            for runner, _ in servers:
                await runner.cleanup()

    return asyncio.run(main())


def test_rate_limit_is_retried_after_its_wait_and_5xx_moves_to_the_next_url() -> None:
    a = Script("a", [(429, {"Retry-After": "0"}, {"error": "slow down"}), (503, {}, {"error": {"message": "busy"}})])
    b = Script("b", [(500, {}, {"error": "boom"})])
    waits, retried = [], []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    policy = RetryPolicy(timeout=5, retries=4, backoff=0.5)
    answer = _run(
        [a, b],
        lambda session, urls: post_with_retries(
            session, urls, "/score", policy=policy, json_body={"x": 1}, on_retry=retried.append, sleep=sleep
        ),
    )
    # attempts: a 429 (Retry-After 0), b 500, a 503, b 200
    assert answer.status == 200 and answer.json() == {"ok": "b"}
    assert waits == [0.0, 1.0, 2.0]
    assert [len(a.seen), len(b.seen)] == [2, 2] and a.seen[0] == {"x": 1}
    assert "slow down" in retried[0] and "boom" in retried[1] and "busy" in retried[2]


def test_client_errors_are_returned_not_retried() -> None:
    a = Script("a", [(400, {}, {"error": {"message": "samples[0].prompt: not a string", "type": "invalid_request_error"}})])
    answer = _run([a], lambda s, urls: post_with_retries(s, urls, "/score", policy=RetryPolicy(5, 3), json_body={}))
    assert answer.status == 400 and len(a.seen) == 1
    assert answer.error_message() == "samples[0].prompt: not a string"


def test_a_dead_url_is_skipped_on_the_retry() -> None:
    live = Script("live", [])
    dead = _dead_url()

    async def call(session, urls):
        return await post_with_retries(session, [dead, *urls], "/score", policy=RetryPolicy(5, 1, backoff=0), json_body={})

    assert _run([live], call).json() == {"ok": "live"}


def test_every_attempt_failing_raises_one_line_naming_the_url_and_cause() -> None:
    a = Script("a", [(502, {}, {"error": "bad gateway"})] * 3)
    with pytest.raises(CallFailed) as caught:
        _run([a], lambda s, urls: post_with_retries(s, urls, "/score", policy=RetryPolicy(5, 2, backoff=0), json_body={}))
    message = str(caught.value)
    assert "\n" not in message and "/score: answered 502: bad gateway (after 3 attempts)" in message
    assert len(a.seen) == 3


def test_a_hung_server_hits_the_timeout() -> None:
    a = Script("a", ["hang"])
    with pytest.raises(CallFailed, match=r"no answer within 0.3 s \(--rm-timeout\) \(after 1 attempt\)"):
        _run([a], lambda s, urls: post_with_retries(s, urls, "/score", policy=RetryPolicy(0.3, 0), json_body={}))
    # control: a server that answers comes back within a timeout (a generous one: a busy machine)
    b = Script("b", [])
    assert _run([b], lambda s, urls: post_with_retries(s, urls, "/score", policy=RetryPolicy(10, 0), json_body={})).status == 200


def test_gather_bounded_keeps_order_limits_concurrency_and_returns_exceptions() -> None:
    running, most = [0], [0]

    def job(i: int):
        async def go() -> int:
            running[0] += 1
            most[0] = max(most[0], running[0])
            await asyncio.sleep(0.01)
            running[0] -= 1
            if i == 3:
                raise RuntimeError("three")
            return i * i

        return go

    results = asyncio.run(gather_bounded([job(i) for i in range(8)], 2))
    assert results[:3] == [0, 1, 4] and isinstance(results[3], RuntimeError) and results[4:] == [16, 25, 36, 49]
    assert most[0] == 2
    with pytest.raises(ValueError, match="limit"):
        asyncio.run(gather_bounded([], 0))


def test_run_in_new_loop_works_with_and_without_a_running_loop():
    async def answer() -> tuple[int, int]:
        await asyncio.sleep(0)
        return 42, threading.get_ident()

    value, thread = run_in_new_loop(answer())
    assert (value, thread) == (42, threading.get_ident())  # no loop here: this thread's own

    async def inside_a_loop() -> tuple[int, int]:
        return run_in_new_loop(answer())  # a reward built inside a run's coroutine

    value, thread = asyncio.run(inside_a_loop())
    assert value == 42 and thread != threading.get_ident()
