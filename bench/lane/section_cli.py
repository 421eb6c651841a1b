"""What the GPU lane's section scripts (``bench/gpu_*.py``) share: the dry-run set-up,
the results folder, and the command line of the two weight-sync sections. A folder of its
own, so that ``bench/*.py`` stays the list of benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch


def prepare(dry_run: bool) -> None:
    """A dry run uses the CPU (also on a machine with GPUs) and one thread; the hub
    libraries stay quiet either way."""
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()


def results_folder(out: Path | None) -> Path:
    """``--out``, else ``$OUT`` (the device tool's folder), else a new temporary folder."""
    folder = out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu-lane-")))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sync_section_main(
    name: str, doc: str | None, section: Callable[[Path, bool, int, int], Awaitable[int]], *, dry_run_help: str, repeats_help: str
) -> None:
    """The command line of a weight-sync section (``ipc_sync``, ``group_sync``): writes
    ``NAME.json`` and ``NAME.md`` and exits with ``section``'s status."""
    script = f"gpu_{name}.py"
    parser = argparse.ArgumentParser(prog=script, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"folder for {name}.json and {name}.md (default: $OUT, else a new temporary folder)"
    )
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument("--buffer-mb", type=int, default=512, help="--update-weight-buffer-size in MiB (default 512, the flag's default)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(f"{script}: needs CUDA (torch sees no GPU); nothing measured. --dry-run runs the same steps on the CPU")
        return
    prepare(args.dry_run)
    out = results_folder(args.out)
    status = asyncio.run(section(out, args.dry_run, max(1, args.repeats), args.buffer_mb * 1024 * 1024))
    print(f"results: {out / f'{name}.json'}, {out / f'{name}.md'}")
    sys.exit(status)
