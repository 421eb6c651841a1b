"""``--compile`` (regional torch.compile of the transformer's repeated blocks): compile
time, and eager vs compiled seconds per rollout for generation and the train step, side
by side in one process. Also the GPU lane's section ``compile`` (``scripts/gpu_lane.sh
--only compile``).

Each mode is a run of ``miles-core train`` (Flow-GRPO with LoRA on the embedded engine,
``brightness`` reward, fp32 on a CPU and bf16 on a GPU), eager first, then with
``--compile``. The steady state is the median of ``perf/rollout_time``,
``perf/train_time`` and ``perf/step_time`` over the rollouts after the first; the
compile time is what the compiled run's first rollout takes beyond its steady state,
minus the same excess of the eager run (first-call costs both pay), per phase. Also
reported: the graphs dynamo compiled and the first step's log-prob drift between engine
and trainer (``train/log_prob_max_abs_diff``) in both modes.

Sizes: 2 prompts x 8 samples per rollout in microgroups of 8 (the trainer's micro-batch
8 samples x 1 step), 8 denoising steps of which 7 are SDE steps, no CFG, SD3's T5 length
256, LoRA rank 16 (alpha 16), 5 rollouts per mode; on a CPU the tiny SD3 pipeline
(``miles-core make-tiny sd3``, 64x64) in fp32, on a GPU the larger one of
``--scale bench`` (a transformer of about 20M parameters, 128x128) in bf16.
``--dry-run`` (the lane's, and the test suite's smoke round): the tiny pipeline on the
CPU, 1 prompt x 2 samples, 3 steps of which 2 SDE steps, LoRA rank 4, 2 rollouts without
optimizer steps (so no grad-mode graphs), the shapes of the compile tests
(tests/test_compile.py), so a warm inductor cache serves it; ``--rollouts``,
``--prompts``, ``--n`` and ``--steps`` override either shape.

Usage: python bench/compile.py [--out DIR] [--dry-run] [--rollouts N] [--prompts N]
[--n N] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lane.section_cli import prepare, results_folder

PHASES = ("rollout", "train", "step")


@dataclass(frozen=True)
class Shape:
    scale: str
    prompts: int
    samples: int
    """Samples per prompt, also the microgroup and the trainer's micro-batch of samples."""
    steps: int
    sde_steps: int
    rollouts: int
    lora_rank: int


CPU_SHAPE = Shape(scale="tiny", prompts=2, samples=8, steps=8, sde_steps=7, rollouts=5, lora_rank=16)
GPU_SHAPE = Shape(scale="bench", prompts=2, samples=8, steps=8, sde_steps=7, rollouts=5, lora_rank=16)
DRY_SHAPE = Shape(scale="tiny", prompts=1, samples=2, steps=3, sde_steps=2, rollouts=2, lora_rank=4)


def run_args(checkpoint: Path, out: Path, shape: Shape, *, gpu: bool, dry_run: bool) -> list[str]:
    tile = ("--micro-batch-size-sample", str(shape.samples), "--micro-batch-size-tstep", "1")
    if dry_run:
        # The compile tests' shapes and grad mode (no optimizer step: the trainer's forward
        # records no gradients), so one inductor cache serves both; a cold compile of the
        # grad-mode graphs would cost the suite about a minute.
        from miles_core.family_checks import tiny_train_args

        # The shape's values (the compile tests' unless overridden on the command line)
        # replace tiny_train_args' own: a repeated flag overrides.
        sizes = (
            "--rollout-batch-size", str(shape.prompts), "--n-samples-per-prompt", str(shape.samples),
            "--rollout-microgroup-size", str(shape.samples), "--diffusion-num-steps", str(shape.steps),
            "--diffusion-num-sde-steps", str(shape.sde_steps), "--lora-rank", str(shape.lora_rank),
        )  # fmt: skip
        return tiny_train_args(checkpoint, out, *sizes, "--num-rollout", str(shape.rollouts), *tile, "--debug-skip-optimizer-step")
    prompts = out / "prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    colors = ("red", "blue", "green", "yellow")
    prompts.write_text("".join(json.dumps({"input": f"a {c} cube"}) + "\n" for c in colors), encoding="utf-8")
    return [
        "--hf-checkpoint", str(checkpoint), "--diffusion-model-family", "sd3", "--prompt-data", str(prompts),
        "--rollout-batch-size", str(shape.prompts), "--n-samples-per-prompt", str(shape.samples),
        "--rollout-microgroup-size", str(shape.samples), "--diffusion-num-steps", str(shape.steps),
        "--diffusion-num-sde-steps", str(shape.sde_steps), "--diffusion-guidance-scale", "1", *tile,
        "--rm-type", "brightness", "--use-lora", "--lora-rank", str(shape.lora_rank), "--lora-alpha", str(shape.lora_rank),
        "--num-rollout", str(shape.rollouts), "--diffusion-forward-dtype", "bf16" if gpu else "fp32",
        "--output-dir", str(out),
    ]  # fmt: skip


def measure(args: list[str]) -> dict[str, Any]:
    """Train with ``args``; the per-rollout phase times, the graphs compiled and the first
    rollout's drift."""
    from miles_core.config.resolve import resolve_config
    from miles_core.regional_compile import graph_count
    from miles_core.training.run import train

    graphs = graph_count()
    began = time.perf_counter()
    path = asyncio.run(train(resolve_config(args), log=lambda line: None))
    wall = time.perf_counter() - began
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    times = {phase: [float(r[f"perf/{phase}_time"]) for r in records] for phase in PHASES}
    return {
        "wall_s": round(wall, 3),
        "graphs": graph_count() - graphs,
        "first_s": {phase: round(values[0], 4) for phase, values in times.items()},
        "steady_s": {phase: round(statistics.median(values[1:]), 4) for phase, values in times.items()},
        "first_rollout_drift": records[0].get("train/log_prob_max_abs_diff"),
    }


def section(out: Path, shape: Shape, *, gpu: bool, dry_run: bool) -> dict[str, Any]:
    from miles_sd3.family import SD3Family

    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    checkpoint = SD3Family.build_tiny_pipeline(work / f"sd3-{shape.scale}", scale=shape.scale)
    base = run_args(checkpoint, work / "eager", shape, gpu=gpu, dry_run=dry_run)
    eager = measure(base)
    compiled = measure([*run_args(checkpoint, work / "compiled", shape, gpu=gpu, dry_run=dry_run), "--compile"])
    compile_s = {
        phase: round((compiled["first_s"][phase] - compiled["steady_s"][phase]) - (eager["first_s"][phase] - eager["steady_s"][phase]), 3)
        for phase in PHASES
    }
    ratios = {phase: round(compiled["steady_s"][phase] / eager["steady_s"][phase], 3) for phase in PHASES}
    return {
        "device": torch.cuda.get_device_name(0) if gpu else "CPU",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": shape.__dict__,
        "eager": eager,
        "compiled": compiled,
        "compile_s": compile_s,
        "compiled_over_eager": ratios,
    }


def markdown(result: dict[str, Any]) -> str:
    eager, compiled = result["eager"], result["compiled"]
    lines = [
        f"compile: {result['device']}, torch {result['torch']}, {result['threads']} threads, shape {result['shape']}",
        "",
        "| phase | eager s | compiled s | compiled / eager | compile s (first rollout's excess) |",
        "|---|---|---|---|---|",
    ]
    for phase in PHASES:
        lines.append(
            f"| {phase} | {eager['steady_s'][phase]} | {compiled['steady_s'][phase]} | "
            f"{result['compiled_over_eager'][phase]}x | {result['compile_s'][phase]} |"
        )
    lines += [
        "",
        f"graphs compiled: {compiled['graphs']}; first-rollout log-prob drift engine vs trainer: "
        f"eager {eager['first_rollout_drift']}, compiled {compiled['first_rollout_drift']}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for compile.json and compile.md (default: $OUT, else a new temporary folder)"
    )
    parser.add_argument("--dry-run", action="store_true", help="the compile tests' tiny shape on the CPU, one thread (the smoke round)")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts per mode, the first one compiles (default 5; 2 in a dry run)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default 2)")
    parser.add_argument("--n", type=int, default=None, help="samples per prompt, also the microgroup (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps, all but the last SDE steps (default 8)")
    args = parser.parse_args()
    prepare(args.dry_run)
    gpu = torch.cuda.is_available() and not args.dry_run
    shape = DRY_SHAPE if args.dry_run else (GPU_SHAPE if gpu else CPU_SHAPE)
    overrides = {"rollouts": args.rollouts, "prompts": args.prompts, "samples": args.n, "steps": args.steps}
    values = {**shape.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    if args.steps is not None:
        values["sde_steps"] = max(1, args.steps - 1)
    shape = Shape(**values)
    if shape.rollouts < 2:
        parser.error("--rollouts must be at least 2 (the first one compiles)")
    out = results_folder(args.out)
    result = {"dry_run": args.dry_run, **section(out, shape, gpu=gpu, dry_run=args.dry_run)}
    (out / "compile.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = markdown(result)
    (out / "compile.md").write_text(text, encoding="utf-8")
    print(text)
    print("ratio compiled / eager (steady state): " + ", ".join(f"{p} {result['compiled_over_eager'][p]}x" for p in PHASES))
    print(f"results: {out / 'compile.json'}, {out / 'compile.md'}")
    sys.exit(0)


if __name__ == "__main__":
    main()
