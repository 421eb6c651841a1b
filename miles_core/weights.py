"""Moving weights between trainer and engines: checksums, safetensors buckets, loading.

Checksums are one SHA-256 per module over its parameters in sorted name order, so the
trainer and any engine can compare weights without moving them. Tensor updates travel as
safetensors buckets of at most ``--update-weight-buffer-size`` bytes (never pickle).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from miles_core.errors import WeightUpdateError


def named_tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over ``(name, tensor)`` pairs in sorted name order, as sglang-diffusion's
    ``compute_weights_checksum`` (``runtime/loader/weight_utils.py``) computes it: for each
    pair, the name's UTF-8 bytes, then the tensor's raw bytes in its own dtype (flattened,
    contiguous, on the CPU). Shapes and dtypes are not hashed separately."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        digest.update(name.encode())
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def module_checksum(module: torch.nn.Module) -> str:
    """The checksum of a module's parameters (``named_parameters()``, buffers excluded),
    as sglang-diffusion's ``/get_weights_checksum`` reports it for that module."""
    return named_tensors_checksum(module.named_parameters())


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors into buckets of at most ``max_bytes`` (a tensor larger than the
    limit travels alone)."""
    if max_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if bucket:
        yield bucket


def bucket_to_bytes(bucket: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(dict(bucket))


def bucket_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def load_named_tensors(
    module: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    module_name: str,
    place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Copy ``tensors`` into the module's parameters of the same names, in place.
    Every name must exist with the same (full) shape; returns the number of tensors
    copied. ``place(tensor, parameter)`` makes what is copied (default: the tensor on the
    parameter's device and dtype; FSDP2 passes one that keeps this rank's shard)."""
    parameters = dict(module.named_parameters())
    for name, tensor in tensors.items():
        target = parameters.get(name)
        if target is None:
            raise WeightUpdateError(f"{module_name} has no parameter {name!r}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightUpdateError(f"{module_name}.{name}: shape {tuple(tensor.shape)} does not match {tuple(target.shape)}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = parameters[name]
            target.copy_(place(tensor, target) if place is not None else tensor.to(device=target.device, dtype=target.dtype))
    return len(tensors)


def load_component_from_disk(module: torch.nn.Module, directory: str | Path, *, module_name: str) -> int:
    """Load every ``*.safetensors`` file of a diffusers component folder into ``module``'s
    parameters. Saved buffers (SD3's ``pos_embed.pos_embed``) are skipped, as
    sglang-diffusion's loader skips every non-parameter; any other unknown name is an error."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"{directory}: no *.safetensors files for {module_name}")
    buffers = {name for name, _ in module.named_buffers()}
    count = 0
    for path in files:
        tensors = {name: t for name, t in load_file(str(path)).items() if name not in buffers}
        count += load_named_tensors(module, tensors, module_name=module_name)
    return count
