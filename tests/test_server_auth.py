"""Who may drive ``miles-core serve-engine``: with a key, every route but ``GET /health``
answers 401 to a request without it, with another or with a malformed header, and
changes nothing; disk loads come only from under the allowed weight roots, links
resolved. Real servers on loopback with the tiny SD3 pipeline (in this process, and one
``serve-engine`` process for the command's own key handling)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from miles_core.cli import serve_engine
from miles_core.engine.auth import API_KEY_ENV, new_secret
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.server import create_app
from miles_core.engine.wire import unpack_outputs
from miles_core.errors import ConfigError
from miles_core.weights import bucket_to_bytes, named_tensors_checksum
from tests.test_server import ServerThread, wait_healthy

KEY = new_secret()
WRONG = KEY[:-1] + ("B" if KEY[-1] == "A" else "A")  # as long as the key, one character off
MISSING = "missing Authorization header: this server requires 'Authorization: Bearer <key>'"
MALFORMED = "malformed Authorization header: expected 'Bearer <key>'"
REFUSED_HEADERS = [
    (None, MISSING),
    (f"Bearer {WRONG}", "wrong API key"),
    ("Basic x", MALFORMED),
    ("Bearer", MALFORMED),
    ("Bearer a b", MALFORMED),
    (KEY, MALFORMED),  # the key without its scheme
]
SMALL = {"prompt": "ok", "num_inference_steps": 1, "width": 16, "height": 16}
OUTSIDE_RULE = "this server loads weights only from directories under the roots it was started with, links resolved"


def call(
    url: str, path: str, body: bytes | dict | None = b"", *, header: str | None = None, method: str = "POST", content_type: str = ""
) -> tuple[int, bytes, dict[str, str]]:
    """One request with ``header`` as its ``Authorization`` (None: none); (status, body, headers)."""
    if isinstance(body, dict):
        body, content_type = json.dumps(body).encode(), content_type or "application/json"
    headers = {"Content-Type": content_type or "application/json"}
    if header is not None:
        headers["Authorization"] = header
    request = urllib.request.Request(url + path, data=body if method == "POST" else None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def keyed(url: str, path: str, body: bytes | dict | None = b"", **kwargs) -> tuple[int, bytes]:
    status, answer, _ = call(url, path, body, header=f"Bearer {KEY}", **kwargs)
    return status, answer


def error(answer: bytes) -> str:
    return json.loads(answer)["error"]


def transformer_checksum(url: str) -> str:
    status, answer = keyed(url, "/get_weights_checksum", {"module_names": ["transformer"]})
    assert status == 200, answer
    return json.loads(answer)["transformer"]


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_sd3) -> EmbeddedEngine:
    return EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")


@pytest.fixture(scope="module")
def weights(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The transformer's weights, and the same with every tensor moved by 1e-3."""
    original = {name: p.detach().clone() for name, p in engine.component("transformer").named_parameters()}
    return original, {name: tensor + 1e-3 for name, tensor in original.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, weights) -> dict[str, Path]:
    """``root`` (the allowed one) with real new weights in ``root/step``, the same weights
    outside it, and links inside the root: ``root/escape`` to the outside copy,
    ``root/inside`` to ``root/step``."""
    _, nudged = weights
    base = tmp_path_factory.mktemp("weights")
    root, outside = base / "root", base / "outside"
    for step in (root / "step", outside / "step"):
        (step / "transformer").mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in nudged.items()}, str(step / "transformer" / "model.safetensors"))
    (root / "escape").symlink_to(outside / "step", target_is_directory=True)
    (root / "inside").symlink_to(root / "step", target_is_directory=True)
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def served(engine, folders):
    server = ServerThread(create_app(engine, api_key=KEY, allowed_weight_roots=[folders["root"]], update_weight_buffer_size=1 << 20))
    wait_healthy(server.url)  # GET /health needs no key
    yield server.url
    server.close()


def every_route(folders: dict[str, Path], nudged: dict[str, torch.Tensor]) -> list[tuple[str, bytes, str]]:
    """(path, body, content type) of each route but /health, each a request that would
    generate or change something (real new weights) if it were served."""
    as_json = "application/json"
    return [
        ("/rollout/generate", json.dumps(SMALL).encode(), as_json),
        ("/update_weights_from_disk", json.dumps({"model_path": str(folders["root"] / "step")}).encode(), as_json),
        (
            "/update_weights_from_tensor",
            msgpack.packb({"target_module": "transformer", "bucket": bucket_to_bytes(nudged)}),
            "application/msgpack",
        ),
        ("/update_weights_from_tensor", json.dumps({"serialized_named_tensors": ["eA=="]}).encode(), as_json),
        ("/get_weights_checksum", b"{}", as_json),
        ("/init_weights_update_group", json.dumps({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}).encode(), as_json),
        ("/update_weights_from_distributed", json.dumps({"group_name": "g"}).encode(), as_json),
        ("/destroy_weights_update_group", json.dumps({"group_name": "g"}).encode(), as_json),
        ("/release_memory_occupation", b"", as_json),
        ("/resume_memory_occupation", b"", as_json),
    ]


# -- the key ----------------------------------------------------------------------------


def test_every_route_but_health_answers_401_without_the_key_and_changes_nothing(served, engine, folders, weights):
    original, nudged = weights
    checksum = transformer_checksum(served)
    assert checksum == named_tensors_checksum(original.items())
    for path, body, content_type in every_route(folders, nudged):
        for header, why in REFUSED_HEADERS:
            status, answer, headers = call(served, path, body, header=header, content_type=content_type)
            assert (status, error(answer), headers.get("WWW-Authenticate")) == (401, why, "Bearer"), (path, header)
            assert transformer_checksum(served) == checksum, (path, header)
            assert not engine.memory_released, (path, header)
    # An unknown route says nothing without the key either; the health check is open.
    assert call(served, "/no/such/route", method="GET")[0] == 401
    status, answer, _ = call(served, "/health", method="GET")
    assert status == 200 and json.loads(answer)["status"] == "ok"
    assert call(served, "/health", method="HEAD")[0] == 200


def test_with_the_key_every_route_answers_as_without_authentication(served, engine, folders, weights):
    original, nudged = weights
    checksum = transformer_checksum(served)
    status, answer = keyed(served, "/rollout/generate", SMALL)
    assert status == 200 and len(unpack_outputs(answer)) == 1
    # The scheme's case does not matter (RFC 9110).
    status, _, _ = call(served, "/get_weights_checksum", {}, header=f"bearer {KEY}")
    assert status == 200

    # Real new weights, from a tensor bucket, then from disk under the root: the controls
    # that the refused requests above would have changed them.
    bucket = msgpack.packb({"target_module": "transformer", "bucket": bucket_to_bytes(nudged)})
    status, answer = keyed(served, "/update_weights_from_tensor", bucket, content_type="application/msgpack")
    assert status == 200, answer
    assert transformer_checksum(served) == named_tensors_checksum(nudged.items()) != checksum
    restore = msgpack.packb({"target_module": "transformer", "bucket": bucket_to_bytes(original)})
    assert keyed(served, "/update_weights_from_tensor", restore, content_type="application/msgpack")[0] == 200
    assert transformer_checksum(served) == checksum
    for folder in (folders["root"] / "step", folders["root"] / "inside"):  # a link that stays inside is fine
        status, answer = keyed(served, "/update_weights_from_disk", {"model_path": str(folder), "target_modules": ["transformer"]})
        assert status == 200 and json.loads(answer)["success"] is True, answer
        assert transformer_checksum(served) == named_tensors_checksum(nudged.items())
        assert keyed(served, "/update_weights_from_tensor", restore, content_type="application/msgpack")[0] == 200
        assert transformer_checksum(served) == checksum

    # The other routes give their own answers, not 401.
    status, answer = keyed(served, "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]})
    assert status == 403 and error(answer).startswith("serialized_named_tensors: refused: this format is unpickled")
    assert keyed(served, "/init_weights_update_group", {})[0] == 400
    assert keyed(served, "/update_weights_from_distributed", {"group_name": "g"})[0] == 400
    status, answer = keyed(served, "/destroy_weights_update_group", {"group_name": "g"})
    assert status == 400 and error(answer).startswith("group_name: this server is in no weight-update group 'g'")
    status, answer = keyed(served, "/release_memory_occupation")
    assert status == 200 and json.loads(answer)["sleeping"] is True and engine.memory_released
    status, answer = keyed(served, "/resume_memory_occupation")
    assert status == 200 and json.loads(answer)["sleeping"] is False and not engine.memory_released
    assert transformer_checksum(served) == checksum


# -- weight roots -----------------------------------------------------------------------


def outside(path: str | Path, roots: str, resolves_to: Path | None = None) -> str:
    """The 403 line for ``path`` on a server with ``roots`` (as it lists them)."""
    shown = repr(str(path)) + (f" (resolves to {str(resolves_to)!r})" if resolves_to else "")
    return f"model_path {shown} is outside the allowed weight roots ({roots}): {OUTSIDE_RULE} (--allowed-weight-roots adds roots)"


def test_disk_loads_come_only_from_under_the_allowed_roots(served, folders):
    root, away = folders["root"], folders["outside"]
    checksum = transformer_checksum(served)

    def refused(path: Path) -> str:
        status, answer = keyed(served, "/update_weights_from_disk", {"model_path": str(path)})
        assert status == 403, (path, answer)
        assert transformer_checksum(served) == checksum, path
        return error(answer)

    roots = str(root.resolve())
    # A folder outside, ways out with ".." (one after a link), and a path outside that does
    # not exist, which gets the same answer as one that does; then a link inside the root
    # that points outside, named with where it leads.
    for path in (away / "step", root / ".." / "outside" / "step", away / "no-such-step", root / "inside" / ".." / ".."):
        assert refused(path) == outside(path, roots)
    assert refused(root / "escape") == outside(root / "escape", roots, resolves_to=(away / "step").resolve())
    # Inside a root, a missing folder is the engine's 400, as before the roots.
    status, answer = keyed(served, "/update_weights_from_disk", {"model_path": str(root / "no-such-step")})
    assert (status, error(answer)) == (400, f"model_path: model_path {root / 'no-such-step'}: not a directory")


def test_a_server_without_roots_loads_nothing_from_disk(engine, folders, tmp_path):
    with pytest.raises(ConfigError) as info:
        create_app(engine, allowed_weight_roots=[tmp_path / "missing"])
    assert str(info.value) == f"--allowed-weight-roots {tmp_path / 'missing'}: no such directory"
    server = ServerThread(create_app(engine))  # no key: a hand-started server's default
    try:
        wait_healthy(server.url)
        step = str(folders["root"] / "step")
        status, answer, _ = call(server.url, "/update_weights_from_disk", {"model_path": step})
        assert status == 403
        assert error(answer) == outside(step, "none")
        # Without a key every request is served (the control for the 401s above).
        assert call(server.url, "/get_weights_checksum", {})[0] == 200
    finally:
        server.close()


# -- the command ------------------------------------------------------------------------


def test_serve_engine_takes_its_key_from_the_environment_only(tiny_sd3, folders, tmp_path):
    """One real process on every interface: the key reaches it through its environment,
    never its command line or its log; with a key it does not warn."""
    log_path = tmp_path / "serve.log"
    env = {**os.environ, API_KEY_ENV: KEY, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "miles_core.cli.main", "serve-engine", "--hf-checkpoint", str(tiny_sd3), "--device", "cpu"]
    command += ["--host", "0.0.0.0", "--port", "0", "--allowed-weight-roots", str(folders["root"])]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (banner := next((line for line in log_path.read_text().splitlines() if line.startswith("serving ")), None)):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        url = "http://127.0.0.1:" + banner.rsplit(":", 1)[1]
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"serve-engine" in cmdline and KEY.encode() not in cmdline
        assert KEY.encode() in Path(f"/proc/{process.pid}/environ").read_bytes()  # where it did come from
        wait_healthy(url, timeout=90)
        assert call(url, "/get_weights_checksum", {})[0] == 401
        assert call(url, "/get_weights_checksum", {}, header=f"Bearer {WRONG}")[0] == 401
        status, answer = keyed(url, "/rollout/generate", SMALL)
        assert status == 200 and len(unpack_outputs(answer)) == 1
    finally:
        process.terminate()
        assert process.wait(30) == 0
    text = log_path.read_text()
    assert KEY not in text and "without an API key" not in text, text


def test_serve_engine_reads_a_key_file_and_checks_its_roots(tiny_sd3, folders, tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    argv = ["--hf-checkpoint", str(tiny_sd3), "--device", "cpu", "--api-key-file", str(key_file)]
    argv += ["--allowed-weight-roots", str(folders["root"])]
    args, family = serve_engine.parse_args(argv, environ={API_KEY_ENV: WRONG})  # the file wins over the environment
    assert capsys.readouterr().err == f"warning: --api-key-file {key_file} is readable by group or others (mode 0644); chmod 600 it\n"
    key_file.chmod(0o600)
    assert serve_engine.parse_args(argv, environ={})[0].api_key == KEY and capsys.readouterr().err == ""
    server = ServerThread(serve_engine.build_app(args, family))
    try:
        wait_healthy(server.url)
        assert call(server.url, "/get_weights_checksum", {}, header=f"Bearer {WRONG}")[0] == 401
        assert keyed(server.url, "/get_weights_checksum", {})[0] == 200
        status, answer = keyed(server.url, "/update_weights_from_disk", {"model_path": str(folders["outside"] / "step")})
        assert status == 403 and "is outside the allowed weight roots" in error(answer)
    finally:
        server.close()
    capsys.readouterr()  # the model's loading progress

    a_file = tmp_path / "file"
    a_file.write_text("")
    base = ["--hf-checkpoint", str(tiny_sd3), "--device", "cpu"]
    for extra, message in [
        (["--allowed-weight-roots", str(tmp_path / "missing")], f"--allowed-weight-roots {tmp_path / 'missing'}: no such directory"),
        (["--allowed-weight-roots", str(folders["root"]), str(a_file)], f"--allowed-weight-roots {a_file}: not a directory"),
        (["--api-key-file", str(a_file)], f"--api-key-file {a_file}: the file is empty; it must hold the key"),
        (["--api-key", ""], "--api-key: the key is empty"),
    ]:
        with pytest.raises(SystemExit) as caught:
            serve_engine.run(base + extra)
        assert caught.value.code == 2
        assert capsys.readouterr().err == f"miles-core serve-engine: error: {message}\n"


def test_an_open_server_beyond_loopback_warns_at_start_up(tiny_sd3, monkeypatch, capsys):
    """Without a key: a warning on every interface, none on loopback (the control). The
    port is taken, so the command stops right after it (exit 1) instead of serving."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for host, warns in (("0.0.0.0", True), ("127.0.0.1", False)):
            assert serve_engine.run(["--hf-checkpoint", str(tiny_sd3), "--device", "cpu", "--host", host, "--port", port]) == 1
            lines = capsys.readouterr().err.splitlines()
            assert lines[-1].startswith(f"miles-core serve-engine: error: cannot listen on {host}:{port}: ")
            warning = (
                f"warning: miles-core serve-engine listens on {host} without an API key: anyone who can reach it can "
                f"generate and replace its weights; set {API_KEY_ENV} or --api-key-file"
            )
            assert lines[:-1] == ([warning] if warns else [])


def test_a_header_with_undecodable_bytes_is_malformed_not_a_crash():
    """aiohttp decodes header bytes that are not UTF-8 into lone surrogates; such a token
    cannot be the key, and says so in the one-line 401 reason rather than raising."""
    from miles_core.engine.auth import refusal

    assert refusal("Bearer k\udcff", "k") == "malformed Authorization header: expected 'Bearer <key>'"
    assert refusal("Bearer k", "k") is None  # the control: the same key, decodable
