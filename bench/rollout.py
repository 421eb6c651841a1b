"""Rollout throughput on the tiny SD3 pipeline, measured side by side in one run.

Samples per second for microgroup sizes 1, 2, 4, 8 at n_samples_per_prompt 16, with the
embedded engine and over HTTP (a `miles-core serve-engine` subprocess), and the time of
a plain `StableDiffusion3Pipeline.__call__` producing the same batch with the same steps.
One torch thread everywhere. Prints the ratios the issue tracker asks about:

- microgroup 8 vs microgroup 1 samples/s (target >= 3x),
- embedded engine (recording log-probs and the trajectory) vs plain diffusers call
  for the same 8-output batch (target <= 1.05x).

Usage: python bench/rollout.py [--steps 10] [--repeats 9] [--no-http]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

N_SAMPLES = 16
PROMPT = "a red cube on a blue floor"


def interleaved(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each function, measured round-robin so that a change in the
    machine's load affects all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


EXTRA: dict = {}
_GROUPS = itertools.count()


def group_requests(steps: int, microgroup: int):
    """One prompt group, a prompt of its own (as in training: the engine's prompt cache
    saves the encode of every microgroup after the group's first, never the first)."""
    from miles_core.request import RolloutRequest

    prompt = f"{PROMPT} {next(_GROUPS)}"
    return [
        RolloutRequest(
            prompt=prompt,
            seed=offset,
            num_inference_steps=steps,
            num_outputs_per_prompt=min(microgroup, N_SAMPLES - offset),
            guidance_scale=4.5,
            rollout_sde_step_indices=tuple(range(steps - 1)),
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            extra_sampling_params=EXTRA,
        )
        for offset in range(0, N_SAMPLES, microgroup)
    ]


def run_group(engine, requests) -> None:
    async def go():
        await asyncio.gather(*(engine.generate(r) for r in requests))

    asyncio.run(go())


async def http_group(url: str, requests) -> None:
    from miles_core.engine.http import HttpEngine

    async with HttpEngine([url]) as client:
        await client.wait_until_healthy(120)
        await asyncio.gather(*(client.generate(r) for r in requests))


def start_server(checkpoint: Path) -> tuple[subprocess.Popen, str]:
    # No key: the bench's client sends none (a MILES_API_KEY exported in the shell would
    # otherwise make the server refuse it).
    env = {**{k: v for k, v in os.environ.items() if k != "MILES_API_KEY"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miles_core.cli.main",
            "serve-engine",
            "--hf-checkpoint",
            str(checkpoint),
            "--diffusion-model-family",
            "sd3",
            "--port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving" in line and "http://" in line:
            return proc, line.strip().rsplit(" ", 1)[-1]
    raise RuntimeError("serve-engine exited before listening")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP measurements")
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="T5 prompt length (SD3's default 256 pads every prompt; see docs/benchmarks.md)",
    )
    args = parser.parse_args()
    if args.max_sequence_length:
        EXTRA["max_sequence_length"] = args.max_sequence_length
    torch.set_num_threads(1)

    from diffusers import StableDiffusion3Pipeline

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.quiet import quiet_hub_libraries
    from miles_core.request import RolloutRequest
    from miles_sd3.family import SD3Family

    quiet_hub_libraries()
    workdir = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    checkpoint = SD3Family.build_tiny_pipeline(workdir / "tiny-sd3")
    engine = EmbeddedEngine.from_checkpoint(checkpoint, "sd3")
    per_mg: dict[tuple[str, int], float] = {}
    seconds = interleaved({mg: (lambda mg=mg: run_group(engine, group_requests(args.steps, mg))) for mg in (1, 2, 4, 8)}, args.repeats)
    per_mg.update({("embedded", mg): N_SAMPLES / s for mg, s in seconds.items()})

    if not args.no_http:
        proc, url = start_server(checkpoint)
        try:
            seconds = interleaved(
                {mg: (lambda mg=mg: asyncio.run(http_group(url, group_requests(args.steps, mg)))) for mg in (1, 2, 4, 8)},
                args.repeats,
            )
            per_mg.update({("http", mg): N_SAMPLES / s for mg, s in seconds.items()})
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    # Same 8-output batch: plain diffusers call vs the embedded engine recording everything.
    pipe = StableDiffusion3Pipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)

    def fresh_request() -> RolloutRequest:
        return replace(request, prompt=f"{PROMPT} {next(_GROUPS)}")

    request = RolloutRequest(
        prompt=PROMPT,
        negative_prompt=" ",
        seed=0,
        num_inference_steps=args.steps,
        num_outputs_per_prompt=8,
        guidance_scale=4.5,
        rollout_sde_step_indices=tuple(range(args.steps - 1)),
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        extra_sampling_params=EXTRA,
    )
    both = interleaved(
        {
            "plain": lambda: pipe(
                f"{PROMPT} {next(_GROUPS)}",
                negative_prompt=" ",
                num_images_per_prompt=8,
                num_inference_steps=args.steps,
                guidance_scale=4.5,
                output_type="pt",
                generator=torch.Generator().manual_seed(0),
                max_sequence_length=args.max_sequence_length or 256,
            ),
            "ours": lambda: engine.generate_sync(fresh_request()),
        },
        args.repeats,
    )
    plain, ours = both["plain"], both["ours"]
    length = args.max_sequence_length or 256
    print(
        f"tiny SD3, {args.steps} steps, CFG 4.5, T5 length {length}, n_samples_per_prompt {N_SAMPLES}, "
        f"1 thread, median of {args.repeats} (interleaved)"
    )
    print(f"{'engine':<10}{'microgroup':>12}{'samples/s':>12}")
    for (kind, microgroup), rate in per_mg.items():
        print(f"{kind:<10}{microgroup:>12}{rate:>12.1f}")
    for kind in ("embedded", "http"):
        if (kind, 1) in per_mg:
            print(f"ratio {kind} microgroup 8 / microgroup 1 samples/s: {per_mg[(kind, 8)] / per_mg[(kind, 1)]:.2f}x (target >= 3)")
    print(f"plain StableDiffusion3Pipeline.__call__, 8 outputs: {plain * 1000:.1f} ms")
    print(f"embedded engine, 8 outputs, log-probs + trajectory: {ours * 1000:.1f} ms")
    print(f"ratio embedded / plain diffusers: {ours / plain:.3f}x (target <= 1.05)")


if __name__ == "__main__":
    main()
