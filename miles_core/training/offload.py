"""Offload and turn-taking (``--offload-train``, ``--offload-rollout``, ``--offload``,
``--colocate``): the trainer and the engine hand the device to each other.

:class:`TrainerOffload` moves a one-process trainer's state off the device with
:class:`~miles_core.memory.OffloadedStorages` (host buffers, storages released, tensor
objects kept) and back. What goes off depends on who else uses the trainer's modules:

- with a remote engine (``http``, ``sglang``, or training ranks under ``--use-ray``) the
  whole training state: the parameters and buffers of the modules the trainer runs
  (:meth:`~miles_core.family.ModelFamily.components`), their gradients, the optimizer
  state and the EMA shadow;
- with the embedded engine, which samples the trainer's own modules, the modules stay
  resident and only the gradients, the optimizer state and the EMA shadow go off (the
  shadow stays under ``--ema-rollout-policy ema``, since the engine then samples it).

Offloading what is already offloaded, or reloading what is resident, does nothing.

:class:`TurnTaking` is the run loop's side: before generation (and evaluation) the
trainer goes off and the engine resumes; before training the engine releases and the
trainer comes back; the weight sync runs with both resident; a checkpoint is written in
the train turn. Each transition frees before it loads, so the device never holds both
sides unless a sync needs them. ``on_phase(phase, report)`` is called at every boundary
with this process's memory audit there (:func:`run_memory_report`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import torch

from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RunError
from miles_core.memory import MemoryReport, OffloadedStorages, audit_memory, module_tensors, optimizer_tensors

PHASES = ("rollout", "eval", "train", "sync", "checkpoint", "done")
"""The phase boundaries :class:`TurnTaking` reports: generation, evaluation, training,
the weight sync, a checkpoint, and the end of the loop (everything resident)."""


PhaseCallback = Callable[[str, MemoryReport], None]
"""Called as ``(phase, report)`` once a phase's turn is taken."""


class Offloadable(Protocol):
    def offload(self) -> None: ...

    def reload(self) -> None: ...


class TrainerOffload:
    """Moves a :class:`~miles_core.training.trainer.Trainer`'s state off the device and
    back (see the module docstring); ``keep_parameters`` when an in-process engine
    samples its modules, ``keep_ema`` when that engine samples the EMA weights."""

    def __init__(self, trainer: Any, *, keep_parameters: bool = False, keep_ema: bool = False) -> None:
        self.trainer = trainer
        self.keep_parameters = keep_parameters
        self.keep_ema = keep_ema
        self._offloaded: OffloadedStorages | None = None

    @property
    def offloaded(self) -> bool:
        return self._offloaded is not None

    @property
    def offloaded_bytes(self) -> int:
        """Bytes held in host memory while offloaded (0 when resident)."""
        return self._offloaded.nbytes if self._offloaded is not None else 0

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What goes off, and what must stay resident (its storages are never released)."""
        trainer = self.trainer
        modules = list(trainer.family.components().values())
        # The optimizer's parameters are the fp32 masters where the forward runs in another
        # dtype (--fsdp-master-dtype at world size 1): they and their gradients are
        # optimizer-side state, never sampled by an engine, so they always go off.
        masters = trainer.masters.copies() if getattr(trainer, "masters", None) is not None else []
        grads = [p.grad for p in [*trainer.parameters, *masters] if p.grad is not None]
        state = masters + optimizer_tensors(trainer.optimizer)
        ema = list(trainer.ema.shadow.values()) if trainer.ema is not None else []
        going = grads + state + ([] if self.keep_ema else ema)
        staying = ema if self.keep_ema else []
        if self.keep_parameters:
            staying += module_tensors(modules)
        else:
            going += module_tensors(modules)
        return going, staying

    def offload(self) -> None:
        if self._offloaded is None:
            going, staying = self.tensors()
            self._offloaded = OffloadedStorages.offload(going, keep=staying)

    def reload(self) -> None:
        if self._offloaded is not None:
            self._offloaded.restore()
            self._offloaded = None


def trainer_offloader(trainer: Any, engine: Any, config: Any) -> Offloadable:
    """The offload of a run's trainer: a :class:`TrainerOffload` of a one-process
    trainer, or the trainer itself when it offloads its own ranks (``--use-ray``)."""
    from miles_core.training.trainer import Trainer

    if not isinstance(trainer, Trainer):
        if not callable(getattr(trainer, "offload", None)):
            raise RunError(f"--offload-train: the trainer {type(trainer).__name__} cannot offload its state")
        return trainer
    shares = isinstance(engine, EmbeddedEngine)  # the engine samples the trainer's modules
    return TrainerOffload(trainer, keep_parameters=shares, keep_ema=shares and config.ema_rollout_policy == "ema")


def run_memory_report(trainer: Any, engine: Any) -> MemoryReport:
    """The memory audit of this process: the parameters and buffers of the modules the
    trainer runs (``parameters``), their gradients, its optimizer state (fp32 master
    copies included), and the embedded engine's other modules (a remote engine's weights
    live in its own process). Under ``--use-ray`` the driver holds no trainer state (the
    training ranks do, in their own processes: ``RayTrainer.rank_memory_reports``), so
    only the engine side can show here."""
    family = getattr(trainer, "family", None)
    parameters = module_tensors(family.components().values()) if family is not None else []
    optimizers = [trainer.optimizer] if getattr(trainer, "optimizer", None) is not None else []
    engine_modules = list(engine.pipeline_modules().values()) if isinstance(engine, EmbeddedEngine) else []
    return audit_memory(parameters=parameters, optimizers=optimizers, engine_modules=engine_modules)


class TurnTaking:
    """The run's turns (see the module docstring): :meth:`enter` a phase of
    :data:`PHASES`. ``trainer`` is None without ``--offload-train``; the engine releases
    only with ``offload_rollout``. Transitions run one at a time; :meth:`trainer_resident`
    holds the trainer on the device for a background job (a restarted engine's re-sync)."""

    def __init__(
        self,
        trainer: Offloadable | None,
        engine: Any,
        *,
        offload_rollout: bool,
        on_phase: PhaseCallback | None = None,
        audit: Callable[[], MemoryReport] | None = None,
    ) -> None:
        if offload_rollout and not getattr(engine, "releases_memory", False):
            raise RunError(f"--offload-rollout: the {type(engine).__name__} engine cannot release its memory")
        self.trainer = trainer
        self.engine = engine if offload_rollout else None
        self.on_phase = on_phase
        self.audit = audit or MemoryReport
        self.phase: str | None = None
        self._lock = asyncio.Lock()
        self._trainer_off = False
        self._engine_off = False

    @classmethod
    def from_run(cls, config: Any, trainer: Any, engine: Any, on_phase: PhaseCallback | None = None) -> TurnTaking:
        """The turns a run's flags ask for (``config.offload_train``,
        ``config.offload_rollout``, resolved from ``--offload`` and ``--colocate``)."""
        if isinstance(engine, EmbeddedEngine):
            # The trainer runs these modules: releasing the engine leaves them resident.
            engine.keep_on_release = frozenset(engine.family.components())
        offloader = trainer_offloader(trainer, engine, config) if config.offload_train else None
        return cls(
            offloader,
            engine,
            offload_rollout=bool(config.offload_rollout),
            on_phase=on_phase,
            audit=lambda: run_memory_report(trainer, engine),
        )

    async def enter(self, phase: str) -> None:
        """Take the turn of ``phase``; free first, then load."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
        async with self._lock:
            trainer_on = phase in ("train", "sync", "checkpoint", "done")
            engine_on = phase != "train" and phase != "checkpoint"
            if not trainer_on:
                await self._set_trainer(False)
            if not engine_on:
                await self._set_engine(False)
            if trainer_on:
                await self._set_trainer(True)
            if engine_on:
                await self._set_engine(True)
            self.phase = phase
            if self.on_phase is not None:  # inside the lock: nothing moves while it looks
                self.on_phase(phase, self.audit())

    @asynccontextmanager
    async def trainer_resident(self) -> Any:
        """The trainer on the device inside the block (reloaded for it when offloaded);
        phase changes wait until the block ends."""
        async with self._lock:
            was_off = self._trainer_off
            await self._set_trainer(True)
            try:
                yield
            finally:
                if was_off:
                    await self._set_trainer(False)

    async def _set_trainer(self, resident: bool) -> None:
        if self.trainer is None or self._trainer_off == (not resident):
            return
        move = asyncio.ensure_future(asyncio.to_thread(self.trainer.reload if resident else self.trainer.offload))
        try:
            await asyncio.shield(move)
        except asyncio.CancelledError:
            # The thread goes on when the run is cancelled (Ctrl-C): wait for it, so that
            # the flag says where the state is when the run's checkpoint on failure reads it.
            await asyncio.wait([move])
            if not move.cancelled() and move.exception() is None:
                self._trainer_off = not resident
            raise
        self._trainer_off = not resident

    async def _set_engine(self, resident: bool) -> None:
        if self.engine is None or self._engine_off == (not resident):
            return
        await (self.engine.resume_memory() if resident else self.engine.release_memory())
        self._engine_off = not resident


__all__ = ["PHASES", "PhaseCallback", "TrainerOffload", "TurnTaking", "run_memory_report", "trainer_offloader"]
