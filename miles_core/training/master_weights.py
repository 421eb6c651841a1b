"""Master weights of a one-process trainer (``--fsdp-master-dtype`` at world size 1).

Classic mixed-precision training: the model's trainable parameters stay in the dtype
they were loaded in (``--diffusion-forward-dtype``), so the forward, the embedded engine
(which samples the trainer's own modules) and weight sync see the same weights as
before; the optimizer owns a copy of each of them in the master dtype. Each
parameter's gradient is added into its master's ``.grad`` as soon as backward has
accumulated it (a post-accumulate-grad hook, so the micro-batches of an optimizer step
are summed in the master dtype, as FSDP2 sums them into its sharded gradients) and the
parameter's own ``.grad`` is dropped. Clipping and the optimizer step run on the
masters; :meth:`MasterWeights.copy_to_model` then rounds them into the parameters.

A parameter already in the master dtype is its own master: nothing is copied, no hook
is registered, and training is exactly what it was without this module. Under FSDP2
the shards are cast to the master dtype before sharding, so every parameter is its own
master there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class MasterWeights:
    """The optimizer's parameters for ``params``: each parameter itself when it is in
    ``dtype``, else a ``dtype`` copy of it that receives its gradients."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = list(params)
        self.masters: list[torch.nn.Parameter] = []
        self._copies: dict[int, torch.nn.Parameter] = {}
        for param in self.params:
            if param.dtype == dtype:
                self.masters.append(param)
                continue
            master = torch.nn.Parameter(param.detach().to(dtype, copy=True))
            self._copies[id(param)] = master
            self.masters.append(master)
            param.register_post_accumulate_grad_hook(self._grad_to_master)

    def copies(self) -> list[torch.nn.Parameter]:
        """The master copies (not the parameters that are their own master)."""
        return list(self._copies.values())

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s master: its copy, or ``param`` itself."""
        return self._copies.get(id(param), param)

    def _grad_to_master(self, param: torch.Tensor) -> None:
        # Called by autograd once param.grad holds this backward's contribution.
        self._fold(param, self._copies[id(param)])

    @staticmethod
    def _fold(param: torch.Tensor, master: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.detach().to(device=master.device, dtype=master.dtype)
        else:
            master.grad.add_(grad.detach().to(device=master.device, dtype=master.dtype))
        param.grad = None

    def gather_gradients(self) -> None:
        """Move gradients set on the parameters outside a backward (assigned by hand)
        into the masters, as the hook does after each backward."""
        for param in self.params:
            master = self._copies.get(id(param))
            if master is not None:
                self._fold(param, master)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round each master into its parameter (after an optimizer step or a load)."""
        for param in self.params:
            master = self._copies.get(id(param))
            if master is not None:
                param.copy_(master)

    @torch.no_grad()
    def load(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the masters of ``(parameter, full-precision value)`` pairs from the values
        themselves (cast to the master dtype), not from the rounded parameters."""
        for param, value in pairs:
            master = self._copies.get(id(param))
            if master is not None:
                master.copy_(value.to(device=master.device, dtype=master.dtype))


__all__ = ["MasterWeights"]
