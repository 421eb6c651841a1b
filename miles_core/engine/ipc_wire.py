"""sglang-diffusion's ``/update_weights_from_tensor`` request: tensors passed as CUDA-IPC
handles inside pickles, for an engine colocated with its trainer on one GPU.

The request is a JSON object (docs/design.md, "The wire contract")::

    {"serialized_named_tensors": [BASE64, ...],   # one payload per engine GPU
     "payload_gpu_uuids": [UUID, ...] | null,     # the GPU each payload was exported from
     "load_format": null,                         # a list of (name, tensor) pairs
     "target_modules": [NAME] | null,             # null: ["transformer"]
     "weight_update_mode": null | "lora_merge",   # lora_merge: lora_A/lora_B tensors
     "lora_alpha": INT | null, "lora_rank": INT | null}

A payload is the base64 text of a pickle written by :class:`multiprocessing.reduction.ForkingPickler`
with torch's tensor reductions (:mod:`torch.multiprocessing.reductions`): a CUDA tensor
pickles as an IPC handle of its storage (nothing is copied), a CPU tensor as the name of a
shared-memory file under torch's ``file_system`` sharing strategy. Unpickling opens
those handles in the receiving process, so the payload is trusted code for whoever sends
it: :func:`load_payload` uses an unpickler that resolves only torch's multiprocessing
tensor-rebuilding functions and the tensor, storage, size and dtype names they take, and the server takes the format only from a loopback
peer when started colocated with its trainer (``--accept-ipc-weights``).

A CUDA tensor's device slot in the pickle holds the GPU's UUID rather than its index, as
sglang's patched reducer writes it, because the trainer and the engine may number the
same GPU differently (``CUDA_VISIBLE_DEVICES``); the receiver maps it back to its index.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import pickle
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

from miles_core.errors import IpcFormatError

LORA_MERGE = "lora_merge"
"""``weight_update_mode`` of a LoRA-only update (lora_A/lora_B tensors)."""
DEFAULT_TARGET_MODULE = "transformer"
"""sglang-diffusion's target module when a request names none."""
FIELDS = (
    "serialized_named_tensors",
    "payload_gpu_uuids",
    "load_format",
    "target_modules",
    "weight_update_mode",
    "lora_alpha",
    "lora_rank",
)
_DEVICE_SLOT = 6  # the storage device's position in rebuild_cuda_tensor's arguments


# -- the peer ---------------------------------------------------------------------------------


def is_loopback_peer(remote: str | None) -> bool:
    """Whether a request's peer address is this machine's loopback (``127.0.0.0/8``,
    ``::1``, or an IPv4-mapped loopback); an unknown peer is not."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


# -- GPU identity -----------------------------------------------------------------------------


def normalize_gpu_uuid(uuid: str) -> str:
    """NVML spells a UUID ``GPU-…`` (or ``MIG-…``), torch without the prefix."""
    return uuid.removeprefix("MIG-").removeprefix("GPU-").lower()


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device as torch reports it."""
    index = device if isinstance(device, int) else (device.index if device.index is not None else torch.cuda.current_device())
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    wanted = normalize_gpu_uuid(device)
    for index in range(torch.cuda.device_count()):
        if normalize_gpu_uuid(device_uuid(index)) == wanted:
            return index
    raise ValueError(f"no visible GPU has UUID {device}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    args = (*args[:_DEVICE_SLOT], _device_index(args[_DEVICE_SLOT]), *args[_DEVICE_SLOT + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def synchronize(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the work queued on each CUDA device of ``tensors``."""
    for index in sorted({tensor.device.index for tensor in tensors if tensor.is_cuda}):
        torch.cuda.synchronize(index)


# -- writing ---------------------------------------------------------------------------------


def _reduce_with_uuid(tensor: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:_DEVICE_SLOT], device_uuid(args[_DEVICE_SLOT]), *args[_DEVICE_SLOT + 1 :])
    return rebuild, args


class _Pickler(ForkingPickler):
    """ForkingPickler with torch's reductions, a CUDA tensor's device written as its UUID."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)  # torch.multiprocessing registered its reducers with ForkingPickler on import
        self.dispatch_table[torch.Tensor] = _reduce_with_uuid
        self.dispatch_table[torch.nn.Parameter] = _reduce_with_uuid


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One payload: the base64 text of a pickled list of ``(name, tensor)`` pairs. The
    tensors must stay alive until the receiver has loaded them (it opens their storage)."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump([(str(name), tensor.detach()) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def build_request(
    payload: str,
    *,
    target_module: str,
    gpu_uuid: str | None,
    lora_only: bool = False,
    lora_alpha: int | None = None,
    lora_rank: int | None = None,
) -> dict[str, Any]:
    """The JSON body of one update: one payload for one module; ``gpu_uuid`` is the GPU the
    payload's tensors live on (None for CPU shared memory)."""
    return {
        "serialized_named_tensors": [payload],
        "payload_gpu_uuids": None if gpu_uuid is None else [gpu_uuid],
        "load_format": None,
        "target_modules": [target_module],
        "weight_update_mode": LORA_MERGE if lora_only else None,
        "lora_alpha": lora_alpha if lora_only else None,
        "lora_rank": lora_rank if lora_only else None,
    }


# -- reading ---------------------------------------------------------------------------------


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,  # sglang's own senders
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _Unpickler(pickle.Unpickler):
    """Resolves only torch's tensor-rebuilding functions, storages, dtypes and sizes; any
    other global (a way to run code) fails the load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def decode_base64(text: Any, field_name: str = "serialized_named_tensors") -> bytes:
    """A payload's bytes; a non-string or invalid base64 raises :class:`IpcFormatError`."""
    if not isinstance(text, str) or not text:
        raise IpcFormatError(field_name, f"each payload must be a non-empty base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IpcFormatError(field_name, f"not valid base64 ({exc})") from None


def load_payload(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Unpickle one payload's ``(name, tensor)`` pairs (opening their shared storage); a
    payload that is not such a list, or names another global, raises :class:`IpcFormatError`."""
    try:
        value = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise IpcFormatError("serialized_named_tensors", f"cannot be unpickled ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise IpcFormatError(
            "serialized_named_tensors", f"a payload must hold a non-empty list of (name, tensor) pairs, got {type(value).__name__}"
        )
    pairs: list[tuple[str, torch.Tensor]] = []
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise IpcFormatError("serialized_named_tensors", "a payload must hold (name, tensor) pairs")
        pairs.append((item[0], item[1]))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise IpcFormatError("serialized_named_tensors", "a payload names one tensor twice")
    return pairs


def select_payload(payloads: Sequence[str], uuids: Sequence[str] | None, own_uuid: str | None) -> str:
    """The payload exported from this server's GPU (``own_uuid``; None: the server runs on
    the CPU). Without ``payload_gpu_uuids`` there must be exactly one payload."""
    if uuids is None:
        if len(payloads) != 1:
            raise IpcFormatError("payload_gpu_uuids", f"required when serialized_named_tensors holds {len(payloads)} payloads")
        return payloads[0]
    if own_uuid is None:
        raise IpcFormatError("payload_gpu_uuids", "this server runs on the CPU, which has no GPU UUID; send null")
    normalized = [normalize_gpu_uuid(uuid) for uuid in uuids]
    own = normalize_gpu_uuid(own_uuid)
    if own not in normalized:
        raise IpcFormatError("payload_gpu_uuids", f"no payload was exported from this server's GPU {own}, got {list(uuids)}")
    return payloads[normalized.index(own)]


__all__ = [
    "DEFAULT_TARGET_MODULE",
    "FIELDS",
    "LORA_MERGE",
    "IpcFormatError",
    "build_request",
    "decode_base64",
    "device_uuid",
    "is_loopback_peer",
    "load_payload",
    "normalize_gpu_uuid",
    "select_payload",
    "serialize_named_tensors",
    "synchronize",
]
