"""The run report: one self-contained HTML file (styles inline, charts as plain SVG,
samples embedded) showing a run's curves, samples, configuration and guard alarms, or
several runs' overlaid with their configuration differences (docs/report.md)."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from miles_core.errors import ReportError
from miles_core.report.page import render
from miles_core.report.run_files import Run, load_run

__all__ = ["load_runs", "write_report"]


def load_runs(run_dirs: Sequence[Path | str]) -> list[Run]:
    """The runs in ``run_dirs`` (:class:`ReportError` for one that is not a run), named by
    their directory's name, or by their whole path where two names would collide."""
    if not run_dirs:
        raise ReportError("no run directory given")
    runs = [load_run(Path(d)) for d in run_dirs]
    names = Counter(run.name for run in runs)
    for run in runs:
        if names[run.name] > 1:
            run.label = str(run.path)
    return runs


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that ``path`` always holds a whole file: a temporary
    file in the same directory, flushed to disk, then renamed over it. On any error the
    old file is left as it was and the temporary file is removed."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp's 0600 would keep the report from whoever may read the run: the mode open() gives, 0o666 less the umask
        os.fchmod(handle, 0o666 & ~current_umask())
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    sync_directory(path.parent)


def current_umask() -> int:
    """The process umask: from /proc on Linux (reading it with os.umask means setting it, for
    every thread of the process, if only for an instant), else set and set back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def sync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries to disk so the rename survives a crash (POSIX; best
    effort: a platform or file system that cannot open or sync a directory is skipped)."""
    try:
        handle = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def write_report(run_dirs: Sequence[Path | str], out: Path | str) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (atomically) and return its path."""
    out = Path(out)
    runs = load_runs(run_dirs)
    if not out.parent.is_dir():
        raise ReportError(f"{out}: cannot write the report: {out.parent} is not a directory")
    try:
        write_text_atomically(out, render(runs, out))
    except OSError as exc:
        raise ReportError(f"{out}: cannot write the report ({exc.strerror or exc})") from None
    return out
