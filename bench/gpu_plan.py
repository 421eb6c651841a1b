"""GPU lane, section ``plan`` (``scripts/gpu_lane.sh --only plan``): the memory plan against
``torch.cuda.max_memory_allocated`` on one GPU, at real width and reduced depth.

For each case a configuration-only copy of a real checkpoint with every block stack cut to
two blocks (widths as published: :func:`miles_core.planning.accuracy.reduced_checkpoint`) is
planned as ``train`` plans it on this machine (the GPU's memory, bf16, torch's multi-tensor
AdamW) and then run for real on the GPU with weights of a constant value: the pipeline, the
run's trainer, a training micro-batch, the optimizer step and a second micro-batch
(:func:`miles_core.planning.accuracy.measured_peak`). Reported per case: the plan's ``train``
phase, the profiler's peak allocator total and ``torch.cuda.max_memory_allocated`` over the
same span, and the ratios planned / measured; with and without gradient checkpointing.

``--dry-run``: the tiny SD3 pipeline on the CPU (the profiler's totals only), in seconds.

Usage: python bench/gpu_plan.py [--out DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from lane.section_cli import prepare, results_folder

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "plugins"
SQUARE_512 = ("--diffusion-height", "512", "--diffusion-width", "512")
CASES = (
    ("SD3.5-Medium, 512x512", REAL / "miles-sd3/tests/data/real_checkpoints/stable-diffusion-3.5-medium", SQUARE_512),
    ("FLUX.1-dev, 512x512", REAL / "miles-flux/tests/data/real_checkpoints/FLUX.1-dev", SQUARE_512),
    (
        "Wan 2.2 TI2V-5B, 480x832x33",
        REAL / "miles-wan22/tests/data/real_checkpoints/Wan2.2-TI2V-5B-Diffusers",
        ("--diffusion-height", "480", "--diffusion-width", "832", "--diffusion-output-num-frames", "33"),
    ),
)


def _config(checkpoint: Path, extra: tuple[str, ...], checkpointing: bool, dry_run: bool):
    from miles_core.config.resolve import resolve_config

    args = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1", "--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "2"]
    args += ["--use-lora", "--micro-batch-size", "1", *extra]
    if dry_run:
        args += ["--diffusion-height", "64", "--diffusion-width", "64", "--diffusion-guidance-scale", "1"]
    if checkpointing:
        args.append("--gradient-checkpointing")
    return resolve_config(args)


def run_case(name: str, checkpoint: Path, extra: tuple[str, ...], checkpointing: bool, dry_run: bool) -> dict:
    from miles_core.planning import plan_run
    from miles_core.planning.accuracy import measured_peak

    config = _config(checkpoint, extra, checkpointing, dry_run)
    train = next(phase for phase in plan_run(config, training=True).rank if phase.name == "train")
    device = "cpu" if dry_run else "cuda"
    measured = measured_peak(config, device=device)
    row = {"case": name, "gradient_checkpointing": checkpointing, "planned": train.nbytes, **measured}
    row["ratio_profiler"] = train.nbytes / max(1, measured["peak"])
    if "max_memory_allocated" in measured:
        row["ratio_max_memory_allocated"] = train.nbytes / max(1, measured["max_memory_allocated"])
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="gpu_plan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for plan.json and plan.md (default: $OUT, else a new temporary folder)"
    )
    parser.add_argument("--dry-run", action="store_true", help="the tiny SD3 pipeline on the CPU")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_plan.py: needs CUDA (torch sees no GPU); nothing measured. --dry-run runs the same steps on the CPU")
        return
    prepare(args.dry_run)
    out = results_folder(args.out)
    from miles_core.planning.accuracy import reduced_checkpoint

    rows, status = [], 0
    with tempfile.TemporaryDirectory() as scratch:
        if args.dry_run:
            tiny = Path(scratch) / "tiny-sd3"
            subprocess.run([sys.executable, "-m", "miles_core.cli.main", "make-tiny", "sd3", str(tiny)], check=True, capture_output=True)
            cases = [("tiny SD3", tiny, ())]
        else:
            cases = [
                (name, reduced_checkpoint(src, Path(scratch) / f"case{i}", depth=2), extra) for i, (name, src, extra) in enumerate(CASES)
            ]
        for name, checkpoint, extra in cases:
            for checkpointing in (False, True):
                try:
                    rows.append(run_case(name, checkpoint, extra, checkpointing, args.dry_run))
                except Exception as exc:  # a case that breaks is reported; the others still run
                    rows.append({"case": name, "gradient_checkpointing": checkpointing, "failed": f"{type(exc).__name__}: {exc}"})
                    status = 1
    (out / "plan.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "| case | gradient checkpointing | planned GiB | profiler peak GiB | max_memory_allocated GiB | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['case']} | {row['gradient_checkpointing']} | failed: {row['failed']} | | | |")
            continue
        mma = row.get("max_memory_allocated")
        ratio = row.get("ratio_max_memory_allocated", row["ratio_profiler"])
        lines.append(
            f"| {row['case']} | {row['gradient_checkpointing']} | {row['planned'] / 2**30:.3f} | {row['peak'] / 2**30:.3f} | "
            f"{'-' if mma is None else f'{mma / 2**30:.3f}'} | {ratio:.3f}x |"
        )
    (out / "plan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("ratio = planned / measured")
    print(f"results: {out / 'plan.json'}, {out / 'plan.md'}")
    sys.exit(status)


if __name__ == "__main__":
    main()
