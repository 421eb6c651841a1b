"""``--rm-type remote`` against real reward servers on loopback (``miles-core
serve-reward``, in a thread or in processes of their own): exact scores on 8-bit and float
images, a server SIGKILLed mid-run, a hung server, the start-up checks and ``miles-core
score``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from PIL import Image

from miles_core.cli.main import main
from miles_core.config.resolve import resolve_config
from miles_core.engine.server import start_server
from miles_core.errors import RewardError
from miles_core.reward_service.remote import RemoteReward
from miles_core.rollout.sample import Sample
from miles_core.testing import scoring_samples, serve_reward_in_thread, serve_reward_process
from miles_core.training.rewards import RewardScorer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = "tests.reward_examples"
KEY = "remote-test-key-42"
MIXTURE = ("--reward-weights", '{"brightness": 0.25, "colorfulness": 2}')
MIXTURE_NAME = "0.25*brightness + 2*colorfulness"  # what the scorer, and so /info, calls it


def resolve(*argv: str):
    return resolve_config(list(argv), prog="miles-core score", scope="reward")


def grid_pixels(n: int, seed: int = 0, shape=(3, 12, 10)) -> list[torch.Tensor]:
    """8-bit images: every value k / 255, as a decoded PNG gives them."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=generator).float().div(255.0) for _ in range(n)]


def score(config, pixels) -> tuple[list[Sample], dict[str, float]]:
    """``pixels`` scored as a run scores a rollout: the samples and the reward metrics."""
    scorer = RewardScorer(config)
    samples = scoring_samples(pixels)
    asyncio.run(scorer.score(samples))
    return samples, scorer.finish(samples)


def mean_pixel(x: torch.Tensor) -> float:
    """``reward_examples.slow_mean``'s value for one output."""
    return float(np.asarray(x, dtype=np.float64).mean())


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(0o600)
    return path


# -- exact scores ----------------------------------------------------------------------------


@pytest.mark.exercises("--rm-url", "--rm-batch-size", "--rm-pixel-encoding", "--rm-remote-reward")
def test_scores_through_servers_equal_the_in_process_reward_exactly(key_file):
    grid = grid_pixels(6) + [torch.randint(0, 256, (3, 3, 8, 6), generator=torch.Generator().manual_seed(9)).float().div(255.0)]
    floats = [torch.rand(3, 12, 10, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    here = resolve(*MIXTURE)
    with serve_reward_in_thread(here, api_key=KEY) as first, serve_reward_in_thread(here, api_key=KEY) as second:
        common = (
            "--rm-type", "remote", "--rm-url", first, second, "--rm-remote-reward", MIXTURE_NAME,
            "--api-key-file", str(key_file), "--rm-batch-size", "2",
        )  # fmt: skip
        png = resolve(*common)
        lossless = resolve(*common, "--rm-pixel-encoding", "float32")

        # 8-bit images (and a 3-frame video) over PNG: the same numbers, bit for bit.
        expected, expected_metrics = score(here, grid)
        got, metrics = score(png, grid)
        assert [s.reward for s in got] == [s.reward for s in expected]
        assert not any(s.reward_failed for s in got)
        assert metrics["rollout/reward/remote/requests"] == 4  # 7 samples in requests of 2
        assert metrics["rollout/reward/remote/retries"] == 0
        for component in ("brightness", "colorfulness"):
            assert metrics[f"rollout/reward/remote/{component}_mean"] == pytest.approx(
                expected_metrics[f"rollout/reward/{component}_mean"], rel=1e-12
            )

        # Float images: exact with float32 on the wire; the control, PNG, rounds them.
        expected, _ = score(here, floats)
        got, _ = score(lossless, floats)
        assert [s.reward for s in got] == [s.reward for s in expected]
        rounded, _ = score(png, floats)
        assert [s.reward for s in rounded] != [s.reward for s in expected]
        assert [s.reward for s in rounded] == pytest.approx([s.reward for s in expected], abs=0.02)

    # A reward that reads 8-bit pixels gets PNG's values on any float image: the same numbers.
    jpeg = resolve("--rm-type", "jpeg_incompressibility")
    big = [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    with serve_reward_in_thread(jpeg) as url:
        got, _ = score(resolve("--rm-type", "remote", "--rm-url", url), big)
    expected, _ = score(jpeg, big)
    assert [s.reward for s in got] == [s.reward for s in expected]


# -- failures --------------------------------------------------------------------------------


def start_scoring(config, pixels) -> tuple[threading.Thread, dict]:
    """Score in a background thread (as a run's scoring does); the result lands in the dict."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = score(config, pixels)
        except BaseException as exc:  # reported by the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def wait_for_calls(mark: Path, calls: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (mark.exists() and len(mark.read_text().splitlines()) >= calls):
        assert time.monotonic() < deadline, f"the server made fewer than {calls} calls in {timeout} s"
        time.sleep(0.01)


def slow_server(tmp_path: Path, name: str, seconds: float):
    mark = tmp_path / f"{name}.calls"
    env = {"PYTHONPATH": str(ROOT), "MILES_TEST_REWARD_MARK": str(mark), "MILES_TEST_REWARD_SECONDS": str(seconds)}
    return mark, serve_reward_process("--custom-rm-path", f"{EXAMPLES}.slow_mean", log_path=tmp_path / f"{name}.log", env=env)


@pytest.mark.exercises("--rm-max-in-flight", "--rm-max-retries", "--rm-retry-backoff")
def test_a_server_killed_mid_run_is_retried_on_the_other_url_or_masked_and_counted(tmp_path):
    mark_a, server_a = slow_server(tmp_path, "a", 3.0)  # slow: the kill lands while it scores
    mark_b, server_b = slow_server(tmp_path, "b", 0.5)
    with server_a as (url_a, process_a), server_b as (url_b, process_b):
        # Two URLs: a dies while it scores; its requests go to b and every sample is scored.
        pixels = grid_pixels(10, seed=1)
        config = resolve(
            "--rm-type", "remote", "--rm-url", url_a, url_b, "--rm-batch-size", "1", "--rm-max-in-flight", "2",
            "--rm-max-retries", "3", "--rm-retry-backoff", "0.05",
        )  # fmt: skip
        thread, result = start_scoring(config, pixels)
        wait_for_calls(mark_a, 2)  # a's first two requests are being scored
        process_a.kill()
        process_a.wait()
        thread.join(120)
        assert "error" not in result, result.get("error")
        samples, metrics = result["value"]
        assert [s.reward for s in samples] == [mean_pixel(x) for x in pixels]
        assert metrics["rollout/reward/failed"] == 0
        assert metrics["rollout/reward/remote/retries"] >= 1
        assert metrics["rollout/reward/remote/failed_requests"] == 0
        assert len(mark_b.read_text().splitlines()) == 10  # b scored every sample: a's share too

        # One URL: b dies while it scores; what it had not scored is masked and counted.
        pixels = grid_pixels(8, seed=2)
        config = resolve(
            "--rm-type", "remote", "--rm-url", url_b, "--rm-batch-size", "1", "--rm-max-in-flight", "1",
            "--rm-max-retries", "1", "--rm-retry-backoff", "0.01",
        )  # fmt: skip
        done = len(mark_b.read_text().splitlines())
        thread, result = start_scoring(config, pixels)
        wait_for_calls(mark_b, done + 3)  # two samples scored, the third being scored
        process_b.kill()
        process_b.wait()
        thread.join(120)
    assert "error" not in result, result.get("error")
    samples, metrics = result["value"]
    failed = [s.reward_failed for s in samples]
    assert 0 < sum(failed) < len(samples), failed
    assert failed == sorted(failed)  # the ones scored before the kill, then none
    for sample, x in zip(samples, pixels):
        assert math.isnan(sample.reward) if sample.reward_failed else sample.reward == mean_pixel(x)
    assert metrics["rollout/reward/failed"] == metrics["rollout/reward/remote_failed"] == sum(failed)
    assert metrics["rollout/reward/remote/failed_requests"] == sum(failed)  # one sample per request


@pytest.mark.exercises("--rm-timeout")
def test_a_hung_server_hits_the_timeout_and_its_samples_are_masked(caplog):
    with serve_reward_in_thread(resolve("--custom-rm-path", f"{EXAMPLES}.hangs")) as url:
        # 2 s: enough for the start-up GETs from this busy process, a blink beside the server's hour
        config = resolve("--rm-type", "remote", "--rm-url", url, "--rm-timeout", "2", "--rm-max-retries", "0")
        started = time.monotonic()
        scorer = RewardScorer(config)
        samples = scoring_samples(grid_pixels(2))
        asyncio.run(scorer.score(samples))
        elapsed = time.monotonic() - started
    assert all(s.reward_failed for s in samples)
    assert elapsed < 60  # one attempt of 2 s, not the server's hour
    with pytest.raises(RewardError, match=r"reward remote failed for every sample .*no answer within 2 s \(--rm-timeout\)"):
        scorer.finish(samples)


def test_what_cannot_be_sent_fails_alone_and_a_request_too_large_goes_in_halves():
    pixels = grid_pixels(4, seed=3, shape=(3, 24, 24))
    pixels[1] = pixels[1].clone()
    pixels[1][0, 0, 0] = math.nan  # PNG cannot carry it
    # One 24x24 PNG sample is about 2.5 kB of JSON: room for one or two, not four.
    with serve_reward_in_thread(resolve("--rm-type", "brightness"), max_body_bytes=6000) as url:
        config = resolve("--rm-type", "remote", "--rm-url", url, "--rm-batch-size", "4")
        samples, metrics = score(config, pixels)
    assert [s.reward_failed for s in samples] == [False, True, False, False]
    assert [samples[i].reward for i in (0, 2, 3)] == [mean_pixel(pixels[i]) for i in (0, 2, 3)]
    assert metrics["rollout/reward/remote_failed"] == 1
    assert metrics["rollout/reward/remote/split_requests"] >= 1
    assert metrics["rollout/reward/remote/failed_requests"] == 0


def test_a_reward_the_server_cannot_use_stops_the_run_as_in_process():
    served = resolve("--custom-rm-path", f"{EXAMPLES}.length_parts")  # dicts, and no --reward-key
    with serve_reward_in_thread(served) as url:
        scorer = RewardScorer(resolve("--rm-type", "remote", "--rm-url", url))
        with pytest.raises(RewardError, match=r"the server cannot use its reward: .*choose the trained one with --reward-key"):
            asyncio.run(scorer.score(scoring_samples(grid_pixels(2))))


# -- start-up checks -------------------------------------------------------------------------


def refused(*argv: str) -> str:
    with pytest.raises(RewardError) as caught:
        RewardScorer(resolve("--rm-type", "remote", *argv))  # builds, and so checks, the reward
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_start_up_refuses_what_it_cannot_use(key_file, tmp_path):
    with serve_reward_in_thread(resolve("--rm-type", "brightness"), api_key=KEY) as bright:
        with serve_reward_in_thread(resolve("--rm-type", "redness"), api_key=KEY) as red:
            key = ("--api-key-file", str(key_file))
            assert "serves reward 'brightness', not 'redness' (--rm-remote-reward)" in refused(
                "--rm-url", bright, "--rm-remote-reward", "redness", *key
            )
            message = refused("--rm-url", bright, red, *key)
            assert f"--rm-url {red} serves 'redness'" in message and "must serve the same reward" in message
            assert "refused the key" in refused("--rm-url", bright)
            assert "--rm-batch-size 300 is above" in refused("--rm-url", bright, "--rm-batch-size", "300", *key)

    # A --use-ray run's reward worker serves its run only.
    with serve_reward_in_thread(resolve("--rm-type", "brightness"), worker=True) as worker:
        assert f"--rm-url {worker} is a --use-ray run's reward worker" in refused("--rm-url", worker)

    # Nothing listening, not a URL, not a reward server.
    with serve_reward_in_thread(resolve("--rm-type", "brightness")) as gone:
        pass
    assert f"--rm-url {gone}: unreachable" in refused("--rm-url", gone)
    assert "not an http:// or https:// URL" in refused("--rm-url", "ftp://host/x")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(request: web.Request) -> web.Response:  # an engine's, say
        return web.json_response({"engine": "sd3"})

    with app_in_thread([web.get("/health", health), web.get("/info", info)]) as url:
        assert "is not a reward server's" in refused("--rm-url", url)


@contextlib.contextmanager
def app_in_thread(routes):
    """An aiohttp application of ``routes`` on a free loopback port, from a thread."""

    async def start():
        app = web.Application()
        app.add_routes(routes)
        return await start_server(app)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield server.url
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def test_start_up_waits_for_a_server_still_loading_its_reward():
    with serve_reward_in_thread(resolve("--rm-type", "brightness")) as real:
        info = json.loads(urllib.request.urlopen(real + "/info").read())
    started = time.monotonic()

    async def health(request: web.Request) -> web.Response:
        if time.monotonic() - started < 1.0:
            return web.json_response({"status": "loading", "error": "reward: still being built"}, status=503)
        return web.json_response({"status": "ok"})

    async def served_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    with app_in_thread([web.get("/health", health), web.get("/info", served_info)]) as url:
        reward = RemoteReward(resolve("--rm-type", "remote", "--rm-url", url, "--rm-timeout", "20"))
        assert reward.served == "brightness" and time.monotonic() - started >= 1.0
        # A server that stays loading past --rm-timeout is refused, in one line.
        started = time.monotonic() + 3600
        assert "GET /health answered 503 (reward: still being built)" in refused("--rm-url", url, "--rm-timeout", "0.5")


# -- miles-core score ------------------------------------------------------------------------


def test_miles_core_score_scores_through_a_server(tmp_path, capsys):
    image = tmp_path / "grey.png"
    Image.new("RGB", (8, 8), (51, 102, 204)).save(image)
    with serve_reward_in_thread(resolve("--rm-type", "brightness")) as url:
        assert main(["score", "--rm-type", "remote", "--rm-url", url, "--json", "--prompt", "a cube", str(image)]) == 0
    out = capsys.readouterr().out
    assert '"reward": 0.4' in out  # (51 + 102 + 204) / 3 / 255 = 0.4666..., brightness of the grey image
    assert main(["score", "--rm-type", "remote", "--rm-url", url, "--prompt", "a cube", str(image)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"reward remote: --rm-url {url}: unreachable" in err


# -- a training run --------------------------------------------------------------------------


def test_a_training_run_scores_through_a_server_as_in_process(tiny_sd3, prompts, tmp_path):
    from tests.tiny_runs import run_metrics, tiny_run_args

    here = tiny_run_args(tiny_sd3, prompts, tmp_path / "here", batch=1, n=2, steps=2, sde_steps=1)
    with serve_reward_in_thread(resolve("--rm-type", "jpeg_incompressibility")) as url:
        remote = tiny_run_args(tiny_sd3, prompts, tmp_path / "remote", batch=1, n=2, steps=2, sde_steps=1)
        remote[remote.index("jpeg_incompressibility")] = "remote"
        remote += ["--rm-url", url, "--rm-pixel-encoding", "float32"]
        (got,) = run_metrics([*remote, "--num-rollout", "1"])
    (expected,) = run_metrics([*here, "--num-rollout", "1"])
    assert got["rollout/reward/raw_mean"] == expected["rollout/reward/raw_mean"]
    assert got["rollout/reward/remote/requests"] >= 1 and got["rollout/reward/failed"] == 0
