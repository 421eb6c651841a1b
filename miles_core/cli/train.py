"""``miles-core train [flags]``: a training run. Takes every flag of ``miles-core
config``; the configuration is resolved and validated before any model loads, then the
run writes ``metrics.jsonl`` and ``config.yaml`` to ``--output-dir``."""

from __future__ import annotations

import sys
from typing import Sequence

from miles_core.cli.config_command import resolve_for_command


def run(argv: Sequence[str], prog: str = "miles-core train") -> int:
    config = resolve_for_command(argv, prog, training=True)
    if config is None:
        return 2

    from miles_core.quiet import quiet_hub_libraries
    from miles_core.rollout.data import PromptDataError
    from miles_core.training.rewards import RewardError
    from miles_core.training.run import RunError, run_sync

    quiet_hub_libraries()
    try:
        out = run_sync(config)
    except (RunError, PromptDataError, RewardError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{prog}: run written to {out}", file=sys.stderr)
    return 0
