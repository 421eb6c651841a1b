"""What this machine offers, read without importing torch (config resolution is fast)."""

from __future__ import annotations

import os
from pathlib import Path


def visible_gpu_count() -> int:
    """NVIDIA GPUs the driver exposes, restricted by ``CUDA_VISIBLE_DEVICES``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part for part in visible.split(",") if part.strip() and part.strip() != "-1"]
        if not ids:
            return 0
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    try:
        present = len(list(gpus_dir.iterdir()))
    except OSError:
        present = 0
    return min(present, len(ids)) if visible is not None else present


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (``cpu.max``, as containers set it) rounded up to whole CPUs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)
