"""Which way a run's weight syncs travel (``--weight-sync-path``): one pure function of the
configuration and the machine, used by the config checks (a refusal stops the run before
anything loads) and by the sync itself.

The paths (docs/guide.md, "Weight sync paths"):

- ``cuda-ipc``: CUDA-IPC handles in sglang-diffusion's ``update_weights_from_tensor``
  format, for an engine on the trainer's own GPU (``--colocate``);
- ``distributed``: a torch.distributed group between the trainer's rank 0 and the engine
  servers (nccl with CUDA, gloo without), broadcast bucket by bucket;
- ``http``: safetensors buckets posted to every server (``serve-engine``);
- ``disk``: the weights written as safetensors and loaded with ``/update_weights_from_disk``
  (sglang-diffusion, which takes neither our buckets nor a distributed group);
- ``none``: the in-process embedded engine samples the trainer's own modules, nothing is synced.
"""

from __future__ import annotations

from typing import Any

from miles_core.errors import ConfigError

PATHS = ("auto", "cuda-ipc", "distributed", "http", "disk")
"""``--weight-sync-path`` choices."""

IN_PROCESS = "embedded"
SERVE_ENGINE = "serve-engine"
SGLANG = "sglang"
OTHER = "other"


def engine_kind(config: Any) -> str:
    """What receives a run's weight syncs: ``embedded`` (the in-process engine: nothing),
    ``serve-engine`` (``--rollout-engine http``, or the embedded engine, which runs as a
    serve-engine on its own actor under ``--use-ray``), ``sglang``, or ``other`` (a plugin's
    engine, synced through its ``update_weights_from_tensors``)."""
    engine = config.rollout_engine
    if engine == "embedded":
        return SERVE_ENGINE if config.get("use_ray") else IN_PROCESS
    if engine == "http":
        return SERVE_ENGINE
    return SGLANG if engine == "sglang" else OTHER


def choose_sync_path(config: Any, *, engine_kind: str, colocated: bool, cuda: bool) -> str:
    """The path of ``--weight-sync-path`` (its ``auto`` resolved), or a one-line
    :class:`ConfigError` for a choice this run cannot take.

    ``auto``: the in-process engine needs none; an engine on the trainer's GPU
    (``colocated`` and ``cuda``, one-process trainer) gets ``cuda-ipc``; serve-engine servers the run places on
    GPUs of their own under ``--use-ray`` get ``distributed``; otherwise ``http``
    (serve-engine, a plugin's engine) or ``disk`` (sglang-diffusion)."""
    chosen = config.get("weight_sync_path") or "auto"
    flag = f"--weight-sync-path {chosen}"
    if engine_kind == IN_PROCESS:
        if chosen != "auto":
            raise ConfigError(
                f"{flag}: the in-process embedded engine samples the trainer's own modules, so there is no weight sync "
                "(leave it auto, or use --use-ray or --rollout-engine http/sglang)"
            )
        return "none"
    ranks_send = bool(config.get("use_ray"))  # Ray's training ranks send buckets or broadcast; no IPC sender there yet
    started_here = not config.get("rollout_engine_urls")  # only servers the run starts accept IPC handles
    if chosen == "auto":
        if colocated and cuda and engine_kind != OTHER and not ranks_send and started_here:
            return "cuda-ipc"
        own_servers = engine_kind == SERVE_ENGINE and started_here
        if cuda and own_servers and config.get("use_ray") and not colocated:
            return "distributed"
        return "disk" if engine_kind == SGLANG else "http"
    if engine_kind == OTHER:
        if chosen != "http":
            raise ConfigError(
                f"{flag}: --rollout-engine {config.rollout_engine} is a plugin's engine, synced through its own "
                "update_weights_from_tensors; leave --weight-sync-path auto (or http)"
            )
        return chosen
    if chosen == "cuda-ipc":
        if not colocated:
            raise ConfigError(f"{flag} requires --colocate: CUDA-IPC handles open only on the GPU of the process that made them")
        if not cuda:
            raise ConfigError(f"{flag} needs CUDA, and this machine has no GPU; use http or distributed (gloo)")
        if not started_here:
            raise ConfigError(
                f"{flag} with --rollout-engine-urls: only the servers a run starts accept CUDA-IPC handles "
                "(started with --accept-ipc-weights, on this machine); use http"
            )
        if ranks_send:
            raise ConfigError(
                f"{flag} with --use-ray: the training ranks send weights as http buckets or over a distributed group; "
                "CUDA-IPC handles come only from a one-process run's trainer in this version"
            )
    elif chosen == "distributed":
        if engine_kind == SGLANG:
            raise ConfigError(
                f"{flag}: sglang-diffusion servers have no distributed weight-update endpoints; use disk (or cuda-ipc with --colocate)"
            )
        if colocated and cuda:
            raise ConfigError(f"{flag} with --colocate on GPUs: nccl cannot put two ranks on one device; use cuda-ipc")
    elif chosen == "http":
        if engine_kind == SGLANG:
            raise ConfigError(f"{flag}: sglang-diffusion servers do not take safetensors buckets; use disk (or cuda-ipc with --colocate)")
    elif chosen == "disk" and engine_kind != SGLANG:
        raise ConfigError(f"{flag} applies to --rollout-engine sglang only (its servers load weights from disk); use http or distributed")
    return chosen


def run_sync_path(config: Any, *, cuda: bool) -> str:
    """:func:`choose_sync_path` for a run's own configuration: its engine, ``--colocate``."""
    return choose_sync_path(config, engine_kind=engine_kind(config), colocated=bool(config.get("colocate")), cuda=cuda)


def ranks_sync_path(config: Any, *, gpus: bool) -> str:
    """The path of a ``--use-ray`` run's syncs, decided once by the driver from the
    placement (``gpus``: the cluster's devices are GPUs) rather than by each rank from its
    own devices: the ranks send ``http`` buckets or broadcast in a ``distributed`` group
    (``auto`` never picks ``cuda-ipc`` under Ray, and an explicit one is refused)."""
    chosen = run_sync_path(config, cuda=gpus)
    return chosen if chosen == "distributed" else "http"


__all__ = ["PATHS", "choose_sync_path", "engine_kind", "ranks_sync_path", "run_sync_path"]
