"""A torch.distributed group of its own between a trainer and its engine servers, for
weight sync (``--weight-sync-path distributed``; docs/design.md, "Weight sync").

The training ranks already have a default process group (FSDP2's), and a serve-engine
server has none, so the weight-update group never touches the default one: it is built
directly from a ``TCPStore`` (rank 0, the trainer, hosts it on a free port) under a
``PrefixStore`` named after the group, as a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) object used through its own ``broadcast``. Rank 0 is the
source; engine server *i* joins as rank ``1 + i``.

The wire layout of one bucket (both sides compute it from the bucket's ``names``,
``dtypes`` and ``shapes``, which travel over HTTP first): the tensors' bytes back to back
in ``names`` order, each starting at a multiple of :data:`ALIGN` bytes, broadcast as one
``uint8`` tensor, so a bucket costs one collective whatever its number of tensors.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch

from miles_core.errors import WeightGroupError

ALIGN = 64
"""Byte alignment of each tensor inside a bucket's flat buffer (any dtype's view fits)."""

DEFAULT_JOIN_TIMEOUT_S = 60.0
"""How long a member waits to reach the group's store and the other members."""

BACKENDS = ("gloo", "nccl")

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names ``dtypes`` carries, as sglang's)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype | None:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> the dtype; None for an unknown name."""
    return _DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=dtype).element_size()


def bucket_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the flat buffer, and the buffer's size."""
    offsets, size = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        size += nbytes(dtype, shape)
    return offsets, size


def pack_bucket(tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes in one flat ``uint8`` tensor on ``device`` (see :func:`bucket_layout`),
    the front of ``out`` when given (a :meth:`WeightGroup.staging` buffer)."""
    offsets, size = bucket_layout([t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
    flat = out[:size] if out is not None else torch.empty(size, dtype=torch.uint8, device=device)
    for tensor, offset in zip(tensors, offsets):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset : offset + data.numel()].copy_(data)
    return flat


def unpack_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The named tensors of a received flat buffer, as views of it (no copy)."""
    offsets, _ = bucket_layout(dtypes, shapes)
    tensors = {}
    for name, dtype, shape, offset in zip(names, dtypes, shapes, offsets):
        size = nbytes(dtype, shape)
        tensors[name] = flat[offset : offset + size].view(dtype).reshape(tuple(shape))
    return tensors


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (the interface a UDP socket would
    leave through; nothing is sent): loopback for a loopback ``host``."""
    if _is_loopback(host):
        return "127.0.0.1" if ":" not in host else "::1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def master_address_for(urls: Sequence[str]) -> str:
    """The address engine servers at ``urls`` reach the trainer at: loopback when every
    server is on loopback, else this machine's address on the route to the first other one."""
    hosts = [urlsplit(url).hostname or "" for url in urls]
    remote = [host for host in hosts if not _is_loopback(host)]
    return local_address_towards(remote[0]) if remote else "127.0.0.1"


def master_store(world_size: int, join_timeout: float) -> Any:
    """Rank 0's ``TCPStore`` on a free port (its ``port`` says which). It listens on every
    interface (this process reaches it on loopback) and does not wait for the members here."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_timeout(join_timeout), wait_for_workers=False)


class WeightGroup:
    """One member's end of a weight-update group (see the module docstring)."""

    def __init__(self, name: str, rank: int, world_size: int, backend: str, store: Any, group: Any, device: torch.device) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self._store = store
        self._group = group
        self._lock = threading.Lock()  # one collective at a time, in order
        self.bucket_lock = threading.Lock()
        """Held while one bucket uses :meth:`staging` (received and loaded, or packed and sent)."""
        self._staging: torch.Tensor | None = None
        self._closing = False

    @classmethod
    def join(
        cls,
        *,
        name: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        timeout: float = 600.0,
        store: Any = None,
    ) -> WeightGroup:
        """Join (rank 0 with its :func:`master_store`: create) the group; blocks until every
        member has joined. Not reaching the store or the members within ``join_timeout``
        seconds raises :class:`WeightGroupError` naming the address."""
        import torch.distributed as dist

        where = f"{master_address}:{master_port}"
        if backend not in BACKENDS:
            raise WeightGroupError(f"weight-update group {name!r}: unknown backend {backend!r} (expected gloo or nccl)")
        try:
            if store is None:
                store = dist.TCPStore(master_address, master_port, world_size, False, timeout=_timeout(join_timeout))
            prefixed = dist.PrefixStore(f"miles-weight-group/{name}", store)
            if backend == "nccl":
                if not torch.cuda.is_available():
                    raise WeightGroupError(f"weight-update group {name!r}: backend nccl needs CUDA, and this process has none")
                device = torch.device("cuda", torch.cuda.current_device())
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = _timeout(timeout)
                group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            else:
                device = torch.device("cpu")
                options = dist.ProcessGroupGloo._Options()
                options._timeout = _timeout(join_timeout)
                # Listen where the other members can reach this one: rank 0 on the address it
                # advertises, the others on their side of the route to it (gloo's default is
                # the address the host name resolves to, often loopback only).
                local = master_address if rank == 0 else local_address_towards(master_address)
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
                group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
                group.set_timeout(_timeout(timeout))  # joining is bounded by join_timeout, transfers by timeout
        except WeightGroupError:
            raise
        except Exception as exc:
            detail = " ".join(str(exc).split())[:300]
            raise WeightGroupError(
                f"could not join weight-update group {name!r} at {where} within {join_timeout:g} s: {type(exc).__name__}: {detail}"
            ) from None
        return cls(name, rank, world_size, backend, store, group, device)

    def staging(self, size: int) -> torch.Tensor:
        """A flat ``uint8`` buffer of ``size`` bytes on the group's device, kept from bucket to
        bucket (grown when needed) and written once when made: a fresh buffer per bucket
        would page-fault its way through the transfer and halve its speed on the CPU."""
        if self._staging is None or self._staging.numel() < size:
            self._staging = None
            self._staging = torch.zeros(size, dtype=torch.uint8, device=self.device)
        return self._staging[:size]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        with self._lock:
            group = self._group
            if group is None:
                raise WeightGroupError(f"weight-update group {self.name!r} is closed")
            try:
                group.broadcast(tensor, src).wait()
                if tensor.is_cuda:
                    # nccl's wait() only orders the current stream after the collective: wait
                    # for the bytes too, so a returned broadcast has arrived (a member's answer
                    # means its bucket is in, and broadcast_seconds is the transfer's time).
                    torch.cuda.current_stream(tensor.device).synchronize()
            finally:
                if self._closing:  # closed while this collective ran: let go of it now
                    self._drop()

    def close(self) -> None:
        """Leave the group: its connections close when the last reference to it goes, which
        also ends, with an error, a collective the other members are waiting in. A
        collective of this member's own that is still running keeps it until it ends
        (``shutdown``/``abort`` would leave that collective hanging, or kill the process)."""
        self._closing = True
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _drop(self) -> None:
        self._group = None
        self._store = None
        self._staging = None


_T = TypeVar("_T")


def in_daemon_thread(function: Callable[[], _T]) -> Any:
    """Run ``function`` in a daemon thread; returns an asyncio future of its result. A
    collective stuck on a member that went away must not keep the process from exiting
    (the default executor's threads would)."""
    import asyncio

    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(set_outcome: Callable[[], Any]) -> None:
        try:
            loop.call_soon_threadsafe(lambda: future.done() or set_outcome())
        except RuntimeError:  # the loop is gone: nobody waits for this outcome any more
            pass

    def run() -> None:
        try:
            result = function()
        except BaseException as exc:  # handed to the awaiting task
            settle(lambda error=exc: future.set_exception(error))
        else:
            settle(lambda: future.set_result(result))

    threading.Thread(target=run, name="weight-group", daemon=True).start()
    return future


def bucket_metadata(bucket: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """``{names, dtypes, shapes}`` of a bucket, as ``/update_weights_from_distributed`` takes them."""
    return {
        "names": list(bucket),
        "dtypes": [dtype_name(t.dtype) for t in bucket.values()],
        "shapes": [list(t.shape) for t in bucket.values()],
    }


__all__ = [
    "ALIGN",
    "BACKENDS",
    "DEFAULT_JOIN_TIMEOUT_S",
    "WeightGroup",
    "bucket_layout",
    "bucket_metadata",
    "dtype_name",
    "in_daemon_thread",
    "local_address_towards",
    "master_address_for",
    "master_store",
    "nbytes",
    "pack_bucket",
    "parse_dtype",
    "unpack_bucket",
]
