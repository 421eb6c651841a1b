"""Learning-rate schedule: the reference's ``--lr*`` flags, with Megatron-LM's formulas.

The reference builds Megatron-LM's ``OptimizerParamScheduler`` (its FSDP backend copies
``get_lr`` verbatim). For optimizer step ``s`` (0 for the first step):

- warmup, while ``warmup_iters > 0`` and ``s <= warmup_iters``:
  ``warmup_init + (lr - warmup_init) * s / warmup_iters`` (so ``s == warmup_iters`` is ``lr``);
- ``constant``: ``lr`` after warmup, forever;
- otherwise, past ``decay_iters`` (``s > decay_iters``): ``min_lr``;
- else, with ``r = (s - warmup_iters) / (decay_iters - warmup_iters)``, the rate is
  ``min_lr + c * (lr - min_lr)`` with ``c = 1 - r`` (``linear``),
  ``c = (1 + cos(pi r)) / 2`` (``cosine``), or for ``wsd`` ``c = 1`` until the last
  ``wsd_decay_iters`` steps before ``decay_iters``, then, with ``q`` the fraction of those
  steps done: ``1 - q`` (linear), ``(1 + cos(pi q)) / 2`` (cosine),
  ``2 * 0.5**q - 1`` (exponential), ``1 - sqrt(q)`` (minus_sqrt).

Megatron counts these in samples (iterations x global batch size); every ratio is the
same in optimizer steps, which is what this module counts.

A resumed run (``--load``) goes on with the schedule its checkpoint saved
(:func:`schedule_state`), warning where the command line differs, unless
``--override-lr-scheduler`` or ``--no-use-checkpoint-lr-scheduler``
(:func:`resolve_schedule_on_resume`), as Megatron's ``--use-checkpoint-opt_param-scheduler``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

DECAY_STYLES = ("constant", "linear", "cosine", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
DEFAULT_WSD_DECAY_STYLE = "exponential"
"""Megatron-LM's default for ``--lr-wsd-decay-style``; our flag's default is unset."""


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule over optimizer steps; :meth:`lr_at` gives the rate.

    ``warmup_iters`` may be fractional: ``--lr-warmup-fraction`` gives
    ``fraction x decay_iters`` and, as in Megatron, it is not rounded.
    """

    lr: float
    min_lr: float = 0.0
    warmup_init: float = 0.0
    warmup_iters: float = 0
    decay_style: str = "constant"
    decay_iters: int | None = None
    wsd_decay_iters: int | None = None
    wsd_decay_style: str | None = None

    def __post_init__(self) -> None:
        # Megatron's constructor assertions, as one-line errors that name the flags.
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {self.decay_style!r}: choose one of {', '.join(DECAY_STYLES)}")
        if self.min_lr < 0:
            raise ValueError(f"--min-lr {self.min_lr} must be >= 0")
        if self.lr < self.min_lr:
            raise ValueError(f"--lr {self.lr} must be >= --min-lr {self.min_lr}")
        if self.warmup_init > self.lr:
            raise ValueError(f"--lr-warmup-init {self.warmup_init} must be <= --lr {self.lr}")
        if self.warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters {self.warmup_iters} must be >= 0")
        if self.decay_style == "constant":
            # Megatron asserts warmup < decay for every style; with constant the decay
            # length is never used, so a short run with a long warmup is not an error here.
            return
        if self.decay_iters is None or self.decay_iters <= 0:
            raise ValueError(f"--lr-decay-style {self.decay_style} needs decay iterations > 0, got {self.decay_iters}")
        if self.warmup_iters >= self.decay_iters:
            raise ValueError(
                f"warmup ({self.warmup_iters} steps) must be shorter than the decay iterations ({self.decay_iters}; "
                "--lr-decay-iters, or the run's total optimizer steps)"
            )
        if self.decay_style == "wsd":
            if self.wsd_decay_iters is None:
                raise ValueError("--lr-decay-style wsd needs --lr-wsd-decay-iters")
            if not 0 < self.wsd_decay_iters <= self.decay_iters:
                raise ValueError(f"--lr-wsd-decay-iters {self.wsd_decay_iters} must be in 1..{self.decay_iters} (the decay iterations)")
            style = self.wsd_decay_style or DEFAULT_WSD_DECAY_STYLE
            if style not in WSD_DECAY_STYLES:
                raise ValueError(f"--lr-wsd-decay-style {style!r}: choose one of {', '.join(WSD_DECAY_STYLES)}")

    def lr_at(self, step: int) -> float:
        """The learning rate for optimizer step ``step`` (0 for the first step)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.lr - self.warmup_init) * float(step) / float(self.warmup_iters)
        if self.decay_style == "constant":
            return self.lr
        assert self.decay_iters is not None  # checked in __post_init__
        if step > self.decay_iters:
            return self.min_lr
        ratio = float(step - self.warmup_iters) / float(self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # wsd
            assert self.wsd_decay_iters is not None
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if step <= anneal_start:
                coeff = 1.0
            else:
                q = float(step - anneal_start) / float(self.wsd_decay_iters)
                style = self.wsd_decay_style or DEFAULT_WSD_DECAY_STYLE
                if style == "linear":
                    coeff = 1.0 - q
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * math.pow(0.5, q) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every param group's ``lr`` to :meth:`lr_at` ``(step)``; return that rate.

        Every group gets the same rate: we have no per-group ``max_lr``/``min_lr``
        overrides (Megatron's ``param_group.get('max_lr', ...)``).
        """
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def from_config(config: Any, total_steps: int) -> LRSchedule:
    """The schedule the ``--lr*`` flags of ``config`` describe, for a run of
    ``total_steps`` optimizer steps.

    As in the reference (``get_lr_scheduler``): the decay iterations are
    ``--lr-decay-iters``, or ``total_steps`` when it is unset; ``--lr-warmup-fraction``,
    when set, gives ``fraction x decay iterations`` of warmup (so ``fraction x
    total_steps`` when ``--lr-decay-iters`` is unset) and wins over ``--lr-warmup-iters``.
    """
    decay_iters = config.lr_decay_iters if config.lr_decay_iters is not None else total_steps
    fraction = config.lr_warmup_fraction
    warmup: float = fraction * decay_iters if fraction is not None else config.lr_warmup_iters
    return LRSchedule(
        lr=config.lr,
        min_lr=config.min_lr,
        warmup_init=config.lr_warmup_init,
        warmup_iters=warmup,
        decay_style=config.lr_decay_style,
        decay_iters=decay_iters,
        wsd_decay_iters=config.lr_wsd_decay_iters,
        wsd_decay_style=config.lr_wsd_decay_style,
    )


# -- resuming: whose schedule wins --------------------------------------------------------

SCHEDULE_KEY = "lr_schedule"
"""Key of the schedule in a checkpoint's ``extra`` (see :func:`schedule_state`)."""

_FIELD_FLAGS = {
    "lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_init": "--lr-warmup-init",
    "warmup_iters": "--lr-warmup-iters/--lr-warmup-fraction",
    "decay_style": "--lr-decay-style",
    "decay_iters": "--lr-decay-iters (or the run's total optimizer steps)",
    "wsd_decay_iters": "--lr-wsd-decay-iters",
    "wsd_decay_style": "--lr-wsd-decay-style",
}


def schedule_state(schedule: LRSchedule) -> dict[str, Any]:
    """The schedule as plain JSON values, for a checkpoint's ``extra[SCHEDULE_KEY]``.
    Resolved values are saved (the decay length is the original run's total when
    ``--lr-decay-iters`` was unset), so a resumed run with another ``--num-rollout``
    keeps the schedule it started with."""
    return dataclasses.asdict(schedule)


def use_checkpoint_schedule(config: Any) -> bool:
    """Megatron's rule: the checkpoint's schedule, unless ``--override-lr-scheduler`` or
    ``--no-use-checkpoint-lr-scheduler`` (unset counts as on, the default)."""
    return not config.override_lr_scheduler and config.use_checkpoint_lr_scheduler is not False


def resolve_schedule_on_resume(config: Any, schedule: LRSchedule, saved: Mapping[str, Any] | None) -> tuple[LRSchedule, list[str]]:
    """The schedule a resumed run uses, and one warning line per setting where the
    checkpoint's and the command line's differ.

    ``schedule`` is the command line's (:func:`from_config`), ``saved`` the checkpoint's
    :func:`schedule_state` (None: a checkpoint written before schedules were saved, whose
    run goes on with the command line's). By default the checkpoint's wins, as Megatron's
    ``--use-checkpoint-opt_param-scheduler``; ``--override-lr-scheduler`` (or
    ``--no-use-checkpoint-lr-scheduler``) keeps the command line's."""
    if saved is None:
        return schedule, ["the checkpoint holds no learning-rate schedule (saved before schedules were); using the command line's"]
    known = {f.name for f in dataclasses.fields(LRSchedule)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ValueError(f"the checkpoint's learning-rate schedule has unknown setting(s) {', '.join(unknown)}")
    try:
        checkpoint = LRSchedule(**{**dataclasses.asdict(schedule), **saved})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the checkpoint's learning-rate schedule is invalid ({exc})") from None
    keep = use_checkpoint_schedule(config)
    chosen = checkpoint if keep else schedule
    warnings = []
    for name, flag in _FIELD_FLAGS.items():
        ours, theirs = getattr(schedule, name), getattr(checkpoint, name)
        if ours == theirs:
            continue
        if keep:
            warnings.append(
                f"{flag}: the checkpoint's {theirs!r} is used, not the command line's {ours!r} "
                "(--override-lr-scheduler keeps the command line's)"
            )
        else:
            warnings.append(f"{flag}: the command line's {ours!r} is used, not the checkpoint's {theirs!r}")
    return chosen, warnings


def resume_schedule(config: Any, schedule: LRSchedule, log: Callable[[str], None]) -> LRSchedule:
    """:func:`resolve_schedule_on_resume` against the checkpoint ``--load`` /
    ``--ckpt-step`` name (only its ``meta.json`` is read), logging each warning; the
    schedule unchanged when there is nothing to resume from. A bad saved schedule
    raises :class:`~miles_core.training.run.RunError`."""
    from pathlib import Path

    from miles_core.errors import RunError
    from miles_core.training.checkpoint import read_extra

    if not config.load:
        return schedule
    saved = read_extra(Path(config.load), config.ckpt_step)
    if saved is None:
        return schedule
    try:
        chosen, warnings = resolve_schedule_on_resume(config, schedule, saved.get(SCHEDULE_KEY))
    except ValueError as exc:
        raise RunError(f"--load {config.load}: {exc}") from None
    for line in warnings:
        log(f"warning: {line}")
    return chosen


__all__ = [
    "DECAY_STYLES",
    "DEFAULT_WSD_DECAY_STYLE",
    "SCHEDULE_KEY",
    "WSD_DECAY_STYLES",
    "LRSchedule",
    "from_config",
    "resolve_schedule_on_resume",
    "resume_schedule",
    "schedule_state",
    "use_checkpoint_schedule",
]
