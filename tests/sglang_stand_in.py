"""A stand-in ``sglang`` package for tests: a Python whose
``sglang.multimodal_gen.runtime.entrypoints.cli.main serve`` runs our own server
(``miles-core serve-engine``, on the CPU, loading weights from any directory as sglang
does) with the host and port it was given, and records its argument list in
``<record>.<pid>`` (the real server: tests/lane_sglang)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

MAIN = """
import json, os, sys
from miles_core.cli.serve_engine import run

argv = sys.argv[1:]
with open(os.environ["FAKE_SGLANG_RECORD"] + f".{os.getpid()}", "w") as f:
    json.dump(argv, f)
assert argv[0] == "serve"
value = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
# sglang-diffusion itself loads weights from any directory it can read: so does the stand-in.
sys.exit(run(["--hf-checkpoint", value["--model-path"], "--diffusion-model-family", "sd3", "--device", "cpu",
              "--host", value["--host"], "--port", value["--port"], "--allowed-weight-roots", "/"]))
"""


LIGHT_MAIN = """
import sys
from aiohttp import web

argv = sys.argv[1:]
value = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}


async def health(request):
    return web.json_response({"status": "ok"})


async def echo(request):
    return web.json_response({"path": request.path, "body": (await request.read()).decode()})


app = web.Application()
app.router.add_get("/health", health)
app.router.add_route("*", "/{tail:.*}", echo)
web.run_app(app, host=value["--host"], port=int(value["--port"]), print=None)
"""


def script(path: Path, body: str) -> Path:
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def build_stand_in_sglang(folder: Path, *, light: bool = False) -> tuple[Path, Path]:
    """The stand-in under ``folder``: ``(its python, the prefix of its argv records)``.
    ``light``: a server that loads no model and answers every route with what it got
    (``{"path", "body"}``; ``GET /health``: 200), up in well under a second, and records nothing."""
    root = folder / "fake"
    package = root / "sglang" / "multimodal_gen" / "runtime" / "entrypoints" / "cli"
    package.mkdir(parents=True)
    for inner in [package, *package.parents]:
        if inner == root:
            break
        (inner / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent(LIGHT_MAIN if light else MAIN))
    record = folder / "argv"
    python = script(folder / "python", f'PYTHONPATH="{root}" FAKE_SGLANG_RECORD="{record}" exec "{sys.executable}" "$@"')
    return python, record


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (an sglang server the run started with its key
    is its authenticating proxy's child)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
