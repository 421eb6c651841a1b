"""FSDP2 data parallelism for the trainer: a train world size above 1
(``--actor-num-nodes`` x ``--actor-num-gpus-per-node``).

One process per rank. Each calls :func:`init_process_group` (gloo on CPU, nccl on GPU),
loads the model family (with only its share of the trained components:
:mod:`miles_core.training.rank_loading`, whose ``sources`` rank 0 passes on) and builds a
:class:`~miles_core.training.trainer.Trainer` with ``dp_rank`` = its rank; the trainer then
shards its trainable components with :func:`shard_modules` (after adding LoRA adapters,
before building the optimizer), which gives components built on the meta device their
shards from rank 0:

- ``fully_shard`` on each repeated transformer block of a component (:func:`blocks_of`),
  then on the component itself; frozen components (text encoders, VAE) stay whole and
  unsharded on every rank, they are only read. Frozen weights *inside* a trained
  component (LoRA's base weights) are sharded with it, like the reference.
- The mesh is 1-D over the world, or 2-D ``(dp_replicate, dp_shard)`` =
  (``--dp-replicate-size``, world / replicate) for hybrid sharding (HSDP). With
  ``--sequence-parallel-size`` > 1 the shard dimension also spans the sequence-parallel
  ranks, and diffusers' context parallelism is set up on the components first
  (:mod:`miles_core.training.sequence_parallel`).
- ``MixedPrecisionPolicy(param_dtype=--diffusion-forward-dtype,
  reduce_dtype=--fsdp-reduce-dtype, cast_forward_inputs=False)``. The trainable
  parameters are cast to ``--fsdp-master-dtype`` before sharding, so the sharded (master)
  weights and the optimizer state are kept in that dtype while the forward runs in the
  forward dtype. The inputs are left to the family (the timestep stays fp32, as in one
  process). A single-process trainer keeps the same master dtype with master copies
  (:mod:`miles_core.training.master_weights`), and equals two ranks to rounding.
- ``--fsdp-cpu-offload``: FSDP2's ``CPUOffloadPolicy`` (:func:`offload_policy`; pinned
  host memory only with CUDA, pinning needs its runtime). The shards, their gradients
  and the optimizer state live in CPU memory; FSDP2 copies each block's shards to the
  mesh's device for the all-gather and copies the reduced gradients back, and the
  optimizer step and clipping run on the CPU. The collectives over those CPU tensors
  (the gradient norm's all-reduce, ``full_tensor`` for checkpoints) run on the mesh's
  groups, so an nccl group is joined as ``cpu:<--fsdp-cpu-backend>,cuda:nccl``
  (:func:`group_backend`, through :func:`init_from_config`); :func:`shard_modules`
  refuses a group without a CPU side. On a CPU mesh (gloo) the offload changes FSDP2's
  copy path only: a two-rank run trains bit for bit as without it.

What is the same as world size 1, given the same rollout (every rank is given the whole
rollout, samples and advantages, and takes its ``--train-dp-split-mode`` share):

- the policy loss (Flow-GRPO): each micro-batch's loss is weighted by its kept pairs over
  the step's kept pairs *across ranks* (exchanged), times the world size, because FSDP2
  averages gradients over ranks; the per-step metric sums are gathered, so every rank
  returns the global metrics (``*_max_*`` metrics take the maximum); the gradient norm
  that ``clip_grad_norm_`` computes over the sharded (DTensor) gradients is the global
  one. Losses, metrics and weights equal world size 1 to float rounding (the sums run in
  another order).
- DiffusionNFT: the step generator ``(--seed, optimizer step)`` is replayed over the whole
  step on every rank (the timestep permutations of every sample and the noise of every
  world-size-1 micro-batch), and each rank keeps the noise rows of its own items, so each
  item is trained at the same timestep with the same noise as at world size 1.

What differs: SFT draws its noise and timesteps per micro-batch inside ``sft_batch``
from a generator seeded by ``(--seed, optimizer step)`` plus an offset for ranks above 0,
so the rows of rank 0 see the draws they would see at world size 1 but the others see
other (independent) draws; the loss has the same expectation, not the same value.

Every FSDP2 forward and backward is a collective: all ranks must run the same number of
micro-batches, through the same components, in the same order. Before an optimizer
step's first forward the ranks exchange their micro-batch plans and stop with a one-line
``ValueError`` naming every rank's count when they differ (for example nft with a
per-sample filter that removed samples from one rank's share only), instead of hanging.
With the policy loss a micro-batch whose pairs are all masked still runs a zero-weight
backward under FSDP2, so the ranks' backward collectives stay paired. Which expert of a
two-expert family (Wan 2.2) a micro-batch runs is part of the plan for the policy loss;
nft and SFT micro-batches are not checked for it.

Collective calls (every rank must make them, in the same order): the trainer's
construction, ``train_rollout`` / ``train_nft`` / ``train_sft``, ``trainable_state``,
``load_trainable_state``, ``optimizer_state``, ``load_optimizer_state``,
``ema.state_dict`` and ``ema.load_state_dict``, and any forward of a sharded component
(so an engine cannot run the sharded modules on one rank alone).

LoRA checkpoints hold full tensors (:meth:`Trainer.trainable_state`,
:meth:`Trainer.optimizer_state`, ``EMA.state_dict``), index-keyed like
``optimizer.state_dict()`` at world size 1, so a run saved at one world size resumes at
another; full fine-tuning saves each rank's shards instead, nothing gathered
(:mod:`~miles_core.training.sharded_checkpoint`, also loadable at any world size). Per-rank RNG: :func:`rank_rng_state` on each rank (the driver saves the list,
``extra["rank_rng"]``), :func:`restore_rank_rng` puts back rank ``r``'s state when the
world size matches and otherwise reseeds each rank from ``(--seed, rank)``. The
trainer's own draws (nft and SFT noise, permutations) never use these global
generators: they come from generators seeded by ``(--seed, optimizer step)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from miles_core.config.fsdp_offload import CPU_BACKENDS

BACKENDS: tuple[str, ...] = ("gloo", "nccl")


# ---------------------------------------------------------------------------- process group


def init_process_group(
    rank: int,
    world_size: int,
    *,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_minutes: float = 10,
    device: Any = None,
    cpu_backend: str | None = None,
) -> None:
    """Join the training ranks' process group (``tcp://master_addr:master_port``).

    ``backend`` is ``--distributed-backend`` (gloo on CPU, nccl on GPU; nccl sets the
    CUDA device first: ``device``, default the current one), ``timeout_minutes``
    ``--distributed-timeout-minutes``. ``cpu_backend`` (``--fsdp-cpu-backend`` under
    ``--fsdp-cpu-offload``) serves the collectives on CPU tensors of an nccl group
    (:func:`group_backend`). Calling it again with the same rank, world size and
    backend is a no-op; anything else while a group exists is an error."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; training on several ranks needs it")
    if backend not in BACKENDS:
        raise ValueError(f"--distributed-backend {backend}: must be one of {', '.join(BACKENDS)}")
    if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
        raise ValueError(f"rank {rank} is not in [0, {world_size}) (world size {world_size})")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master port {master_port} is not a TCP port (1-65535)")
    if not timeout_minutes or timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes {timeout_minutes}: must be positive")
    composed = group_backend(backend, cpu_backend)
    if dist.is_initialized():
        current = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        if current == (int(rank), int(world_size), composed):
            return
        raise RuntimeError(
            f"a process group already exists here (rank {current[0]} of {current[1]}, {current[2]}); "
            "call destroy_process_group() before joining another"
        )
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs a CUDA device on every rank; use gloo on CPU")
        torch.cuda.set_device(torch.device(device) if device is not None else torch.cuda.current_device())
    host = f"[{master_addr}]" if ":" in str(master_addr) and not str(master_addr).startswith("[") else master_addr
    try:
        dist.init_process_group(
            composed,
            init_method=f"tcp://{host}:{int(master_port)}",
            rank=int(rank),
            world_size=int(world_size),
            timeout=timedelta(minutes=float(timeout_minutes)),
        )
    except Exception as exc:  # the store and backends raise assorted types; one line names the setup
        raise RuntimeError(
            f"joining the process group failed (rank {rank} of {world_size}, {composed}, tcp://{host}:{master_port}): "
            f"{type(exc).__name__}: {exc}".replace("\n", " ")
        ) from exc


def group_backend(backend: str, cpu_backend: str | None) -> str:
    """The backend string of the training process group: ``backend`` alone, or, for an
    nccl group with a CPU backend, ``cpu:<cpu_backend>,cuda:nccl``: one group whose
    collectives on CUDA tensors run on nccl and those on CPU tensors on ``cpu_backend``.
    FSDP2's CPU offload needs the latter: its shards, gradients and optimizer state are
    CPU tensors, and the collectives over them (the gradient norm that clipping
    all-reduces, the full tensors of checkpoints) run on the mesh's groups, which inherit
    this backend. A gloo group runs every collective on CPU already, so ``cpu_backend``
    must be gloo (or None) there."""
    if cpu_backend is None:
        return backend
    if cpu_backend not in CPU_BACKENDS:
        raise ValueError(f"--fsdp-cpu-backend {cpu_backend}: must be one of {', '.join(CPU_BACKENDS)} (a backend for CPU tensors)")
    if backend == "nccl":
        return f"cpu:{cpu_backend},cuda:nccl"
    if cpu_backend != backend:
        raise ValueError(
            f"--fsdp-cpu-backend {cpu_backend} with --distributed-backend {backend}: a {backend} group runs the "
            f"CPU collectives itself; use --fsdp-cpu-backend {backend}"
        )
    return backend


def init_from_config(config: Any, rank: int, *, master_addr: str, master_port: int, device: Any = None) -> None:
    """:func:`init_process_group` with ``config.world_size``, ``--distributed-backend``,
    ``--distributed-timeout-minutes`` and, under ``--fsdp-cpu-offload``,
    ``--fsdp-cpu-backend``."""
    init_process_group(
        rank,
        config.world_size,
        master_addr=master_addr,
        master_port=master_port,
        backend=config.distributed_backend,
        timeout_minutes=config.distributed_timeout_minutes,
        device=device,
        cpu_backend=config.fsdp_cpu_backend if getattr(config, "fsdp_cpu_offload", False) else None,
    )


def destroy_process_group() -> None:
    """Leave the process group (no-op when none exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_active() -> bool:
    """Whether a process group exists in this process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------- sharding


def _dtype(name: str) -> torch.dtype:
    from miles_core.model_loading import torch_dtype

    return torch_dtype(name)


def build_mesh(config: Any, device_type: str) -> Any:
    """The data-parallel device mesh: 1-D over the world, or 2-D
    ``(dp_replicate, dp_shard)`` with ``--dp-replicate-size`` > 1 (HSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    replicate = int(getattr(config, "dp_replicate_size", 1) or 1)
    if replicate < 1 or world % replicate:
        raise ValueError(f"--dp-replicate-size {replicate} must divide the data-parallel size {world}")
    if replicate > 1:
        return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))


def mixed_precision(config: Any) -> Any:
    """``MixedPrecisionPolicy(param_dtype=--diffusion-forward-dtype, reduce_dtype=--fsdp-reduce-dtype)``,
    without FSDP2's cast of the forward's floating-point inputs: the families cast their
    inputs themselves and keep the timestep in fp32 (as the pipelines and the engine do);
    a bf16 timestep would make the sharded forward differ from the one-process one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=_dtype(config.diffusion_forward_dtype),
        reduce_dtype=_dtype(config.fsdp_reduce_dtype),
        cast_forward_inputs=False,
    )


def offload_policy(config: Any) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` under ``--fsdp-cpu-offload`` (pinned host memory when
    CUDA is present: pinning needs a CUDA runtime), else the no-offload ``OffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if getattr(config, "fsdp_cpu_offload", False):
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


def has_cpu_collectives(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend()``'s string) can run
    collectives on CPU tensors."""
    parts = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {"cpu": backend}
    return parts.get("cpu") in CPU_BACKENDS


def blocks_of(module: torch.nn.Module, family: Any = None, component: str | None = None) -> list[torch.nn.Module]:
    """The repeated blocks of a trained component, each sharded on its own: the family's
    ``fsdp_blocks(component, module)`` when it defines one; else the submodules whose
    class diffusers lists in ``_repeated_blocks`` or ``_no_split_modules`` (outermost
    only); else the elements of the component's direct ``ModuleList`` children."""
    hook = getattr(family, "fsdp_blocks", None)
    if callable(hook):
        return list(hook(component, module))
    names = set(getattr(module, "_repeated_blocks", None) or ()) | set(getattr(module, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []
    if names:
        inside: list[str] = []
        for name, sub in module.named_modules():
            if sub is module or any(name.startswith(prefix + ".") for prefix in inside):
                continue
            if type(sub).__name__ in names:
                found.append(sub)
                inside.append(name)
    if not found:
        found = [block for child in module.children() if isinstance(child, torch.nn.ModuleList) for block in child]
    return found


def shard_modules(
    modules: Mapping[str, torch.nn.Module], config: Any, family: Any, *, dp_rank: int, sources: dict[str, torch.nn.Module] | None = None
) -> Any:
    """Cast the trainable parameters to ``--fsdp-master-dtype`` and apply ``fully_shard``
    (with :func:`mixed_precision` and :func:`offload_policy`) to each component's blocks
    and then the component; return the mesh. Collective. Components built on the meta
    device (:mod:`miles_core.training.rank_loading`) then get their shards from rank 0's
    ``sources``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != int(config.world_size):
        raise ValueError(
            f"the process group has {world} ranks but the configuration's train world size is "
            f"{config.world_size} (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if dp_rank != rank:
        raise ValueError(f"Trainer(dp_rank={dp_rank}) in the process group's rank {rank}: pass the rank as dp_rank")
    device = getattr(family, "device", torch.device("cpu"))
    sequence_parallel = None
    if int(getattr(config, "sequence_parallel_size", 1) or 1) > 1:
        from miles_core.training import sequence_parallel

        layout = sequence_parallel.layout_from_config(config, rank)
        world_mesh, mesh = sequence_parallel.build_meshes(layout, torch.device(device).type)
    else:
        mesh = build_mesh(config, torch.device(device).type)
    policy = mixed_precision(config)
    offload = offload_policy(config)
    if getattr(config, "fsdp_cpu_offload", False) and not has_cpu_collectives(str(dist.get_backend())):
        raise ValueError(
            f"--fsdp-cpu-offload: the process group's backend {dist.get_backend()} has none for CPU tensors, which the "
            "offloaded shards' collectives need; join it with init_from_config (cpu:<--fsdp-cpu-backend>,cuda:nccl)"
        )
    master = _dtype(config.fsdp_master_dtype)
    from miles_core.training.rank_loading import is_deferred, materialise_shards

    deferred = {name: module for name, module in modules.items() if is_deferred(module)}
    if deferred and rank == 0 and set(deferred) - set(sources or {}):
        raise ValueError(f"components {sorted(set(deferred) - set(sources or {}))} were built on the meta device with no weights to load")
    # Weights loaded whole on every rank may differ (LoRA drawn per process): rank 0's win.
    # Deferred ones are broadcast from rank 0 anyway.
    same_starting_weights({name: module for name, module in modules.items() if name not in deferred})
    if sequence_parallel is not None:
        # Hooks and processors on the plain modules, before fully_shard wraps them.
        sequence_parallel.apply_context_parallel(modules, family, config, layout, world_mesh)
    for name, module in modules.items():
        for parameter in module.parameters():
            if parameter.requires_grad and parameter.dtype != master:
                parameter.data = parameter.data.to(master)
        for block in blocks_of(module, family, name):
            fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    if deferred:
        # FSDP2's CPU offload keeps the shards on the host.
        storage = torch.device("cpu") if getattr(config, "fsdp_cpu_offload", False) else torch.device(device)
        materialise_shards(deferred, sources if sources is not None else {}, device=torch.device(device), storage=storage)
    return mesh


@torch.no_grad()
def same_starting_weights(modules: Mapping[str, torch.nn.Module]) -> list[str]:
    """Make every rank start from rank 0's trainable weights (collective, before sharding:
    each rank's shard is cut from its own copy). Weights loaded from the checkpoint agree
    already; LoRA adapters are initialised from each process's own RNG and would not. The
    ranks compare a fingerprint of each trainable parameter and rank 0 broadcasts those
    that differ; returns their names."""
    import torch.distributed as dist

    params = [
        (f"{component}.{name}", p) for component, module in modules.items() for name, p in module.named_parameters() if p.requires_grad
    ]
    prints = [(float(p.double().sum()), float(p.double().square().sum())) for _, p in params]
    gathered = all_gather_object(prints)
    differing = [i for i in range(len(params)) if any(ranks[i] != gathered[0][i] for ranks in gathered)]
    for i in differing:
        dist.broadcast(params[i][1].data, src=0)
    return [params[i][0] for i in differing]


# ---------------------------------------------------------------------------- full state


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed has no sharded tensors
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter or optimizer state)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A private full CPU copy of ``tensor``; for a DTensor the all-gathered tensor
    (collective: every rank must call it for the same tensor)."""
    if is_sharded(tensor):
        tensor = tensor.full_tensor()  # may alias the local shard on a mesh of one shard: copied below
    return tensor.detach().to("cpu", copy=True)


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) laid out as ``like``: this rank's shard as a
    DTensor with ``like``'s mesh and placements, or ``full`` itself on ``like``'s device
    when ``like`` is a plain tensor. No communication: each rank cuts its own shard."""
    full = full.to(device=like.device)
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def load_full_tensors(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, module_name: str) -> int:
    """Copy full tensors into ``module``'s (possibly sharded) parameters of the same
    names, each rank its shard; shapes are checked against the full shapes."""
    from miles_core.weights import load_named_tensors

    return load_named_tensors(
        module, tensors, module_name=module_name, place=lambda tensor, target: distribute_like(tensor.to(target.dtype), target)
    )


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor replaced by its full CPU tensor (and
    every other tensor copied, so later steps do not change it): the same index-keyed
    format as an unsharded optimizer's. Collective."""
    state = optimizer.state_dict()
    return {
        "state": {
            index: {key: full_tensor(value) if torch.is_tensor(value) else value for key, value in entry.items()}
            for index, entry in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load an index-keyed full state (:func:`full_optimizer_state`, or a plain
    ``optimizer.state_dict()`` of any world size) into an optimizer over sharded or plain
    parameters: every parameter-shaped tensor becomes this rank's shard of it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    converted: dict[Any, Any] = {}
    for index, entry in dict(state.get("state", {})).items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"optimizer state for parameter {index!r}, but this optimizer has {len(params)} parameters")
        param = params[index]
        values = {}
        for key, value in entry.items():
            if torch.is_tensor(value) and value.ndim > 0:
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {index} has shape {tuple(value.shape)}, the parameter "
                        f"{tuple(param.shape)}: saved with other trainable parameters (same --use-lora / LoRA settings?)"
                    )
                value = distribute_like(value, param) if is_sharded(param) else value
            values[key] = value
        converted[index] = values
    optimizer.load_state_dict({"state": converted, "param_groups": state["param_groups"]})


# ---------------------------------------------------------------------------- exchanges


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a single-element list without a group)."""
    import torch.distributed as dist

    if not is_active():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def check_plans(plans: Sequence[Sequence[Sequence[Any]]], *, first_step: int = 0) -> None:
    """``plans[rank][step]`` lists the micro-batches (a label each, e.g. the expert) that
    ``rank`` will run in each optimizer step; raise a one-line ``ValueError`` naming every
    rank's count when the ranks disagree (FSDP2's collectives would otherwise hang)."""

    def each(values: Iterable[Any]) -> str:
        return ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))

    steps = [len(plan) for plan in plans]
    if len(set(steps)) > 1:
        raise ValueError(
            f"data-parallel ranks would take different numbers of optimizer steps ({each(steps)}); every rank must "
            "be given the same rollout"
        )
    for step in range(steps[0] if steps else 0):
        counts = [len(plan[step]) for plan in plans]
        if len(set(counts)) > 1:
            raise ValueError(
                f"optimizer step {first_step + step} of this rollout: data-parallel ranks would run different numbers of micro-batches "
                f"({each(counts)}); under FSDP2 every rank must run the same number of forward and backward passes, "
                "or their collectives deadlock"
            )
        for index in range(counts[0]):
            labels = [plan[step][index] for plan in plans]
            if len(set(map(repr, labels))) > 1:
                raise ValueError(
                    f"optimizer step {first_step + step} of this rollout: micro-batch {index} would run different components on the "
                    f"data-parallel ranks ({each(labels)}); under FSDP2 every rank must run the same one"
                )


def combine_sums(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The step's metric sums over ranks: added, except ``*_max_*`` keys (the maximum)
    and ``*_min_*`` keys (the minimum). Keys are taken in sorted order."""
    keys = sorted({key for sums in per_rank for key in sums})
    combined: dict[str, float] = {}
    for key in keys:
        values = [float(sums[key]) for sums in per_rank if key in sums]
        parts = key.split("_")
        combined[key] = max(values) if "max" in parts else min(values) if "min" in parts else math.fsum(values)
    return combined


# ---------------------------------------------------------------------------- per-rank RNG


def rank_rng_state() -> dict[str, Any]:
    """This rank's global generator states (python, numpy, torch CPU and CUDA), as
    :func:`~miles_core.training.checkpoint.capture_rng` returns them; the driver saves
    the list of every rank's (``extra["rank_rng"]``)."""
    from miles_core.training.checkpoint import capture_rng

    return capture_rng()


def restore_rank_rng(states: Sequence[Mapping[str, Any]] | None, *, rank: int, world_size: int, seed: int) -> bool:
    """Put back rank ``rank``'s saved state when ``states`` has one per rank of this world
    size; otherwise (a resume at another world size, or none saved) reseed python,
    numpy and torch from ``(seed, rank)``. Returns whether the saved state was restored."""
    if states is not None and len(states) == world_size:
        from miles_core.training.checkpoint import restore_rng

        restore_rng(states[rank])
        return True
    value = (int(seed) * 1_000_003 + int(rank) * 7_919) % (2**32)
    random.seed(value)
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is not None:
        np.random.seed(value)
    torch.manual_seed(value)
    return False


__all__ = [
    "BACKENDS",
    "all_gather_object",
    "blocks_of",
    "build_mesh",
    "check_plans",
    "combine_sums",
    "destroy_process_group",
    "distribute_like",
    "full_optimizer_state",
    "full_tensor",
    "group_backend",
    "has_cpu_collectives",
    "init_from_config",
    "init_process_group",
    "is_active",
    "is_sharded",
    "load_full_optimizer_state",
    "load_full_tensors",
    "mixed_precision",
    "offload_policy",
    "rank_rng_state",
    "restore_rank_rng",
    "same_starting_weights",
    "shard_modules",
]
