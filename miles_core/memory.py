"""What tensors hold, by role and device, and moving storages off their device and back.

:func:`audit_memory` sums the bytes of every storage that a trainer's parameters, their
gradients, its optimizers' state and an engine's modules hold, per role and per device
(``"cpu"``, ``"cuda:0"``, ...), so on CUDA it reports each GPU apart. A storage is counted
once, under the first role that claims it (parameters, gradients, optimizer state, then
engine weights), whatever number of tensors view it; a DTensor counts its local shard.

:class:`OffloadedStorages` is the offload mechanism the trainer (``--offload-train``) and
the engines (``--offload-rollout``) share: each storage's bytes are copied into a host
buffer (pinned when CUDA is present) and the storage is resized to zero bytes, so the
tensors keep their identity (optimizers and modules hold references to them) while their
memory is released; :meth:`OffloadedStorages.restore` resizes each storage back and copies
its bytes in. The same code runs on a CPU, where the audit then shows the released role
at zero bytes. A released tensor must not be read until it is restored (torch does not
check: the read is out of bounds); the callers guard every way in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

ROLES = ("parameters", "gradients", "optimizer_state", "engine_weights")
"""The roles :func:`audit_memory` reports, in the order they claim a shared storage."""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held per ``(role, device)``; a role seen with nothing resident shows 0."""

    bytes: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def resident(self, role: str, device: str | None = None) -> int:
        """The bytes ``role`` holds on ``device`` (None: on every device)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
        return sum(n for (r, d), n in self.bytes.items() if r == role and (device is None or d == device))

    def by_role(self) -> dict[str, int]:
        """Every role's bytes over all devices."""
        return {role: self.resident(role) for role in ROLES}

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{role: {device: bytes}}`` for every role (JSON-able)."""
        out: dict[str, dict[str, int]] = {role: {} for role in ROLES}
        for (role, device), n in sorted(self.bytes.items()):
            out[role][device] = n
        return out


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s bytes in this process: a DTensor's
    local shard, else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)  # torch.distributed.tensor.DTensor
    return local if isinstance(local, torch.Tensor) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    # Every meta storage has data pointer 0; its StorageImpl's address tells them apart.
    return str(tensor.device), storage._cdata if tensor.is_meta else storage.data_ptr()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of an optimizer's per-parameter state (AdamW: ``step``,
    ``exp_avg``, ``exp_avg_sq``)."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules``."""
    return [t for module in modules for t in (*module.parameters(), *module.buffers())]


def audit_memory(
    *,
    parameters: Iterable[torch.Tensor] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    engine_modules: Iterable[torch.nn.Module] = (),
    include_meta: bool = False,
) -> MemoryReport:
    """The bytes resident per role and device: ``parameters``, their ``.grad`` (and the
    gradients of the optimizers' own parameters), the state of ``optimizers`` (with the
    optimizers' parameters that are not in ``parameters``: master copies kept in another
    dtype than the model's), and the parameters and buffers of ``engine_modules`` that no
    earlier role holds. Each storage counts once (``untyped_storage().nbytes()``).
    Tensors on the meta device are left out unless ``include_meta`` (the memory planner
    counts a run built there, :mod:`miles_core.planning`)."""
    parameters = list(parameters)
    optimizers = list(optimizers)
    optimized = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
    counted: set[tuple[str, int]] = set()
    totals: dict[tuple[str, str], int] = {}

    def claim(role: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None:
                continue
            tensor = local_tensor(tensor)
            if tensor.is_meta and not include_meta:
                continue
            device = str(tensor.device)
            totals.setdefault((role, device), 0)
            nbytes = tensor.untyped_storage().nbytes()
            key = _storage_key(tensor)
            if nbytes == 0 or key in counted:
                continue
            counted.add(key)
            totals[(role, device)] += nbytes

    claim("parameters", parameters)
    claim("gradients", (p.grad for p in [*parameters, *optimized] if p.is_leaf))  # a view has no gradient of its own
    claim("optimizer_state", [*optimized, *(t for optimizer in optimizers for t in optimizer_tensors(optimizer))])
    claim("engine_weights", module_tensors(engine_modules))
    return MemoryReport(totals)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat ``uint8`` tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _own_storage(tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """Give ``tensors`` (all viewing one storage that cannot be resized: weights read
    from a memory-mapped safetensors file) a resizable copy of it, keeping each tensor
    object, its offset, shape and strides."""
    old = tensors[0].untyped_storage()
    new = torch.UntypedStorage(old.nbytes(), device=old.device)
    _byte_view(new).copy_(_byte_view(old))
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            new, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
    return new


def own_storages(modules: Iterable[torch.nn.Module]) -> int:
    """Give every parameter and buffer of ``modules`` whose storage cannot be resized
    (weights read from a memory-mapped safetensors file) a resizable copy allocated by
    torch, keeping the tensor objects; returns the bytes copied.

    :class:`~miles_core.family.ModelFamily` does this once at load, so a run that offloads
    and one that does not compute on the same storages: the copy :class:`OffloadedStorages`
    would otherwise make at the first offload moves the data to another address, and a
    kernel's rounding may depend on its operands' alignment."""
    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    for tensor in module_tensors(modules):
        tensor = local_tensor(tensor)
        if tensor.is_meta or tensor.untyped_storage().resizable():
            continue
        groups.setdefault(_storage_key(tensor), []).append(tensor)
    return sum(_own_storage(group).nbytes() for group in groups.values())


class OffloadedStorages:
    """Storages moved to host buffers and released on their device (see the module
    docstring). Build it with :meth:`offload`; :meth:`restore` undoes it once."""

    def __init__(self, entries: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
        self._entries = entries
        self.restored = False

    @property
    def nbytes(self) -> int:
        """The bytes held in host buffers (what was released)."""
        return sum(host.numel() for _, host in self._entries)

    @classmethod
    def offload(cls, tensors: Iterable[torch.Tensor], *, keep: Iterable[torch.Tensor] = ()) -> OffloadedStorages:
        """Copy the storages of ``tensors`` to host memory and release them; storages that
        a tensor of ``keep`` also views stay where they are (a module that shares a
        weight with one that must stay resident)."""
        kept = {_storage_key(local_tensor(t)) for t in keep}
        groups: dict[tuple[str, int], list[torch.Tensor]] = {}
        for tensor in tensors:
            tensor = local_tensor(tensor)
            if tensor.is_meta or tensor.untyped_storage().nbytes() == 0:
                continue
            key = _storage_key(tensor)
            if key not in kept:
                groups.setdefault(key, []).append(tensor)
        cuda = any(key[0].startswith("cuda") for key in groups)
        entries: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        for group in groups.values():
            storage = group[0].untyped_storage()
            if not storage.resizable():
                storage = _own_storage(group)
            on_cuda = storage.device.type == "cuda"
            # Pinned host memory lets the copies run asynchronously; torch's host
            # allocator caches pinned blocks, so the next turn reuses them.
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=on_cuda and torch.cuda.is_available())
            host.copy_(_byte_view(storage), non_blocking=on_cuda)
            entries.append((storage, host))
        if cuda:
            torch.cuda.synchronize()  # every copy done before its source is freed
        for storage, _ in entries:
            storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # give the memory back for the other side's turn
        return cls(entries)

    def restore(self) -> None:
        """Resize each storage back and copy its bytes in."""
        if self.restored:
            raise RuntimeError("these storages were already restored")
        cuda = False
        for storage, host in self._entries:
            storage.resize_(host.numel())
            on_cuda = storage.device.type == "cuda"
            cuda = cuda or on_cuda
            _byte_view(storage).copy_(host, non_blocking=on_cuda)
        if cuda:
            torch.cuda.synchronize()
        self._entries = []
        self.restored = True


__all__ = [
    "ROLES",
    "MemoryReport",
    "OffloadedStorages",
    "audit_memory",
    "local_tensor",
    "module_tensors",
    "optimizer_tensors",
    "own_storages",
]
