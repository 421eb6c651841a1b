"""A stand-in ``sglang`` package for tests: a Python whose
``sglang.multimodal_gen.runtime.entrypoints.cli.main serve`` runs our own server
(``miles-core serve-engine``, on the CPU) with the host and port it was given, and records
its argument list in ``<record>.<pid>`` (the real server: tests/lane_sglang)."""

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
sys.exit(run(["--hf-checkpoint", value["--model-path"], "--diffusion-model-family", "sd3", "--device", "cpu",
              "--host", value["--host"], "--port", value["--port"]]))
"""


def script(path: Path, body: str) -> Path:
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def build_stand_in_sglang(folder: Path) -> tuple[Path, Path]:
    """The stand-in under ``folder``: ``(its python, the prefix of its argv records)``."""
    root = folder / "fake"
    package = root / "sglang" / "multimodal_gen" / "runtime" / "entrypoints" / "cli"
    package.mkdir(parents=True)
    for inner in [package, *package.parents]:
        if inner == root:
            break
        (inner / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent(MAIN))
    record = folder / "argv"
    python = script(folder / "python", f'PYTHONPATH="{root}" FAKE_SGLANG_RECORD="{record}" exec "{sys.executable}" "$@"')
    return python, record
