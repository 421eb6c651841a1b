"""The run's secret on the miles router and in front of sglang-diffusion servers: the
router requires it on every route but ``GET /health`` and sends it to the engines; a
sglang server the run starts (the suite's stand-in, tests/sglang_stand_in.py) sits on
loopback behind an authenticating proxy that requires the key, forwards requests and
answers unchanged, and lets weights load only from under the run's sync folders; the key
is on no command line and in no log, and the server behind the proxy never gets it."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import shutil
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file, save_file
from yarl import URL

from miles_core.cli import router as router_cli
from miles_core.engine.auth import API_KEY_ENV, auth_headers, new_secret, open_server_warning, refusal
from miles_core.engine.auth_proxy import create_proxy_app
from miles_core.engine.http import HttpEngine
from miles_core.engine.router import Router, RouterSettings
from miles_core.engine.router_process import start_router
from miles_core.engine.sglang import SglangEngine
from miles_core.engine.weight_roots import resolve_roots, weight_path_refusal
from miles_core.engine.wire import unpack_outputs
from miles_core.request import RolloutRequest
from tests.sglang_stand_in import build_stand_in_sglang, children
from tests.test_server import ServerThread, assert_same_outputs

KEY = new_secret()
WRONG = {"Authorization": f"Bearer {new_secret()}"}
REFUSED_HEADERS = {
    "missing": ({}, refusal(None, KEY)),
    "wrong": (WRONG, "wrong API key"),
    "malformed": ({"Authorization": f"Basic {KEY}"}, refusal("Basic x", KEY)),
    "two tokens": ({"Authorization": f"Bearer {KEY} {KEY}"}, refusal("Bearer a b", KEY)),
}
REQUEST = RolloutRequest(
    prompt="a red cube", seed=7, width=32, height=32, num_inference_steps=2, num_outputs_per_prompt=2, request_id="auth"
)


def call(url: str, path: str, *, method: str = "POST", body: bytes | dict | None = None, headers=None) -> tuple[int, bytes, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **(headers or {})}

    async def go():
        async with aiohttp.ClientSession() as session:
            # encoded: the path goes out as written (yarl would collapse dot segments).
            async with session.request(method, URL(url + path, encoded=True), data=data, headers=headers) as response:
                return response.status, await response.read(), dict(response.headers)

    return asyncio.run(go())


def keyed(url: str, path: str, **kwargs) -> tuple[int, bytes, dict]:
    return call(url, path, headers=auth_headers(KEY), **kwargs)


def checksum(url: str) -> dict:
    status, raw, _ = keyed(url, "/get_weights_checksum", body={"module_names": ["transformer"]})
    assert status == 200, raw
    return json.loads(raw)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def nudged_transformer(checkpoint: Path, folder: Path, delta: float) -> dict[str, torch.Tensor]:
    """A diffusers-style ``folder/transformer`` of the checkpoint's with one tensor moved by ``delta``."""
    source = checkpoint / "transformer"
    target = folder / "transformer"
    target.mkdir(parents=True)
    shutil.copyfile(source / "config.json", target / "config.json")
    tensors = load_file(str(source / "diffusion_pytorch_model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + delta
    save_file(tensors, str(target / "diffusion_pytorch_model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def sglang(tiny_sd3, tmp_path_factory):
    """One stand-in sglang server the way a run starts it with its key: behind the proxy."""
    folder = tmp_path_factory.mktemp("sglang")
    python, _ = build_stand_in_sglang(folder)
    engine = SglangEngine.launch(str(python), str(tiny_sd3), [], 1, folder / "work", timeout=120, api_key=KEY)
    try:
        proxy = engine.processes[0].pid
        argv = Path(f"/proc/{proxy}/cmdline").read_bytes().decode().split("\0")
        upstream = f"http://127.0.0.1:{argv[argv.index('--upstream-port') + 1]}"
        yield engine, upstream
    finally:
        engine.stop_servers()


# -- the proxy in front of sglang --------------------------------------------------------------


def test_the_proxy_refuses_requests_without_the_key_and_changes_nothing(sglang, tiny_sd3, tmp_path):
    engine, upstream = sglang
    url = engine.urls[0]
    assert url != upstream and call(url, "/health", method="GET")[0] == 200  # liveness stays open
    before = checksum(url)
    # Requests that would change the weights or the server's state if they got through.
    inside = engine.sync_root / "refused"
    nudged_transformer(Path(tiny_sd3), inside, 0.5)
    guarded = {
        "/rollout/generate": REQUEST.to_json(),
        "/update_weights_from_disk": {"model_path": str(inside), "target_modules": ["transformer"]},
        "/update_weights_from_tensor": {"serialized_named_tensors": []},
        "/release_memory_occupation": {},
        "/get_weights_checksum": {"module_names": ["transformer"]},
        "/init_weights_update_group": {"group_name": "g"},
    }
    for path, body in guarded.items():
        for case, (headers, why) in REFUSED_HEADERS.items():
            status, raw, answer = call(url, path, body=body, headers=headers)
            assert (status, json.loads(raw)) == (401, {"error": why}), (path, case)
            assert answer["WWW-Authenticate"] == "Bearer"
    assert call(url, "/health", method="GET", headers=WRONG)[0] == 200
    assert checksum(url) == before  # no refused load reached the server
    assert keyed(url, "/rollout/generate", body=REQUEST.to_json())[0] == 200  # not released either
    # The control: the same load with the key does change the weights.
    assert keyed(url, "/update_weights_from_disk", body=guarded["/update_weights_from_disk"])[0] == 200
    assert checksum(url) != before


def test_a_generation_through_the_proxy_is_the_servers_own(sglang):
    engine, upstream = sglang
    url = engine.urls[0]
    status, through, _ = keyed(url, "/rollout/generate", body=REQUEST.to_json())
    assert status == 200
    direct = call(upstream, "/rollout/generate", body=REQUEST.to_json())[1]
    assert_same_outputs(unpack_outputs(direct), unpack_outputs(through))
    other = dataclasses.replace(REQUEST, seed=REQUEST.seed + 1)
    moved = unpack_outputs(keyed(url, "/rollout/generate", body=other.to_json())[1])
    assert not torch.equal(moved[0].generated_output, unpack_outputs(through)[0].generated_output)  # the control
    # An answer the server refuses comes back as it gave it.
    bad = {**REQUEST.to_json(), "num_inference_steps": 0}
    assert keyed(url, "/rollout/generate", body=bad)[:2] == call(upstream, "/rollout/generate", body=bad)[:2]


def test_disk_loads_only_from_under_the_sync_folder(sglang, tiny_sd3, tmp_path):
    engine, upstream = sglang
    url = engine.urls[0]
    roots = resolve_roots(engine.allowed_weight_roots)
    assert roots == (engine.sync_root.resolve(),)
    outside = tmp_path / "outside"
    nudged_transformer(Path(tiny_sd3), outside, 0.25)
    link = engine.sync_root / "escape"
    link.symlink_to(outside, target_is_directory=True)
    dotted = engine.sync_root / ".." / ".." / ".." / outside.relative_to(engine.sync_root.parents[2])
    before = checksum(url)
    for path in (outside, link, dotted, Path("/")):
        status, raw, _ = keyed(url, "/update_weights_from_disk", body={"model_path": str(path), "target_modules": ["transformer"]})
        assert (status, json.loads(raw)) == (403, {"error": weight_path_refusal(str(path), roots)}), path
    assert checksum(url) == before
    # The control: the server itself would have loaded it.
    assert call(upstream, "/update_weights_from_disk", body={"model_path": str(outside), "target_modules": ["transformer"]})[0] == 200
    assert checksum(url) != before

    # The run's own syncs and a restarted server's re-sync land under the sync folder: they pass.
    tensors = load_file(str(Path(tiny_sd3) / "transformer" / "diffusion_pytorch_model.safetensors"))
    moved = {name: value + 0.125 for name, value in tensors.items()}

    async def sync() -> list[dict]:
        view = engine.view(url)
        try:
            sums = []
            for client, weights in ((engine, moved), (view, tensors)):
                await client.update_weights_from_tensors("transformer", weights, buffer_size=1 << 20)
                sums.append(await client.weights_checksums(["transformer"]))
            return sums
        finally:
            await HttpEngine.close(engine)
            await HttpEngine.close(view)

    synced, resynced = asyncio.run(sync())
    assert synced != resynced and [p.name for p in sorted(engine.sync_root.glob("*sync-*"))] == ["resync-00001", "sync-00000"]
    assert checksum(url) == resynced[url]


def test_the_key_is_on_no_command_line_in_no_log_and_not_given_to_sglang(sglang):
    engine, _ = sglang
    proxy = engine.processes[0].pid
    servers = children(proxy)
    assert len(servers) == 1
    for pid in (proxy, *servers):
        assert KEY not in cmdline(pid)
    assert environ(proxy)[API_KEY_ENV] == KEY  # how it got there
    assert API_KEY_ENV not in environ(servers[0])
    logs = list((engine.work_dir / "logs").iterdir())
    assert engine.log_paths[0] in logs and not any(KEY.encode() in p.read_bytes() for p in logs)


# -- the proxy's forwarding, on loopback stand-ins ----------------------------------------------------


def echo_app() -> web.Application:
    """An upstream that answers with what it got, in a gzip body it encodes itself."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen = {"method": request.method, "raw_path": request.raw_path, "headers": dict(request.headers), "body": body.hex()}
        response = web.Response(status=207, body=gzip.compress(json.dumps(seen).encode(), mtime=0))
        response.headers["Content-Encoding"] = "gzip"
        response.headers["Content-Type"] = "application/x-seen"
        response.headers.add("X-Twice", "1")
        response.headers.add("X-Twice", "2")
        return response

    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def test_the_proxy_passes_requests_and_answers_through_unchanged(tmp_path):
    upstream = ServerThread(echo_app())
    proxy = ServerThread(create_proxy_app(upstream.url, KEY, resolve_roots([tmp_path])))
    closed = ServerThread(create_proxy_app("http://127.0.0.1:9", KEY, ()))  # port 9: nothing listens
    payload = os.urandom(3 << 19)

    async def go():
        async def chunks():
            for start in range(0, len(payload), 1 << 19):
                yield payload[start : start + (1 << 19)]

        async with aiohttp.ClientSession(auto_decompress=False) as session:
            headers = {**auth_headers(KEY), "X-Custom": "kept", "Content-Type": "application/octet-stream"}
            target = URL(proxy.url + "/some/where?a=1&b=%2F", encoded=True)
            async with session.put(target, data=chunks(), headers=headers) as response:
                streamed = response.status, await response.read(), response.headers.getall("X-Twice"), response.headers
            async with session.post(closed.url + "/rollout/generate", headers=auth_headers(KEY), data=b"{}") as response:
                gone = response.status, await response.json()
            return streamed, gone

    try:
        (status, raw, twice, headers), gone = asyncio.run(go())
    finally:
        for server in (proxy, closed, upstream):
            server.close()
    assert status == 207 and headers["Content-Encoding"] == "gzip" and twice == ["1", "2"]
    seen = json.loads(gzip.decompress(raw))  # undecoded on the way: the upstream's gzip bytes
    assert seen["method"] == "PUT" and seen["raw_path"] == "/some/where?a=1&b=%2F"
    assert bytes.fromhex(seen["body"]) == payload
    assert seen["headers"]["X-Custom"] == "kept" and "Authorization" not in seen["headers"]
    assert gone[0] == 502 and gone[1]["error"].startswith("the server behind this proxy (http://127.0.0.1:9) gave no answer: ")
    assert "\n" not in gone[1]["error"]


def test_the_proxy_refuses_weight_loads_it_cannot_check(tmp_path):
    upstream = ServerThread(echo_app())
    proxy = ServerThread(create_proxy_app(upstream.url, KEY, resolve_roots([tmp_path])))
    inside, outside = str(tmp_path / "a"), str(tmp_path.parent)
    roots = resolve_roots([tmp_path])
    cases = [
        ("/update_weights_from_disk", b"{not json", 400, "/update_weights_from_disk: the body is not JSON"),
        ("/update_weights_from_disk", b'["x"]', 400, "/update_weights_from_disk: the body is not a JSON object"),
        ("/update_weights_from_disk", b'{"model_path": 3}', 400, "/update_weights_from_disk: model_path must be a string path, got int"),
        ("/set_lora", json.dumps({"lora_nickname": ["a", "b"], "lora_path": [inside, outside]}).encode(), 403, "lora_path"),
        ("//update_weights_from_disk/", json.dumps({"model_path": outside}).encode(), 403, "model_path"),
        ("/v1/set_lora", json.dumps({"lora_nickname": "a", "lora_path": outside}).encode(), 403, "lora_path"),
        ("/x/../update_weights_from_disk", json.dumps({"model_path": outside}).encode(), 400, None),
        ("/set_lora", json.dumps({"lora_nickname": "a", "lora_path": inside}).encode(), 207, None),
        ("/update_weights_from_disk", json.dumps({"model_path": inside}).encode(), 207, None),
        ("/update_weights_from_disk", b"{}", 207, None),  # the server answers a missing path itself
    ]
    try:
        for path, body, expected, message in cases:
            status, raw, _ = keyed(proxy.url, path, body=body)
            assert status == expected, (path, body, raw)
            if expected == 400 and message is None:  # a dot segment: not forwarded at all
                assert json.loads(raw) == {"error": f"path {path!r}: '.' and '..' segments are not forwarded"}
            elif expected == 403:
                assert json.loads(raw) == {"error": weight_path_refusal(outside, roots, field=message)}
            elif message is not None:
                assert json.loads(raw) == {"error": message}
            else:
                assert bytes.fromhex(json.loads(raw)["body"]) == body  # the body as it came
    finally:
        proxy.close()
        upstream.close()


# -- the router ------------------------------------------------------------------------------------


def test_the_router_requires_its_key_and_sends_it_to_the_engines(sglang, tmp_path):
    engine, upstream = sglang
    engine_url = engine.urls[0]  # the proxy: a server that requires the key
    router = start_router(["--sglang-server-concurrency", "2"], tmp_path / "router.log", api_key=KEY)
    try:
        url = router.url
        routes = [
            ("POST", f"/add_worker?url={engine_url}", None),
            ("POST", f"/remove_worker?url={engine_url}", None),
            ("GET", "/list_workers", None),
            ("POST", "/rollout/generate", REQUEST.to_json()),
        ]
        for method, path, body in routes:
            for case, (headers, why) in REFUSED_HEADERS.items():
                status, raw, _ = call(url, path, method=method, body=body, headers=headers)
                assert (status, json.loads(raw)) == (401, {"error": why}), (path, case)
        assert call(url, "/health", method="GET")[0] == 200
        assert json.loads(keyed(url, "/list_workers", method="GET")[1])["workers"] == []  # the refused add changed nothing
        assert keyed(url, f"/add_worker?url={engine_url}")[0] == 200
        status, raw, headers = keyed(url, "/rollout/generate", body=REQUEST.to_json())
        assert status == 200 and headers["X-Miles-Engine"] == engine_url
        direct = call(upstream, "/rollout/generate", body=REQUEST.to_json())[1]
        assert_same_outputs(unpack_outputs(direct), unpack_outputs(raw))
        assert [w["state"] for w in json.loads(keyed(url, "/list_workers", method="GET")[1])["workers"]] == ["healthy"]
        assert keyed(url, f"/remove_worker?url={engine_url}")[0] == 200

        assert KEY not in cmdline(router.process.pid) and environ(router.process.pid)[API_KEY_ENV] == KEY
        assert KEY not in router.log_path.read_text()
    finally:
        router.stop(timeout=10)

    async def forward(key: str | None) -> int:  # the control: a router without the key is refused by the engine
        keyless = Router(RouterSettings(), api_key=key)
        await keyless.start()
        try:
            keyless.add(engine_url)
            return (await keyless.forward(json.dumps(REQUEST.to_json()).encode(), "application/json"))[0]
        finally:
            await keyless.close()

    assert asyncio.run(forward(None)) == 401


def test_router_key_sources_and_warnings(tmp_path, monkeypatch, capsys):
    unbindable = ["--host", "192.0.2.1"]  # TEST-NET-1: the router warns, then cannot listen
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert router_cli.run(unbindable) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == open_server_warning("miles-core router", "192.0.2.1", None) and len(lines) == 2
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert router_cli.run(unbindable) == 1
    assert len(capsys.readouterr().err.splitlines()) == 1  # with a key: no warning
    assert router_cli.parse_args([]).api_key == KEY
    monkeypatch.delenv(API_KEY_ENV)

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    assert router_cli.parse_args(["--api-key-file", str(key_file)]).api_key == KEY
    assert capsys.readouterr().err == f"warning: --api-key-file {key_file} is readable by group or others (mode 0644); chmod 600 it\n"
    key_file.write_text("")
    with pytest.raises(SystemExit) as info:
        router_cli.parse_args(["--api-key-file", str(key_file)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"--api-key-file {key_file}: the file is empty; it must hold the key")


# -- a restart, on a light stand-in --------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_server_dies_with_its_proxy_and_a_restarted_one_gets_the_key(tiny_sd3, tmp_path):
    python, _ = build_stand_in_sglang(tmp_path, light=True)
    engine = SglangEngine.launch(str(python), str(tiny_sd3), [], 1, tmp_path / "work", timeout=60, api_key=KEY)
    try:
        old, proxy = engine.urls[0], engine.processes[0].pid
        (server,) = children(proxy)
        os.kill(proxy, signal.SIGKILL)  # the proxy alone (as the fault-tolerance test kills a server)
        deadline = time.monotonic() + 10
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server)  # no keyless server outlives its proxy

        new = engine.restart_server(0)  # what the supervisor does with a dead server
        assert new != old and engine.log_paths[0].name == "engine-0.restart1.log"
        assert call(new, "/rollout/generate", body=b'{"x": 1}')[0] == 401
        status, raw, _ = keyed(new, "/rollout/generate", body=b'{"x": 1}')
        assert (status, json.loads(raw)) == (200, {"path": "/rollout/generate", "body": '{"x": 1}'})
        proxy = engine.processes[0].pid
        assert KEY not in cmdline(proxy) and environ(proxy)[API_KEY_ENV] == KEY
        (server,) = children(proxy)
        assert API_KEY_ENV not in environ(server)
        assert not any(KEY.encode() in p.read_bytes() for p in (tmp_path / "work" / "logs").iterdir())
    finally:
        engine.stop_servers()
    assert engine.processes[0].poll() is not None and not alive(server)
