"""Engine fleets the run starts itself (``--rollout-engine http --rollout-num-engines N``):
real ``miles-core serve-engine`` subprocesses, weight sync to every one of them with the
checksums checked after each sync, the same metrics as a one-engine run, the servers
stopped when the run ends, and one-line errors naming an engine's log."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

import miles_core.training.weight_sync as weight_sync
from miles_core.engine.fleet import EngineFleet, ServedEngine
from miles_core.errors import FleetError
from tests.test_server import http
from tests.tiny_runs import run_metrics, tiny_run_args

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}']


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _recording_sync(monkeypatch) -> list[dict]:
    """Wrap sync_to_engine: after each sync, every engine's reported checksums and the
    trainer's, per URL and module."""
    syncs: list[dict] = []
    original = weight_sync.sync_to_engine

    async def recording(engine, modules, config):
        result = await original(engine, modules, config)
        reported = await engine.weights_checksums(list(modules))
        lora_only = bool(config.lora_ipc_weight_sync)
        trainer = {name: weight_sync.expected_checksum(module, lora_only=lora_only) for name, module in modules.items()}
        syncs.append({"engine": engine, "urls": list(engine.urls), "reported": reported, "trainer": trainer})
        return result

    monkeypatch.setattr(weight_sync, "sync_to_engine", recording)
    return syncs


def _outcome(records: list[dict]) -> list[dict]:
    """The records without timings (perf/*), which differ from run to run."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and not k.endswith("_time")} for r in records]


def _fleet_run(tiny_sd3, prompts, out, engines: int, *extra: str) -> list[dict]:
    args = [
        *tiny_run_args(tiny_sd3, prompts, out, batch=2, n=2, steps=3, sde_steps=1),
        "--num-rollout",
        "2",
        "--lr",
        "3e-2",
        "--rollout-engine",
        "http",
        "--rollout-num-engines",
        str(engines),
        *extra,
    ]
    return run_metrics(args, timeout=300)


@pytest.mark.exercises("--rollout-num-engines", "--rollout-engine", "--update-weight-buffer-size", "--use-miles-router")
def test_a_run_with_two_engines_syncs_both_and_matches_one_engine(tiny_sd3, prompts, tmp_path, monkeypatch):
    """Also through the miles router (--use-miles-router; tests/test_router.py tests the
    router itself): the same metrics as the in-process routing, the requests spread over
    both engines by the router, the weights synced to each engine directly."""
    from miles_core.engine.http import HttpEngine

    syncs = _recording_sync(monkeypatch)
    routers: list[list[dict]] = []
    original_close = HttpEngine.close

    async def close(self):  # the router's view of its engines, before the run stops it
        if self.router is not None:
            routers.append(await self.workers())
        await original_close(self)

    monkeypatch.setattr(HttpEngine, "close", close)
    buffer = ("--update-weight-buffer-size", str(64 * 1024))
    two = _fleet_run(tiny_sd3, prompts, tmp_path / "two", 2, *buffer)
    two_syncs, syncs[:] = list(syncs), []
    routed = _fleet_run(tiny_sd3, prompts, tmp_path / "routed", 2, *buffer, "--use-miles-router")
    routed_syncs, syncs[:] = list(syncs), []
    one = _fleet_run(tiny_sd3, prompts, tmp_path / "one", 1, *buffer)
    assert [r["rollout_id"] for r in two] == [0, 1]
    assert _outcome(routed) == _outcome(two)
    # Control: the compared records change with the requests (rollout 1's seeds and
    # weights are not rollout 0's), so equal records mean equal requests; through the
    # router a changed seed changes the answer (tests/test_router.py).
    assert routed[0]["rollout/reward/raw_mean"] != routed[1]["rollout/reward/raw_mean"]
    assert len(routers) == 1 and sorted(w["sent"] for w in routers[0]) == [2, 2]  # one request per engine per rollout
    assert all(sent == 0 for sent in routed_syncs[0]["engine"].sent)  # none routed in the run's process
    # One sync before the first rollout and one after each update, to every engine, each
    # engine's checksum equal to the trainer's.
    for run_syncs, engines in ((two_syncs, 2), (routed_syncs, 2), (syncs, 1)):
        assert len(run_syncs) == 3
        for sync in run_syncs:
            assert len(set(sync["urls"])) == engines and set(sync["reported"]) == set(sync["urls"])
            for answer in sync["reported"].values():
                assert answer == sync["trainer"]
    assert two_syncs[0]["trainer"] != two_syncs[-1]["trainer"]  # control: training moved the weights
    # Both engines generated, and the outcome is the one-engine run's (outputs depend only on seeds).
    assert all(sent > 0 for sent in two_syncs[0]["engine"].sent)
    assert "rollout/reward/raw_mean" in _outcome(one)[0] and "train/loss" in _outcome(one)[1]
    assert _outcome(two) == _outcome(one)
    assert two[0]["perf/weight_sync_bytes"] > 0
    # The engines' logs are under the run's folder, and the servers are gone.
    for index in range(2):
        assert "serving sd3" in (tmp_path / "two" / "engines" / f"engine_{index}.log").read_text()
    for url in two_syncs[0]["urls"]:
        with pytest.raises(OSError):
            http(url, "/health", method="GET")


def test_an_engine_that_fails_to_start_names_its_log(tmp_path):
    with pytest.raises(FleetError) as info:
        EngineFleet.start(
            tmp_path / "no-such-model", 2, tmp_path / "logs", "--diffusion-model-family", "sd3", "--device", "cpu", timeout=60
        )
    message = str(info.value)
    # Whichever of the two exits first is named (both fail the same way).
    assert "\n" not in message and re.search(r"engine_[01]\.log", message) and "before it was healthy" in message
    assert str(tmp_path / "logs") in message


def test_a_banner_another_thread_wrote_into_is_not_taken_for_a_url(tmp_path):
    # A failing load's error printed into the banner line (two threads on one stderr) once
    # made "failed" the URL: only a whole "serving ... on http://HOST:PORT" line counts.
    log = tmp_path / "engine.log"
    log.write_text("serving sd3 /x on miles-core serve-engine: error: loading /x as sd3 failed\n")
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    engine = ServedEngine(process, log)
    assert not engine.poll_banner() and engine.url is None
    log.write_text(log.read_text() + "serving sd3 /x on http://127.0.0.1:8123\n")
    assert engine.poll_banner() and engine.url == "http://127.0.0.1:8123"
    process.wait()


def test_an_engine_that_is_not_healthy_in_time_names_its_log(tiny_sd3, tmp_path):
    with pytest.raises(FleetError, match=r"was not healthy within 0\.01 s; see .*engine_0\.log"):
        EngineFleet.start(tiny_sd3, 1, tmp_path / "logs", "--diffusion-model-family", "sd3", "--device", "cpu", timeout=0.01)


def test_a_run_whose_engine_fails_is_one_line(tmp_path, prompts, tiny_sd3, monkeypatch):
    from miles_core.config.resolve import resolve_config
    from miles_core.engine import fleet
    from miles_core.errors import RunError
    from miles_core.training.run import train

    original = EngineFleet.start.__func__
    monkeypatch.setattr(
        fleet.EngineFleet,
        "start",
        classmethod(
            lambda cls, checkpoint, count, log_dir, *args, **kw: original(
                cls, checkpoint, count, log_dir, *args, "--no-such-option", timeout=60
            )
        ),
    )
    config = resolve_config(
        [
            *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=1, n=2, steps=3, sde_steps=1),
            "--num-rollout",
            "1",
            "--rollout-engine",
            "http",
            "--rollout-num-engines",
            "1",
        ]
    )
    with pytest.raises(RunError) as info:
        asyncio.run(train(config, log=lambda line: None))
    assert "\n" not in str(info.value) and str(tmp_path / "run" / "engines" / "engine_0.log") in str(info.value)


def test_an_engine_killed_mid_rollout_stops_the_run_naming_its_url(tiny_sd3, prompts, tmp_path, monkeypatch):
    """Without --use-fault-tolerance, an engine that dies mid-request stops the run with a
    one-line error naming the engine's URL."""
    import os
    import signal

    from miles_core.config.resolve import resolve_config
    from miles_core.engine.http import HttpEngine
    from miles_core.errors import RunError
    from miles_core.training.run import train

    fleets = []
    original_start = EngineFleet.start.__func__
    monkeypatch.setattr(
        EngineFleet, "start", classmethod(lambda cls, *args, **kw: fleets.append(original_start(cls, *args, **kw)) or fleets[-1])
    )
    original_post = HttpEngine._post

    async def post(self, url, path, **kw):
        if path == "/rollout/generate" and fleets[0].engines[0].process.poll() is None:
            os.kill(fleets[0].engines[0].process.pid, signal.SIGKILL)
            fleets[0].engines[0].process.wait(timeout=10)
        return await original_post(self, url, path, **kw)

    monkeypatch.setattr(HttpEngine, "_post", post)
    config = resolve_config(
        [
            *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=1, n=2, steps=3, sde_steps=1),
            "--num-rollout",
            "1",
            "--rollout-engine",
            "http",
            "--rollout-num-engines",
            "1",
        ]
    )
    with pytest.raises(RunError) as info:
        asyncio.run(train(config, log=lambda line: None))
    message = str(info.value)
    url = fleets[0].engines[0].url
    assert "\n" not in message and message.startswith(f"rollout engine failed: {url}/rollout/generate: no response")
