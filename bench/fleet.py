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

Weight-sync paths (``--weight-sync-path``): the transformer of the bench-size pipeline
(``miles-core make-tiny sd3 DIR --scale bench``; ``--sync-scale tiny`` for the tiny one) to
one engine through ``http`` and ``distributed`` (a gloo group with the engine process),
``--sync-bucket-mb`` MiB buckets: the transfer (the sync without its checksum work) in
MB/s and as a ratio to a warm in-process ``copy_`` of the same tensors, the group's
broadcasts alone, and the checksum time (SHA-256 of what is sent, the engine's checksum
request) apart. ``cuda-ipc`` needs CUDA (``bench/gpu_ipc_sync.py`` measures it on a GPU).

Usage: python bench/fleet.py [--repeats 3] [--requests 8] [--outputs 2] [--steps 6] [--threads 1]
       [--sync-scale bench] [--sync-bucket-mb 512]
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
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--outputs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--sync-scale", choices=("bench", "tiny"), default="bench", help="pipeline of the weight-sync path comparison")
    parser.add_argument(
        "--sync-bucket-mb", type=float, default=512.0, help="bucket size of the weight-sync path comparison (the flag default)"
    )
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
        paths = sync_paths(args, tmp, tiny, fleets[1].urls, engine_args)
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
    print_sync_paths(paths)


def sync_paths(args: argparse.Namespace, tmp: Path, tiny: Path, tiny_urls: list[str], engine_args: tuple[str, ...]) -> dict[str, Any]:
    """Each weight-sync path's transfer against a warm in-process copy (see the module docstring)."""
    from diffusers import SD3Transformer2DModel

    from miles_core.engine.fleet import EngineFleet
    from miles_core.engine.http import HttpEngine
    from miles_core.training.weight_sync import close_weight_groups, engine_weights, group_sender, sync_to_engine
    from miles_sd3.family import SD3Family

    fleet = None
    if args.sync_scale == "bench":
        checkpoint = SD3Family.build_tiny_pipeline(tmp / "stable-diffusion-3-bench", scale="bench")
        fleet = EngineFleet.start(checkpoint, 1, tmp / "logs-sync", *engine_args, threads=args.threads)
        urls = fleet.urls
    else:
        checkpoint, urls = tiny, tiny_urls
    try:
        module = SD3Transformer2DModel.from_pretrained(str(Path(checkpoint) / "transformer"))
        tensors = [t.clone() for _, t in engine_weights(module)]
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        warm_targets = [torch.zeros_like(t) for t in tensors]

        def copy(warm: bool) -> float:
            """Into fresh tensors (as the in-memory copy above, and as a receiver's fresh
            buffers would be), or into ones already written (cache and page tables warm)."""
            targets = warm_targets if warm else [torch.empty_like(t) for t in tensors]
            began = time.perf_counter()
            for target, tensor in zip(targets, tensors):
                target.copy_(tensor)
            return time.perf_counter() - began

        async def measure() -> dict[str, list[tuple[float, float, float]]]:
            rows: dict[str, list[tuple[float, float, float]]] = {"http": [], "distributed": []}
            async with HttpEngine(urls) as engine:
                for path in rows:
                    config = SimpleNamespace(
                        lora_ipc_weight_sync=False, update_weight_buffer_size=int(args.sync_bucket_mb * 2**20), weight_sync_path=path
                    )
                    await sync_to_engine(engine, {"transformer": module}, config)  # warm-up (the group is made here)
                    for _ in range(args.repeats):
                        sender = await group_sender(urls, config) if path == "distributed" else None
                        before = sender.broadcast_seconds if sender is not None else 0.0
                        result = await sync_to_engine(engine, {"transformer": module}, config)
                        broadcast = sender.broadcast_seconds - before if sender is not None else float("nan")
                        rows[path].append((result.seconds - result.checksum_seconds, result.checksum_seconds, broadcast))
            await close_weight_groups()
            return rows

        rows = asyncio.run(measure())
        copies = [copy(warm=False) for _ in range(max(3, args.repeats))]
        warm = [copy(warm=True) for _ in range(max(3, args.repeats))]
    finally:
        if fleet is not None:
            fleet.stop()
    return {
        "scale": args.sync_scale,
        "megabytes": megabytes,
        "copy": statistics.median(copies),
        "warm_copy": statistics.median(warm),
        "rows": rows,
        "bucket": args.sync_bucket_mb,
    }


def print_sync_paths(paths: dict[str, Any]) -> None:
    megabytes, copy_s, warm_s = paths["megabytes"], paths["copy"], paths["warm_copy"]
    print(
        f"weight-sync paths, {paths['scale']}-scale SD3 transformer ({megabytes:.1f} MB, {paths['bucket']:g} MiB buckets, "
        f"1 engine), medians; in-process copy {megabytes / copy_s:.0f} MB/s into fresh tensors, "
        f"{megabytes / warm_s:.0f} MB/s into written ones (warm)"
    )
    for path, rows in paths["rows"].items():
        transfer = statistics.median(r[0] for r in rows)
        checksum = statistics.median(r[1] for r in rows)
        line = (
            f"  {path:<12} transfer {megabytes / transfer:6.0f} MB/s, ratio to copy {copy_s / transfer:.2f}x "
            f"({warm_s / transfer:.2f}x warm); checksums {checksum:.3f} s apart"
        )
        if path == "distributed":
            broadcast = statistics.median(r[2] for r in rows)
            line += f"; broadcasts alone {megabytes / broadcast:.0f} MB/s, {copy_s / broadcast:.2f}x copy"
        print(line)
    if torch.cuda.is_available():
        print("  cuda-ipc     measured by bench/gpu_ipc_sync.py (an engine on this GPU)")
    else:
        print("  cuda-ipc     needs CUDA (bench/gpu_ipc_sync.py on a GPU machine)")


if __name__ == "__main__":
    main()
