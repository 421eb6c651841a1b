"""HTTP engine fleets: rollout throughput with 1 and 2 engines, and weight-sync cost per MB
against a plain in-memory copy of the same tensors, side by side in one run.

Engines are real ``miles-core serve-engine`` processes of the tiny SD3 pipeline
(``miles_core.engine.fleet.EngineFleet``), each with ``--threads`` torch threads, behind
one ``HttpEngine`` (least-busy routing). Throughput: ``--requests`` concurrent requests
of ``--outputs`` samples each (64x64, ``--steps`` steps), samples per second, median of
``--repeats`` rounds that alternate between the fleets. Weight sync: the transformer's
full weights through ``sync_to_engine`` (safetensors buckets of ``--bucket-mb`` MiB,
checksums checked) to a 1-engine and a 2-engine fleet, against ``copy_`` of the same
tensors into preallocated ones in this process; seconds per MB, medians.

Usage: python bench/fleet.py [--repeats 3] [--requests 8] [--outputs 2] [--steps 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--outputs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from miles_core.engine.fleet import EngineFleet
    from miles_core.engine.http import HttpEngine
    from miles_core.request import RolloutRequest
    from miles_core.training.weight_sync import engine_weights, sync_to_engine
    from miles_sd3.family import SD3Family

    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    tiny = SD3Family.build_tiny_pipeline(tmp / "stable-diffusion-3-tiny")
    engine_args = ("--diffusion-model-family", "sd3", "--device", "cpu")
    fleets = {n: EngineFleet.start(tiny, n, tmp / f"logs{n}", *engine_args, threads=args.threads) for n in (1, 2)}
    try:
        from diffusers import SD3Transformer2DModel

        module = SD3Transformer2DModel.from_pretrained(str(Path(tiny) / "transformer"))
        tensors = [t.clone() for _, t in engine_weights(module)]
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        base = RolloutRequest(prompt="a red cube", width=64, height=64, num_inference_steps=args.steps, num_outputs_per_prompt=args.outputs)
        sync_config = SimpleNamespace(lora_ipc_weight_sync=False, update_weight_buffer_size=int(args.bucket_mb * 2**20))

        async def rollout(engine: HttpEngine, round_: int) -> float:
            requests = [replace(base, seed=1000 * round_ + 10 * i, request_id=f"r{round_}-{i}") for i in range(args.requests)]
            began = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            elapsed = time.perf_counter() - began
            return sum(len(r) for r in results) / elapsed

        async def sync(engine: HttpEngine) -> float:
            result = await sync_to_engine(engine, {"transformer": module}, sync_config)
            return result.seconds / (result.bytes / 1e6)

        def copy() -> float:
            targets = [torch.empty_like(t) for t in tensors]
            began = time.perf_counter()
            for target, tensor in zip(targets, tensors):
                target.copy_(tensor)
            return (time.perf_counter() - began) / megabytes

        async def measure() -> dict[str, list[float]]:
            engines = {n: HttpEngine(fleet.urls) for n, fleet in fleets.items()}
            for engine in engines.values():  # warm up: the first request loads lazily built state
                await engine.generate(replace(base, seed=1, request_id="warm"))
            times: dict[str, list[float]] = {}
            for round_ in range(args.repeats):
                for n, engine in engines.items():
                    times.setdefault(f"rollout samples/s, {n} engine(s)", []).append(await rollout(engine, round_))
                    times.setdefault(f"weight sync s/MB, {n} engine(s)", []).append(await sync(engine))
                times.setdefault("in-memory copy s/MB", []).append(copy())
            for engine in engines.values():
                await engine.close()
            return times

        times = asyncio.run(measure())
    finally:
        for fleet in fleets.values():
            fleet.stop()
    print(
        f"tiny SD3 transformer: {megabytes:.2f} MB; {args.requests} requests x {args.outputs} samples, 64x64, "
        f"{args.steps} steps; {args.threads} torch thread(s) per engine; median of {args.repeats}"
    )
    medians = {key: statistics.median(values) for key, values in times.items()}
    for key, value in medians.items():
        print(f"  {key:<34} {value:.4g}")
    one, two = medians["rollout samples/s, 1 engine(s)"], medians["rollout samples/s, 2 engine(s)"]
    print(f"  2 engines / 1 engine throughput: {two / one:.2f}x")
    print(f"  weight sync (1 engine) / in-memory copy: {medians['weight sync s/MB, 1 engine(s)'] / medians['in-memory copy s/MB']:.0f}x")


if __name__ == "__main__":
    main()
