"""One weight sync along the run's ``--weight-sync-path``: the CUDA-IPC sender for an engine
on the trainer's GPU (:mod:`miles_core.training.ipc_sync`), else
:func:`~miles_core.training.weight_sync.sync_to_engine` (``http``, ``disk``,
``distributed``). Kept apart from both so that neither imports the other's module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_core.training import weight_sync


async def sync_weights(
    engine: Any, modules: Mapping[str, torch.nn.Module] | Sequence[weight_sync.ModuleWeights], config: Any
) -> weight_sync.SyncResult:
    """Send the trained modules' weights (or a snapshot of them) to every server of
    ``engine`` and check the servers' checksums, along :func:`weight_sync.sync_path`."""
    if weight_sync.sync_path(config) == "cuda-ipc":
        # The colocated engine gets CUDA-IPC handles (its own sender, the same checks).
        from miles_core.training.ipc_sync import sync_through_ipc

        return await sync_through_ipc(engine, modules, config)
    return await weight_sync.sync_to_engine(engine, modules, config)  # looked up now: tests may wrap it


__all__ = ["sync_weights"]
