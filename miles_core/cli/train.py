"""``miles-core train [flags]``: a training run. Takes every flag of ``miles-core
config``; the configuration is resolved and validated before any model loads, then the
run writes ``metrics.jsonl``, ``config.yaml`` and ``train.log`` to ``--output-dir``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from miles_core.cli.config_command import resolve_for_command


def run(argv: Sequence[str], prog: str = "miles-core train") -> int:
    config = resolve_for_command(argv, prog, training=True)

    from miles_core.launch import run_sync
    from miles_core.quiet import show_hub_libraries

    # A hub id or a real checkpoint (the pipeline, a reward model) with its download progress
    # and load warnings, at --log-level (the run log sends them to RUN_DIR/train.log too); a
    # tiny pipeline's own load is quiet (ModelFamily.load_pipeline).
    show_hub_libraries(config.log_level)
    out = run_sync(config)
    print(f"{prog}: run written to {out}", file=sys.stderr)
    return 0
