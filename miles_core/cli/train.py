"""``miles-core train [flags]``: a training run. Takes every flag of ``miles-core
config``; the configuration is resolved and validated before any model loads, then the
run writes ``metrics.jsonl`` and ``config.yaml`` to ``--output-dir``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from miles_core.cli.config_command import resolve_for_command


def run(argv: Sequence[str], prog: str = "miles-core train") -> int:
    config = resolve_for_command(argv, prog, training=True)

    from miles_core.launch import run_sync
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()
    out = run_sync(config)
    print(f"{prog}: run written to {out}", file=sys.stderr)
    return 0
