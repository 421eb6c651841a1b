"""The memory plan against the peak measured on this machine (docs/benchmarks.md, "Memory
plan against measured peaks").

For each case, a configuration-only copy of a real checkpoint at reduced depth (every block
stack, the text encoders' included, cut to one block; widths as published:
:func:`miles_core.planning.accuracy.reduced_checkpoint`) is planned
(:func:`miles_core.planning.plan_run`, as ``train`` plans it on this CPU: fp32) and then run
for real with weights of a constant value: the pipeline built, the run's trainer, a training
micro-batch, the optimizer step and a second micro-batch, under ``torch.profiler``
(:func:`miles_core.planning.accuracy.measured_peak`). Printed side by side: the plan's
``train`` phase and the measured peak, and the part above what the build leaves (optimizer
state, gradients, the step), each with its ratio planned / measured.

Usage: python bench/plan_accuracy.py [--smoke] [--json PATH]
(``--smoke``: the tiny SD3 pipeline instead of the real configurations: seconds.)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "plugins"
CASES = (
    ("SD3.5-Medium", REAL / "miles-sd3/tests/data/real_checkpoints/stable-diffusion-3.5-medium", 1, ("--diffusion-guidance-scale", "1")),
    ("SD3.5-Medium", REAL / "miles-sd3/tests/data/real_checkpoints/stable-diffusion-3.5-medium", 2, ("--diffusion-guidance-scale", "1")),
    ("FLUX.1-dev", REAL / "miles-flux/tests/data/real_checkpoints/FLUX.1-dev", 1, ()),
)
"""(name, configuration folder, micro-batch, extra flags): 64x64, one block per stack."""


def _config(checkpoint: Path, micro_batch: int, extra: tuple[str, ...]):
    from miles_core.config.resolve import resolve_config

    args = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1", "--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "2"]
    args += ["--use-lora", "--micro-batch-size", str(micro_batch), "--diffusion-height", "64", "--diffusion-width", "64", *extra]
    return resolve_config(args)


def measure(name: str, checkpoint: Path, micro_batch: int, extra: tuple[str, ...]) -> dict:
    from miles_core.planning import plan_run
    from miles_core.planning.accuracy import measured_peak

    config = _config(checkpoint, micro_batch, extra)
    start = time.perf_counter()
    plan = plan_run(config, training=True)
    plan_s = time.perf_counter() - start
    train = next(phase for phase in plan.rank if phase.name == "train")
    static = sum(t.nbytes for t in train.terms if t.name.endswith(" weights") or t.name in ("trainable", "master copies"))
    start = time.perf_counter()
    measured = measured_peak(config)
    run_s = time.perf_counter() - start
    return {
        "case": name,
        "micro_batch": micro_batch,
        "planned": train.nbytes,
        "measured": measured["peak"],
        "planned_above_build": train.nbytes - static,
        "measured_above_build": measured["peak"] - measured["built"],
        "plan_s": plan_s,
        "run_s": run_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny SD3 pipeline instead of the real configurations")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from miles_core.planning.accuracy import reduced_checkpoint
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.smoke:
            tiny = Path(scratch) / "tiny-sd3"
            subprocess.run([sys.executable, "-m", "miles_core.cli.main", "make-tiny", "sd3", str(tiny)], check=True, capture_output=True)
            cases = [("tiny SD3", tiny, 2, ("--diffusion-guidance-scale", "1"))]
        else:
            cases = [
                (n, reduced_checkpoint(src, Path(scratch) / f"{n}-{i}", depth=1), mb, extra) for i, (n, src, mb, extra) in enumerate(CASES)
            ]
        for case in cases:
            rows.append(measure(*case))
    print(
        f"{'case':<14} {'mb':>3} {'planned MiB':>12} {'measured MiB':>13} {'ratio':>6}   {'above build':>11} {'measured':>9} {'ratio':>6}"
    )
    for row in rows:
        whole = row["planned"] / row["measured"]
        above = row["planned_above_build"] / max(1, row["measured_above_build"])
        print(
            f"{row['case']:<14} {row['micro_batch']:>3} {row['planned'] / 2**20:>12.1f} {row['measured'] / 2**20:>13.1f} {whole:>5.3f}x"
            f"   {row['planned_above_build'] / 2**20:>11.1f} {row['measured_above_build'] / 2**20:>9.1f} {above:>5.3f}x"
        )
    print("ratio = planned / measured (1.000x: the plan is the measured peak)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
