"""Weight sync through CUDA-IPC handles, for an engine colocated with its trainer on one GPU.

The trainer's tensors stay where they are: each request carries, in sglang-diffusion's
``/update_weights_from_tensor`` format (:mod:`miles_core.engine.ipc_wire`), pickled IPC
handles of a bucket of at most ``--update-weight-buffer-size`` bytes of tensors, and the
engine copies from the trainer's memory into its own modules on the same device. What is
sent (full weights with LoRA deltas merged, or the ``lora_A``/``lora_B`` tensors under
``--lora-ipc-weight-sync``) and the checksum check afterwards are those of the HTTP path
(:func:`miles_core.training.weight_sync.sync_to_engine`). Both our serve-engine (started
with ``--accept-ipc-weights``) and sglang-diffusion servers take the requests.

Only CUDA tensors are sent: a CPU tensor (a CPU trainer, or a snapshot copied to the host
for a background re-sync) raises :class:`~miles_core.errors.WeightSyncError`, since a
pickled CPU tensor would need a shared-memory file the engine may not be able to open;
those syncs go through HTTP.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_core.engine.ipc_wire import build_request, device_uuid, serialize_named_tensors
from miles_core.errors import WeightSyncError
from miles_core.training.weight_sync import (
    ModuleWeights,
    SyncResult,
    check_checksums,
    engine_weights,
    expected_checksum,
    lora_config,
    lora_tensors,
)


@dataclass
class IpcSyncResult(SyncResult):
    """A :class:`SyncResult` with the transfer timed apart: posting the handles (the engine
    copies during it); ``checksum_seconds`` is hashing what was sent on the host (a copy to
    the CPU per tensor) and the engines' checksums."""

    transfer_seconds: float = 0.0


def module_weights(modules: Mapping[str, torch.nn.Module], *, lora_only: bool) -> list[ModuleWeights]:
    """What a sync sends for each module, as the HTTP path sends it."""
    weights = []
    for name, module in modules.items():
        if lora_only:
            tensors = sorted(lora_tensors(module), key=lambda item: item[0])
            weights.append(ModuleWeights(name, tensors, lora_config(module), expected_checksum(module, lora_only=True)))
        else:
            weights.append(ModuleWeights(name, engine_weights(module)))
    return weights


def device_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Tensors grouped into buckets of at most ``max_bytes`` (a larger tensor alone), left
    on their device; a bucket holds one device's tensors."""
    if max_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > max_bytes or tensor.device != bucket[0][1].device):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise WeightSyncError(f"the CUDA-IPC weight sync sends an integer {what} (sglang-diffusion's format), the adapter has {value!r}")
    return int(value)


def ipc_request(weights: ModuleWeights, bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The request body of one bucket of ``weights`` (a :func:`device_buckets` bucket; keep
    it alive until the engine has answered: the body holds handles of its storage). A
    LoRA-only module (``lora_config`` set) gives a ``lora_merge`` update."""
    alpha = rank = None
    if weights.lora_config is not None:
        alpha, rank = _integer(weights.lora_config["lora_alpha"], "lora_alpha"), _integer(weights.lora_config["r"], "rank")
    device = bucket[0][1].device
    return build_request(
        serialize_named_tensors(bucket),
        target_module=weights.name,
        gpu_uuid=device_uuid(device) if device.type == "cuda" else None,
        lora_only=weights.lora_config is not None,
        lora_alpha=alpha,
        lora_rank=rank,
    )


def ipc_requests(weights: ModuleWeights, buffer_size: int) -> Iterator[tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]]:
    """Each request body for one module with the bucket it refers to (see :func:`ipc_request`)."""
    for bucket in device_buckets(weights.tensors, buffer_size):
        yield ipc_request(weights, bucket), bucket


async def sync_through_ipc(
    engine: Any, modules_or_snapshot: Mapping[str, torch.nn.Module] | Sequence[ModuleWeights], config: Any
) -> IpcSyncResult:
    """Send the trained modules' weights (or a snapshot of them, still on the GPU) to every
    server of ``engine`` as CUDA-IPC handles, then check every server's checksums as the
    HTTP path does. A tensor not on a CUDA device raises :class:`WeightSyncError` before
    anything of its bucket is sent.

    An engine whose servers hash their whole module, parameters the trainer does not send
    included (the ``sglang`` engine: ``expect_ipc_module``), is told what was sent, so that
    it can tell the servers' checksum of that plus the checkpoint's other tensors for the
    trainer's; a LoRA-only sync to it is refused, since its checksum does not cover an
    adapter."""
    began = time.perf_counter()
    lora_only = bool(config.lora_ipc_weight_sync)
    expect = getattr(engine, "expect_ipc_module", None)
    if lora_only and expect is not None:
        raise WeightSyncError(
            f"--lora-ipc-weight-sync through CUDA IPC to {type(engine).__name__}: its servers' checksums do not cover a LoRA "
            "adapter, so the sync could not be checked (leave --lora-ipc-weight-sync off: full weights, merged)"
        )
    if isinstance(modules_or_snapshot, Mapping):
        weights = module_weights(modules_or_snapshot, lora_only=lora_only)
    else:
        weights = list(modules_or_snapshot)
    result = IpcSyncResult(path="cuda-ipc")
    for module in weights:
        if lora_only and (module.lora_config is None or module.checksum is None):
            raise ValueError(f"{module.name}: a LoRA-only sync needs the weights of a LoRA-only snapshot")
        digest = hashlib.sha256()
        previous: str | None = None
        host: dict[str, torch.Tensor] = {}
        for bucket in device_buckets(module.tensors, config.update_weight_buffer_size):
            name, tensor = bucket[0]
            if tensor.device.type != "cuda" or not torch.cuda.is_available():
                raise WeightSyncError(
                    f"the CUDA-IPC weight sync sends CUDA tensors; {module.name}.{name} is on {tensor.device} "
                    "(sync through HTTP: --weight-sync-path http)"
                )
            posted = time.perf_counter()
            await engine.update_weights_from_ipc(ipc_request(module, bucket))
            hashed = time.perf_counter()
            result.transfer_seconds += hashed - posted
            for name, tensor in bucket:
                if previous is not None and name <= previous:
                    raise ValueError(f"weights must come in sorted name order ({name!r} after {previous!r})")
                previous = name
                on_host = tensor.cpu()
                digest.update(name.encode())  # the recipe of miles_core.weights.named_tensors_checksum
                digest.update(on_host.reshape(-1).view(torch.uint8).numpy().data)
                if expect is not None:
                    host[name] = on_host
                result.bytes += tensor.numel() * tensor.element_size()
            result.checksum_seconds += time.perf_counter() - hashed
        result.checksums[module.name] = module.checksum if lora_only and module.checksum else digest.hexdigest()
        if expect is not None:
            expect(module.name, host)
    checked = time.perf_counter()
    await check_checksums(engine, result.checksums, lora_only=lora_only)
    result.checksum_seconds += time.perf_counter() - checked
    result.seconds = time.perf_counter() - began
    return result


__all__ = ["IpcSyncResult", "device_buckets", "ipc_request", "ipc_requests", "module_weights", "sync_through_ipc"]
