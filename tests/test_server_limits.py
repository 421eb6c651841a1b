"""What one ``/rollout/generate`` request may ask of ``miles-core serve-engine``: the
request limits (per field and in total work) derived from the model, the body cap, the
cancellation of a request whose client goes away, and sglang's ``generator_device`` (cpu or cuda).
Against real servers on loopback, with the tiny SD3 pipeline."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time

import aiohttp
import pytest

from miles_core.cli import serve_engine
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.limits import DefaultOutput, RequestLimits
from miles_core.engine.server import create_app
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import ConfigError, RequestLimitError
from miles_core.family import GenerationParams
from miles_core.request import RolloutRequest
from tests.test_server import ServerThread, assert_same_outputs, http, wait_healthy

GENERATE = "/rollout/generate"
SMALL = {"prompt": "ok", "num_inference_steps": 2, "width": 16, "height": 16}


@pytest.fixture(scope="module")
def engine(tiny_sd3) -> EmbeddedEngine:
    return EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")


def serve(engine: EmbeddedEngine, **kwargs) -> ServerThread:
    server = ServerThread(create_app(engine, **kwargs))
    wait_healthy(server.url)
    return server


@pytest.fixture(scope="module")
def served(engine):
    server = serve(engine)
    yield server.url
    server.close()


def refusal(answer: tuple[int, bytes]) -> tuple[int, dict]:
    status, body = answer
    return status, json.loads(body)


def assert_serves(url: str) -> None:
    status, body = http(url, GENERATE, SMALL)
    assert status == 200 and len(unpack_outputs(body)) == 1


# -- the limits -------------------------------------------------------------------------


def test_default_limits_follow_the_model(engine):
    pipe = engine.family.pipeline
    side = pipe.default_sample_size * pipe.vae_scale_factor  # SD3's own default size (64 for the tiny one)
    assert side == 64 and pipe.scheduler.config.num_train_timesteps == 1000
    assert RequestLimits.derive(engine.family) == RequestLimits(
        max_outputs_per_request=64,
        max_inference_steps=1000,
        max_resolution=2 * side,
        max_num_frames=1,
        max_request_work=16 * 50 * side * side,
    )
    # An override replaces its limit only.
    assert RequestLimits.derive(engine.family, {"max_request_work": 5, "max_num_frames": None}) == RequestLimits(
        max_outputs_per_request=64,
        max_inference_steps=1000,
        max_resolution=2 * side,
        max_num_frames=1,
        max_request_work=5,
    )
    # Video models: their default clip, counted as at least 121 frames.
    wan = RequestLimits.for_output(DefaultOutput(480, 832, 81, video=True), 1000)
    assert (wan.max_resolution, wan.max_num_frames, wan.max_request_work) == (1664, 242, 16 * 50 * 121 * 480 * 832)
    long_clip = RequestLimits.for_output(DefaultOutput(512, 768, 161, video=True), 1000)
    assert (long_clip.max_num_frames, long_clip.max_request_work) == (322, 16 * 50 * 161 * 512 * 768)
    with pytest.raises(ConfigError, match=r"^--max-request-work 0: must be a positive integer$"):
        RequestLimits.derive(engine.family, {"max_request_work": 0})
    with pytest.raises(ConfigError, match=r"^unknown request limit 'max_prompt'"):
        create_app(engine, limits={"max_prompt": 3})


def test_the_frame_limit_counts_resolved_frames():
    limits = RequestLimits.for_output(DefaultOutput(480, 832, 81, video=True), 1000)

    def params(frames: int | None) -> GenerationParams:
        return GenerationParams(height=480, width=832, num_inference_steps=2, guidance_scale=1.0, num_frames=frames)

    request = RolloutRequest(prompt="x", num_inference_steps=2)
    limits.check(request, params(242))
    with pytest.raises(RequestLimitError) as caught:
        limits.check(request, params(243))
    error = caught.value
    assert str(error) == "num_frames: 243 is over this server's limit of 242 frames (--max-num-frames raises it)"
    assert (error.status, error.value, error.limit, error.flag) == (400, 243, 242, "--max-num-frames")


def test_the_oversized_request_is_refused_at_once_and_the_server_keeps_serving(served):
    start = time.monotonic()
    status, body = refusal(http(served, GENERATE, {"prompt": "x", "num_outputs_per_prompt": 100000000, "num_inference_steps": 4}))
    assert time.monotonic() - start < 5
    assert status == 400 and body == {
        "error": "num_outputs_per_prompt: 100000000 is over this server's limit of 64 outputs (--max-outputs-per-request raises it)",
        "field": "num_outputs_per_prompt",
        "value": 100000000,
        "limit": 64,
        "flag": "--max-outputs-per-request",
    }
    assert_serves(served)


def test_each_field_and_the_total_work_have_a_limit(served):
    cases = [
        ({"num_outputs_per_prompt": 65}, "num_outputs_per_prompt", 65, 64, "outputs", "--max-outputs-per-request"),
        ({"num_inference_steps": 1001}, "num_inference_steps", 1001, 1000, "steps", "--max-inference-steps"),
        # 144 is a size SD3 takes (a multiple of 16, inside its 256-pixel positional table).
        ({"height": 144, "width": 16}, "height", 144, 128, "pixels", "--max-resolution"),
        ({"width": 144, "height": 16}, "width", 144, 128, "pixels", "--max-resolution"),
    ]
    for fields, name, value, limit, unit, flag in cases:
        status, body = refusal(http(served, GENERATE, {**SMALL, **fields}))
        assert status == 400 and body == {
            "error": f"{name}: {value} is over this server's limit of {limit} {unit} ({flag} raises it)",
            "field": name,
            "value": value,
            "limit": limit,
            "flag": flag,
        }, body
        assert_serves(served)
    # At the limits: served.
    status, body = http(served, GENERATE, {**SMALL, "width": 128, "height": 128, "num_inference_steps": 1})
    assert status == 200 and unpack_outputs(body)[0].generated_output.shape == (3, 128, 128)
    # Every field in range, the product not: 413 (the width and height resolved from the
    # model's default, 64).
    work = 64 * 1 * 64 * 64 * 1000
    status, body = refusal(http(served, GENERATE, {"prompt": "x", "num_outputs_per_prompt": 64, "num_inference_steps": 1000}))
    assert status == 413 and body == {
        "error": f"request: work 64 outputs x 1 frames x 64 x 64 pixels x 1000 steps = {work} is over this "
        "server's limit of 3276800 (--max-request-work raises it)",
        "field": "request",
        "value": work,
        "limit": 3276800,
        "flag": "--max-request-work",
    }
    assert_serves(served)


def test_overridden_limits_are_enforced_to_the_unit(engine):
    # Two 64x64 outputs of 3 steps are exactly the work limit; one step more is over it.
    limit = 2 * 64 * 64 * 3
    server = serve(engine, limits={"max_request_work": limit, "max_outputs_per_request": 70})
    try:
        exact = {"prompt": "x", "num_outputs_per_prompt": 2, "num_inference_steps": 3}
        status, body = http(server.url, GENERATE, exact)
        assert status == 200 and len(unpack_outputs(body)) == 2
        status, body = refusal(http(server.url, GENERATE, {**exact, "num_inference_steps": 4}))
        assert (status, body["value"], body["limit"], body["flag"]) == (413, limit + 2 * 64 * 64, limit, "--max-request-work")
        # Raised above the default of 64 outputs.
        status, body = http(server.url, GENERATE, {**SMALL, "num_outputs_per_prompt": 70, "num_inference_steps": 1})
        assert status == 200 and [o.seed for o in unpack_outputs(body)] == list(range(70))
    finally:
        server.close()


def test_serve_engine_flags_set_the_limits(tiny_sd3):
    # The command's own parser and application, served in this process.
    args, family = serve_engine.parse_args(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--device",
            "cpu",
            "--max-outputs-per-request",
            "70",
            "--max-generate-body-bytes",
            "4096",
        ]
    )
    server = ServerThread(serve_engine.build_app(args, family))
    try:
        wait_healthy(server.url, timeout=60)
        status, body = http(server.url, GENERATE, {**SMALL, "num_outputs_per_prompt": 70, "num_inference_steps": 1})
        assert status == 200 and len(unpack_outputs(body)) == 70
        status, body = refusal(http(server.url, GENERATE, {**SMALL, "num_outputs_per_prompt": 71}))
        assert (status, body["limit"], body["flag"]) == (400, 70, "--max-outputs-per-request")
        status, body = refusal(http(server.url, GENERATE, {**SMALL, "prompt": "x" * 5000}))
        assert (status, body["limit"], body["flag"]) == (413, 4096, "--max-generate-body-bytes")
        # The others keep their defaults.
        status, body = refusal(http(server.url, GENERATE, {**SMALL, "num_inference_steps": 1001}))
        assert (status, body["limit"]) == (400, 1000)
    finally:
        server.close()


def test_serve_engine_refuses_a_limit_below_one(tiny_sd3, capsys):
    with pytest.raises(SystemExit) as caught:
        serve_engine.run(["--hf-checkpoint", str(tiny_sd3), "--max-request-work", "0"])
    assert caught.value.code == 2
    assert capsys.readouterr().err == "miles-core serve-engine: error: --max-request-work 0: must be at least 1\n"


# -- bodies -----------------------------------------------------------------------------


def test_an_oversized_body_is_refused_with_413(served):
    prompt = "x" * (1024**2)
    payload = json.dumps({"prompt": prompt}).encode()
    status, body = refusal(http(served, GENERATE, payload))
    assert status == 413 and body == {
        "error": f"body: {len(payload)} bytes is over this server's limit of 1048576 bytes (--max-generate-body-bytes raises it)",
        "field": "body",
        "value": len(payload),
        "limit": 1048576,
        "flag": "--max-generate-body-bytes",
    }
    assert_serves(served)

    async def chunked() -> tuple[int, dict]:
        async def chunks():  # no Content-Length: the server counts while it reads
            for start in range(0, len(payload), 65536):
                yield payload[start : start + 65536]

        async with aiohttp.ClientSession() as session:
            async with session.post(served + GENERATE, data=chunks()) as response:
                return response.status, await response.json()

    status, body = asyncio.run(chunked())
    assert (
        status == 413
        and body["value"] is None
        and body["error"] == ("body: over this server's limit of 1048576 bytes (--max-generate-body-bytes raises it)")
    )
    assert_serves(served)


# -- generator_device -----------------------------------------------------------------


def test_generator_device_cpu_and_cuda_are_served_and_others_are_refused(served, engine, monkeypatch):
    from types import SimpleNamespace

    import torch

    from miles_core.engine import sampler
    from miles_core.engine.sampler import generator_device

    # The sampler asks where each request's generators live (a spy: on this CPU-only machine
    # both answers are the CPU, so the outputs alone could not tell).
    asked: list[str] = []
    monkeypatch.setattr(
        sampler, "generator_device", lambda request, family: asked.append(request.generator_device) or generator_device(request, family)
    )

    plain = {**SMALL, "seed": 5, "request_id": "g"}
    baseline = unpack_outputs(http(served, GENERATE, plain)[1])
    status, with_cpu = http(served, GENERATE, {**plain, "generator_device": "cpu"})
    assert status == 200
    assert_same_outputs(baseline, unpack_outputs(with_cpu))
    assert RolloutRequest.from_json({**plain, "generator_device": "cpu"}) == RolloutRequest.from_json(plain)
    # cuda: the generators live on the model's device (here the CPU), so with the model on
    # the CPU the device draw (initial and SDE noise) is exactly the CPU draw ...
    cuda = RolloutRequest.from_json({**plain, "generator_device": "cuda"})
    assert cuda.generator_device == "cuda" and cuda.to_json()["generator_device"] == "cuda"
    assert generator_device(cuda, engine.family) == engine.family.device == torch.device("cpu")
    assert generator_device(cuda, SimpleNamespace(device=torch.device("cuda", 0))) == torch.device("cuda", 0)
    assert generator_device(RolloutRequest.from_json(plain), SimpleNamespace(device=torch.device("cuda", 0))) == torch.device("cpu")
    asked.clear()
    status, on_device = http(served, GENERATE, {**plain, "generator_device": "cuda"})
    assert status == 200 and asked == ["cuda"]
    assert_same_outputs(baseline, unpack_outputs(on_device))
    # ... and still the seed's (control: another seed, another sample).
    other = unpack_outputs(http(served, GENERATE, {**plain, "seed": 6, "generator_device": "cuda"})[1])
    assert not torch.equal(other[0].generated_output, baseline[0].generated_output)
    for value, message in (("tpu", "must be one of cpu, cuda, got 'tpu'"), (1, "must be a string, got 1")):
        status, body = refusal(http(served, GENERATE, {**plain, "generator_device": value}))
        assert status == 400 and body == {"error": f"generator_device: {message}"}
    assert_serves(served)


# -- cancellation ---------------------------------------------------------------------


def test_a_request_whose_client_goes_away_is_cancelled(engine, caplog):
    caplog.set_level(logging.INFO, logger="miles_core.engine")
    steps = 20000  # about 10 ms each here: minutes, unless it is cancelled
    server = serve(engine, limits={"max_inference_steps": steps, "max_request_work": 10**12})
    try:
        body = json.dumps(
            {**SMALL, "prompt": "a request nobody waits for", "num_inference_steps": steps, "request_id": "abandoned"}
        ).encode()
        host, port = server.url.removeprefix("http://").split(":")
        encoded = engine.conditioning_cache.misses
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /rollout/generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + 30
            while engine.conditioning_cache.misses == encoded:  # its prompt is encoded: the steps follow
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)
        gone = time.monotonic()
        assert_serves(server.url)
        assert time.monotonic() - gone < 10
    finally:
        server.close()
    messages = [record.getMessage() for record in caplog.records]
    assert (
        "POST /rollout/generate abandoned: cancelled (the client went away, or the server is stopping); stopping its generation"
    ) in messages
    stopped = [m for m in messages if m.startswith("request abandoned: cancelled after ")]
    assert len(stopped) == 1, messages
    ran = int(re.fullmatch(rf"request abandoned: cancelled after (\d+) of {steps} denoising steps", stopped[0])[1])
    assert ran < steps // 4  # stopped, long before its end
