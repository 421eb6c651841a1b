"""GPU lane case ``ipc_sync``: weight sync through CUDA-IPC handles to a serve-engine on the
trainer's own GPU, as JSON and a markdown table.

A ``miles-core serve-engine --accept-ipc-weights`` process serves the bench-size SD3
pipeline (``miles-core make-tiny sd3 DIR --scale bench``) on GPU 0 in bf16; this process
holds the trainer's copy of its transformer on the same GPU with every weight moved off
the checkpoint's, and syncs it ``--repeats`` times:

- through CUDA IPC (:func:`miles_core.training.ipc_sync.sync_through_ipc`): the transfer
  time (posting the handles; the engine copies while the request is open) and the checksum
  time (hashing what was sent on the host, and the engine's checksums) apart;
- over HTTP (:func:`miles_core.training.weight_sync.sync_to_engine`, safetensors buckets),
  the path every other engine takes, at the same bucket size;
- an in-process copy of the same tensors into buffers on the same GPU: the bound.

After each sync the engine's checksum must equal the trainer's (the sync checks it); the
control then changes one trainer weight and the check must fail. Without CUDA the program
prints that it needs CUDA and exits 0; ``--dry-run`` runs the same steps on the CPU at the
tiny size, the tensors passed as torch ``file_system`` shared memory instead of CUDA
handles (the request format, the server's load path and the checksums; no throughput that
means anything).

Usage: python bench/gpu_ipc_sync.py [--out DIR] [--dry-run] [--repeats 3] [--buffer-mb 512]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lane.section_cli import sync_section_main


def _mb(n: float) -> float:
    return n / 1e6


def _in_process_copy(tensors: list[torch.Tensor], device: torch.device) -> float:
    """Seconds to copy ``tensors`` into preallocated buffers on their own device."""
    buffers = [torch.empty_like(t) for t in tensors]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


async def _ipc_sync_cpu(client: Any, module: torch.nn.Module, config: Any) -> dict[str, float]:
    """The dry run's IPC sync: the sender's requests with CPU shared memory, then the check."""
    from miles_core.training.ipc_sync import ipc_requests, module_weights
    from miles_core.training.weight_sync import check_checksums, engine_weights
    from miles_core.weights import named_tensors_checksum

    began = time.perf_counter()
    (weights,) = module_weights({"transformer": module}, lora_only=False)
    sent = 0
    for body, bucket in ipc_requests(weights, config.update_weight_buffer_size):
        await client.update_weights_from_ipc(body)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
    transfer = time.perf_counter() - began
    checked = time.perf_counter()
    await check_checksums(client, {"transformer": named_tensors_checksum(engine_weights(module))}, lora_only=False)
    return {"transfer_s": transfer, "checksum_s": time.perf_counter() - checked, "bytes": sent}


async def measure(checkpoint: Path, workdir: Path, device: torch.device, repeats: int, buffer_bytes: int) -> dict[str, Any]:
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.fleet import start_engine
    from miles_core.engine.http import HttpEngine
    from miles_core.errors import WeightSyncError
    from miles_core.training.ipc_sync import sync_through_ipc
    from miles_core.training.weight_sync import check_checksums, sync_to_engine
    from miles_core.weights import module_checksum

    cuda = device.type == "cuda"
    dtype = "bf16" if cuda else "fp32"
    served = start_engine(
        checkpoint,
        "--device",
        "cuda" if cuda else "cpu",
        "--dtype",
        dtype,
        "--diffusion-model-family",
        "sd3",
        "--update-weight-buffer-size",
        str(buffer_bytes),
        "--accept-ipc-weights",
        log_path=workdir / "engine.log",
        healthy=True,
        timeout=180.0,
    )
    try:
        trainer = EmbeddedEngine.from_checkpoint(
            checkpoint, "sd3", device=str(device), dtype=torch.bfloat16 if cuda else torch.float32
        ).component("transformer")
        config = SimpleNamespace(lora_ipc_weight_sync=False, update_weight_buffer_size=buffer_bytes)
        tensors = [p.detach() for p in trainer.parameters()]
        total = sum(t.numel() * t.element_size() for t in tensors)
        ipc: list[dict[str, float]] = []
        http: list[float] = []
        copies: list[float] = []
        async with HttpEngine(served.url, request_timeout=600.0) as client:
            for repeat in range(repeats):
                with torch.no_grad():  # new weights each time, so every sync moves something
                    generator = torch.Generator(device=device).manual_seed(repeat)
                    for parameter in trainer.parameters():
                        parameter.add_(torch.randn(parameter.shape, generator=generator, device=device, dtype=parameter.dtype) * 1e-3)
                if cuda:
                    result = await sync_through_ipc(client, {"transformer": trainer}, config)
                    ipc.append({"transfer_s": result.transfer_seconds, "checksum_s": result.checksum_seconds, "bytes": result.bytes})
                else:
                    ipc.append(await _ipc_sync_cpu(client, trainer, config))
                began = time.perf_counter()
                await sync_to_engine(client, {"transformer": trainer}, config)
                http.append(time.perf_counter() - began)
                copies.append(_in_process_copy(tensors, device))
            with torch.no_grad():  # the control: one trainer weight changed after the sync
                next(trainer.parameters()).view(-1)[0] += 1.0
            try:
                await check_checksums(client, {"transformer": module_checksum(trainer)}, lora_only=False)
                control = "FAILED: the engine's checksum matched a changed trainer weight"
            except WeightSyncError:
                control = "mismatch detected"
    finally:
        served.stop()
    transfer = statistics.median(r["transfer_s"] for r in ipc)
    checksum = statistics.median(r["checksum_s"] for r in ipc)
    copy = statistics.median(copies)
    return {
        "bytes": total,
        "tensors": len(tensors),
        "buffer_bytes": buffer_bytes,
        "repeats": repeats,
        "ipc_transfer_s": transfer,
        "ipc_checksum_s": checksum,
        "http_sync_s": statistics.median(http),
        "in_process_copy_s": copy,
        "ipc_mb_per_s": _mb(total) / transfer,
        "in_process_mb_per_s": _mb(total) / copy,
        "ipc_over_copy": copy / transfer,
        "checksums": "equal after every sync",
        "control": control,
    }


def markdown(report: dict[str, Any]) -> str:
    r = report["result"]
    ipc = "CPU shared memory (dry run)" if report["dry_run"] else "CUDA IPC"
    return "\n".join(
        [
            f"GPU lane, ipc_sync: {report['device']}, torch {report['torch']}, SD3 {report['scale']} transformer, "
            f"{_mb(r['bytes']):.1f} MB in {r['tensors']} tensors ({report['dtype']}), buckets of {_mb(r['buffer_bytes']):.0f} MB, "
            f"median of {r['repeats']}",
            "",
            "| path | seconds | MB/s | ratio to in-process copy |",
            "|---|---|---|---|",
            f"| {ipc}, transfer | {r['ipc_transfer_s']:.4f} | {r['ipc_mb_per_s']:.0f} | {r['ipc_over_copy']:.3f}x |",
            f"| {ipc}, checksums (host hash + engine) | {r['ipc_checksum_s']:.4f} | | |",
            f"| HTTP buckets, whole sync | {r['http_sync_s']:.4f} | {_mb(r['bytes']) / r['http_sync_s']:.0f} | "
            f"{r['in_process_copy_s'] / r['http_sync_s']:.3f}x |",
            f"| in-process copy | {r['in_process_copy_s']:.4f} | {r['in_process_mb_per_s']:.0f} | 1.000x |",
            "",
            f"checksums: {r['checksums']}; control (one trainer weight changed): {r['control']}",
            "",
        ]
    )


async def section(out: Path, dry_run: bool, repeats: int, buffer_bytes: int) -> int:
    from miles_sd3.family import SD3Family

    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors as shared-memory files
    with tempfile.TemporaryDirectory(prefix="gpu-lane-ipc-") as tmp:
        workdir = Path(tmp)
        checkpoint = SD3Family.build_tiny_pipeline(workdir / "sd3", scale="tiny" if dry_run else "bench")
        report: dict[str, Any] = {
            "section": "ipc_sync",
            "dry_run": dry_run,
            "device": torch.cuda.get_device_name(device) if cuda else "CPU",
            "torch": torch.__version__,
            "dtype": "bf16" if cuda else "fp32",
            "scale": "tiny" if dry_run else "bench",
        }
        report["result"] = await measure(checkpoint, workdir, device, repeats, buffer_bytes)
    (out / "ipc_sync.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "ipc_sync.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report), end="")
    return 0 if report["result"]["control"] == "mismatch detected" else 1


def main() -> None:
    sync_section_main(
        "ipc_sync",
        __doc__,
        section,
        dry_run_help="the tiny size on the CPU, tensors in shared memory, in seconds",
        repeats_help="syncs per path; the table shows medians (default 3)",
    )


if __name__ == "__main__":
    main()
