"""Counting the bytes a computation holds, without running it: on the meta device.

A meta tensor has a shape, a dtype and a storage of a size, but no data, so a forward and
backward of a 14B transformer at 720p runs here in seconds and every byte it would
allocate can be counted exactly (docs/design.md, "Planning memory"):

- :class:`SavedForBackward` sees every tensor autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters and
  buffers left out: the activations of a micro-batch.
- :class:`LiveBytes` follows every storage the computation allocates (a
  ``TorchDispatchMode`` sees each operator's outputs; a storage is freed when its last
  tensor dies, seen through a ``weakref.finalize`` on the storage): the bytes alive now
  and the peak, transients, gradient checkpointing's recomputation and the backward's
  gradient buffers included.
- :func:`fused_attention` makes ``scaled_dot_product_attention`` run as the fused kernels
  a GPU runs (flash / memory-efficient attention save query, key, value, output and the
  log-sum-exp; never the score matrix). On the meta device torch otherwise takes its
  math fallback, which materialises and saves the ``[B, H, L, L]`` scores.

The counts hold on any device: the same computation on the CPU with real tensors gives the
same bytes (tests/test_planning.py compares them), which is what makes a count on the meta
device a count of a real run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of the storage ``tensor`` views, the same for every view of it and valid
    on the meta device (where every data pointer is 0)."""
    return tensor.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages ``tensors`` view."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        seen.setdefault(storage_key(tensor), tensor.untyped_storage().nbytes())
    return sum(seen.values())


def _fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, float(dropout_p), bool(is_causal), attn_mask=attn_mask, scale=scale
    )[0]


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """While active, ``torch.nn.functional.scaled_dot_product_attention`` runs as a fused
    attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which has a
    meta implementation), saving for the backward what CUDA's flash and memory-efficient
    kernels save. Grouped-query attention (``enable_gqa``) repeats key and value heads
    first, as those kernels are given them. ``torch.autocast`` also takes the meta
    device meanwhile (:class:`_MetaAutocast`).

    It replaces the module attribute (callers that look it up when they call, as torch's
    and diffusers' attention code does), not a mode: gradient checkpointing recomputes
    blocks inside the backward, where a ``TorchFunctionMode`` entered around the forward
    is not active. Not thread-safe: the planner runs it before anything else runs."""
    original, autocast = F.scaled_dot_product_attention, torch.autocast
    F.scaled_dot_product_attention = _fused_sdpa
    torch.autocast = _MetaAutocast  # type: ignore[misc]
    try:
        yield
    finally:
        F.scaled_dot_product_attention, torch.autocast = original, autocast


class _MetaAutocast(torch.autocast):
    """``torch.autocast`` that takes ``device_type="meta"`` (a model's code that sets
    autocast for its tensors' device, as Cosmos 3's rotary embedding switches it off, runs
    on the meta device too): autocast has no meta kind, and the CPU's ``enabled=False`` is
    the same no-op."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


class SavedForBackward:
    """A context manager counting the tensors autograd saves for the backward while it is
    active: each storage once, in the dtype it is saved in, the storages of ``exclude``
    (parameters and buffers: they are resident anyway) left out. :attr:`nbytes` is the
    bytes of those still alive when it is read (a saved tensor of a graph branch nothing
    reaches dies with the branch, and its storage's identity may be reused), :attr:`count`
    their number. Read them before the backward frees them."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._seen: dict[int, tuple[weakref.ref, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._exclude:
            return tensor
        known = self._seen.get(key)
        if known is None or known[0]() is not storage:
            self._seen[key] = (weakref.ref(storage), storage.nbytes())
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _alive(self) -> list[int]:
        return [nbytes for ref, nbytes in self._seen.values() if ref() is not None]

    @property
    def nbytes(self) -> int:
        return sum(self._alive())

    @property
    def count(self) -> int:
        return len(self._alive())

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class LiveBytes(TorchDispatchMode):
    """Follows every storage an operator allocates while the mode is active (an output that
    views none of the operator's inputs) until its last tensor dies: :attr:`current` bytes
    alive, :attr:`peak` since the last :meth:`reset_peak`. Storages that existed before
    (parameters, inputs) are not counted; in-place operators and views allocate nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._alive: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self._alive.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._alive:
                continue
            nbytes = storage.nbytes()
            self._alive[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


__all__ = ["fused_attention", "LiveBytes", "SavedForBackward", "storage_bytes", "storage_key"]
