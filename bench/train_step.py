"""Time of one training step (rollout, reward, train, weight sync), against the pure
model compute inside it, at two sizes of SD3 pipeline, measured side by side in one run.

A step is one iteration of the real run loop (:func:`miles_core.training.run.prepare_run`
and :func:`miles_core.training.loops.rollouts`, as ``miles-core train`` runs it): LoRA, Flow-GRPO, the embedded engine,
jpeg_compressibility. Each step is split into its phases (the loop's own ``perf/*``
timings; "loop" is the rest of the iteration). Forward hooks on the transformer and the
VAE decoder record every model call of a step (inputs, batch shape, with or without
gradients); after each step the benchmark replays one call of each kind directly on the
loaded modules (a gradient-enabled call is timed with its backward), round robin with
the steps, and takes medians. Pure model compute per step = sum over kinds of
(calls per step x median time per call); it counts the transformer's forwards and
backwards and the VAE decodes, nothing else (text encoders, SDE steps, rewards,
collation, optimizer: overhead). One torch thread.

Sizes: ``tiny`` (``miles-core make-tiny sd3``, 64x64) and ``bench`` (``--scale bench``,
a ~20M-parameter transformer, 128x128). Prints a table per size and the ratio
total step time / pure model compute (target at bench size: at most 1.15).

Usage: python bench/train_step.py [--repeats 9] [--bench-repeats 3] [--sizes tiny,bench]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
THINGS = ("cube", "ball", "cone", "tree", "house", "cat", "boat", "cup")
RUN_FLAGS = (
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "8",
    "--rollout-microgroup-size",
    "8",
    "--diffusion-num-steps",
    "10",
    "--diffusion-num-sde-steps",
    "3",
    "--micro-batch-size-sample",
    "8",
    "--micro-batch-size-tstep",
    "1",
    "--num-steps-per-rollout",
    "2",
    "--use-lora",
    "--rm-type",
    "jpeg_compressibility",
)
PHASES = ("rollout", "reward", "train", "weight sync", "loop")


def _detached(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _batch(args: tuple, kwargs: dict) -> int:
    first = args[0] if args else kwargs.get("hidden_states")
    return int(first.shape[0])


class CallRecorder:
    """Counts the model calls of a step by kind (module, grad on/off, batch) and keeps
    the inputs of the first call of each kind, to replay."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.modules = modules
        self.counts: Counter = Counter()
        self.inputs: dict[tuple, tuple[tuple, dict]] = {}
        self.active = True
        for name, module in modules.items():
            module.register_forward_pre_hook(self._hook(name), with_kwargs=True)

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            if self.active:
                key = (name, torch.is_grad_enabled(), _batch(args, kwargs))
                self.counts[key] += 1
                if key not in self.inputs:
                    self.inputs[key] = (_detached(args), _detached(kwargs))

        return hook

    def replay(self, key: tuple) -> float:
        """Seconds of one call of this kind on the loaded module (with its backward when
        the step ran it with gradients)."""
        name, grad, _ = key
        module = self.modules[name]
        args, kwargs = self.inputs[key]
        self.active = False
        try:
            start = time.perf_counter()
            with torch.set_grad_enabled(grad):
                out = module(*args, **kwargs)
                if grad:
                    out = out[0] if isinstance(out, (tuple, list)) else out
                    out.backward(torch.ones_like(out))
            return time.perf_counter() - start
        finally:
            self.active = True


def _label(key: tuple) -> str:
    name, grad, batch = key
    if name == "transformer":
        return f"transformer {'forward+backward' if grad else 'forward'}, batch {batch}"
    return f"VAE decode, batch {batch}"


async def measure(size: str, workdir: Path, prompts: Path, repeats: int, warmup: int, calls_per_round: int) -> dict[str, Any]:
    from miles_core.config.resolve import resolve_config
    from miles_core.training.loops import rollouts
    from miles_core.training.run import prepare_run
    from miles_sd3.family import SD3Family

    checkpoint = SD3Family.build_tiny_pipeline(workdir / size, scale=size)
    total = warmup + repeats
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(checkpoint),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(prompts),
            *RUN_FLAGS,
            "--num-rollout",
            str(total),
            "--output-dir",
            str(workdir / f"run-{size}"),
        ]
    )
    # The run as `miles-core train` builds it (an RL run on the embedded engine), stepped here.
    run = await prepare_run(config, log=lambda line: None, progress=False)
    engine, trainer = run.engine, run.trainer
    loop = rollouts(run)

    pipe = engine.family.pipeline
    recorder = CallRecorder({"transformer": pipe.transformer, "vae": pipe.vae.decoder})
    steps: list[dict[str, float]] = []
    per_call: dict[tuple, list[float]] = {}
    counts: Counter | None = None
    try:
        for round_ in range(total):
            recorder.counts = Counter()
            start = time.perf_counter()
            metrics, _samples = await loop.__anext__()
            wall = time.perf_counter() - start
            if counts is None:
                counts = recorder.counts
            elif recorder.counts != counts:
                raise RuntimeError(f"model calls changed between steps: {dict(counts)} vs {dict(recorder.counts)}")
            for key in counts:
                times = [recorder.replay(key) for _ in range(calls_per_round)]
                trainer.optimizer.zero_grad(set_to_none=True)  # the replayed backwards' gradients
                if round_ >= warmup:
                    per_call.setdefault(key, []).extend(times)
            if round_ >= warmup:
                rollout, reward, train = (metrics[f"perf/{k}_time"] for k in ("rollout", "reward", "train"))
                steps.append(
                    {
                        "rollout": rollout,
                        "reward": reward,
                        "train": train,
                        "weight sync": metrics["perf/step_time"] - rollout - reward - train,
                        "loop": wall - metrics["perf/step_time"],
                        "total": wall,
                    }
                )
    finally:
        await loop.aclose()
        await run.close()
    assert counts is not None
    call_time = {key: statistics.median(values) for key, values in per_call.items()}
    model = {phase: 0.0 for phase in (*PHASES, "total")}
    for key, count in counts.items():
        grad = key[1]
        phase = "train" if grad else "rollout"  # no-grad forwards and decodes: the engine's
        model[phase] += count * call_time[key]
        model["total"] += count * call_time[key]
    wall = {phase: statistics.median(step[phase] for step in steps) for phase in (*PHASES, "total")}
    params = sum(p.numel() for n, p in pipe.transformer.named_parameters() if "lora_" not in n)
    return {
        "size": size,
        "params": params,
        "wall": wall,
        "model": model,
        "counts": counts,
        "call_time": call_time,
        "repeats": repeats,
        "resolution": f"{config.diffusion_height}x{config.diffusion_width}",
        "warmup": warmup,
        "totals": [step["total"] for step in steps],
    }


def report(result: dict[str, Any]) -> None:
    wall, model = result["wall"], result["model"]
    print(
        f"\n{result['size']} SD3 ({result['resolution']}, transformer {result['params'] / 1e6:.2f}M parameters), "
        f"median of {result['repeats']} steps after {result['warmup']} warm-up (interleaved with the model calls)"
    )
    print(f"{'phase':<13}{'step ms':>10}{'model ms':>10}{'other ms':>10}")
    for phase in (*PHASES, "total"):
        print(f"{phase:<13}{wall[phase] * 1000:>10.1f}{model[phase] * 1000:>10.1f}{(wall[phase] - model[phase]) * 1000:>10.1f}")
    print("model calls per step (median ms per call):")
    for key, count in sorted(result["counts"].items(), key=lambda kv: str(kv[0])):
        print(f"  {count:>3} x {_label(key)}: {result['call_time'][key] * 1000:.1f} ms")
    print("step totals (s): " + ", ".join(f"{t:.2f}" for t in result["totals"]))
    target = " (target <= 1.15)" if result["size"] == "bench" else ""
    print(f"ratio total step / pure model compute: {wall['total'] / model['total']:.3f}x{target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9, help="measured steps at the tiny size (default 9)")
    parser.add_argument("--bench-repeats", type=int, default=3, help="measured steps at the bench size (default 3)")
    parser.add_argument("--sizes", default="tiny,bench", help="comma-separated: tiny, bench (default both)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        workdir = Path(tmp)
        prompts = workdir / "prompts.jsonl"
        # A prompt of its own for every group of every step, as in training (no encode is cached across steps).
        prompts.write_text(
            "".join(
                f'{{"input": "a {a} {thing} next to a {b} {other}"}}\n'
                for a, thing in zip(COLORS, THINGS)
                for b in COLORS
                for other in THINGS[:2]
            ),
            encoding="utf-8",
        )
        print(
            "RL training step: 2 prompts x 8 samples, microgroup 8, 10 steps (3 SDE), CFG 4.0, T5 length 256, "
            "micro-batch tile 8x1, 2 optimizer steps, LoRA, jpeg_compressibility; 1 thread"
        )
        for size in args.sizes.split(","):
            bench = size == "bench"
            # At the bench size a step takes most of a minute: no separate warm-up step (the
            # first step's one-off costs are milliseconds; the median drops the slowest step)
            # and one replay per call kind per round. Tiny calls take milliseconds: a warm-up
            # step and several replays per round, for steadier medians.
            result = asyncio.run(
                measure(
                    size,
                    workdir,
                    prompts,
                    args.bench_repeats if bench else args.repeats,
                    warmup=0 if bench else 1,
                    calls_per_round=1 if bench else 5,
                )
            )
            report(result)
    print(f"\nbenchmark took {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
