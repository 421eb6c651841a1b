"""``miles-core train [flags]``: a training run. Takes every flag of ``miles-core
config``; the configuration is resolved and validated before any model loads, then the
run writes ``metrics.jsonl``, ``config.yaml`` and ``train.log`` to ``--output-dir``. Once the
run's inputs are checked and before any weight is read, its memory plan
(:mod:`miles_core.planning`) is held against the device's memory (the host's without a
GPU) unless ``--skip-memory-plan``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from miles_core.cli.config_command import resolve_for_command


def run(argv: Sequence[str], prog: str = "miles-core train") -> int:
    config = resolve_for_command(argv, prog, training=True)

    from miles_core.launch import run_sync
    from miles_core.quiet import show_hub_libraries

    # A hub id or a real checkpoint (the pipeline, a reward model) with its download progress
    # and load warnings, at --log-level (the run log sends them to RUN_DIR/train.log too); a
    # tiny pipeline's own load is quiet (ModelFamily.load_pipeline).
    show_hub_libraries(config.log_level)
    out = run_sync(config, before_load=memory_check)
    print(f"{prog}: run written to {out}", file=sys.stderr)
    return 0


def memory_check(config: Any, log: Any) -> None:
    """The memory plan, once the run's inputs are checked and before any weight is read: a
    run that cannot fit stops here in one line (exit 2); one that fits logs its peak."""
    from miles_core.planning import check_memory_plan
    from miles_core.planning.plan import gib

    plan = check_memory_plan(config)
    if plan is not None:
        peak = plan.peak()
        log(f"memory plan: peak {gib(peak.nbytes)} at {peak.name} of {gib(plan.capacity)} ({plan.capacity_source})")
