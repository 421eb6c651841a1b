"""``miles-core serve-engine`` and the ``http`` engine against the embedded engine, on a
tiny SD3 pipeline: same tensors, health, errors that name the field, weight sync."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load, save_file

from miles_core import testing
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.http import HttpEngine
from miles_core.engine.server import create_app, start_server
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import EngineRequestError
from miles_core.request import RolloutRequest
from miles_core.weights import iter_buckets, module_checksum, named_tensors_checksum

ROLLOUT = RolloutRequest(
    prompt="a red cube",
    negative_prompt="blurry",
    seed=7,
    num_inference_steps=3,
    num_outputs_per_prompt=2,
    rollout_debug_mode=True,
    rollout_return_denoising_env=True,
    rollout_return_dit_trajectory=True,
    request_id="req-1",
)
EVAL = RolloutRequest(prompt="a blue ball", seed=3, num_inference_steps=2, rollout=False, request_id="req-2")
SMALL = RolloutRequest(prompt="ok", num_inference_steps=2, request_id="small")


# -- helpers --------------------------------------------------------------------------


class ServerThread:
    """An application served from its own event loop in a background thread."""

    def __init__(self, app) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(start_server(app), self.loop).result(30)
        self.url = self.server.url

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def http(
    url: str, path: str, body: bytes | dict | None = None, *, method: str = "POST", content_type: str = "application/json"
) -> tuple[int, bytes]:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=body, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def error_of(status_body: tuple[int, bytes]) -> tuple[int, str]:
    status, body = status_body
    return status, json.loads(body)["error"]


def assert_same(a, b, path="$"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b))
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def assert_same_outputs(expected, got):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        e, g = e.to_wire(), g.to_wire()
        for timing in ("inference_time_s", "peak_memory_mb"):
            e.pop(timing), g.pop(timing)
        assert_same(e, g)


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_healthy(url: str, timeout: float = 30) -> None:
    async def main():
        async with HttpEngine(url) as client:
            await client.wait_until_healthy(timeout=timeout, interval=0.05)

    run(main())


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from miles_sd3.family import SD3Family

    # The name matches the sd3 family's patterns, so serve-engine finds the family itself.
    return Path(SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "stable-diffusion-3-tiny"))


@pytest.fixture(scope="module")
def reference(tiny_dir) -> EmbeddedEngine:
    """The trainer-side view: an embedded engine of the same checkpoint."""
    return EmbeddedEngine.from_checkpoint(tiny_dir, "sd3")


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    engine = EmbeddedEngine.from_checkpoint(tiny_dir, "sd3")
    # Disk loads come from the checkpoint and the tests' own folders, all under the base temp.
    roots = [tmp_path_factory.getbasetemp()]
    server = ServerThread(create_app(engine, update_weight_buffer_size=1 << 20, allowed_weight_roots=roots))
    wait_healthy(server.url)
    yield server.url, engine
    server.close()


# -- generation -----------------------------------------------------------------------


def test_rollout_matches_the_embedded_engine(served, reference):
    url, _ = served
    for request in (ROLLOUT, EVAL):
        status, body = http(url, "/rollout/generate", request.to_json())
        assert status == 200, body[:300]
        got = unpack_outputs(body)
        assert_same_outputs(reference.generate_sync(request), got)
    rollout = unpack_outputs(http(url, "/rollout/generate", ROLLOUT.to_json())[1])
    assert [o.seed for o in rollout] == [7, 8]
    assert rollout[0].dit_trajectory["latents"].shape[0] == 4 and rollout[0].rollout_debug_tensors is not None
    assert rollout[0].denoising_env["pos_cond_kwargs"] and rollout[0].rollout_log_probs.shape == (3,)
    pixels_only = unpack_outputs(http(url, "/rollout/generate", EVAL.to_json())[1])[0]
    assert pixels_only.rollout_log_probs is None and pixels_only.dit_trajectory is None
    assert pixels_only.denoising_env is None and pixels_only.rollout_debug_tensors is None


def test_response_is_plain_msgpack_with_safetensors_records(served, reference):
    url, _ = served
    status, body = http(url, "/rollout/generate", ROLLOUT.to_json())
    assert status == 200
    records = msgpack.unpackb(body, raw=False)
    expected = reference.generate_sync(ROLLOUT)
    for output, record in zip(expected, records):
        assert record["request_id"] == "req-1" and record["seed"] == output.seed
        for name in ("generated_output", "rollout_log_probs"):
            tensor_record = record[name]
            assert tensor_record["__tensor__"] is True and tensor_record["dtype"] == "torch.float32"
            tensor = load(tensor_record["data"])["t"]
            assert tensor_record["shape"] == list(tensor.shape)
            assert torch.equal(tensor, getattr(output, name))
        latents = load(record["dit_trajectory"]["latents"]["data"])["t"]
        assert torch.equal(latents, output.dit_trajectory["latents"])


def test_malformed_requests_name_the_field_and_the_server_stays_up(served):
    url, _ = served
    valid = SMALL.to_json()
    cases = [
        (b"{not json", "body"),
        ({**valid, "bogus": 1}, "bogus"),
        ({**valid, "num_inference_steps": 0}, "num_inference_steps"),
        ({**valid, "num_inference_steps": 3, "rollout_sde_step_indices": [0, 2]}, "rollout_sde_step_indices"),
        ({**valid, "seed": "x"}, "seed"),
        ([1, 2], "body"),
        ({**valid, "rollout_sde_type": "nope"}, "rollout_sde_type"),
        ({**valid, "image_path": ["/a.png", "/b.png"]}, "image_path"),
        # SD3 is text-to-image: an image is refused before the request reaches the engine.
        ({**valid, "image_path": "/data/first-frame.png"}, "image_path"),
    ]
    for body, field in cases:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, message = error_of(http(url, "/rollout/generate", payload))
        assert 400 <= status < 500 and message.startswith(f"{field}: "), (body, status, message)
        status, ok = http(url, "/rollout/generate", valid)
        assert status == 200 and len(unpack_outputs(ok)) == 1
    status, message = error_of(http(url, "/get_weights_checksum", {"module_names": ["transformer", "nope"]}))
    assert status == 400 and message.startswith("module_names: unknown module 'nope'")
    status, message = error_of(http(url, "/update_weights_from_disk", {"flush_cache": True}))
    assert status == 400 and message.startswith("model_path: ")
    status, message = error_of(http(url, "/no/such/route", {}))
    assert status == 404
    assert http(url, "/health", method="GET")[0] == 200


def test_health_is_503_until_the_model_is_loaded(reference):
    release = threading.Event()

    def slow_loader():
        assert release.wait(30)
        return reference

    server = ServerThread(create_app(slow_loader))
    try:
        status, body = http(server.url, "/health", method="GET")
        assert status == 503 and json.loads(body)["status"] == "loading"
        status, message = error_of(http(server.url, "/rollout/generate", SMALL.to_json()))
        assert status == 503 and message.startswith("engine: ")
        release.set()
        wait_healthy(server.url)
        assert http(server.url, "/health", method="GET")[0] == 200
    finally:
        release.set()
        server.close()


def test_unexpected_errors_answer_500_and_the_server_stays_up(reference):
    broken = EmbeddedEngine(reference.family, backends=reference.backends)

    def boom(request):
        raise RuntimeError("boom")

    broken.generate_sync = boom
    server = ServerThread(create_app(broken, max_request_bytes=4096))
    try:
        wait_healthy(server.url)
        assert error_of(http(server.url, "/rollout/generate", SMALL.to_json())) == (500, "RuntimeError: boom")
        status, message = error_of(http(server.url, "/update_weights_from_tensor", b"x" * 10000, content_type="application/msgpack"))
        assert (status, message) == (
            413,
            "body: 10000 bytes is over this server's limit of 4096 bytes "
            "(--update-weight-buffer-size raises it on the server, which takes bodies "
            "up to twice it plus 16 MiB; a lower one on the client sends smaller buckets)",
        )
        status, body = http(server.url, "/get_weights_checksum", {"module_names": ["transformer"]})
        assert status == 200 and json.loads(body) == {"transformer": module_checksum(reference.component("transformer"))}
    finally:
        server.close()


def test_failed_load_is_reported_by_health():
    def broken():
        raise RuntimeError("no such checkpoint")

    server = ServerThread(create_app(broken))
    try:
        deadline = time.monotonic() + 10
        while (body := json.loads(http(server.url, "/health", method="GET")[1]))["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert body["status"] == "failed" and "no such checkpoint" in body["error"]
    finally:
        server.close()


# -- weights ----------------------------------------------------------------------------


def test_weight_sync_checksums_and_buckets(served, reference, tiny_dir, tmp_path):
    url, engine = served
    original = {name: p.detach().clone() for name, p in reference.component("transformer").named_parameters()}
    checksum = module_checksum(reference.component("transformer"))
    assert checksum == named_tensors_checksum(original.items())
    nudged = dict(original)
    name = sorted(original)[len(original) // 2]
    nudged[name] = original[name] + 1e-3
    sizes = sorted(t.numel() * t.element_size() for t in original.values())
    buffer_size = max(sizes[-1], sum(sizes) // 5)
    assert len(list(iter_buckets(nudged.items(), buffer_size))) >= 3

    async def sync():
        async with HttpEngine(url) as client:
            assert await client.weights_checksum(["transformer"]) == {"transformer": checksum}
            sent = await client.update_weights_from_tensors("transformer", nudged, buffer_size=buffer_size)
            assert sent == len(nudged)
            changed = (await client.weights_checksum(["transformer"]))["transformer"]
            assert changed != checksum and changed == named_tensors_checksum(nudged.items())
            # The generation follows the new weights.
            assert not torch.equal((await client.generate(SMALL))[0].generated_output, reference.generate_sync(SMALL)[0].generated_output)
            # The trainer sends its weights back (generator of pairs, tiny buckets).
            await client.update_weights_from_tensors("transformer", iter(original.items()), buffer_size=1)
            assert await client.weights_checksum(["transformer"]) == {"transformer": checksum}
            assert await client.weights_checksums(None) == {url: {"transformer": checksum}}

            # From disk: a saved copy of the nudged weights, then the original checkpoint.
            copy = tmp_path / "step-1"
            (copy / "transformer").mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in nudged.items()}, str(copy / "transformer" / "model.safetensors"))
            answers = await client.update_weights_from_disk(str(copy))
            assert answers[url]["success"] is True
            assert (await client.weights_checksum(["transformer"]))["transformer"] == changed
            await client.update_weights_from_disk(str(tiny_dir), target_modules=["transformer"])
            assert await client.weights_checksum(["transformer"]) == {"transformer": checksum}
            # A flat folder of one module's weights, as sglang-diffusion accepts.
            flat = tmp_path / "flat"
            flat.mkdir()
            save_file({k: v.contiguous() for k, v in nudged.items()}, str(flat / "model.safetensors"))
            await client.update_weights_from_disk(str(flat), target_modules=["transformer"])
            assert (await client.weights_checksum(["transformer"]))["transformer"] == changed
            await client.update_weights_from_disk(str(tiny_dir))
            assert await client.weights_checksum(["transformer"]) == {"transformer": checksum}
            with pytest.raises(EngineRequestError) as info:
                await client.update_weights_from_disk(str(tmp_path / "missing"))
            assert info.value.status == 400 and info.value.message.startswith("model_path: ")

    run(sync())
    assert module_checksum(engine.component("transformer")) == checksum


def test_tensor_update_errors_name_the_field(served, reference):
    url, engine = served
    checksum = module_checksum(engine.component("transformer"))
    weight_name, weight = next(iter(reference.component("transformer").named_parameters()))
    from miles_core.weights import bucket_to_bytes

    def send(body: dict) -> tuple[int, str]:
        return error_of(http(url, "/update_weights_from_tensor", msgpack.packb(body), content_type="application/msgpack"))

    bucket = bucket_to_bytes({weight_name: weight.detach()})
    cases = [
        ({"target_module": "transformer", "bucket": bucket, "lora_only": True}, "bucket: lora_only update holds"),
        ({"target_module": "vae", "bucket": bucket}, "target_module: unknown module 'vae'"),
        ({"target_module": "transformer", "bucket": b"junk"}, "bucket: not valid safetensors"),
        (
            {"target_module": "transformer", "bucket": bucket_to_bytes({"nope.weight": torch.zeros(1)})},
            "bucket: transformer has no parameter 'nope.weight'",
        ),
        (
            {"target_module": "transformer", "bucket": bucket_to_bytes({weight_name: torch.zeros(1, 1, 1)})},
            f"bucket: transformer.{weight_name}: shape",
        ),
        ({"target_module": "transformer", "bucket": bucket, "extra": 1}, "extra: unknown field"),
        ({"target_module": "transformer", "bucket": bucket, "lora_only": "yes"}, "lora_only: must be true or false"),
    ]
    for body, prefix in cases:
        status, message = send(body)
        assert status == 400 and message.startswith(prefix), (status, message)
    status, message = error_of(http(url, "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}))
    assert status == 403 and message.startswith("serialized_named_tensors: refused: this format is unpickled")
    assert module_checksum(engine.component("transformer")) == checksum

    async def lora_guard():
        async with HttpEngine(url) as client:
            with pytest.raises(ValueError, match="not a lora_A/lora_B"):
                await client.update_weights_from_tensors("transformer", {weight_name: weight}, buffer_size=1 << 20, lora_only=True)

    run(lora_guard())


# -- the http engine ------------------------------------------------------------------


def test_http_engine_spreads_requests_over_urls(served, reference):
    url, _ = served

    async def main():
        async with HttpEngine([url, url], max_concurrency=2) as client:
            requests = [replace(SMALL, seed=s, request_id=f"r{s}") for s in range(4)]
            results = await asyncio.gather(*(client.generate(r) for r in requests))
            assert client.sent == [2, 2] and client.in_flight == [0, 0]
            for request, outputs in zip(requests, results):
                assert_same_outputs(reference.generate_sync(request), outputs)
            with pytest.raises(EngineRequestError) as info:
                await client.generate(replace(SMALL, num_inference_steps=0))
            error = info.value
            assert error.status == 400 and error.url == url + "/rollout/generate"
            assert error.message.startswith("num_inference_steps: ") and url in str(error)

    run(main())


def test_http_engine_bounds_in_flight_requests_per_url():
    from aiohttp import web

    from miles_core.engine.wire import pack_outputs
    from miles_core.request import RolloutOutput

    active = {"now": 0, "max": 0}

    async def generate(request):
        body = await request.json()
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        await asyncio.sleep(0.03)
        active["now"] -= 1
        output = RolloutOutput(
            request_id=body["request_id"],
            prompt=body["prompt"],
            seed=body["seed"],
            generated_output=torch.full((3, 2, 2), float(body["seed"])),
        )
        return web.Response(body=pack_outputs([output]), content_type="application/msgpack")

    app = web.Application()
    app.router.add_post("/rollout/generate", generate)
    server = ServerThread(app)
    try:

        async def main():
            async with HttpEngine(server.url, max_concurrency=2) as client:
                results = await asyncio.gather(*(client.generate(replace(SMALL, seed=s)) for s in range(6)))
            assert [r[0].generated_output[0, 0, 0].item() for r in results] == list(range(6))

        run(main())
        assert active["max"] == 2
    finally:
        server.close()


class _CountingServers:
    """Loopback ``/rollout/generate`` servers that count, from their side, the requests in
    flight on each and in all. A request is held until ``peak`` requests have been in
    flight together (or ``hold`` s passed), so whether requests overlap does not depend on
    timing."""

    def __init__(self, count: int, *, peak: int, hold: float) -> None:
        from aiohttp import web

        self.lock = threading.Lock()
        self.now = [0] * count
        self.most = [0] * count
        self.most_total = 0
        self.events: list[tuple[str, int]] = []
        self.peak, self.hold = peak, hold
        self.servers = []
        for index in range(count):
            app = web.Application()
            app.router.add_post("/rollout/generate", self._handler(index))
            self.servers.append(ServerThread(app))
        self.urls = [server.url for server in self.servers]

    def _handler(self, index: int):
        from aiohttp import web

        from miles_core.engine.wire import pack_outputs
        from miles_core.request import RolloutOutput

        async def generate(request):
            body = await request.json()
            with self.lock:
                self.now[index] += 1
                self.most[index] = max(self.most[index], self.now[index])
                self.most_total = max(self.most_total, sum(self.now))
                self.events.append(("in", index))
            deadline = time.monotonic() + self.hold
            while self.most_total < self.peak and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            outputs = [
                RolloutOutput(
                    request_id=body["request_id"],
                    prompt=body["prompt"],
                    seed=body["seed"] + i,
                    generated_output=torch.full((3, 2, 2), float(body["seed"] + i)),
                )
                for i in range(body["num_outputs_per_prompt"])
            ]
            with self.lock:
                self.now[index] -= 1
                self.events.append(("out", index))
            return web.Response(body=pack_outputs(outputs), content_type="application/msgpack")

        return generate

    def close(self) -> None:
        for server in self.servers:
            server.close()


@pytest.mark.exercises("--sglang-server-concurrency")
def test_server_concurrency_caps_each_server_not_the_rollout():
    """Two servers, ``--sglang-server-concurrency 1``: a rollout has one request in flight
    on each server (two in all), and a third waits for a free place. Control: an engine
    that does not cap its servers itself (here a plain wrapper) is capped by the rollout
    at one request in all, which was the flag's effect on the http engine before; the
    samples are the same either way."""
    from miles_core.engine.base import RolloutEngine
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout
    from miles_core.step_strategies import sde_window

    class Wrapper(RolloutEngine):
        @classmethod
        def from_config(cls, config):  # built directly in this test
            raise TypeError("build it directly")

        def __init__(self, inner: RolloutEngine) -> None:
            self.inner = inner

        async def generate(self, request):
            return await self.inner.generate(request)

        async def weights_checksum(self, module_names):
            return await self.inner.weights_checksum(module_names)

    settings = RolloutSettings(
        n_samples_per_prompt=4,
        rollout_microgroup_size=2,
        rollout_batch_size=2,
        rollout_seed=11,
        diffusion_num_steps=4,
        diffusion_num_sde_steps=1,
        diffusion_sde_window_range=None,
        diffusion_sde_candidate_steps=None,
        diffusion_guidance_scale=4.5,
        diffusion_true_cfg_scale=None,
        diffusion_negative_prompt=None,
        diffusion_height=None,
        diffusion_width=None,
        diffusion_output_num_frames=1,
        diffusion_fps=None,
        diffusion_sde_type="sde",
        diffusion_noise_level=0.7,
        diffusion_log_prob_no_const=False,
        diffusion_debug_mode=False,
        sglang_server_concurrency=1,
    )
    prompts = [PromptRecord("a red cube", {}, 0), PromptRecord("a blue ball", {}, 1)]

    def rollout_through(wrap: bool, hold: float) -> tuple[_CountingServers, list, HttpEngine]:
        servers = _CountingServers(2, peak=2, hold=hold)
        try:

            async def main():
                async with HttpEngine(servers.urls, max_concurrency=settings.sglang_server_concurrency) as engine:
                    groups = await generate_rollout(Wrapper(engine) if wrap else engine, settings, 0, prompts, sde_window)
                return groups, engine

            groups, engine = run(main())
        finally:
            servers.close()
        return servers, groups, engine

    capped, groups, engine = rollout_through(wrap=False, hold=5.0)
    assert capped.most == [1, 1] and capped.most_total == 2  # one per server, two in all
    assert sum(engine.sent) == 4 and engine.in_flight == [0, 0]
    # The first two went out together, one to each server; the third only after one came back.
    assert sorted(capped.events[:2]) == [("in", 0), ("in", 1)] and capped.events[2][0] == "out"
    assert [event for event, _ in capped.events].count("in") == 4

    # Two requests in flight together would be held until both were there; one at a time,
    # each waits out its short hold alone.
    control, control_groups, _ = rollout_through(wrap=True, hold=0.1)
    assert control.most_total == 1  # the whole rollout capped at one request
    assert [event for event, _ in control.events] == ["in", "out"] * 4

    def samples(groups) -> list[tuple[int, int, int, float]]:
        return [(s.group_index, s.index_in_group, s.seed, s.output.generated_output[0, 0, 0].item()) for g in groups for s in g]

    assert samples(groups) == samples(control_groups) and len(samples(groups)) == 8


def test_http_engine_reports_unreachable_servers():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def main():
        async with HttpEngine(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(EngineRequestError) as info:
                await client.generate(SMALL)
            assert info.value.status is None
            with pytest.raises(TimeoutError, match=f"127.0.0.1:{port} \\(no answer\\)"):
                await client.wait_until_healthy(timeout=0.3, interval=0.1)

    run(main())


# -- the command ------------------------------------------------------------------------


def test_serve_engine_command(tiny_dir, reference, tmp_path):
    with testing.serve_engine_process(tiny_dir, "--device", "cpu", log_path=tmp_path / "serve.log") as served:
        assert served.banner.startswith(f"serving sd3 {tiny_dir} on http://127.0.0.1:")

        async def main():
            async with HttpEngine(served.url) as client:
                await client.wait_until_healthy(timeout=60)
                assert_same_outputs(reference.generate_sync(ROLLOUT), await client.generate(ROLLOUT))
                checksum = module_checksum(reference.component("transformer"))
                assert await client.weights_checksum(["transformer"]) == {"transformer": checksum}

        run(main())
        assert served.stop() == 0, served.log_path.read_text()


def test_serve_engine_rejects_an_unknown_family(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", "serve-engine", "--hf-checkpoint", "acme/mystery"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "no installed model family matches its name" in result.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", "serve-engine", "--hf-checkpoint", str(tmp_path / "mystery")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and f"--hf-checkpoint {tmp_path / 'mystery'}: no such directory" in missing.stderr


@pytest.mark.exercises("--rollout-parser-num-workers")
def test_http_engine_decodes_responses_off_the_event_loop(served, reference, monkeypatch):
    import miles_core.engine.http as http_module

    url, _ = served
    threads = []
    decode = http_module.unpack_outputs

    def recording(raw):
        threads.append(threading.current_thread())
        return decode(raw)

    monkeypatch.setattr(http_module, "unpack_outputs", recording)

    async def main():
        loop_thread = threading.current_thread()
        async with HttpEngine([url, url], decode_workers=2) as client:
            requests = [replace(SMALL, seed=s, request_id=f"d{s}") for s in range(4)] + [ROLLOUT]
            results = await asyncio.gather(*(client.generate(r) for r in requests))
        assert len(threads) == 5 and loop_thread not in threads
        assert all(t.name.startswith("rollout-decode") for t in threads) and len({t.name for t in threads}) <= 2
        for request, outputs in zip(requests, results):
            assert_same_outputs(reference.generate_sync(request), outputs)

    run(main())
    with pytest.raises(ValueError, match="decode_workers must be at least 1"):
        HttpEngine(url, decode_workers=0)
    from types import SimpleNamespace

    config = SimpleNamespace(rollout_engine_urls=url, sglang_server_concurrency=4, rollout_parser_num_workers=3)
    assert HttpEngine.from_config(config).decode_workers == 3
