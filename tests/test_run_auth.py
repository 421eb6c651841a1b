"""The run's side of the servers' authentication: a run that starts engine servers makes a
secret, gives it to each of them (a restarted one too) in its environment only, and its
clients send it; the servers refuse requests without it; the secret reaches no file of
the run directory, no log line and no command line. Servers started by hand take the
user's key (``--api-key``, ``--api-key-file``, ``MILES_API_KEY``), and one that refuses the
run's key stops the run at start-up with a one-line error (exit status 2)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from miles_core.config.document import config_document
from miles_core.config.resolve import resolve_config
from miles_core.engine.auth import API_KEY_ENV
from miles_core.engine.fleet import EngineFleet
from miles_core.engine.health import HEALTHY
from miles_core.engine.http import HttpEngine
from miles_core.errors import ApiKeyError, ConfigError
from miles_core.launch import train
from tests.tiny_runs import tiny_run_args

WRONG_KEY = "not-the-servers-key"

GUARDED = (
    "/rollout/generate",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/get_weights_checksum",
    "/init_weights_update_group",
    "/release_memory_occupation",
)
"""Generating and mutating routes (and the checksum): each must refuse a request without the key."""


def status(url: str, path: str, key: str | None = None, method: str = "POST") -> int:
    """The HTTP status of one request (a harmless body: with the right key the checksum of
    no module)."""
    request = urllib.request.Request(url + path, method=method, data=b'{"module_names": []}' if method == "POST" else None)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def assert_requires(url: str, key: str) -> None:
    """``url`` answers 401 to every guarded route without a key and with a wrong one, 200
    with ``key`` (the checksum of no module) and to ``GET /health`` without any."""
    for path in GUARDED:
        assert status(url, path) == 401, path
        assert status(url, path, WRONG_KEY) == 401, path
    assert status(url, "/get_weights_checksum", key) == 200
    assert status(url, "/health", method="GET") == 200


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def assert_nowhere(secret: str, out: Path, texts: list[str]) -> None:
    """``secret`` in no file under ``out`` (bytes) and in none of ``texts``."""
    files = [path for path in out.rglob("*") if path.is_file()]
    assert files
    leaked = [str(path) for path in files if secret.encode() in path.read_bytes()]
    assert not leaked
    assert not [text for text in texts if secret in text]


@pytest.mark.exercises("--rollout-num-engines", "--use-fault-tolerance")
def test_a_fleet_run_with_a_restart_gives_its_secret_to_every_server_and_nowhere_else(tiny_sd3, prompts, tmp_path, monkeypatch, capfd):
    """A fault-tolerant run of two 2-engine rollouts; engine 0 is killed as rollout 0
    begins and restarted. The servers require the run's secret (401 without it, or with
    another), the restarted one too (its re-sync, which needs the secret, admitted it), each
    got it in its environment, and it is in no command line, file, log or output."""
    out = tmp_path / "run"
    seen: dict = {"fleets": [], "calls": 0, "cmdlines": {}}
    start = EngineFleet.start.__func__
    monkeypatch.setattr(
        EngineFleet, "start", classmethod(lambda cls, *a, **kw: seen["fleets"].append(start(cls, *a, **kw)) or seen["fleets"][-1])
    )
    generate = HttpEngine.generate

    def servers_hold(fleet: EngineFleet) -> None:
        for engine in fleet.engines:
            pid = engine.process.pid
            seen["cmdlines"][pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert environ(pid)[API_KEY_ENV] == fleet.api_key  # given in its environment
            assert_requires(engine.url, fleet.api_key)

    async def checked_generate(self, request):
        seen["calls"] += 1
        fleet = seen["fleets"][0]
        if seen["calls"] == 1:  # rollout 0 begins: the run's servers refuse strangers; engine 0 dies
            assert self.api_key == fleet.api_key and os.environ.get(API_KEY_ENV) != fleet.api_key
            servers_hold(fleet)
            seen["killed"] = fleet.engines[0].process.pid
            os.kill(seen["killed"], signal.SIGKILL)
        elif seen["calls"] == 3:  # rollout 1 waits for the restarted engine, re-synced with the secret
            deadline = time.monotonic() + 120
            while self.supervisor.state[0] != HEALTHY:
                assert time.monotonic() < deadline, "engine 0 was not restarted"
                await asyncio.sleep(0.05)
            assert fleet.engines[0].process.pid != seen["killed"]
            servers_hold(fleet)
        return await generate(self, request)

    monkeypatch.setattr(HttpEngine, "generate", checked_generate)
    args = [
        *tiny_run_args(tiny_sd3, prompts, out, batch=1, n=4, steps=3, sde_steps=1),
        "--num-rollout",
        "2",
        "--rollout-engine",
        "http",
        "--rollout-num-engines",
        "2",
        "--use-fault-tolerance",
        "--rollout-health-check-interval",
        "0.5",
        "--rollout-health-check-timeout",
        "10",
        "--save",
        str(out / "checkpoints"),
    ]
    lines: list[str] = []
    path = asyncio.run(asyncio.wait_for(train(resolve_config(args), log=lines.append), 300))
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert [r["rollout_id"] for r in records] == [0, 1] and seen["calls"] == 4
    assert sum(r["rollout/engine_restarts"] for r in records) == 1
    fleet = seen["fleets"][0]
    assert fleet.restarts == [1, 0] and len(seen["cmdlines"]) == 3
    assert all(engine.process.poll() is not None for engine in fleet.engines)  # stopped with the run
    secret = fleet.api_key
    assert secret and len(secret) >= 40
    assert not [pid for pid, cmdline in seen["cmdlines"].items() if secret.encode() in cmdline]
    assert (out / "config.yaml").is_file() and list((out / "checkpoints").iterdir())
    captured = capfd.readouterr()
    assert_nowhere(secret, out, [*lines, captured.out, captured.err])


# -- servers started by hand --------------------------------------------------------------

KEY = "a-key-the-user-chose-0123456789"


@pytest.fixture(scope="module")
def hand_started(tiny_sd3):
    """An engine server started with the user's key (in this process: what the run sees of
    it is its HTTP side)."""
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.server import create_app
    from tests.test_server import ServerThread

    server = ServerThread(create_app(EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3"), api_key=KEY))
    yield server
    server.close()


def _url_args(tiny_sd3, prompts, out: Path, url: str, *extra: str) -> list[str]:
    return [
        *tiny_run_args(tiny_sd3, prompts, out, batch=1, n=2, steps=2, sde_steps=1),
        "--num-rollout",
        "1",
        "--rollout-engine",
        "http",
        "--rollout-engine-urls",
        url,
        *extra,
    ]


def _key_file(path: Path, key: str, mode: int) -> Path:
    path.write_text(key + "\n")
    path.chmod(mode)
    return path


@pytest.mark.exercises("--api-key-file", "--rollout-engine-urls")
def test_a_hand_started_server_takes_the_users_key_file(hand_started, tiny_sd3, prompts, tmp_path, monkeypatch, capfd):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    key_file = _key_file(tmp_path / "key", KEY, 0o600)
    out = tmp_path / "run"
    path = asyncio.run(train(resolve_config(_url_args(tiny_sd3, prompts, out, hand_started.url, "--api-key-file", str(key_file)))))
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0] and "train/loss" in records[0]
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["api_key_file"] == str(key_file)  # the path, not the key
    captured = capfd.readouterr()
    assert "readable by group or others" not in captured.err
    assert_nowhere(KEY, out, [captured.out, captured.err])


@pytest.mark.exercises("--api-key", "--api-key-file", "--rollout-engine-urls")
def test_a_server_that_refuses_the_runs_key_stops_the_run_at_start_up(hand_started, tiny_sd3, prompts, tmp_path, monkeypatch, capfd):
    """A wrong key from any source, or none, is a one-line error naming the server and
    the 401 before any model loads (exit status 2); a key file others can read is used,
    with a warning."""
    url = hand_started.url
    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def refused(*extra: str) -> str:
        with pytest.raises(ApiKeyError) as caught:
            asyncio.run(train(resolve_config(_url_args(tiny_sd3, prompts, tmp_path / "run", url, *extra))))
        assert caught.value.exit_code == 2
        message = str(caught.value)
        assert "\n" not in message and f"engine server {url} refused the run's requests with 401" in message
        assert WRONG_KEY not in message and KEY not in message
        return message

    assert "(wrong API key): it was started with another key" in refused("--api-key", WRONG_KEY)
    loose = _key_file(tmp_path / "loose-key", WRONG_KEY, 0o644)
    assert "(wrong API key)" in refused("--api-key-file", str(loose))
    assert f"--api-key-file {loose} is readable by group or others (mode 0644); chmod 600 it" in capfd.readouterr().err
    assert "missing Authorization header" in refused()
    monkeypatch.setenv(API_KEY_ENV, WRONG_KEY)
    assert "(wrong API key)" in refused()
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.exercises("--api-key", "--api-key-file")
def test_the_key_flags_go_with_hand_started_servers_and_are_never_written(tiny_sd3, prompts, tmp_path):
    base = _url_args(tiny_sd3, prompts, tmp_path, "http://127.0.0.1:9")
    document = config_document(resolve_config([*base, "--api-key", KEY]))
    assert document["rollout"]["api_key"] == "<redacted>" and KEY not in yaml.safe_dump(document)
    # A YAML key over the command line's: the note says so, without either key.
    (tmp_path / "over.yaml").write_text(yaml.safe_dump({"api_key": "other-key"}), encoding="utf-8")
    notes = resolve_config([*base, "--api-key", KEY, "--custom-config-path", str(tmp_path / "over.yaml")]).notes
    (note,) = [n for n in notes if "'api_key'" in n]
    assert note.endswith("overrides --api-key <redacted> from the command line with <redacted>") and "other-key" not in note
    with pytest.raises(ConfigError) as caught:
        resolve_config([*base, "--api-key", KEY, "--api-key-file", str(tmp_path / "key")])
    assert caught.value.messages == ["--api-key and --api-key-file are mutually exclusive: give the key one way"]
    fleet = [a for a in base if a not in ("--rollout-engine-urls", "http://127.0.0.1:9")] + ["--rollout-num-engines", "2"]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*fleet, "--api-key-file", str(tmp_path / "key")])
    assert caught.value.messages == [
        "--api-key-file: the key of engine servers started by hand goes with --rollout-engine-urls; the servers a run "
        "starts get a fresh secret of the run"
    ]
