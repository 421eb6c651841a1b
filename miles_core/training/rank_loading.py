"""Each rank of a sharded trainer holds only its share of the components it trains.

A trainer of world size above 1 (:mod:`miles_core.training.fsdp`) used to load the whole
pipeline on every rank and shard afterwards: a 14B expert was whole on every rank's device
before ``fully_shard`` cut it. Instead, :func:`load_rank_family` builds the trained
components on the meta device on every rank (:mod:`miles_core.component_build`: the real
module tree, no data), loads the other components as one process does, and on rank 0 alone
also loads the trained components' weights, on the host. The trainer adds its LoRA
adapters to both (rank 0's draw PEFT's initial values from the generator exactly as a
whole load does), shards the meta modules and calls :func:`materialise_shards`: parameter
by parameter and buffer by buffer, rank 0 broadcasts the full tensor and each rank keeps its
shard. No device ever holds a whole trained component and only rank 0's host does, once,
until the trainer is built; the weights are bit for bit those of a whole load.

A configuration this cannot serve loads whole as before (:func:`load_rank_family` says
why in its result): one training rank, a hub id (its ``model_index.json`` is not read
before the download), ``--model-backend-path`` and ``--sft-encoder-checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import CheckpointError
from miles_core.family import ModelFamily


@dataclass
class RankFamily:
    """A training rank's family and what materialises its deferred components."""

    family: ModelFamily
    sources: dict[str, torch.nn.Module] = field(default_factory=dict)
    """Rank 0: each deferred component with its weights, on the host (the trainer consumes
    them); other ranks: empty."""
    whole: str | None = None
    """Why the trained components were loaded whole (None: deferred)."""


def trained_names(config: Any) -> list[str]:
    """The components ``--update-weight-target-module`` trains."""
    return [name.strip() for name in str(config.update_weight_target_module).split(",") if name.strip()]


def _whole_reason(config: Any) -> str | None:
    if int(config.world_size) < 2:
        return "one training rank shards nothing"
    if config.get("model_backend_path"):
        return "--model-backend-path builds its own family"
    if config.get("sft_encoder_checkpoint"):
        return "--sft-encoder-checkpoint loads its encoders from another pipeline"
    if not Path(str(config.hf_checkpoint)).is_dir():
        return f"--hf-checkpoint {config.hf_checkpoint} is not a local directory"
    return None


def load_rank_family(config: Any, rank: int) -> RankFamily:
    """Rank ``rank``'s family (see the module docstring): the trained components on the meta
    device, the rest loaded on the device; rank 0 also gets them with weights on the host."""
    from miles_core.component_build import build_component, component_class
    from miles_core.family_match import read_model_index
    from miles_core.model_loading import family_class, finish_family, load_family, model_device, torch_dtype
    from miles_core.quiet import quiet_hub_load

    reason = _whole_reason(config)
    if reason is not None:
        return RankFamily(load_family(config), whole=reason)
    checkpoint = Path(str(config.hf_checkpoint))
    dtype = torch_dtype(config.diffusion_forward_dtype)
    index = read_model_index(checkpoint)
    deferred: dict[str, torch.nn.Module] = {}
    sources: dict[str, torch.nn.Module] = {}
    for name in trained_names(config):
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry)):
            raise CheckpointError(
                f"--hf-checkpoint {checkpoint}: model_index.json lists no component {name!r}, which --update-weight-target-module trains"
            )
        where = f"--hf-checkpoint {checkpoint}: component {name} ({entry[0]}.{entry[1]})"
        cls = component_class(entry[0], entry[1], where)
        deferred[name] = build_component(cls, checkpoint / name, dtype, where, "meta")
        if rank == 0:
            with quiet_hub_load(checkpoint):
                sources[name] = cls.from_pretrained(str(checkpoint), subfolder=name, torch_dtype=dtype)
    family_cls = family_class(config)
    family = family_cls(family_cls.load_pipeline(checkpoint, dtype=dtype, **deferred), device=model_device(), dtype=dtype)
    return RankFamily(finish_family(config, family), sources)


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s parameters, then its buffers, by name (each tensor once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def is_deferred(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a parameter on the meta device (built, not loaded)."""
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
def materialise_shards(
    modules: Mapping[str, torch.nn.Module], sources: MutableMapping[str, torch.nn.Module], *, device: torch.device, storage: torch.device
) -> int:
    """Give the sharded, meta-built ``modules`` their data (collective, after
    ``fully_shard``): each parameter's and buffer's full tensor is broadcast from rank 0's
    ``sources`` (same names, shapes and dtypes: checked there) over ``device`` and each
    rank keeps its shard, allocated on ``storage`` (the device, or the host under FSDP2's CPU
    offload). ``sources`` is emptied as it is consumed; returns the bytes broadcast."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank = dist.get_rank()
    sent = 0
    for name, module in modules.items():
        source = dict(named_tensors(sources.pop(name))) if rank == 0 else {}
        module.to_empty(device=storage)
        targets = list(named_tensors(module))
        if rank == 0:
            shapes = {key: (tuple(t.shape), t.dtype) for key, t in source.items()}
            wanted = {key: (tuple(t.shape), t.dtype) for key, t in targets}
            if set(shapes) != set(wanted) or any(shapes[key][0] != wanted[key][0] for key in wanted):
                differing = sorted(set(shapes) ^ set(wanted)) or sorted(k for k in wanted if shapes[k][0] != wanted[k][0])
                raise CheckpointError(
                    f"component {name}: the loaded weights and the module built from its config differ at {differing[:3]}"
                )
        for key, tensor in targets:
            if rank == 0:
                full = source.pop(key).to(device=device, dtype=tensor.dtype).contiguous()
            else:
                full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
            dist.broadcast(full, src=0)
            sent += full.numel() * full.element_size()
            if isinstance(tensor, DTensor):
                shard = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
                tensor.to_local().copy_(shard)
            else:
                tensor.copy_(full)
            del full
    return sent


__all__ = ["RankFamily", "is_deferred", "load_rank_family", "materialise_shards", "named_tensors", "trained_names"]
