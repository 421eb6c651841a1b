"""GPU lane, section ``train`` (``scripts/gpu_lane.sh --only train``): the training side of
an SD3.5-Medium-sized model on one GPU, as JSON and a markdown table.

The pipeline is the bench-size SD3 one (``miles-core make-tiny sd3 DIR --scale bench``)
with its transformer replaced by one of SD3.5 Medium's published shape (:data:`SD35_MEDIUM`:
24 MMDiT blocks of 24 heads x 64, SD3.5's extra image attention in blocks 0-12, RMS
query/key norm) with random weights. Its two conditioning input widths follow the bench
text encoders (the real T5-XXL and CLIP widths, 4096 and 2048, would need the real
encoders); everything inside the blocks is the real model's size.

Every case but the last is a run of ``miles-core train`` (``prepare_run`` and the run
loop, full fine-tuning, Flow-GRPO, the embedded engine, jpeg_compressibility), with the
flags of the case added:

- ``baseline``: bf16 rollout, train and step time (median over the rollouts after the
  first), peak GPU memory per phase;
- ``--offload-train``, ``--offload-rollout``, ``--fsdp-cpu-offload``: peak GPU memory per
  phase (the last rollout's: the optimizer state exists from the first step on);
- the alignment probe (``--debug-skip-optimizer-step --diffusion-debug-mode``) in bf16,
  with micro-batches that reproduce the engine's microgroups and with flat ones: the
  trainer's drift from the engine;
- ring attention at sequence-parallel size 2 when two GPUs are visible (:func:`ring_case`):
  two nccl ranks, one GPU each, split one sample's tokens of the tiny Wan 2.2 pipeline;
  their gradient against one process's in bf16, and the step time.

Peak memory per phase is ``torch.cuda.max_memory_allocated``, reset at the start of each
rollout, when training starts (``trainer.train_rollout``) and when it returns: "rollout"
covers generation, scoring and whatever the run does before training, "train" the
optimizer steps, "after" the rest of the iteration (weight sync). A case whose flag does
not take effect in this tree (a note saying it has no effect, or an error while the run is
set up) reports ``not available: <message>``; an error after the run started is
``failed: ...`` and makes the program exit with status 1 once every case has run.

``--dry-run``: the same cases on the CPU at the tiny size (the tiny SD3 pipeline with a
transformer of the same configuration scaled down), in seconds; the test suite runs it.

Usage: python bench/gpu_train.py [--out DIR] [--dry-run] [--resolution 512] [--budget-s 210]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lane.section_cli import prepare, results_folder

SD35_MEDIUM: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
"""The transformer configuration published with stabilityai/stable-diffusion-3.5-medium
(``transformer/config.json``)."""

DRY_RUN_SHAPE: dict[str, Any] = {
    "sample_size": 8,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "caption_projection_dim": 16,
    "pos_embed_max_size": 16,
    "dual_attention_layers": (0,),
}
"""What the dry run scales down (the tiny pipeline's sizes); the rest stays SD3.5 Medium's."""

PROBE = ("--debug-skip-optimizer-step", "--diffusion-debug-mode")
RING_SPLIT = ("--actor-num-nodes", "2", "--sequence-parallel-size", "2", "--ulysses-degree", "1")
"""The ring case's split: two ranks, one sequence-parallel group, ring degree 2."""
RING_MODEL = ("--fsdp-attention-backend", "_native_cudnn", "--diffusion-forward-dtype", "bf16")
"""What the ring case's ranks and its one-process reference share: cuDNN attention, which
returns the log-sum-exp the ring merges its partial results with, and bf16, which it
runs in."""
WAN_FAMILY = "wan2_2"
"""The Wan 2.2 family's registered name (the miles-wan22 plugin)."""
WAN_TINY = (
    "--diffusion-height",
    "32",
    "--diffusion-width",
    "32",
    "--diffusion-output-num-frames",
    "5",
    "--diffusion-guidance-scale",
    "1",
    "--diffusion-guidance-scale-2",
    "1",
    "--update-weight-target-module",
    "transformer,transformer_2",
)
"""The tiny Wan 2.2 run of the ring case (the wan22 plugin's own sequence-parallel check):
video tokens that 2 ranks share equally, both experts trained. Wan because its plan splits
only the video tokens (text is cross-attended whole): SD3's and Qwen-Image's joint
attention splits the prompt too, and a prompt length the ranks do not divide is padded
and masked, which the ring cannot do."""
DRIFT_KEYS = (
    "train/log_prob_max_abs_diff",
    "train/log_prob_mean_abs_diff",
    "train/model_output_max_abs_diff",
    "train/model_output_mean_abs_diff",
)
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
THINGS = ("cube", "ball", "cone", "tree", "house", "cat", "boat", "cup")


@dataclass(frozen=True)
class Shape:
    """The sizes of one run of the section."""

    scale: str
    """The ``make-tiny sd3 --scale`` of the pipeline."""
    prompts: int
    samples: int
    """Samples per prompt, also the microgroup."""
    steps: int
    sde_steps: int
    rollouts: int
    """Rollouts of the baseline and memory cases (the probe runs one)."""
    flat_micro_batch: int
    """The probe's flat ``--micro-batch-size``: pairs, not aligned with the microgroups."""


GPU_SHAPE = Shape(scale="bench", prompts=2, samples=4, steps=10, sde_steps=3, rollouts=3, flat_micro_batch=3)
DRY_SHAPE = Shape(scale="tiny", prompts=1, samples=2, steps=2, sde_steps=1, rollouts=2, flat_micro_batch=1)


@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...] = ()
    kind: str = "memory"
    """``memory`` (times and peaks), ``probe`` (drift) or ``ring`` (sequence parallelism)."""


def cases(shape: Shape) -> list[Case]:
    tile = ("--micro-batch-size-sample", str(shape.samples), "--micro-batch-size-tstep", "1")
    return [
        Case("baseline", tile),
        Case("--offload-train", ("--offload-train", *tile)),
        Case("--offload-rollout", ("--offload-rollout", *tile)),
        Case("--fsdp-cpu-offload", ("--fsdp-cpu-offload", *tile)),
        Case("probe, micro-batches = microgroups", (*PROBE, *tile), kind="probe"),
        Case("probe, flat micro-batches", (*PROBE, "--micro-batch-size", str(shape.flat_micro_batch)), kind="probe"),
        Case("ring attention, SP 2", (*RING_SPLIT, *RING_MODEL), kind="ring"),
    ]


# ---------------------------------------------------------------------------- model


def build_checkpoint(workdir: Path, shape: Shape, device: torch.device, dtype: torch.dtype, dry_run: bool) -> tuple[Path, dict[str, Any]]:
    """The ``make-tiny sd3`` pipeline of ``shape.scale`` with an SD3.5-Medium-configured
    transformer (random weights, stored in ``dtype``) in place of its own."""
    from diffusers import SD3Transformer2DModel

    from miles_sd3.family import SD3Family

    pipeline = SD3Family.build_tiny_pipeline(workdir / f"sd3-{shape.scale}", scale=shape.scale)

    def component(name: str) -> dict[str, Any]:
        return json.loads((pipeline / name / "config.json").read_text(encoding="utf-8"))

    latent = component("vae")["latent_channels"]
    config = {
        **SD35_MEDIUM,
        **(DRY_RUN_SHAPE if dry_run else {}),
        # The conditioning widths of the pipeline's own text encoders: T5's width (the CLIP
        # states are padded up to it) and the two CLIP projections, concatenated.
        "joint_attention_dim": component("text_encoder_3")["d_model"],
        "pooled_projection_dim": component("text_encoder")["projection_dim"] + component("text_encoder_2")["projection_dim"],
        "in_channels": latent,
        "out_channels": latent,
    }
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes for 2B parameters
        transformer = SD3Transformer2DModel(**config).to(dtype)
    params = sum(p.numel() for p in transformer.parameters())
    shutil.rmtree(pipeline / "transformer")
    transformer.save_pretrained(pipeline / "transformer", safe_serialization=True)
    del transformer
    _release(device)
    return pipeline, {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}, "parameters": params}


# ---------------------------------------------------------------------------- memory


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _bytes(n: int | None) -> str:
    """``n`` bytes for a table: GiB, MiB or KiB, whichever reads best."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class PhaseMemory:
    """Peak GPU memory per phase, and the tensors resident by role as each phase starts
    (the run's memory audit), from the run loop's phase callback (``on_phase``). Phases
    close in order: a rollout's "rollout" ends when its "train" begins, and so on."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.phases: list[dict[str, Any]] = []

    def __call__(self, phase: str, report: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self.phases:
                self.phases[-1]["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        device = str(self.device) if self.device.index is not None else f"{self.device.type}:0" if self.cuda else "cpu"
        resident = {role: report.resident(role, device) for role in report.by_role()}
        self.phases.append({"phase": phase, "resident_bytes": resident})

    def last_rollout(self) -> dict[str, dict[str, Any]]:
        """The phases of the last rollout: its rollout, train and sync, by name."""
        starts = [i for i, entry in enumerate(self.phases) if entry["phase"] == "rollout"]
        if not starts:
            return {}
        return {entry["phase"]: entry for entry in self.phases[starts[-1] :] if entry["phase"] in ("rollout", "train", "sync")}


# ---------------------------------------------------------------------------- cases


def _one_line(exc: BaseException) -> str:
    """A deliberate miles-core error's own message, else the exception's type and message."""
    from miles_core.errors import MilesError

    text = str(exc) if isinstance(exc, MilesError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _inert_note(config: Any, flags: tuple[str, ...]) -> str | None:
    """The configuration's note that one of ``flags`` has no effect in this run, if any."""
    named = [flag for flag in flags if flag.startswith("--")]
    for note in config.notes:
        if "has no effect" in note and any(note.startswith((f"{flag}:", f"{flag} ")) for flag in named):
            return note
    return None


async def run_case(case: Case, base: list[str], workdir: Path, shape: Shape, device: torch.device) -> dict[str, Any]:
    from miles_core.config.resolve import resolve_config
    from miles_core.training.loops import rollouts
    from miles_core.training.run import prepare_run

    result: dict[str, Any] = {"case": case.name, "kind": case.kind, "flags": list(case.flags)}
    if case.kind == "ring":
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            result["status"] = "skipped: one GPU" if device.type == "cuda" else "skipped: no GPU (CPU dry run)"
            return result
        _release(device)
        return ring_case(result, workdir / "ring")
    count = 1 if case.kind == "probe" else shape.rollouts
    slug = "".join(c if c.isalnum() else "-" for c in case.name).strip("-")
    args = [*base, *case.flags, "--num-rollout", str(count), "--output-dir", str(workdir / f"run-{slug}")]
    _release(device)
    if device.type == "cuda":
        result["resident_before_bytes"] = torch.cuda.memory_allocated(device)
    began = time.perf_counter()
    try:
        config = resolve_config(args)
    except Exception as exc:
        result["status"] = f"not available: {_one_line(exc)}"
        return result
    note = _inert_note(config, case.flags)
    if note is not None:
        result["status"] = f"not available: {note}"
        return result
    memory = PhaseMemory(device)
    try:
        run = await prepare_run(config, log=lambda line: None, progress=False, on_phase=memory)
    except Exception as exc:  # set-up refused the combination, or the feature is not there
        result["status"] = f"not available: {_one_line(exc)}"
        return result
    records: list[dict[str, Any]] = []
    try:
        async for metrics, _samples in rollouts(run):
            records.append(metrics)
    except Exception as exc:
        result["status"] = f"failed: {_one_line(exc)}"
        return result
    finally:
        await run.close()
        del run
        _release(device)
    result["status"] = "ok"
    result["seconds"] = round(time.perf_counter() - began, 2)
    timed = records[1:] or records  # the first rollout pays one-off costs
    for phase in ("rollout", "train", "step"):
        result[f"{phase}_s"] = round(statistics.median(r[f"perf/{phase}_time"] for r in timed), 4)
    last = memory.last_rollout()
    result["peak_bytes"] = {phase: entry.get("peak_bytes") for phase, entry in last.items()}
    result["resident_bytes"] = {phase: entry["resident_bytes"] for phase, entry in last.items()}
    if case.kind == "probe":
        first = records[0]
        result["drift"] = {key.removeprefix("train/"): first.get(key) for key in DRIFT_KEYS}
        ratio = first.get("train/ratio_mean", (first.get("train/ratio_mean_per_step") or [None])[0])
        result["drift"]["first_ratio"] = ratio
    return result


def _crash_status(crash: str) -> str:
    """The status of a rank's traceback: a configuration the rank refused while setting up
    (a ``ConfigError``) is ``not available``, anything else ``failed``."""
    last = next((line for line in reversed(crash.strip().splitlines()) if line.strip()), crash)
    kind, _, message = last.partition(": ")
    if kind.rsplit(".", 1)[-1] == "ConfigError":
        return f"not available: {' '.join(message.split())}"
    return f"failed: {' '.join(last.split())}"


def ring_case(
    result: dict[str, Any],
    workdir: Path,
    split: tuple[str, ...] = RING_SPLIT,
    model: tuple[str, ...] = RING_MODEL,
    backend: str = "nccl",
) -> dict[str, Any]:
    """Ring attention over two GPUs, without Ray: the tiny Wan 2.2 pipeline (``miles-core
    make-tiny wan2_2``), one rollout sampled here, then one optimizer step of it (full
    fine-tuning at lr 0, :mod:`miles_core.sequence_parallel_checks`) in this process and on
    two ``torch.multiprocessing`` ranks (``backend``: nccl, one GPU each) that split each
    sample's tokens by ``split``, both with ``model``. Reports the ranks' reduced gradient
    against this process's, relative to its largest element (``gradient_error``; bf16 and
    another order of summation, so not zero), the same with every attention made local
    (``control_gradient_error``: what a broken split looks like), the loss difference, and
    the step time of each (the second step of each: the first pays cuDNN's and NCCL's
    set-up). ``not available`` when the wan22 plugin is not installed or a rank refuses
    the configuration."""
    from miles_core import sequence_parallel_checks as checks
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import InputError
    from miles_core.plugin_manager import get_host

    began = time.perf_counter()
    families = get_host().registries.model_family
    if WAN_FAMILY not in families:
        result["status"] = f"not available: {families.unknown_message(WAN_FAMILY)}"
        return result
    try:
        family = families.get(WAN_FAMILY).load()
        tiny = family.build_tiny_pipeline(workdir / "wan22-tiny")
        args = checks.check_args(tiny, workdir / "run", *WAN_TINY, *model, family=WAN_FAMILY)
        config = resolve_config(args)
    except Exception as exc:
        result["status"] = f"not available: {_one_line(exc)}"
        return result
    result["model"] = "tiny Wan 2.2 (make-tiny wan2_2), 32x32, 5 frames, 1 prompt x 2 samples, both experts trained"
    try:
        rollout = checks.make_rollout(args)
        checks.train_once(config, rollout)  # warm-up
        reference = checks.train_once(config, rollout)
    except InputError as exc:
        result["status"] = f"not available: {_one_line(exc)}"
        return result
    except Exception as exc:
        result["status"] = f"failed: {_one_line(exc)}"
        return result
    ranks = [*args, *split]
    scenarios = {"warm-up": ranks, "split": ranks, "local-attention": [*ranks, checks.LOCAL_ATTENTION]}
    runs = checks.run_ranks(2, scenarios, rollout, workdir / "ranks", backend=backend)
    for results in runs.values():
        crashes = [r["crash"] for r in results if "crash" in r]
        if crashes:
            # A rank that stopped first has the traceback; the other says "no result".
            result["status"] = _crash_status(max(crashes, key=len))
            return result
    split_runs, control = runs["split"], runs["local-attention"]
    loss = reference["metrics"]["train/loss"]
    result["status"] = "ok"
    result["seconds"] = round(time.perf_counter() - began, 2)
    result["step_s"] = round(max(r["train_s"] for r in split_runs), 4)  # the slowest rank ends the step
    result["reference_step_s"] = round(reference["train_s"], 4)
    result["gradient_error"] = max(checks.gradient_error(r["gradients"], reference["gradients"]) for r in split_runs)
    result["control_gradient_error"] = min(checks.gradient_error(r["gradients"], reference["gradients"]) for r in control)
    result["loss_abs_diff"] = max(abs(r["metrics"]["train/loss"] - loss) for r in split_runs)
    return result


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value else f"{value:.{digits}f}"
    return str(value)


def _size(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.2f}M"


def markdown(report: dict[str, Any]) -> str:
    dtype = report["transformer"]["dtype"]
    lines = [
        f"GPU lane, train: {report['device']}, torch {report['torch']}, SD3.5-Medium-shaped transformer of "
        f"{_size(report['transformer']['parameters'])} parameters ({dtype}), {report['resolution']}, {report['shape']}",
        "",
        "| case | status | rollout s | train s | step s | peak, rollout | peak, train | peak, sync | grads + optimizer in rollout |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        if case["kind"] != "memory":
            continue
        peak = case.get("peak_bytes", {})
        held = case.get("resident_bytes", {}).get("rollout")
        trainer_state = None if held is None else held["gradients"] + held["optimizer_state"]
        lines.append(
            f"| {case['case']} | {case['status']} | {_fmt(case.get('rollout_s'))} | {_fmt(case.get('train_s'))} | {_fmt(case.get('step_s'))} "
            f"| {_bytes(peak.get('rollout'))} | {_bytes(peak.get('train'))} | {_bytes(peak.get('sync'))} | {_bytes(trainer_state)} |"
        )
    lines += [
        "",
        f"| alignment probe ({dtype}) | status | log-prob max | log-prob mean | model output max | model output mean | first ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        if case["kind"] != "probe":
            continue
        drift = case.get("drift", {})
        lines.append(
            f"| {case['case'].removeprefix('probe, ')} | {case['status']} | {_fmt(drift.get('log_prob_max_abs_diff'))} "
            f"| {_fmt(drift.get('log_prob_mean_abs_diff'))} | {_fmt(drift.get('model_output_max_abs_diff'))} "
            f"| {_fmt(drift.get('model_output_mean_abs_diff'))} | {_fmt(drift.get('first_ratio'), 9)} |"
        )
    for case in report["cases"]:
        if case["kind"] != "ring":
            continue
        lines += [
            "",
            "| ring attention | status | step s | one process, step s | gradient error vs one process | control (local attention) | loss diff |",
            "|---|---|---|---|---|---|---|",
            f"| {case['case'].removeprefix('ring attention, ')}, tiny Wan 2.2 | {case['status']} "
            f"| {_fmt(case.get('step_s'))} | {_fmt(case.get('reference_step_s'))} | {_fmt(case.get('gradient_error'))} "
            f"| {_fmt(case.get('control_gradient_error'))} | {_fmt(case.get('loss_abs_diff'))} |",
        ]
    lines += ["", f"section took {report['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "train.md").write_text(markdown(report), encoding="utf-8")


# ---------------------------------------------------------------------------- main


async def section(out: Path, dry_run: bool, resolution: int | None, budget_s: float) -> int:
    from miles_core.machine import visible_gpu_count

    began = time.perf_counter()
    cuda = torch.cuda.is_available() and not dry_run
    if cuda and not visible_gpu_count():
        # The run places its model by the GPUs the driver lists; none listed would train on the CPU.
        print("gpu_train.py: torch sees a GPU but miles-core does not (/proc/driver/nvidia/gpus, CUDA_VISIBLE_DEVICES)", file=sys.stderr)
        return 1
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = DRY_SHAPE if dry_run else GPU_SHAPE
    with tempfile.TemporaryDirectory(prefix="gpu-lane-train-") as tmp:
        workdir = Path(tmp)
        checkpoint, transformer = build_checkpoint(workdir, shape, device, dtype, dry_run)
        transformer["dtype"] = "bf16" if cuda else "fp32"
        prompts = workdir / "prompts.jsonl"
        prompts.write_text(
            "".join(
                f'{{"input": "a {a} {thing} next to a {b} {other}"}}\n'
                for a, thing in zip(COLORS, THINGS)
                for b in COLORS
                for other in THINGS
            ),
            encoding="utf-8",
        )
        base = [
            "--hf-checkpoint",
            str(checkpoint),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            str(shape.prompts),
            "--n-samples-per-prompt",
            str(shape.samples),
            "--rollout-microgroup-size",
            str(shape.samples),
            "--diffusion-num-steps",
            str(shape.steps),
            "--diffusion-num-sde-steps",
            str(shape.sde_steps),
            "--rm-type",
            "jpeg_compressibility",
            "--diffusion-forward-dtype",
            "bf16" if cuda else "fp32",
        ]
        if resolution is not None:
            base += ["--diffusion-height", str(resolution), "--diffusion-width", str(resolution)]
        report: dict[str, Any] = {
            "section": "train",
            "dry_run": dry_run,
            "device": torch.cuda.get_device_name(device) if cuda else "CPU",
            "gpus": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__,
            "transformer": transformer,
            "resolution": f"{resolution}x{resolution}" if resolution else "the pipeline's native size",
            "shape": f"{shape.prompts} prompts x {shape.samples} samples (microgroup {shape.samples}), {shape.steps} steps "
            f"({shape.sde_steps} SDE), full fine-tuning, {shape.rollouts} rollouts per timed case",
            "run_flags": base[6:],
            "cases": [],
            "elapsed_s": 0.0,
        }
        for case in cases(shape):
            elapsed = time.perf_counter() - began
            if elapsed > budget_s:
                result = {
                    "case": case.name,
                    "kind": case.kind,
                    "flags": list(case.flags),
                    "status": f"skipped: the section's {budget_s:.0f} s budget is spent",
                }
            else:
                result = await run_case(case, base, workdir, shape, device)
            report["cases"].append(result)
            report["elapsed_s"] = round(time.perf_counter() - began, 1)
            print(f"{case.name}: {result['status']} ({report['elapsed_s']:.0f} s)", flush=True)
            _write(out, report)
    print()
    print(markdown(report), end="")
    return 1 if any(case["status"].startswith("failed") for case in report["cases"]) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for train.json and train.md (default: $OUT, else a new temporary folder)"
    )
    parser.add_argument("--dry-run", action="store_true", help="the tiny size on the CPU, in seconds")
    parser.add_argument(
        "--resolution", type=int, default=None, help="image side in pixels (default: 512 on a GPU, the tiny pipeline's in a dry run)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="start no case after this many seconds (default 210: the section stays under 4 minutes)",
    )
    args = parser.parse_args()
    prepare(args.dry_run)
    out = results_folder(args.out)
    resolution = args.resolution if args.resolution is not None else (None if args.dry_run else 512)
    status = asyncio.run(section(out, args.dry_run, resolution, args.budget_s))
    print(f"results: {out / 'train.json'}, {out / 'train.md'}")
    sys.exit(status)


if __name__ == "__main__":
    main()
