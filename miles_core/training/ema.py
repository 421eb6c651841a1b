"""EMA of the trained weights: the old policy of DiffusionNFT and the ``ema`` reference.

Decay schedule (docs/design.md, "Advantages, losses and the EMA"; the ``--ema-decay-*`` flags): ``decay_init`` for the
first ``flat_steps`` steps, then ``min((step - flat_steps) * ramp, decay_max)``; the ramp
restarts from zero at the end of the flat period, so the decay may drop there. Update:
``ema <- d * ema + (1 - d) * theta``.

``step`` counts optimizer steps taken, the one just made included (1 for the first
update): the reference's ``LoraEmaShadow.update`` increments its step before computing
the decay.

The shadow is float32 whatever the parameters' dtype, so that a small ``1 - d`` is not
rounded away in bf16. :meth:`EMA.swap_into` puts the EMA weights into the live
parameters for a forward (``--ema-rollout-policy ema``, ``--ref-mode ema``) and restores
the live ones bit for bit; unlike the reference's in-place exchange, the shadow itself is
never touched by a swap, so it stays float32 and checkpointable throughout.

Under FSDP2 the parameters are DTensors and the shadow is sharded like them (each rank
updates its shard); :meth:`EMA.state_dict` gathers full CPU tensors and
:meth:`EMA.load_state_dict` cuts each rank's shard from full ones, so an EMA saved at one
world size loads at another (both are collectives there).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

NamedParams = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def ema_decay(step: int, *, init: float, ramp: float, maximum: float, flat_steps: int) -> float:
    """The EMA decay at ``step``: ``init`` while ``step <= flat_steps``, else
    ``min((step - flat_steps) * ramp, maximum)``."""
    if step < 0:
        raise ValueError(f"EMA step must be >= 0, got {step}")
    if step <= flat_steps:
        return float(init)
    return float(min((step - flat_steps) * ramp, maximum))


def _named(params: NamedParams) -> dict[str, torch.Tensor]:
    return dict(params.items()) if isinstance(params, Mapping) else dict(params)


class EMA:
    """A float32 shadow of named parameters, updated with :func:`ema_decay`.

    Args:
        named_params: the trained parameters (``module.named_parameters()`` or a dict);
            the shadow starts as their copy.
        decay_init, decay_ramp, decay_max, flat_steps: ``--ema-decay-init``,
            ``--ema-decay-ramp``, ``--ema-decay-max``, ``--ema-decay-flat-steps``.
        device: where the shadow lives; default, each parameter's own device.
    """

    def __init__(
        self,
        named_params: NamedParams,
        *,
        decay_init: float = 0.001,
        decay_ramp: float = 0.001,
        decay_max: float = 0.5,
        flat_steps: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        params = _named(named_params)
        if not params:
            raise ValueError("EMA needs at least one parameter")
        self.decay_init = float(decay_init)
        self.decay_ramp = float(decay_ramp)
        self.decay_max = float(decay_max)
        self.flat_steps = int(flat_steps)
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().to(device=device if device is not None else p.device, dtype=torch.float32, copy=True)
            for name, p in params.items()
        }
        self.last_step = 0
        """The step of the latest :meth:`update` (0 before any)."""
        self._swapped = False

    @classmethod
    def from_config(cls, config: Any, named_params: NamedParams, *, device: torch.device | str | None = None) -> EMA:
        """An EMA with the ``--ema-decay-*`` flags of ``config``."""
        return cls(
            named_params,
            decay_init=config.ema_decay_init,
            decay_ramp=config.ema_decay_ramp,
            decay_max=config.ema_decay_max,
            flat_steps=config.ema_decay_flat_steps,
            device=device,
        )

    def decay_at(self, step: int) -> float:
        """:func:`ema_decay` with this EMA's settings."""
        return ema_decay(step, init=self.decay_init, ramp=self.decay_ramp, maximum=self.decay_max, flat_steps=self.flat_steps)

    def _matched(self, named_params: NamedParams, what: str) -> dict[str, torch.Tensor]:
        # The same names and shapes as the shadow, or a one-line error naming the difference:
        # a silently skipped parameter would leave a stale EMA for it.
        params = _named(named_params)
        missing = sorted(self.shadow.keys() - params.keys())
        extra = sorted(params.keys() - self.shadow.keys())
        if missing or extra:
            raise ValueError(f"EMA.{what}: parameter names differ from the shadow's (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, p in params.items():
            if p.shape != self.shadow[name].shape:
                raise ValueError(f"EMA.{what}: {name} has shape {tuple(p.shape)}, the shadow {tuple(self.shadow[name].shape)}")
        return params

    @torch.no_grad()
    def update(self, named_params: NamedParams, step: int) -> float:
        """``ema = d * ema + (1 - d) * theta`` with ``d = decay_at(step)``; return ``d``."""
        if self._swapped:
            # Inside swap_into the live parameters hold the EMA weights; folding them back
            # in would be a silent no-op update.
            raise RuntimeError("EMA.update called inside swap_into; update after the swap is undone")
        params = self._matched(named_params, "update")
        decay = self.decay_at(step)
        for name, p in params.items():
            shadow = self.shadow[name]
            shadow.mul_(decay).add_(p.detach().to(device=shadow.device, dtype=torch.float32), alpha=1.0 - decay)
        self.last_step = step
        return decay

    @torch.no_grad()
    def copy_to(self, named_params: NamedParams) -> None:
        """Write the EMA weights into ``named_params`` (cast to each parameter's dtype)."""
        for name, p in self._matched(named_params, "copy_to").items():
            p.copy_(self.shadow[name].to(device=p.device, dtype=p.dtype))

    @contextmanager
    def swap_into(self, module_params: NamedParams) -> Iterator[None]:
        """Temporarily put the EMA weights into ``module_params``; restore them on exit,
        bit for bit, even when the body raises."""
        if self._swapped:
            raise RuntimeError("EMA.swap_into is not re-entrant")
        params = self._matched(module_params, "swap_into")
        with torch.no_grad():
            backup = {name: p.detach().clone() for name, p in params.items()}
            self.copy_to(params)
        self._swapped = True
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(backup[name])
            self._swapped = False

    def state_dict(self) -> dict[str, Any]:
        """The shadow (cloned, float32) and the last step, for checkpoints. A shadow of
        FSDP2-sharded parameters is sharded like them; its state holds the full CPU
        tensors (collective: every rank must call it)."""
        return {
            "shadow": {name: _full(t) for name, t in self.shadow.items()},
            "last_step": self.last_step,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; names and shapes must match this EMA's. Full
        tensors go into a sharded shadow shard by shard (each rank cuts its own)."""
        if "shadow" not in state:
            raise ValueError("EMA.load_state_dict: no 'shadow' entry in the state")
        loaded = self._matched(state["shadow"], "load_state_dict")
        for name, t in loaded.items():
            shadow = self.shadow[name]
            value = t.to(device=shadow.device, dtype=torch.float32)
            if _is_dtensor(shadow) and not _is_dtensor(value):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, shadow.device_mesh, shadow.placements, src_data_rank=None)
            shadow.copy_(value)
        self.last_step = int(state.get("last_step", 0))


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # no torch.distributed in this build: nothing is sharded
        return False
    return isinstance(tensor, DTensor)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy of ``tensor``; the full CPU tensor of a DTensor (collective)."""
    if _is_dtensor(tensor):
        return tensor.full_tensor().detach().to("cpu", copy=True)
    return tensor.detach().clone()


__all__ = ["EMA", "NamedParams", "ema_decay"]
