"""A run's output directory: where it goes, what a resumed run keeps, and the trained
weights exported there at the end."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.errors import RunError


def output_directory(config: Config, resume_from: int | None, log: Callable[[str], None] | None = None) -> Path:
    """The run directory. A fresh run never reuses one that holds a run; a resumed run
    (``--load``) continues its own: the records of rollouts it will redo move from
    ``metrics.jsonl``, ``samples/eval/manifest.jsonl`` and ``guard.jsonl`` to
    ``<name>.superseded.jsonl`` beside each (nothing written is lost), and a partial last
    line (a run killed mid-write) is dropped with a warning on ``log``, so every file
    the run appends to ends with a complete line."""
    from miles_core.training.evaluation import MANIFEST
    from miles_core.training.guard import ALARMS_FILE
    from miles_core.training.run_log import LOG_FILE

    path = Path(config.output_dir) if config.output_dir else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        if resume_from is None:
            raise RunError(f"--output-dir {path}: already holds a run (metrics.jsonl); choose another directory")
        for records in (metrics, path / MANIFEST, path / ALARMS_FILE):
            _supersede(records, resume_from, log or print)
        run_log = path / LOG_FILE
        if run_log.exists() and run_log.stat().st_size and not run_log.read_bytes().endswith(b"\n"):
            with run_log.open("a", encoding="utf-8") as handle:  # the resumed run's lines start on a line of their own
                handle.write("\n")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _supersede(records: Path, resume_from: int, log: Callable[[str], None]) -> None:
    """Keep ``records``' JSON lines of rollouts before ``resume_from``; move the others
    (and any complete line that is not a record) to ``<stem>.superseded.jsonl``; drop a
    partial last line, saying so."""
    if not records.exists():
        return
    text = records.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    partial = lines.pop()  # "" when the file ends with a newline
    if partial.strip():
        log(f"warning: {records}: dropped a partial last line ({len(partial)} characters; the run was stopped mid-write)")
    keep, superseded = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            earlier = int(json.loads(line)["rollout_id"]) < resume_from
        except (ValueError, KeyError, TypeError):
            earlier = False
        (keep if earlier else superseded).append(line)
    if superseded:
        with records.with_name(records.stem + ".superseded.jsonl").open("a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in superseded))
    if superseded or partial:
        records.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


def save_weights(config: Config, trainer: Any, out: Path) -> None:
    """The trained weights in a form plain diffusers loads: a LoRA (``out/lora``) or the
    full components (``out/model/<component>``). Training ranks on Ray write them
    themselves (:mod:`~miles_core.training.final_weights`)."""
    if config.debug_skip_optimizer_step or config.debug_rollout_only:
        return
    ranks_write = getattr(trainer, "save_weights", None)
    if callable(ranks_write):
        ranks_write(out)
    elif config.use_lora:
        trainer.family.save_lora(out / "lora", trainer.modules)
    else:
        for name, module in trainer.modules.items():
            module.save_pretrained(str(out / "model" / name))
