"""The miles router (``--use-miles-router``, ``miles-core router``): a run through it
gives the in-process routing's metrics (tests/test_fleet.py); it spreads requests over the engines, caps each
engine and its connection pool, passes bodies through unchanged, retries a request whose
engine died on another one with the same result, and reports the dead engine until it is
registered again; the run's side restarts an engine the router took out and registers
the new one; bad flags and a router that cannot start are one-line errors."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from miles_core.config.resolve import resolve_config
from miles_core.engine.fleet import ServedEngine, wait_for
from miles_core.engine.health import FaultTolerance
from miles_core.engine.http import HttpEngine
from miles_core.engine.router_process import RouterProcess, start_router
from miles_core.errors import ConfigError, EngineRequestError, FleetError, RunError
from miles_core.request import RolloutRequest
from tests.test_server import ServerThread
from tests.tiny_runs import run_metrics, tiny_run_args

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}']

# A real upstream engine stand-in in a process of its own (so that it can be killed): its
# answer is a function of the request body alone, as a served model's is of its request.
UPSTREAM = """
import asyncio, hashlib, sys
from aiohttp import web

hold = float(sys.argv[1])

async def generate(request):
    body = await request.read()
    if b"refuse" in body:
        return web.json_response({"error": "prompt: refused"}, status=400)
    await asyncio.sleep(hold)
    return web.Response(body=hashlib.sha256(body).digest(), content_type="application/msgpack")

async def health(request):
    return web.Response(text="ok")

async def main():
    app = web.Application()
    app.router.add_post("/rollout/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"serving upstream on http://127.0.0.1:{runner.addresses[0][1]}", file=sys.stderr, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def upstream(log_dir: Path, name: str, hold: float) -> ServedEngine:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(hold)], stderr=log, start_new_session=True)
    served = ServedEngine(process, log_path)
    wait_for([served], 30, healthy=True)
    return served


def call(url: str, path: str, *, method: str = "POST", body: bytes | None = None) -> tuple[int, bytes, dict]:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url + path, data=body) as response:
                return response.status, await response.read(), dict(response.headers)

    return asyncio.run(go())


def workers(router: RouterProcess) -> dict[str, dict]:
    status, raw, _ = call(router.url, "/list_workers", method="GET")
    assert status == 200
    return {w["url"]: w for w in json.loads(raw)["workers"]}


# The run through the router, against the in-process routing of the same two-engine run,
# is in tests/test_fleet.py (it shares that test's in-process run).


# -- the router on its own ------------------------------------------------------------------


class CountingUpstreams:
    """Loopback ``/rollout/generate`` servers that count, from their side, the requests
    in flight on each and in all, and answer ``b"<index>:" + body``. A request is held
    until ``peak`` requests are in flight together (or ``hold`` s passed), so whether
    requests overlap does not depend on timing."""

    def __init__(self, count: int, *, peak: int, hold: float) -> None:
        from aiohttp import web

        self.lock = threading.Lock()
        self.now = [0] * count
        self.most = [0] * count
        self.served = [0] * count
        self.most_total = 0
        self.peak, self.hold = peak, hold
        self.servers = []
        for index in range(count):
            app = web.Application()
            app.router.add_post("/rollout/generate", self._handler(index))
            app.router.add_get("/health", self._health)
            self.servers.append(ServerThread(app))
        self.urls = [server.url for server in self.servers]

    @staticmethod
    async def _health(request):
        from aiohttp import web

        return web.Response(text="ok")

    def _handler(self, index: int):
        from aiohttp import web

        async def generate(request):
            body = await request.read()
            with self.lock:
                self.now[index] += 1
                self.served[index] += 1
                self.most[index] = max(self.most[index], self.now[index])
                self.most_total = max(self.most_total, sum(self.now))
            deadline = time.monotonic() + self.hold
            while self.most_total < self.peak and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            with self.lock:
                self.now[index] -= 1
            return web.Response(body=f"{index}:".encode() + body, content_type="application/msgpack")

        return generate

    def close(self) -> None:
        for server in self.servers:
            server.close()


def _burst(router_url: str, count: int) -> list[tuple[int, bytes, dict]]:
    async def go():
        async with aiohttp.ClientSession() as session:

            async def one(i: int):
                body = json.dumps({"prompt": "p", "seed": i}).encode()
                async with session.post(router_url + "/rollout/generate", data=body) as response:
                    return response.status, await response.read(), dict(response.headers), body

            return await asyncio.gather(*(one(i) for i in range(count)))

    return asyncio.run(go())


@pytest.mark.exercises("--miles-router-max-connections", "--sglang-server-concurrency")
def test_the_router_spreads_caps_each_engine_and_its_connection_pool(tmp_path):
    """8 requests at once over 2 engines with --sglang-server-concurrency 2: 2 in flight
    on each (4 in all), both engines serving, bodies passed through unchanged both ways;
    with --miles-router-max-connections 3 only 3 are in flight in all."""
    for name, extra, most_total in (("capped", [], 4), ("pooled", ["--miles-router-max-connections", "3"], 3)):
        upstreams = CountingUpstreams(2, peak=4, hold=0.3 if most_total < 4 else 10.0)
        router = start_router(["--sglang-server-concurrency", "2", *extra], tmp_path / f"{name}.log")
        try:
            for url in upstreams.urls:
                assert call(router.url, f"/add_worker?url={url}")[0] == 200
            answers = _burst(router.url, 8)
            assert upstreams.most_total == most_total
            # Both engines served (how the second wave splits depends on which answers
            # first), never more than 2 at once on one.
            assert max(upstreams.most) == 2 and sum(upstreams.served) == 8 and min(upstreams.served) >= 2
            for status, raw, headers, body in answers:
                index = upstreams.urls.index(headers["X-Miles-Engine"])
                assert status == 200 and raw == f"{index}:".encode() + body and headers["X-Miles-Retries"] == "0"
                assert headers["Content-Type"] == "application/msgpack"
            assert [w["sent"] for w in workers(router).values()] == upstreams.served
        finally:
            router.stop(timeout=5)
            upstreams.close()


@pytest.mark.exercises("--use-miles-router", "--miles-router-health-check-failure-threshold", "--rollout-health-check-interval")
def test_the_router_retries_a_request_on_another_engine_when_its_engine_dies(tmp_path):
    """Engine A holds its request; A is killed: the router takes A out and sends the same
    body to B, whose answer is the one B gives that body directly. A stays out (listed
    down) until it is registered again. An engine's error answer is passed back, not
    retried. Control: another seed gives another answer."""
    slow, fast = upstream(tmp_path, "a", hold=60.0), upstream(tmp_path, "b", hold=0.0)
    router = start_router(
        ["--rollout-health-check-interval", "30", "--miles-router-health-check-failure-threshold", "1"], tmp_path / "router.log"
    )
    try:
        for engine in (slow, fast):  # A first: the first request goes to A (ties go to the least recently chosen)
            assert call(router.url, f"/add_worker?url={engine.url}")[0] == 200
        body = json.dumps({"prompt": "a red cube", "seed": 11}).encode()
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(answer=call(router.url, "/rollout/generate", body=body)))
        thread.start()
        deadline = time.monotonic() + 30
        while workers(router)[slow.url]["in_flight"] != 1:
            assert time.monotonic() < deadline, "the request never reached engine A"
            time.sleep(0.02)
        os.kill(slow.process.pid, signal.SIGKILL)
        thread.join(30)
        status, raw, headers = result["answer"]
        assert status == 200 and headers["X-Miles-Engine"] == fast.url and headers["X-Miles-Retries"] == "1"
        assert raw == call(fast.url, "/rollout/generate", body=body)[1] == hashlib.sha256(body).digest()
        other = json.dumps({"prompt": "a red cube", "seed": 12}).encode()
        assert call(router.url, "/rollout/generate", body=other)[1] != raw  # control: the seed matters
        listed = workers(router)
        assert listed[slow.url]["state"] == "down" and "no answer" in listed[slow.url]["reason"]
        assert listed[fast.url]["state"] == "healthy" and listed[fast.url]["sent"] == 2
        # An engine's verdict comes back as it gave it, from the engine it chose, once.
        status, raw, headers = call(router.url, "/rollout/generate", body=b'{"prompt": "refuse"}')
        assert (status, json.loads(raw), headers["X-Miles-Retries"]) == (400, {"error": "prompt: refused"}, "0")
        # A registration brings A's URL back (the registrar re-synced it), a removal takes B out.
        revived = upstream(tmp_path, "a2", hold=0.0)
        try:
            assert call(router.url, f"/add_worker?url={revived.url}")[0] == 200
            assert call(router.url, f"/remove_worker?url={fast.url}")[0] == 200
            assert call(router.url, f"/remove_worker?url={fast.url}x")[0] == 404
            assert call(router.url, "/add_worker?url=ftp://nope")[:2] == (
                400,
                b'{"error": "url: \'ftp://nope\' is not an http:// or https:// base URL"}',
            )
            listed = workers(router)
            assert fast.url not in listed and listed[revived.url]["state"] == "healthy"
            assert call(router.url, "/rollout/generate", body=body)[2]["X-Miles-Engine"] == revived.url
        finally:
            revived.stop(timeout=5)
    finally:
        router.stop(timeout=5)
        slow.stop(timeout=5)
        fast.stop(timeout=5)


@pytest.mark.exercises("--use-fault-tolerance")
def test_the_run_side_restarts_an_engine_the_router_took_out_and_registers_the_new_one(tmp_path):
    """The router's health check takes a killed engine out; the run's engine sees it in
    /list_workers, restarts it (the callback), re-syncs it (prepare) and registers the new
    URL in place of the old one. A router that is gone fails the request in one line
    naming it and its log."""
    first, other = upstream(tmp_path, "a", hold=0.0), upstream(tmp_path, "b", hold=0.0)
    router = start_router(
        ["--rollout-health-check-interval", "0.1", "--miles-router-health-check-failure-threshold", "2"], tmp_path / "router.log"
    )
    started: list[ServedEngine] = []
    prepared: list[str] = []

    async def restart(index: int) -> str:
        started.append(await asyncio.to_thread(upstream, tmp_path, f"restart{index}", 0.0))
        return started[-1].url

    async def prepare(url: str) -> None:
        prepared.append(url)

    async def main():
        settings = FaultTolerance(interval=0.1, timeout=2.0, failure_threshold=2)
        engine = HttpEngine(
            [first.url, other.url], fault_tolerance=settings, restart=restart, router=router.url, router_log=str(router.log_path)
        )
        engine.supervisor.prepare = prepare
        try:
            await engine.register()
            engine.supervisor.start()
            assert sorted(w["url"] for w in await engine.workers()) == sorted([first.url, other.url])
            os.kill(first.process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (started and started[0].url in {w["url"] for w in await engine.workers()}):
                assert time.monotonic() < deadline, "the engine was not restarted and registered"
                await asyncio.sleep(0.05)
            listed = {w["url"]: w["state"] for w in await engine.workers()}
            assert listed == {other.url: "healthy", started[0].url: "healthy"}
            assert engine.urls == [started[0].url, other.url] and prepared == [started[0].url]
            assert engine.weight_urls() == [started[0].url, other.url]
            # A router lost mid-run: the request fails naming it and its log (the run stops, exit 1).
            router.stop(timeout=5)
            with pytest.raises(EngineRequestError) as info:
                await engine.generate(RolloutRequest(prompt="a red cube", seed=1))
            assert info.value.status is None and info.value.url == router.url + "/rollout/generate"
            assert info.value.message.startswith("the miles router gave no answer (")
            assert info.value.message.endswith(f"; see its log {tmp_path / 'router.log'}")
        finally:
            await engine.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        router.stop(timeout=5)
        for engine in (first, other, *started):
            engine.stop(timeout=5)


# -- bad input ------------------------------------------------------------------------------


def test_bad_router_flags_are_one_line_errors(tiny_sd3, prompts, tmp_path):
    base = [*tiny_run_args(tiny_sd3, prompts, tmp_path), "--num-rollout", "1"]
    cases = [
        (
            ["--use-miles-router"],
            "--use-miles-router routes the engine servers the run starts: it needs --rollout-engine http "
            "--rollout-num-engines N, not --rollout-engine embedded",
        ),
        (
            ["--use-miles-router", "--rollout-engine", "http", "--rollout-engine-urls", "http://127.0.0.1:1"],
            "--rollout-engine-urls",
        ),
        (
            ["--use-miles-router", "--use-distributed-post", "--use-ray", "--rollout-engine", "http", "--rollout-num-engines", "2"],
            "--use-distributed-post and --use-miles-router cannot be combined",
        ),
        (["--miles-router-max-connections", "0"], "--miles-router-max-connections"),
    ]
    for extra, expected in cases:
        with pytest.raises(ConfigError) as info:
            resolve_config([*base, *extra])
        assert expected in str(info.value), str(info.value)
        assert any(expected in line and len(line) < 400 for line in str(info.value).splitlines())
    notes = resolve_config([*base, "--miles-router-max-connections", "4"]).notes
    assert (
        "--miles-router-max-connections 4: no effect without --use-miles-router (it caps the router's connections to the engines)" in notes
    )
    for argv, message in (
        (["--miles-router-max-connections", "0"], "--miles-router-max-connections must be at least 1, got 0"),
        (["--rollout-health-check-interval", "0"], "--rollout-health-check-interval must be positive, got 0.0"),
        (["--worker-urls", "nope"], "--worker-urls: 'nope' is not an http:// or https:// base URL"),
    ):
        done = subprocess.run([sys.executable, "-m", "miles_core.cli.main", "router", *argv], capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (2, f"miles-core router: error: {message}\n")


def test_a_router_that_cannot_start_is_a_one_line_error_naming_its_log(tiny_sd3, prompts, tmp_path, monkeypatch):
    with pytest.raises(FleetError) as info:  # an address this machine does not have
        start_router([], tmp_path / "unbound.log", host="192.0.2.1")
    message = str(info.value)
    assert message.startswith("the miles router pid ") and "exited with status 1 before it was healthy" in message
    assert f"see {tmp_path / 'unbound.log'} (last line: miles-core router: error: cannot listen on 192.0.2.1:0" in message

    # In a run: exit status 2 at start-up, naming the flag and the log, before any engine starts.
    import miles_core.engine.router_process as router_process

    monkeypatch.setattr(router_process, "router_arguments", lambda config: ["--port", "70000"])
    args = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=2, n=2, steps=3, sde_steps=1),
        *("--num-rollout", "1", "--rollout-engine", "http", "--rollout-num-engines", "2", "--use-miles-router"),
    ]
    with pytest.raises(RunError) as info:
        run_metrics(args, timeout=120)
    assert info.value.exit_code == 2 and len(str(info.value).splitlines()) == 1
    log = (tmp_path / "run").glob("**/router.log")
    log = next(log)
    assert str(info.value).startswith("--use-miles-router: the miles router pid ")
    assert f"see {log.absolute()} (last line: miles-core router: error: --port 70000: must be in [0, 65535])" in str(info.value)
    assert not list((tmp_path / "run").glob("**/engines/engine_0.log"))  # no engine was started
