"""Configuration rules of FSDP2's CPU offload (``--fsdp-cpu-offload``,
``--fsdp-cpu-backend``), checked before anything loads.

The offload is FSDP2's own ``CPUOffloadPolicy`` on the sharded trainer of a world size
above 1 (:mod:`miles_core.training.fsdp`); a one-process trainer has no FSDP2 shards to
offload and moves its state off the GPU between phases with ``--offload-train`` instead.
``--fsdp-cpu-backend`` names the backend of the process group's CPU side.
"""

from __future__ import annotations

from typing import Any

CPU_BACKENDS: tuple[str, ...] = ("gloo", "mpi", "ucc")
"""torch.distributed backends that run collectives on CPU tensors (mpi and ucc only in
torch builds that include them)."""


def fsdp_offload_errors(config: Any) -> list[str]:
    """One line per impossible combination of the FSDP CPU offload flags."""
    if not config.get("fsdp_cpu_offload"):
        return []
    errors = []
    if config.world_size == 1:
        errors.append(
            "--fsdp-cpu-offload offloads the FSDP2 shards of a world size above 1 (--actor-num-nodes x "
            "--actor-num-gpus-per-node); a one-process trainer has none: use --offload-train to move its weights, "
            "gradients and optimizer state off the GPU while the engine generates"
        )
    cpu_backend = config.get("fsdp_cpu_backend")
    if cpu_backend not in CPU_BACKENDS:
        errors.append(f"--fsdp-cpu-backend {cpu_backend}: must be one of {', '.join(CPU_BACKENDS)} (a backend for CPU tensors)")
    elif config.get("distributed_backend") == "gloo" and cpu_backend != "gloo":
        errors.append(
            f"--fsdp-cpu-backend {cpu_backend} with --distributed-backend gloo: a gloo group runs the CPU collectives "
            "itself; use --fsdp-cpu-backend gloo"
        )
    return errors


def fsdp_offload_notes(config: Any) -> list[str]:
    """``--fsdp-cpu-backend`` set without ``--fsdp-cpu-offload``: it has no effect."""
    if config.get("fsdp_cpu_offload") or not config.is_user_set("fsdp_cpu_backend"):
        return []
    return [f"--fsdp-cpu-backend {config.get('fsdp_cpu_backend')} has no effect without --fsdp-cpu-offload"]


__all__ = ["CPU_BACKENDS", "fsdp_offload_errors", "fsdp_offload_notes"]
