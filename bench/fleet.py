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
one engine through ``http`` and ``distributed`` (a gloo group with the engine process, one
broadcast per bucket), ``--sync-bucket-mb`` MiB buckets, the paths alternating: the transfer (the sync without its checksum work) in
MB/s, the group's packing and broadcasts alone, and the checksum time (SHA-256 of what is
sent, the engine's checksum request) apart. Each is compared with three references measured
in the same run on the same bytes: ``dst.copy_(src)`` into tensors written before (warm),
the same copy into a new anonymous ``mmap`` not touched before (fresh: page faults
included; glibc would reuse freed, already mapped memory for ``torch.empty``), and a bare
gloo broadcast of the bucket's flat buffer from this process to another Python process in
a group made as the weight-update group is (the transport's ceiling). ``cuda-ipc`` needs
CUDA (``bench/gpu_ipc_sync.py`` measures it on a GPU). ``--sync-only`` runs only this part.

Usage: python bench/fleet.py [--repeats 3] [--requests 8] [--outputs 2] [--steps 6] [--threads 1]
       [--sync-scale bench] [--sync-bucket-mb 512] [--sync-only]
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
    parser.add_argument("--sync-only", action="store_true", help="only the weight-sync path comparison (no rollout throughput)")
    parser.add_argument("--broadcast-peer", help=argparse.SUPPRESS)  # PORT:BYTES:REPEATS, the other end of bare_broadcast
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.broadcast_peer:
        broadcast_peer(args.broadcast_peer)
        return
    if args.sync_only:
        from miles_sd3.family import SD3Family

        tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        tiny = SD3Family.build_tiny_pipeline(tmp / "stable-diffusion-3-tiny") if args.sync_scale == "tiny" else tmp
        print_sync_paths(sync_paths(args, tmp, tiny, None, ("--diffusion-model-family", "sd3", "--device", "cpu")))
        return

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


def sync_paths(
    args: argparse.Namespace, tmp: Path, tiny: Path, tiny_urls: list[str] | None, engine_args: tuple[str, ...]
) -> dict[str, Any]:
    """Each weight-sync path's transfer against the transport's and memory's own speeds (see
    the module docstring)."""
    from diffusers import SD3Transformer2DModel

    from miles_core.engine.fleet import EngineFleet
    from miles_core.engine.http import HttpEngine
    from miles_core.engine.weight_group import bucket_layout
    from miles_core.training.weight_sync import close_weight_groups, engine_weights, group_sender, sync_to_engine
    from miles_sd3.family import SD3Family

    fleet = None
    if args.sync_scale == "bench" or tiny_urls is None:
        checkpoint = tiny if args.sync_scale == "tiny" else SD3Family.build_tiny_pipeline(tmp / "stable-diffusion-3-bench", scale="bench")
        fleet = EngineFleet.start(checkpoint, 1, tmp / "logs-sync", *engine_args, threads=args.threads)
        urls = fleet.urls
    else:
        checkpoint, urls = tiny, tiny_urls
    try:
        module = SD3Transformer2DModel.from_pretrained(str(Path(checkpoint) / "transformer"))
        tensors = [t.clone() for _, t in engine_weights(module)]
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        _, flat_bytes = bucket_layout([t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
        variants = ("http", "distributed")

        references: dict[str, list[float]] = {"bare": [], "fresh_copy": [], "warm_copy": []}

        async def measure() -> dict[str, list[tuple[float, float, float]]]:
            rows: dict[str, list[tuple[float, float, float]]] = {path: [] for path in variants}
            bare = BareBroadcast(flat_bytes)
            async with HttpEngine(urls) as engine:
                configs = {
                    path: SimpleNamespace(
                        lora_ipc_weight_sync=False, update_weight_buffer_size=int(args.sync_bucket_mb * 2**20), weight_sync_path=path
                    )
                    for path in variants
                }
                for path in variants:  # warm-up (the group is made here)
                    await sync_to_engine(engine, {"transformer": module}, configs[path])
                for _ in range(args.repeats):  # everything alternates: the machine's load hits each alike
                    references["bare"].append(bare.seconds())
                    references["fresh_copy"].append(copy_seconds(tensors, fresh=True))
                    references["warm_copy"].append(copy_seconds(tensors, fresh=False))
                    for path in variants:
                        sender = await group_sender(urls, configs[path]) if path == "distributed" else None
                        before = sender.broadcast_seconds if sender is not None else 0.0
                        result = await sync_to_engine(engine, {"transformer": module}, configs[path])
                        broadcast = sender.broadcast_seconds - before if sender is not None else float("nan")
                        rows[path].append((result.seconds - result.checksum_seconds, result.checksum_seconds, broadcast))
            await close_weight_groups()
            bare.stop()
            return rows

        rows = asyncio.run(measure())
    finally:
        if fleet is not None:
            fleet.stop()
    return {
        "scale": args.sync_scale,
        "megabytes": megabytes,
        **{key: statistics.median(values) for key, values in references.items()},
        "rows": rows,
        "bucket": args.sync_bucket_mb,
    }


def copy_seconds(tensors: list[torch.Tensor], *, fresh: bool) -> float:
    """Seconds of ``dst.copy_(src)`` for every tensor. ``fresh=False``: into tensors of the
    same sizes written once before (resident, page tables and caches as warm as they get).
    ``fresh=True``: into views of a new anonymous mapping (``mmap``), made for this call and
    not touched before the copy, so each first write faults in a zeroed page: glibc's malloc
    would hand back memory freed by the previous call, already mapped, and that is not fresh."""
    import mmap

    if not fresh:
        targets = [torch.empty_like(t) for t in tensors]
        for target, tensor in zip(targets, tensors):
            target.copy_(tensor)
        mapping = None
    else:
        from miles_core.engine.weight_group import bucket_layout, unpack_bucket

        offsets, size = bucket_layout([t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
        mapping = mmap.mmap(-1, size)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        names = [str(i) for i in range(len(tensors))]
        targets = list(unpack_bucket(flat, names, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors]).values())
    began = time.perf_counter()
    for target, tensor in zip(targets, tensors):
        target.copy_(tensor)
    seconds = time.perf_counter() - began
    if mapping is not None:
        del targets, flat
        mapping.close()
    return seconds


class BareBroadcast:
    """One gloo broadcast of ``size`` bytes from this process to another Python process
    (``--broadcast-peer``), in a group made as the weight-update group is
    (:class:`~miles_core.engine.weight_group.WeightGroup`, loopback), between buffers written
    once before: the transport's own speed, without HTTP, packing or loading. The peer waits
    (blocked, idle) between measurements, so they interleave with the syncs."""

    def __init__(self, size: int) -> None:
        import subprocess
        import sys

        from miles_core.engine.weight_group import WeightGroup, master_store

        store = master_store(2, 60.0)
        self.peer = subprocess.Popen([sys.executable, __file__, "--broadcast-peer", f"{store.port}:{size}"])
        self.group = WeightGroup.join(
            name="bench", master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2, backend="gloo", store=store
        )
        self.flat, self.flag = torch.ones(size, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
        self.seconds()  # warm-up: both sides' buffers written, the connection's buffers grown

    def seconds(self) -> float:
        self.flag.fill_(1)
        self.group.broadcast(self.flag)  # both sides are in the loop before the clock starts
        began = time.perf_counter()
        self.group.broadcast(self.flat)
        return time.perf_counter() - began

    def stop(self) -> None:
        self.flag.fill_(0)
        self.group.broadcast(self.flag)
        self.group.close()
        self.peer.wait(timeout=60)


def broadcast_peer(spec: str) -> None:
    """The other end of :class:`BareBroadcast`."""
    from miles_core.engine.weight_group import WeightGroup

    port, size = (int(part) for part in spec.split(":"))
    group = WeightGroup.join(name="bench", master_address="127.0.0.1", master_port=port, rank=1, world_size=2, backend="gloo")
    flat, flag = torch.zeros(size, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    while True:
        group.broadcast(flag)
        if not flag.item():
            break
        group.broadcast(flat)
    group.close()


def print_sync_paths(paths: dict[str, Any]) -> None:
    megabytes = paths["megabytes"]
    speeds = {name: megabytes / paths[key] for name, key in (("warm", "warm_copy"), ("fresh", "fresh_copy"), ("bare", "bare"))}
    print(
        f"weight-sync paths, {paths['scale']}-scale SD3 transformer ({megabytes:.1f} MB, {paths['bucket']:g} MiB buckets, "
        f"1 engine), medians; copy_ into written tensors (warm) {speeds['warm']:.0f} MB/s, into a fresh mapping "
        f"{speeds['fresh']:.0f} MB/s; bare gloo broadcast {speeds['bare']:.0f} MB/s"
    )
    print(f"  {'path':<34} {'MB/s':>6}  {'/warm':>6} {'/fresh':>6} {'/bare':>6}  checksums")
    for key, rows in paths["rows"].items():
        transfer = megabytes / statistics.median(r[0] for r in rows)
        checksum = statistics.median(r[1] for r in rows)
        ratios = "  ".join(f"{transfer / speeds[name]:5.2f}x" for name in ("warm", "fresh", "bare"))
        print(f"  {key:<34} {transfer:6.0f}  {ratios}  {checksum:.3f} s")
        if key.startswith("distributed"):
            alone = megabytes / statistics.median(r[2] for r in rows)
            ratios = "  ".join(f"{alone / speeds[name]:5.2f}x" for name in ("warm", "fresh", "bare"))
            print(f"  {'  its broadcasts alone':<34} {alone:6.0f}  {ratios}")
    print(
        f"  {'bare gloo broadcast (same bytes)':<34} {speeds['bare']:6.0f}  "
        + "  ".join(f"{speeds['bare'] / speeds[name]:5.2f}x" for name in ("warm", "fresh", "bare"))
    )
    if torch.cuda.is_available():
        print("  cuda-ipc: measured by bench/gpu_ipc_sync.py (an engine on this GPU)")
    else:
        print("  cuda-ipc: needs CUDA (bench/gpu_ipc_sync.py on a GPU machine)")


if __name__ == "__main__":
    main()
