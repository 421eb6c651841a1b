"""The bytes of the ``/rollout/generate`` contract: msgpack documents with tensors inside.

A tensor travels as a record ``{"__tensor__": True, "data": <safetensors bytes of
{"t": tensor}>, "shape": [...], "dtype": "torch.float32"}`` (docs/design.md, "The wire contract"), the
encoding sglang-diffusion's rollout API uses, so a response of either server decodes with
plain ``msgpack`` and ``safetensors``. Older sglang-diffusion builds sent ``data`` as a
base64 string of the same safetensors bytes; :func:`decode_tensor` accepts both.

Only msgpack's own types and tensors cross the boundary: nothing is pickled, and
:func:`unpack` rejects msgpack extension types and malformed tensor records with a
:class:`WireError` that names where in the document the problem is.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import torch

from miles_core.errors import WireError
from miles_core.request import RolloutOutput

TENSOR_TAG = "__tensor__"
_TENSOR_KEYS = frozenset({TENSOR_TAG, "data", "shape", "dtype"})
_SCALARS = (type(None), bool, int, float, str, bytes)


# -- tensors ----------------------------------------------------------------------------


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """One tensor as a wire record (CPU, contiguous, in its own dtype)."""
    from safetensors.torch import save

    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise WireError(f"cannot encode a {tensor.layout} tensor; only dense tensors travel")
    data = tensor.detach().cpu().contiguous()
    # clone() drops a larger backing storage (a slice of a batch), which safetensors
    # would otherwise refuse or copy whole.
    if data.untyped_storage().nbytes() != data.numel() * data.element_size():
        data = data.clone()
    return {TENSOR_TAG: True, "data": save({"t": data}), "shape": list(data.shape), "dtype": str(data.dtype)}


def decode_tensor(record: Any, *, path: str = "tensor") -> torch.Tensor:
    """Rebuild a tensor from its wire record, checking the record's shape."""
    from safetensors.torch import load

    if not isinstance(record, Mapping):
        raise WireError(f"{path}: a tensor record must be a map, got {type(record).__name__}")
    extra = sorted(str(k) for k in set(record) - _TENSOR_KEYS)
    if extra:
        raise WireError(f"{path}: unexpected key {extra[0]!r} in a tensor record (keys: {', '.join(sorted(_TENSOR_KEYS))})")
    if record.get(TENSOR_TAG) is not True:
        raise WireError(f"{path}: {TENSOR_TAG} must be true, got {record.get(TENSOR_TAG)!r}")
    data = record.get("data")
    if isinstance(data, str):  # older sglang-diffusion: base64 of the safetensors bytes
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireError(f"{path}.data: a string must be base64 of safetensors bytes ({exc})") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{path}.data: must be safetensors bytes, got {type(data).__name__}")
    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise WireError(f"{path}.data: not valid safetensors bytes ({exc})") from None
    if set(tensors) != {"t"}:
        raise WireError(f"{path}.data: must hold exactly one tensor named 't', got {sorted(tensors)}")
    tensor = tensors["t"]
    shape = record.get("shape")
    if shape is not None:
        if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise WireError(f"{path}.shape: must be a list of integers, got {shape!r}")
        if list(shape) != list(tensor.shape):
            raise WireError(f"{path}.shape: {list(shape)} does not match the data's shape {list(tensor.shape)}")
    dtype = record.get("dtype")
    if dtype is not None:
        if not isinstance(dtype, str):
            raise WireError(f"{path}.dtype: must be a string, got {dtype!r}")
        if dtype != str(tensor.dtype):
            raise WireError(f"{path}.dtype: {dtype!r} does not match the data's dtype {str(tensor.dtype)!r}")
    return tensor


def is_tensor_record(value: Any) -> bool:
    return isinstance(value, Mapping) and TENSOR_TAG in value


# -- documents --------------------------------------------------------------------------


def to_wire(obj: Any, *, path: str = "$") -> Any:
    """``obj`` with every tensor replaced by its record (dicts, lists and tuples walked;
    tuples become lists). Anything but msgpack's own types and tensors is an error."""
    if isinstance(obj, torch.Tensor):
        return encode_tensor(obj)
    if isinstance(obj, Mapping):
        if TENSOR_TAG in obj:
            raise WireError(f"{path}: a map may not use the reserved key {TENSOR_TAG!r}")
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise WireError(f"{path}: map keys must be strings, got {type(key).__name__} {key!r}")
            out[key] = to_wire(value, path=f"{path}.{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_wire(value, path=f"{path}[{i}]") for i, value in enumerate(obj)]
    if isinstance(obj, _SCALARS):
        return obj
    raise WireError(f"{path}: cannot send a {type(obj).__module__}.{type(obj).__qualname__} (only tensors and msgpack types)")


def from_wire(obj: Any, *, path: str = "$") -> Any:
    """Reverse :func:`to_wire`: rebuild tensors from their records."""
    if isinstance(obj, dict):
        if TENSOR_TAG in obj:
            return decode_tensor(obj, path=path)
        return {key: from_wire(value, path=f"{path}.{key}") for key, value in obj.items()}
    if isinstance(obj, list):
        return [from_wire(value, path=f"{path}[{i}]") for i, value in enumerate(obj)]
    if isinstance(obj, _SCALARS):
        return obj
    raise WireError(f"{path}: unexpected {type(obj).__name__} (msgpack extension types are not part of the format)")


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj``, tensors encoded as records."""
    return msgpack.packb(to_wire(obj), use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """Decode msgpack bytes made by :func:`pack` (or by sglang-diffusion)."""
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, ext_hook=_reject_ext, timestamp=0)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise WireError(f"$: not a valid msgpack document ({type(exc).__name__}: {exc})") from None
    return from_wire(obj)


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"$: msgpack extension type {code} is not part of the format")


# -- rollout responses ------------------------------------------------------------------

_REQUIRED = ("request_id", "prompt", "seed", "generated_output")


def pack_outputs(outputs: Iterable[RolloutOutput]) -> bytes:
    """A ``/rollout/generate`` response body: a list with one record per output."""
    return pack([output.to_wire() for output in outputs])


def unpack_outputs(data: bytes | bytearray | memoryview) -> list[RolloutOutput]:
    """Parse a ``/rollout/generate`` response body (ours or sglang-diffusion's)."""
    records = unpack(data)
    if not isinstance(records, list):
        raise WireError(f"$: a rollout response must be a list of records, got {type(records).__name__}")
    outputs = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise WireError(f"$[{i}]: a rollout record must be a map, got {type(record).__name__}")
        missing = [key for key in _REQUIRED if key not in record]
        if missing:
            raise WireError(f"$[{i}].{missing[0]}: missing from the rollout record")
        if not isinstance(record["generated_output"], torch.Tensor):
            raise WireError(f"$[{i}].generated_output: must be a tensor record")
        record = dict(record)
        for key in ("inference_time_s", "peak_memory_mb"):
            if record.get(key) is None:  # sglang-diffusion sends null when unmeasured
                record[key] = 0.0
        outputs.append(RolloutOutput.from_wire(record))
    return outputs


__all__ = [
    "TENSOR_TAG",
    "WireError",
    "decode_tensor",
    "encode_tensor",
    "from_wire",
    "is_tensor_record",
    "pack",
    "pack_outputs",
    "to_wire",
    "unpack",
    "unpack_outputs",
]
