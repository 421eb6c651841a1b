"""Sequence parallelism in the trainer (``--sequence-parallel-size`` SP, ``--ulysses-degree``
U): one sample's tokens split over SP ranks in the trained transformer's forward and
backward, on diffusers' context parallelism.

**The mesh.** The training ranks form a 4-D device mesh ``(dp_replicate, dp_shard, ring,
ulysses)`` of sizes ``(--dp-replicate-size, DP / replicate, SP / U, U)``, where DP = world /
SP is the data-parallel size. Consecutive ranks are one sequence-parallel group (rank =
``dp_rank x SP + sp_rank``), so its all-to-all stays on the fastest links. FSDP2 shards
over ``dp_shard x ring x ulysses`` flattened (``dp_shard_sp``, as torchtitan's dp_shard_cp)
and replicates over ``dp_replicate``: gradients are reduced over the data-parallel and
the sequence-parallel ranks.

**diffusers' context parallelism, set up by hand.** ``ModelMixin.enable_parallelism``
builds its own mesh from ``torch.accelerator.device_count()``, which fails on a CPU-only
machine and knows nothing of FSDP. :func:`apply_context_parallel` does what it does with
our mesh: a ``ContextParallelConfig(ring_degree, ulysses_degree, mesh)`` set up for this
rank, recorded on every attention processor (they pass it to ``dispatch_attention_fn``,
which runs the Ulysses all-to-all or the ring), and diffusers' split/gather hooks placed
by the component's plan (:meth:`~miles_core.family.ModelFamily.context_parallel_plan`:
the transformer's ``_cp_plan``, or one the family provides, SD3's). Ulysses works with
torch's native attention, on CPU with gloo too; the ring merges partial results with
their log-sum-exp, so it needs a backend that returns one (flash or cuDNN, CUDA only:
:data:`~miles_core.config.sequence_parallel.RING_BACKENDS`).

**The data and the gradient.** The SP ranks of one data-parallel group train the same
samples: the trainer's data-parallel rank and size are :attr:`Layout.dp_rank` and DP. Each
SP rank's forward ends with the gathered output (the whole sample), so every SP rank
computes the same loss; its backward reaches only its own tokens (the gather's backward
keeps this rank's slice; the all-to-all's backward returns the other ranks' shares of
each attention), so the SP ranks' gradients add up to the sample's gradient. FSDP2
averages over all ``world = DP x SP`` ranks, so the trainer scales each micro-batch's
loss (a share of the whole step) by ``world``: the reduced gradient is then the step's,
as at world size 1. Metrics are taken from the first SP rank of each data-parallel group
(the others computed the same numbers).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_core.config.sequence_parallel import RING_BACKENDS, ulysses_degree
from miles_core.errors import ConfigError

FLAG = "--sequence-parallel-size"


@dataclass(frozen=True)
class Layout:
    """Where one rank stands: data-parallel and sequence-parallel coordinates."""

    rank: int
    world: int
    sp: int
    ulysses: int
    replicate: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel size (ranks that train different samples)."""
        return self.world // self.sp

    @property
    def ring(self) -> int:
        return self.sp // self.ulysses

    @property
    def dp_shard(self) -> int:
        return self.dp // self.replicate

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp


def layout_from_config(config: Any, rank: int) -> Layout:
    """The layout of ``rank`` in a run of ``config`` (``config.world_size`` ranks)."""
    sp = int(getattr(config, "sequence_parallel_size", 1) or 1)
    return Layout(
        rank=int(rank),
        world=int(config.world_size),
        sp=sp,
        ulysses=ulysses_degree(sp, int(getattr(config, "ulysses_degree", 0) or 0)),
        replicate=int(getattr(config, "dp_replicate_size", 1) or 1),
    )


def build_meshes(layout: Layout, device_type: str) -> tuple[Any, Any]:
    """``(world mesh, FSDP mesh)``: the 4-D ``(dp_replicate, dp_shard, ring, ulysses)``
    mesh the context-parallel config reads, and the mesh FSDP2 shards on
    (``dp_shard_sp``, or ``(dp_replicate, dp_shard_sp)`` with hybrid sharding). Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(
        device_type,
        (layout.replicate, layout.dp_shard, layout.ring, layout.ulysses),
        mesh_dim_names=("dp_replicate", "dp_shard", "ring", "ulysses"),
    )
    # The same ranks in the same (row-major) order, with the last three dimensions as one:
    # built directly, since torch deprecates slicing a flattened dimension off a root mesh.
    shard = layout.dp_shard * layout.sp
    if layout.replicate > 1:
        fsdp_mesh = init_device_mesh(device_type, (layout.replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard_sp"))
    else:
        fsdp_mesh = init_device_mesh(device_type, (shard,), mesh_dim_names=("dp_shard_sp",))
    return world, fsdp_mesh


def _attention_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    return [sub for sub in module.modules() if isinstance(sub, (Attention, MochiAttention, AttentionModuleMixin))]


def _check_processors(name: str, module: torch.nn.Module, layout: Layout) -> list[Any]:
    """The component's attention processors, after checking that each dispatches through
    diffusers' backends with one that can run this split (one-line errors naming it)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    processors = []
    for attention in _attention_modules(module):
        processor = attention.processor
        if processor is None or not hasattr(processor, "_parallel_config"):
            raise ConfigError(
                f"{FLAG} {layout.sp}: the attention processor {type(processor).__name__} of component {name} "
                f"({type(module).__name__}) does not dispatch through diffusers' attention backends, so it cannot "
                "split a sample's tokens (its family must provide a dispatching processor)"
            )
        backend = processor._attention_backend
        backend = AttentionBackendName(backend) if backend is not None else _AttentionBackendRegistry.get_active_backend()[0]
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ConfigError(
                f"{FLAG} {layout.sp}: --fsdp-attention-backend {backend.value} does not support context parallelism; use one "
                f"of {', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))}"
            )
        if layout.ring > 1 and backend.value not in RING_BACKENDS:
            raise ConfigError(
                f"{FLAG} {layout.sp} --ulysses-degree {layout.ulysses}: ring attention needs a backend that returns "
                f"the log-sum-exp; --fsdp-attention-backend {backend.value} does not (use one of {', '.join(RING_BACKENDS)})"
            )
        processors.append(processor)
    if not processors:
        raise ConfigError(f"{FLAG} {layout.sp}: component {name} ({type(module).__name__}) has no attention to split")
    return processors


def apply_context_parallel(modules: Mapping[str, torch.nn.Module], family: Any, config: Any, layout: Layout, world_mesh: Any) -> Any:
    """Set diffusers' context parallelism up on each trained component (before FSDP2
    wraps it): the family's plan, processors that dispatch with this rank's
    ``ParallelConfig``, diffusers' split/gather hooks, and checks that a sample's
    sequences divide over the ranks. Returns the ``ParallelConfig``."""
    from diffusers.hooks.context_parallel import apply_context_parallel as apply_plan
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    from miles_core.training.backend_options import set_attention_backend

    device = torch.device(getattr(family, "device", "cpu"))
    parallel = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=world_mesh)
    )
    parallel.setup(layout.rank, layout.world, device, mesh=world_mesh)  # collective: flattens the ring x ulysses mesh
    # The plans, the heads rule and the size checks (installed first: their output checks
    # must run inside diffusers' split).
    plans = check_split_shapes(modules, family, layout.sp, layout.ulysses)
    for (name, module), plan in zip(modules.items(), plans):
        if config.fsdp_attention_backend:
            set_attention_backend({name: module}, config.fsdp_attention_backend)  # processors the family installed too
        for processor in _check_processors(name, module, layout):
            processor._parallel_config = parallel
        module._parallel_config = parallel  # what enable_parallelism records: set_attention_backend checks it
        apply_plan(module, parallel.context_parallel_config, plan)
    return parallel


def check_split_shapes(modules: Mapping[str, torch.nn.Module], family: Any, sequence_parallel: int, ulysses: int) -> list[Any]:
    """What can be checked of a split before any rank exists: every trained component has a
    plan (the family's or diffusers'), and its attention heads divide over the Ulysses
    degree. Installs the plan's size checks (:func:`install_size_checks`) without splitting
    anything, so a forward afterwards raises the one-line :class:`ConfigError` of a
    tensor whose tokens ``sequence_parallel`` ranks cannot share; the memory planner runs
    one on the meta device before a run loads. Returns the plans."""
    plans = []
    for name, module in modules.items():
        plan = family.context_parallel_plan(name, module, sequence_parallel)
        if not plan:
            raise ConfigError(
                f"{FLAG} {sequence_parallel}: component {name} ({type(module).__name__}) has no context-parallel plan (no "
                f"_cp_plan in diffusers, none from the {type(family).__name__} family)"
            )
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        if heads is not None and int(heads) % ulysses:
            raise ConfigError(
                f"{FLAG} {sequence_parallel} --ulysses-degree {ulysses}: Ulysses gives each rank a share of the attention "
                f"heads, and component {name} has {heads}; use a Ulysses degree that divides {heads}"
            )
        install_size_checks(name, module, plan, sequence_parallel)
        plans.append(plan)
    return plans


def install_size_checks(name: str, module: torch.nn.Module, plan: Mapping[str, Any], degree: int) -> None:
    """Hooks that stop a forward whose split tensors the ranks cannot share equally, with
    a one-line error naming the sizes (diffusers only asserts). Inputs: torch pre-hooks,
    which run before the forward diffusers wraps; outputs: diffusers hooks registered
    before the plan's, so they see an output before diffusers' split does."""
    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks.context_parallel import ContextParallelInput, _get_submodule_by_name

    def check(tensor: Any, spec: ContextParallelInput, where: str) -> None:
        if not torch.is_tensor(tensor) or (spec.expected_dims is not None and tensor.dim() != spec.expected_dims):
            return  # diffusers leaves it whole
        size = tensor.shape[spec.split_dim]
        if size % degree:
            raise ConfigError(
                f"{FLAG} {degree}: {where} of component {name} has {size} tokens along dimension {spec.split_dim}, which "
                f"{degree} ranks cannot share equally; choose sizes (--diffusion-height, --diffusion-width, frames, "
                f"prompt length) whose token counts {degree} divides"
            )

    class OutputCheck(ModelHook):
        def __init__(self, outputs: dict[int, ContextParallelInput], label: str) -> None:
            super().__init__()
            self.outputs, self.label = outputs, label

        def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
            values = output if isinstance(output, (list, tuple)) else [output]
            for index, spec in self.outputs.items():
                if index < len(values):
                    check(values[index], spec, f"output {index} of {self.label}")
            return output

    for module_id, entries in plan.items():
        if not isinstance(entries, Mapping):
            continue  # a gather
        targets = _get_submodule_by_name(module, module_id)
        label = module_id or "the forward"
        inputs = {key: spec for key, spec in entries.items() if isinstance(key, str)}
        outputs = {key: spec for key, spec in entries.items() if isinstance(key, int)}
        for target in targets if isinstance(targets, list) else [targets]:
            if inputs:
                names = list(inspect.signature(type(target).forward).parameters)[1:]

                def pre_hook(_: Any, args: tuple, kwargs: dict, inputs: dict = inputs, names: list = names, label: str = label) -> None:
                    for key, spec in inputs.items():
                        value = kwargs.get(key)
                        if value is None and key in names and names.index(key) < len(args):
                            value = args[names.index(key)]
                        specs = spec if isinstance(spec, (list, tuple)) else [spec]
                        values = value if isinstance(value, (list, tuple)) else [value]
                        for part, item in zip(specs, values):
                            if not part.split_output:
                                check(item, part, f"input {key} of {label}")

                target.register_forward_pre_hook(pre_hook, with_kwargs=True)
            if outputs:
                HookRegistry.check_if_exists_or_initialize(target).register_hook(OutputCheck(outputs, label), f"sp_check---{module_id}")


__all__ = ["FLAG", "Layout", "apply_context_parallel", "build_meshes", "check_split_shapes", "install_size_checks", "layout_from_config"]
