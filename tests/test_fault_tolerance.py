"""``--use-fault-tolerance`` for HTTP engine fleets: an engine killed mid-rollout is
restarted and re-synced while its requests are retried elsewhere with the same seeds, so
the run's samples and metrics are an undisturbed run's; health checks take a hung engine
out of routing after the failure threshold; a bad request is not retried; and
``--miles-router-timeout`` bounds a request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

import miles_core.training.weight_sync as weight_sync
from miles_core.config.resolve import resolve_config
from miles_core.engine.fleet import EngineFleet
from miles_core.engine.health import DOWN, HEALTHY
from miles_core.engine.http import HttpEngine
from miles_core.errors import EngineRequestError
from miles_core.request import RolloutRequest
from miles_core.training.debug_data import load_rollout_data
from tests.test_server import assert_same
from tests.tiny_runs import run_metrics, tiny_run_args

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}']
REQUEST = RolloutRequest(
    prompt="a red cube",
    seed=11,
    num_inference_steps=3,
    num_outputs_per_prompt=2,
    rollout_return_dit_trajectory=True,
    rollout_return_denoising_env=True,
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet(tiny_sd3, tmp_path_factory):
    """Two tiny serve-engine servers shared by the engine-level tests (each test leaves
    them running and not stopped)."""
    started = EngineFleet.start(
        tiny_sd3, 2, tmp_path_factory.mktemp("fleet"), "--diffusion-model-family", "sd3", "--device", "cpu", timeout=120, threads=1
    )
    yield started
    started.stop(timeout=5)


@contextmanager
def stopped(process):
    """SIGSTOP ``process`` (it hangs: connections stay open, nothing answers); SIGCONT after."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def _same_outputs(expected, got) -> None:
    """Outputs equal bit for bit (request ids and timings aside)."""
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        e, g = e.to_wire(), g.to_wire()
        for key in ("request_id", "inference_time_s", "peak_memory_mb"):
            e.pop(key), g.pop(key)
        assert_same(e, g)


def assert_the_kill_changed_nothing(records: list[dict], calm: list[dict], killed_dir: Path, calm_dir: Path) -> None:
    """A 2-rollout run whose engine was killed mid-rollout against the undisturbed run: at
    least one request retried, one restart, and the same metrics (but the fault counters
    and timings), samples, rewards and outputs (saved under ``<dir>/rollouts``)."""
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert sum(r["rollout/engine_retries"] for r in records) >= 1
    assert sum(r["rollout/engine_restarts"] for r in records) == 1
    assert all(r["rollout/engine_retries"] == 0 and r["rollout/engine_restarts"] == 0 for r in calm)
    assert _comparable(records) == _comparable(calm)
    assert "train/loss" in records[1] and "rollout/reward/raw_mean" in records[0]
    for rollout_id in (0, 1):
        got, got_rewards = load_rollout_data(str(killed_dir / "rollouts" / "{}.msgpack"), rollout_id)
        want, want_rewards = load_rollout_data(str(calm_dir / "rollouts" / "{}.msgpack"), rollout_id)
        assert len(got) == len(want) == 8
        assert_same(got_rewards, want_rewards)
        for g, w in zip(got, want):
            assert (g.seed, g.group_index, g.index_in_group, g.sde_step_indices, g.reward) == (
                w.seed,
                w.group_index,
                w.index_in_group,
                w.sde_step_indices,
                w.reward,
            )
        _same_outputs([w.output for w in want], [g.output for g in got])


def restart_after_first_sync(original, seen: dict, stopping: str):
    """A fixed order for a restart (``original(self, index)``, blocking): it waits until
    the run synced twice (before rollout 0, after its training), unless the engine stops."""

    def restart(self, index, *args, **kw):
        deadline = time.monotonic() + 120
        while len(seen["syncs"]) < 2 and not getattr(self, stopping):
            assert time.monotonic() < deadline, "no weight sync after rollout 0"
            time.sleep(0.05)
        return original(self, index, *args, **kw)

    return restart


def recording_sync(seen: dict):
    """``sync_to_engine`` that also records, after each sync, what the trainer sent and what
    every engine reports (``seen["syncs"]``), and how many posts came before."""
    original = weight_sync.sync_to_engine

    async def recording(engine, modules, config):
        result = await original(engine, modules, config)
        reported = await engine.weights_checksums(list(result.checksums))
        seen["syncs"].append(
            {"urls": sorted(reported), "sent": dict(result.checksums), "reported": reported, "posts_before": len(seen["posts"])}
        )
        return result

    return recording


async def poll(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.05)


def _comparable(records: list[dict]) -> list[dict]:
    """The records without timings (perf/*, *_time) and fault counters
    (rollout/engine_*): what a disturbed run must share with an undisturbed one."""
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "rollout/engine_")) and not k.endswith("_time")} for r in records]


# -- the run ------------------------------------------------------------------------------


def _disturbed_run(tiny_sd3, prompts, out: Path, monkeypatch, *, kill: bool) -> dict:
    """A 2-engine fault-tolerant run of two rollouts (4 microgroups each); with ``kill``,
    engine 0 gets SIGKILL as soon as a microgroup of rollout 0 returns while engine 0 has
    a request in flight (at the first return, in practice: each server works through its
    two requests one at a time)."""
    seen: dict = {"fleets": [], "posts": [], "syncs": [], "killed_pid": None, "generates": 0}
    original_start = EngineFleet.start.__func__
    monkeypatch.setattr(
        EngineFleet,
        "start",
        classmethod(lambda cls, *args, **kw: seen["fleets"].append(original_start(cls, *args, **kw)) or seen["fleets"][-1]),
    )

    original_post = HttpEngine._post

    async def post(self, url, path, **kw):
        seen["posts"].append((path, url))
        return await original_post(self, url, path, **kw)

    original_generate = HttpEngine.generate

    async def generate(self, request):
        seen["generates"] += 1
        fleet = seen["fleets"][0]
        if kill and seen["generates"] > 4:
            # Rollout 1 waits for the restarted engine, so that the run exercises it (the
            # restart itself runs in the background while rollout 0 goes on without it).
            await poll(lambda: self.supervisor.state[0] == HEALTHY, "engine 0 restarted")
        outputs = await original_generate(self, request)
        if kill and seen["killed_pid"] is None and self.in_flight[0]:
            seen["killed_pid"], seen["killed_url"] = fleet.engines[0].process.pid, fleet.engines[0].url
            seen["killed_at"] = len(seen["posts"])
            os.kill(fleet.engines[0].process.pid, signal.SIGKILL)
        return outputs

    # The restarted engine comes up only after rollout 0 trained and synced, so its re-sync
    # must send the trained policy (here: the EMA weights).
    monkeypatch.setattr(HttpEngine, "_post", post)
    monkeypatch.setattr(HttpEngine, "generate", generate)
    monkeypatch.setattr(EngineFleet, "restart", restart_after_first_sync(EngineFleet.restart, seen, "_stopped"))
    monkeypatch.setattr(weight_sync, "sync_to_engine", recording_sync(seen))
    args = [
        *tiny_run_args(tiny_sd3, prompts, out, batch=2, n=4, steps=3, sde_steps=1),
        "--num-rollout",
        "2",
        "--lr",
        "3e-2",
        "--rollout-engine",
        "http",
        "--rollout-num-engines",
        "2",
        "--use-fault-tolerance",
        "--rollout-health-check-interval",
        "0.5",
        "--rollout-health-check-timeout",
        "10",
        # The engines sample the EMA policy: a re-sync must send that, not the live weights.
        "--use-ema",
        "--ema-rollout-policy",
        "ema",
        "--ema-decay-init",
        "0.5",
        "--ema-decay-flat-steps",
        "100",
        "--save-debug-rollout-data",
        str(out / "rollouts" / "{}.msgpack"),
    ]
    seen["records"] = run_metrics(args, timeout=400)
    monkeypatch.undo()
    return seen


@pytest.mark.exercises("--use-fault-tolerance")
def test_an_engine_killed_mid_rollout_is_restarted_and_the_run_is_unchanged(tiny_sd3, prompts, tmp_path, monkeypatch):
    began = time.monotonic()
    disturbed = _disturbed_run(tiny_sd3, prompts, tmp_path / "killed", monkeypatch, kill=True)
    middle = time.monotonic()
    calm = _disturbed_run(tiny_sd3, prompts, tmp_path / "calm", monkeypatch, kill=False)
    print(f"disturbed run {middle - began:.1f} s, undisturbed {time.monotonic() - middle:.1f} s")

    assert_the_kill_changed_nothing(disturbed["records"], calm["records"], tmp_path / "killed", tmp_path / "calm")

    # A new process took engine 0's place, from its own log.
    fleet = disturbed["fleets"][0]
    new_url = fleet.engines[0].url
    assert fleet.engines[0].process.pid != disturbed["killed_pid"] and new_url != disturbed["killed_url"]
    assert fleet.restarts == [1, 0]
    assert "serving sd3" in (tmp_path / "killed" / "engines" / "engine_0.restart1.log").read_text()
    assert fleet.engines[0].process.poll() is not None  # stopped with the run

    # It got the trainer's current weights, checksums checked, before it served: the
    # re-sync (the third sync: initial, after rollout 0, re-sync, after rollout 1) sent
    # what the sync after rollout 0's training sent (the EMA policy of the moment), and the
    # first request it got came after the checksum check.
    syncs = disturbed["syncs"]
    resync = next(i for i, s in enumerate(syncs) if s["urls"] == [new_url])
    assert resync == 2 and syncs[1]["urls"] == [fleet.urls[1]]
    assert syncs[2]["reported"][new_url] == syncs[2]["sent"] == syncs[1]["sent"] != syncs[0]["sent"]
    posts = disturbed["posts"]
    first_request = posts.index(("/rollout/generate", new_url))
    first_check = posts.index(("/get_weights_checksum", new_url))
    assert first_check < syncs[resync]["posts_before"] <= first_request
    # Once dead, the killed engine got no weight update (syncs go to healthy engines).
    assert ("/update_weights_from_tensor", disturbed["killed_url"]) not in posts[disturbed["killed_at"] :]
    assert len(syncs) == 4 and [len(s["urls"]) for s in syncs].count(2) >= 2
    # The undisturbed run's every sync went to both engines.
    assert all(len(s["urls"]) == 2 for s in calm["syncs"])


# -- the engine -----------------------------------------------------------------------------


def _config(urls: list[str], tiny_sd3, prompts, tmp_path, *extra: str):
    return resolve_config(
        [*tiny_run_args(tiny_sd3, prompts, tmp_path / "run"), "--rollout-engine", "http", "--rollout-engine-urls", ",".join(urls), *extra]
    )


@pytest.mark.exercises(
    "--rollout-health-check-interval",
    "--rollout-health-check-timeout",
    "--rollout-health-check-first-wait",
    "--miles-router-health-check-failure-threshold",
)
def test_health_checks_take_a_hung_engine_out_and_back_in(fleet, tiny_sd3, prompts, tmp_path):
    config = _config(
        fleet.urls,
        tiny_sd3,
        prompts,
        tmp_path,
        "--use-fault-tolerance",
        "--rollout-health-check-first-wait",
        "1.0",
        "--rollout-health-check-interval",
        "0.2",
        "--rollout-health-check-timeout",
        "1",
        "--miles-router-health-check-failure-threshold",
        "2",
    )
    hung, other = fleet.engines[0], fleet.engines[1]

    async def main():
        async with HttpEngine(other.url) as direct:
            expected = await direct.generate(REQUEST)
        engine = HttpEngine.from_config(config)
        supervisor = engine.supervisor
        checks, prepared = [], []
        check = supervisor.check

        async def recording_check(url, timeout):
            began = time.monotonic()
            status = await check(url, timeout)
            checks.append((url, status, began, time.monotonic() - began))
            return status

        async def prepare(url):  # the run re-syncs weights here
            prepared.append((url, list(supervisor.state)))

        supervisor.check, supervisor.prepare = recording_check, prepare
        try:
            with stopped(hung.process):
                began = time.monotonic()
                # The first request goes to engine 0, which hangs: only the health checks
                # can take it back, and it is retried on engine 1 (the same seeds).
                outputs = await asyncio.wait_for(engine.generate(REQUEST), 30)
                elapsed = time.monotonic() - began
                assert engine.sent == [1, 1] and supervisor.retries == 1
                _same_outputs(expected, outputs)
                assert supervisor.state == [DOWN, HEALTHY]
                assert supervisor.reason[0] == "2 failed health checks in a row, the last: no answer within 1 s"
                # No check before the first wait; two failed checks of 1 s each, 0.2 s apart.
                assert min(c[2] for c in checks) - began >= 0.95
                failed = [c for c in checks if c[0] == hung.url]
                assert [c[1] for c in failed] == [None, None]
                assert all(0.95 <= c[3] < 4 for c in failed)
                assert failed[1][2] - failed[0][2] >= 1 + 0.2 - 0.05
                assert elapsed < 1.0 + 2 * (1 + 0.2) + 4
                # While it is down nothing goes there.
                await asyncio.wait_for(engine.generate(replace(REQUEST, seed=12)), 30)
                assert engine.sent == [1, 2] and prepared == []
            # Running again, it passes a check, is prepared (weights) and rejoins.
            await asyncio.wait_for(poll(lambda: supervisor.state[0] == HEALTHY, "engine 0 back", 30), 35)
            assert prepared == [(hung.url, ["restarting", "healthy"])] and supervisor.restarts == 1
            again = await asyncio.wait_for(engine.generate(REQUEST), 30)
            assert engine.sent == [2, 2]
            _same_outputs(expected, again)
        finally:
            await engine.close()

    asyncio.run(main())


@pytest.mark.exercises("--use-fault-tolerance")
def test_a_bad_request_is_not_retried(fleet, tiny_sd3, prompts, tmp_path):
    config = _config(fleet.urls, tiny_sd3, prompts, tmp_path, "--use-fault-tolerance")
    # The last step is never stochastic: every server answers 400.
    bad = replace(REQUEST, rollout_sde_step_indices=(2,))

    async def main():
        async with HttpEngine.from_config(config) as engine:
            with pytest.raises(EngineRequestError) as info:
                await asyncio.wait_for(engine.generate(bad), 30)
            assert info.value.status == 400 and "rollout_sde_step_indices" in info.value.message
            assert sum(engine.sent) == 1 and engine.supervisor.retries == 0
            assert engine.supervisor.state == [HEALTHY, HEALTHY]

    asyncio.run(main())


@pytest.mark.exercises("--miles-router-timeout")
def test_the_router_timeout_bounds_a_request(fleet, tiny_sd3, prompts, tmp_path):
    hung = fleet.engines[0]
    config = _config([hung.url], tiny_sd3, prompts, tmp_path, "--miles-router-timeout", "1")

    async def main():
        async with HttpEngine.from_config(config) as engine:
            began = time.monotonic()
            with stopped(hung.process), pytest.raises(EngineRequestError) as info:
                await asyncio.wait_for(engine.generate(REQUEST), 30)
            assert time.monotonic() - began < 10
        assert info.value.status is None
        assert str(info.value) == f"{hung.url}/rollout/generate: no response: TimeoutError: no complete answer within 1 s"

    asyncio.run(main())


def test_fault_tolerance_settings_are_checked_and_noted(tiny_sd3, prompts, tmp_path):
    from miles_core.engine.health import FaultTolerance

    with pytest.raises(ValueError, match="--miles-router-health-check-failure-threshold must be at least 1, got 0"):
        FaultTolerance(failure_threshold=0)
    base = tiny_run_args(tiny_sd3, prompts, tmp_path / "run")
    assert FaultTolerance.from_config(resolve_config(base)) is None
    # The configuration refuses such values whatever the engine (one line each).
    from miles_core.errors import ConfigError

    for flag, value, rule in (
        ("--miles-router-health-check-failure-threshold", "0", "must be at least 1"),
        ("--miles-router-timeout", "0", "must be positive"),
        ("--rollout-health-check-interval", "-1", "must be positive"),
    ):
        with pytest.raises(ConfigError) as info:
            resolve_config([*base, flag, value])
        assert f"{flag} {float(value) if flag != '--miles-router-health-check-failure-threshold' else value}: {rule}" in str(info.value)
    notes = resolve_config([*base, "--rollout-health-check-interval", "5", "--miles-router-health-check-failure-threshold", "2"]).notes
    assert (
        "--rollout-health-check-interval, --miles-router-health-check-failure-threshold: the engine health "
        "checks run only under --use-fault-tolerance or --use-miles-router, so they have no effect"
    ) in notes, notes
    notes = resolve_config([*base, "--use-fault-tolerance", "--miles-router-timeout", "60"]).notes
    assert any(n.startswith("--use-fault-tolerance has no effect with --rollout-engine embedded") for n in notes), notes
    assert (
        "--miles-router-timeout 60.0: no effect with --rollout-engine embedded (it bounds the requests of --rollout-engine http and sglang)"
    ) in notes, notes
    http = [*base, "--rollout-engine", "http", "--rollout-engine-urls", "http://127.0.0.1:1"]
    sglang = [*base, "--rollout-engine", "sglang", "--sglang-python", "/opt/sglang/bin/python"]
    for remote in (http, sglang):
        assert not [
            n
            for n in resolve_config(
                [*remote, "--use-fault-tolerance", "--miles-router-timeout", "60", "--rollout-health-check-timeout", "5"]
            ).notes
            if "fault-tolerance" in n or "health-check" in n or "router" in n
        ], remote


def test_a_stopped_fleet_restarts_nothing(tmp_path):
    import subprocess

    from miles_core.engine.fleet import ServedEngine
    from miles_core.errors import FleetError

    process = subprocess.Popen(["sleep", "60"])
    fleet = EngineFleet([ServedEngine(process, tmp_path / "engine_0.log")], checkpoint=tmp_path, log_dir=tmp_path)
    fleet.stop(timeout=5)
    with pytest.raises(FleetError, match="not restarted, the fleet is stopping"):
        fleet.restart(0)
    assert fleet.engines[0].process is process and not list(tmp_path.glob("*.restart*.log"))
    with pytest.raises(FleetError, match="was not started by EngineFleet.start"):
        EngineFleet([ServedEngine(process, tmp_path / "x.log")]).restart(0)


def test_with_no_engine_left_a_request_fails_naming_every_engine():
    import socket

    from miles_core.engine.health import FaultTolerance

    ports = []
    for _ in range(2):
        with socket.socket() as sock:  # a port nothing listens on: connections are refused
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    async def main():
        settings = FaultTolerance(interval=0.1, timeout=1, engine_wait=1.0)
        async with HttpEngine(urls, fault_tolerance=settings) as engine:
            began = time.monotonic()
            with pytest.raises(EngineRequestError) as info:
                await asyncio.wait_for(engine.generate(REQUEST), 30)
            assert 1.0 <= time.monotonic() - began < 10
            # One try per engine (each marked down on its refusal), then the wait for one to come back.
            assert engine.sent == [1, 1] and engine.supervisor.retries == 1
        message = str(info.value)
        assert message.startswith(
            f"{urls[0]}, {urls[1]}: no response: no healthy engine within 1 s: {urls[0]} down "
            "(a request got no answer: ClientConnectorError"
        )
        assert f"; {urls[1]} down (a request got no answer" in message

    asyncio.run(main())
