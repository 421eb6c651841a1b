"""``miles-core plan [train flags] [--json]``: the memory plan of a training run, from its
configuration files alone (nothing is loaded: the components are built on the meta
device). Takes every flag of ``train`` (recipes included) and prints, per training rank
and per engine, what each phase holds, the peak against the device's memory and, when it
does not fit, the smallest change that makes it fit (docs/guide.md, "Planning memory").
Exit 0 when the plan fits, 1 when it does not, 2 for a configuration error."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from miles_core.cli.config_command import resolve_for_command

USAGE = """usage: {prog} [train flags...] [--json]

The memory plan of the training run these flags describe (the same flags as train,
--custom-config-path recipes included), built from the checkpoint's configuration files on
the meta device: nothing is loaded, no GPU is needed.

  --json    print the plan as JSON instead of text

Without a visible GPU the plan is held against --gpu-memory-gb (default 80) and counts the
forward in bf16 when --diffusion-forward-dtype is auto (what a GPU would pick).
Exit status: 0 the plan fits, 1 it does not, 2 a configuration error."""


def run(argv: Sequence[str], prog: str = "miles-core plan") -> int:
    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE.format(prog=prog))
        return 0
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    config = resolve_for_command(args, prog, training=False)

    from miles_core.planning import plan_run
    from miles_core.planning.plan import render

    plan = plan_run(config)
    if as_json:
        json.dump(plan.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(plan))
    return 0 if plan.fits else 1
