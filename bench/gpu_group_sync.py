"""GPU lane case ``group_sync``: weight sync through a torch.distributed group
(``--weight-sync-path distributed``) to a serve-engine on a GPU of its own, as JSON and a
markdown table.

A ``miles-core serve-engine`` process serves the bench-size SD3 pipeline (``miles-core
make-tiny sd3 DIR --scale bench``) in bf16 on the second visible GPU (its own
``CUDA_VISIBLE_DEVICES``); this process holds the trainer's copy of its transformer on GPU
0 with every weight moved off the checkpoint's, and syncs it ``--repeats`` times (after a
warm-up sync, which makes the group) with
:func:`~miles_core.training.weight_sync.sync_to_engine`, as a run does. Two cases on the
same engine:

- ``nccl``: the group a run gets for an engine on its own GPU; needs two GPUs (nccl cannot
  put two ranks on one device), reported as skipped with one;
- ``gloo``: the same group over gloo (buckets staged in host memory), on the second GPU
  when there are two, on the trainer's own GPU when there is one.

Each reports the transfer (the sync without its checksum work: the HTTP metadata request
per bucket, the bucket's staging, its broadcast and the engine's load), the broadcasts
alone (packing and broadcasting, the group sender's ``broadcast_seconds``) and the
checksum time (SHA-256 of what is sent, the engine's checksum request) apart; beside them
an HTTP sync of the same weights (safetensors buckets) and the bounds: an in-process copy
of the same tensors into buffers on GPU 0, and with two GPUs from GPU 0 into buffers on
GPU 1.

After each sync the engine's checksum must equal the trainer's (the sync checks it), and
the HTTP sync of the same weights must leave the same checksum; the control then changes
one trainer weight and the check must fail. Without CUDA the program prints that it needs
CUDA and exits 0; ``--dry-run`` runs the ``gloo`` case on the CPU at the tiny size (the
request format, the group, the server's load path and the checksums; no throughput that
means anything).

Usage: python bench/gpu_group_sync.py [--out DIR] [--dry-run] [--repeats 3] [--buffer-mb 512]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lane.section_cli import sync_section_main

NCCL = "nccl, engine on its own GPU"
GLOO = "gloo, buckets staged in host memory"


def _mb(n: float) -> float:
    return n / 1e6


def _in_process_copy(tensors: list[torch.Tensor], target: torch.device) -> float:
    """Seconds to copy ``tensors`` into preallocated buffers on ``target``."""
    buffers = [torch.empty_like(t, device=target) for t in tensors]
    for buffer, tensor in zip(buffers, tensors):  # once unmeasured: pages and peer access set up
        buffer.copy_(tensor)
    devices = {t.device for t in tensors} | {target}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    began = time.perf_counter()
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - began


def engine_devices(count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine: the second GPU this process sees (with two
    or more), else its first, in this process's own numbering of them."""
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    index = 1 if count >= 2 else 0
    return visible[index] if len(visible) > index else str(index)


async def run_case(client: Any, trainer: torch.nn.Module, backend: str, buffer_bytes: int, repeats: int) -> dict[str, Any]:
    """``repeats`` group syncs (new weights each time, after a warm-up) and an HTTP sync of
    the same weights after each; the checksums compared; then the control."""
    from miles_core.errors import WeightSyncError
    from miles_core.training.weight_sync import check_checksums, close_weight_groups, expected_checksum, group_sender, sync_to_engine

    def config(path: str) -> SimpleNamespace:
        return SimpleNamespace(
            lora_ipc_weight_sync=False, update_weight_buffer_size=buffer_bytes, weight_sync_path=path, distributed_backend=backend
        )

    device = next(trainer.parameters()).device
    rows: list[dict[str, float]] = []
    http: list[float] = []
    checksums = "equal after every sync"
    try:
        await sync_to_engine(client, {"transformer": trainer}, config("distributed"))  # warm-up: the group is made here
        sender = await group_sender(client.weight_urls(), config("distributed"))
        for repeat in range(repeats):
            with torch.no_grad():  # new weights each time, so every sync moves something
                generator = torch.Generator(device=device).manual_seed(repeat)
                for parameter in trainer.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator, device=device, dtype=parameter.dtype) * 1e-3)
            before = sender.broadcast_seconds
            result = await sync_to_engine(client, {"transformer": trainer}, config("distributed"))
            rows.append(
                {
                    "sync_s": result.seconds,
                    "transfer_s": result.seconds - result.checksum_seconds,
                    "broadcast_s": sender.broadcast_seconds - before,
                    "checksum_s": result.checksum_seconds,
                    "bytes": result.bytes,
                }
            )
            began = time.perf_counter()
            over_http = await sync_to_engine(client, {"transformer": trainer}, config("http"))
            http.append(time.perf_counter() - began)
            if over_http.checksums != result.checksums:
                checksums = f"MISMATCH: the HTTP sync of the same weights left {over_http.checksums}, the group's {result.checksums}"
        # Independently of what was sent: the engine holds exactly the trainer's live weights.
        await check_checksums(client, {"transformer": expected_checksum(trainer, lora_only=False)}, lora_only=False)
    except WeightSyncError as exc:
        checksums = f"MISMATCH: {exc}"
    except Exception as exc:  # a group that cannot be made or used: reported, and the other case still runs
        return {"case": NCCL if backend == "nccl" else GLOO, "status": f"failed: {type(exc).__name__}: {exc}"}
    finally:
        await close_weight_groups()
    with torch.no_grad():  # the control: one trainer weight changed after the syncs
        parameter = next(trainer.parameters())
        saved = parameter.view(-1)[0].clone()
        parameter.view(-1)[0] += 1.0
    try:
        await check_checksums(client, {"transformer": expected_checksum(trainer, lora_only=False)}, lora_only=False)
        control = "FAILED: the engine's checksum matched a changed trainer weight"
    except WeightSyncError:
        control = "mismatch detected"
    with torch.no_grad():
        parameter.view(-1)[0] = saved
    if not rows:
        return {"case": NCCL if backend == "nccl" else GLOO, "status": f"failed: {checksums}", "checksums": checksums, "control": control}
    total = rows[0]["bytes"]
    transfer = statistics.median(r["transfer_s"] for r in rows)
    broadcast = statistics.median(r["broadcast_s"] for r in rows)
    return {
        "case": NCCL if backend == "nccl" else GLOO,
        "status": "ok",
        "backend": backend,
        "bytes": total,
        "repeats": repeats,
        "sync_s": statistics.median(r["sync_s"] for r in rows),
        "transfer_s": transfer,
        "broadcast_s": broadcast,
        "checksum_s": statistics.median(r["checksum_s"] for r in rows),
        "http_sync_s": statistics.median(http),
        "transfer_mb_per_s": _mb(total) / transfer,
        "broadcast_mb_per_s": _mb(total) / broadcast if broadcast > 0 else None,
        "checksums": checksums,
        "control": control,
    }


async def measure(
    checkpoint: Path, workdir: Path, gpus: int, dry_run: bool, repeats: int, buffer_bytes: int, progress: Callable[[list], None]
) -> dict[str, Any]:
    """Both cases on one engine; ``progress`` gets the cases measured so far after each one
    (a later case that hangs until the lane's cut-off leaves the earlier ones written)."""
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.fleet import start_engine
    from miles_core.engine.http import HttpEngine

    cuda = gpus > 0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    served = start_engine(
        checkpoint,
        "--device",
        "cuda" if cuda else "cpu",
        "--dtype",
        "bf16" if cuda else "fp32",
        "--diffusion-model-family",
        "sd3",
        "--update-weight-buffer-size",
        str(buffer_bytes),
        log_path=workdir / "engine.log",
        healthy=True,
        timeout=180.0,
        env={"CUDA_VISIBLE_DEVICES": engine_devices(gpus)} if cuda else None,
    )
    try:
        trainer = EmbeddedEngine.from_checkpoint(
            checkpoint, "sd3", device=str(device), dtype=torch.bfloat16 if cuda else torch.float32
        ).component("transformer")
        tensors = [p.detach() for p in trainer.parameters()]
        cases: list[dict[str, Any]] = []
        async with HttpEngine(served.url, request_timeout=600.0) as client:
            if gpus >= 2:
                cases.append(await run_case(client, trainer, "nccl", buffer_bytes, repeats))
            else:
                why = (
                    "no GPU (CPU dry run)"
                    if dry_run
                    else f"needs 2 GPUs (nccl cannot put two ranks on one device), this machine has {gpus}"
                )
                cases.append({"case": NCCL, "status": f"skipped: {why}"})
            progress(cases)
            cases.append(await run_case(client, trainer, "gloo", buffer_bytes, repeats))
            progress(cases)
        copies = [_in_process_copy(tensors, device) for _ in range(repeats)]
        peer = [_in_process_copy(tensors, torch.device("cuda", 1)) for _ in range(repeats)] if gpus >= 2 else []
    finally:
        served.stop()
    total = sum(t.numel() * t.element_size() for t in tensors)
    copy = statistics.median(copies)
    bounds = {"in_process_copy_s": copy, "in_process_mb_per_s": _mb(total) / copy}
    if peer:
        bounds.update(peer_copy_s=statistics.median(peer), peer_mb_per_s=_mb(total) / statistics.median(peer))
    for case in cases:
        if case["status"] == "ok":
            case["transfer_over_copy"] = copy / case["transfer_s"]
            if peer:
                case["transfer_over_peer_copy"] = bounds["peer_copy_s"] / case["transfer_s"]
    return {
        "bytes": total,
        "tensors": len(tensors),
        "buffer_bytes": buffer_bytes,
        "repeats": repeats,
        "engine_device": "the second GPU" if gpus >= 2 else ("the trainer's GPU" if cuda else "CPU"),
        **bounds,
        "cases": cases,
    }


def markdown(report: dict[str, Any]) -> str:
    r, gpus = report["result"], report["gpus"]
    total = _mb(r["bytes"])
    lines = [
        f"GPU lane, group_sync: {report['device']}{f' x {gpus}' if gpus else ''}, torch {report['torch']}, "
        f"SD3 {report['scale']} transformer, {total:.1f} MB in {r['tensors']} tensors ({report['dtype']}), "
        f"buckets of {r['buffer_bytes'] / 2**20:g} MiB, "
        f"engine on {r['engine_device']}, median of {r['repeats']} syncs after a warm-up",
        "",
        "| path | seconds | MB/s | ratio to in-process copy |",
        "|---|---|---|---|",
    ]
    for case in r["cases"]:
        name = case["case"]
        if case["status"] != "ok":
            lines.append(f"| {name} | {case['status']} | | |")
            continue
        broadcast = case["broadcast_s"]
        speed = f"{total / broadcast:.0f} | {r['in_process_copy_s'] / broadcast:.3f}x" if broadcast > 0 else " | "
        lines += [
            f"| {name}, transfer | {case['transfer_s']:.4f} | {case['transfer_mb_per_s']:.0f} | {case['transfer_over_copy']:.3f}x |",
            f"| {name}, broadcasts alone | {broadcast:.4f} | {speed} |",
            f"| {name}, checksums (host hash + engine) | {case['checksum_s']:.4f} | | |",
            f"| HTTP buckets, whole sync (same engine) | {case['http_sync_s']:.4f} | {total / case['http_sync_s']:.0f} | "
            f"{r['in_process_copy_s'] / case['http_sync_s']:.3f}x |",
        ]
    lines.append(f"| in-process copy, same device | {r['in_process_copy_s']:.4f} | {r['in_process_mb_per_s']:.0f} | 1.000x |")
    if "peer_copy_s" in r:
        lines.append(
            f"| in-process copy, GPU 0 to GPU 1 | {r['peer_copy_s']:.4f} | {r['peer_mb_per_s']:.0f} | "
            f"{r['in_process_copy_s'] / r['peer_copy_s']:.3f}x |"
        )
    lines.append("")
    for case in r["cases"]:
        if "control" in case:
            lines.append(f"{case['case']}: checksums {case.get('checksums', '-')}; control (one trainer weight changed): {case['control']}")
    lines.append("")
    return "\n".join(lines)


def succeeded(report: dict[str, Any]) -> bool:
    """Every case that ran: ok, checksums equal, control detected."""
    ran = [case for case in report["result"]["cases"] if not case["status"].startswith("skipped: ")]
    return bool(ran) and all(
        case["status"] == "ok" and case["checksums"] == "equal after every sync" and case["control"] == "mismatch detected" for case in ran
    )


async def section(out: Path, dry_run: bool, repeats: int, buffer_bytes: int) -> int:
    from miles_sd3.family import SD3Family

    gpus = 0 if dry_run else torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="gpu-lane-group-") as tmp:
        workdir = Path(tmp)
        checkpoint = SD3Family.build_tiny_pipeline(workdir / "sd3", scale="tiny" if dry_run else "bench")
        report: dict[str, Any] = {
            "section": "group_sync",
            "dry_run": dry_run,
            "device": torch.cuda.get_device_name(0) if gpus else "CPU",
            "gpus": gpus,
            "torch": torch.__version__,
            "dtype": "bf16" if gpus else "fp32",
            "scale": "tiny" if dry_run else "bench",
        }

        def progress(cases: list) -> None:
            partial = {**report, "result": {"partial": True, "cases": cases}}
            (out / "group_sync.json").write_text(json.dumps(partial, indent=2) + "\n", encoding="utf-8")

        report["result"] = await measure(checkpoint, workdir, gpus, dry_run, repeats, buffer_bytes, progress)
    (out / "group_sync.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "group_sync.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report), end="")
    return 0 if succeeded(report) else 1


def main() -> None:
    sync_section_main(
        "group_sync",
        __doc__,
        section,
        dry_run_help="the gloo case at the tiny size on the CPU, in seconds",
        repeats_help="syncs per case after the warm-up; the table shows medians (default 3)",
    )


if __name__ == "__main__":
    main()
