"""The run log: every line a run logs goes to the console (as it always did) and, with a
timestamp and its level, to ``RUN_DIR/train.log``.

A run logs through one callable (``log(line)``): rollout lines, summaries, notes and
warnings. :class:`RunLog` is that callable. Lines logged before the run directory exists
(the thread plan, a cluster's start) are kept and written when it opens; a resumed run
appends to its directory's file. ``--log-level`` filters both the console and the file:
a line is a warning when it starts with ``warning:`` (or ``<who>: warning:``; the
guard's ``guard: alarm:`` too), an error with ``error:``, otherwise info. Python
``logging`` records of ``miles_core`` (and, in the file, of the hub libraries:
transformers, diffusers, huggingface_hub) at or above the level go to the same places
while the run log is attached. An error that ends the run is the file's last line
(``error: ...``, as the command prints it).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from miles_core.quiet import HUB_LOGGERS, LEVELS

LOG_FILE = "train.log"
_LEVEL_PREFIX = re.compile(r"^(?:[\w.\- ]+: )?(warning|error|alarm):", re.IGNORECASE)


def line_level(line: str) -> int:
    """A logged line's level: ``warning: ...`` (and a guard's ``guard: alarm: ...``) a
    warning, ``error: ...`` an error, else info."""
    match = _LEVEL_PREFIX.match(line)
    if not match:
        return logging.INFO
    word = match.group(1).lower()
    return logging.WARNING if word == "alarm" else LEVELS[word]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class _Records(logging.Handler):
    """Python logging records into the run log (the file; the console too for ``miles_core``
    records, which have no handler of their own)."""

    def __init__(self, run_log: RunLog, console: bool) -> None:
        super().__init__(run_log.level)
        self.run_log = run_log
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.name}: {record.getMessage()}"
            if record.exc_info and record.levelno >= logging.ERROR:
                line += f" ({record.exc_info[1]!r})"
            if self.console:
                self.run_log.console(line)
            self.run_log.write(record.levelno, line)
        except Exception:
            self.handleError(record)


class RunLog:
    """``log(line)`` for a run: to ``console`` (default stderr) and ``RUN_DIR/train.log``
    once :meth:`open` names the directory, lines below ``level`` left out of both."""

    def __init__(self, level: str = "info", console: Callable[[str], None] | None = None) -> None:
        self.level = LEVELS[level]
        self.console = console or _stderr
        self.pending: list[str] = []
        self.file: IO[str] | None = None
        self.path: Path | None = None
        self._attached: list[tuple[logging.Logger, logging.Handler, int]] = []
        self._owners = 0  # the :meth:`attached` blocks open (nested under --use-ray: launch, then run)

    @classmethod
    def of(cls, log: Callable[[str], None] | None, config: Any) -> RunLog:
        """``log`` itself when it is a run log already, else a run log at
        ``--log-level`` whose console is ``log``."""
        if isinstance(log, RunLog):
            return log
        return cls(config.get("log_level") or "info", log)

    def __call__(self, line: str) -> None:
        level = line_level(line)
        if level < self.level:
            return
        self.console(line)
        self.write(level, line)

    def write(self, level: int, line: str) -> None:
        """One line into the file (kept until the directory is known)."""
        stamp = datetime.now().isoformat(sep=" ", timespec="milliseconds")
        text = "".join(f"{stamp} {logging.getLevelName(level):<7} {part}\n" for part in line.splitlines() or [""])
        if self.file is None:
            self.pending.append(text)
            return
        self.file.write(text)
        self.file.flush()

    def open(self, out: Path) -> Path:
        """Start writing ``out/train.log`` (appending: a resumed run goes on in its file)
        with the lines kept so far."""
        if self.file is None:
            self.path = Path(out) / LOG_FILE
            self.file = self.path.open("a", encoding="utf-8")
            self.file.writelines(self.pending)
            self.file.flush()
            self.pending.clear()
        return self.path

    def attach(self) -> None:
        """Send Python logging records of ``miles_core`` (console and file, at the level,
        which the ``miles_core`` logger takes) and the hub libraries (file) here too."""
        if self._attached:
            return
        for name in ("miles_core", *HUB_LOGGERS):
            logger = logging.getLogger(name)
            handler = _Records(self, console=name == "miles_core")
            logger.addHandler(handler)
            self._attached.append((logger, handler, logger.level))
            if name == "miles_core":
                logger.setLevel(self.level)

    @contextmanager
    def attached(self) -> Iterator[RunLog]:
        """Attached to Python logging while the block runs; closed (the file too) when the
        outermost such block ends, so a nested block (``miles_core.launch`` around the
        run's ``train`` under ``--use-ray``) leaves the file open for the lines logged after
        it. The error that leaves the outermost block is its last line: ``error: ...`` in
        the file only (the command prints it to the console itself)."""
        self.attach()
        self._owners += 1
        try:
            yield self
        except BaseException as exc:
            if self._owners == 1:
                self.record_error(exc)
            raise
        finally:
            self._owners -= 1
            if self._owners == 0:
                self.close()

    def record_error(self, exc: BaseException) -> None:
        """The error that ends the run, as the command line prints it (``error: MESSAGE``
        per line of a miles-core error; another exception by its type and first line)."""
        from miles_core.errors import MilesError

        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return
        if isinstance(exc, MilesError):
            lines = str(exc).splitlines() or [type(exc).__name__]
        else:
            text = str(exc).strip()
            lines = [f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__]
        for line in lines:
            self.write(logging.ERROR, f"error: {line}")

    def close(self) -> None:
        """Detached from Python logging and the file closed, whoever still holds it."""
        self._owners = 0
        for logger, handler, level in self._attached:
            logger.removeHandler(handler)
            logger.setLevel(level)
        self._attached.clear()
        if self.file is not None:
            self.file.close()
            self.file = None


__all__ = ["LOG_FILE", "RunLog", "line_level"]
