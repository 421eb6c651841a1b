"""Loading a run directory for the report: what the run wrote, read defensively.

A run may still be writing (the report is rewritten at every evaluation) or may have been
killed mid-write, so every JSON-lines file is read up to its last complete line and a
line that does not parse is skipped, never fatal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_core.errors import ReportError

MANIFEST = Path("samples") / "eval" / "manifest.jsonl"
GUARD = Path("guard.jsonl")


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line, up to its last complete line: a last line
    without its newline (a writer interrupted) is ignored, and so is any line that is not
    a JSON object. A missing file is an empty list."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    records = []
    for line in complete.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any]
    manifest: list[dict[str, Any]]
    alarms: list[dict[str, Any]]
    grids: list[Path] = field(default_factory=list)
    label: str | None = None
    """What the report calls the run (default: its directory's name)."""

    @property
    def name(self) -> str:
        return self.label or self.path.name or str(self.path)

    @property
    def sources(self) -> dict[str, str]:
        sources = self.config.get("sources")
        return {str(k): str(v) for k, v in sources.items()} if isinstance(sources, dict) else {}

    def flag(self, dest: str, default: Any = None) -> Any:
        """The value of flag ``dest`` in whichever group of config.yaml holds it."""
        for group, values in self.config.items():
            if group not in NON_FLAG_SECTIONS and isinstance(values, dict) and dest in values:
                return values[dest]
        return default

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(rollout ids, values) of the records holding a number under ``key``."""
        xs, ys = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "rollout_id" in record:
                xs.append(float(record["rollout_id"]))
                ys.append(float(value))
        return xs, ys

    def keys(self) -> set[str]:
        return {key for record in self.records for key in record}


NON_FLAG_SECTIONS = ("resolved", "components", "sources")
"""The sections of config.yaml that are not flag groups."""


def load_run(directory: Path) -> Run:
    """The run in ``directory``; :class:`ReportError` when it is not a run directory."""
    directory = Path(directory)
    config_path, metrics_path = directory / "config.yaml", directory / "metrics.jsonl"
    if not directory.is_dir() or not (config_path.is_file() or metrics_path.is_file()):
        raise ReportError(f"{directory}: not a run directory (no config.yaml or metrics.jsonl)")
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ReportError(f"{config_path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        config = loaded if isinstance(loaded, dict) else {}
    grids = sorted((directory / "samples").glob("eval_*.png"))
    return Run(
        path=directory,
        records=read_json_lines(metrics_path),
        config=config,
        manifest=read_json_lines(directory / MANIFEST),
        alarms=read_json_lines(directory / GUARD),
        grids=grids,
    )
