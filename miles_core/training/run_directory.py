"""A run's output directory: where it goes, what a resumed run keeps, and the trained
weights exported there at the end."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.errors import RunError


def output_directory(config: Config, resume_from: int | None) -> Path:
    """The run directory. A fresh run never reuses one that holds a run; a resumed run
    (``--load``) continues its own: records of rollouts it will redo move to
    ``metrics.superseded.jsonl`` (nothing written is lost)."""
    path = Path(config.output_dir) if config.output_dir else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        if resume_from is None:
            raise RunError(f"--output-dir {path}: already holds a run (metrics.jsonl); choose another directory")
        keep, superseded = [], []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            if line.strip():
                (keep if json.loads(line)["rollout_id"] < resume_from else superseded).append(line)
        if superseded:
            with (path / "metrics.superseded.jsonl").open("a", encoding="utf-8") as handle:
                handle.write("\n".join(superseded) + "\n")
        metrics.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    path.mkdir(parents=True, exist_ok=True)
    return path


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
