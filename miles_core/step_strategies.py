"""Step strategies: which denoising steps run the SDE, and which latents come back.

A strategy fills the two step fields of a ``POST /rollout/generate`` request
(``rollout_sde_step_indices`` and ``rollout_return_step_indices``, docs/design.md, "The wire contract"). It
is a plain callable ``strategy(ctx: StepContext) -> StepSelection``; register one with
``miles_register_step_strategies`` or name it with ``--diffusion-step-strategy-path``.

Step numbering: with ``T`` inference steps, loop step ``k`` (0-based) moves latent
``x_k`` to ``x_{k+1}``; latents are indexed ``0..T`` and ``x_T`` is the final one. The
last step (``k = T - 1``, ``sigma' = 0``) is never an SDE step: its Gaussian is
degenerate (CPS) or so peaked that its log-prob overflows (flow_grpo leaves it out of
training for that reason). A :class:`StepSelection` never holds it; a window that
reaches it (``--diffusion-sde-window-range lo,T``, the reference's default
``[0, num_inference_steps)``) keeps it as the deterministic Euler (ODE) step, untrained
(see :func:`sde_window`).

Strategies are pure functions of their context, so the engine and a replay of the same
request choose the same steps. They draw from a local :class:`random.Random`, never the
global one, so nothing else in the process can shift their choice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol


def _check_ints(field: str, values: tuple[int, ...]) -> None:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"StepSelection.{field}: {value!r} is not an int")


def _check_indices(field: str, values: tuple[int, ...], hi: int) -> None:
    """Sorted, unique values in ``[0, hi]``; one-line ValueError otherwise."""
    for value in values:
        if not 0 <= value <= hi:
            raise ValueError(f"StepSelection.{field}: step {value} is outside [0, {hi}]")
    if list(values) != sorted(set(values)):
        raise ValueError(f"StepSelection.{field} {list(values)} must be sorted and without repeats")


@dataclass(frozen=True)
class StepSelection:
    """What one rollout request asks the engine for.

    ``sde_steps``: loop steps ``k`` that run the SDE; the others run ODE and have
    log-prob 0. ``return_steps``: latent indices ``0..T`` the engine returns. Build one
    with :meth:`build` to get the return set right; the constructor only validates.
    """

    sde_steps: tuple[int, ...]
    return_steps: tuple[int, ...]

    def __post_init__(self) -> None:
        # Tuples keep the record hashable and frozen in fact, not only in name.
        object.__setattr__(self, "sde_steps", tuple(self.sde_steps))
        object.__setattr__(self, "return_steps", tuple(self.return_steps))
        _check_ints("sde_steps", self.sde_steps)
        _check_ints("return_steps", self.return_steps)
        # The final latent x_T is always returned, so T is the largest returned index.
        num_steps = max(self.return_steps, default=0)
        if num_steps < 1:
            raise ValueError(f"StepSelection.return_steps {list(self.return_steps)} must end with the final latent T >= 1")
        _check_indices("return_steps", self.return_steps, num_steps)
        _check_indices("sde_steps", self.sde_steps, num_steps - 1)
        for k in self.sde_steps:
            if k == num_steps - 1:
                raise ValueError(
                    f"StepSelection.sde_steps: step {k} is the last step (T = {num_steps}, the largest of "
                    "return_steps; sigma' = 0) and is never an SDE step"
                )
            if k not in self.return_steps or k + 1 not in self.return_steps:
                raise ValueError(
                    f"StepSelection.return_steps {list(self.return_steps)} must include latents {k} and {k + 1} of SDE step {k}"
                )

    @property
    def num_steps(self) -> int:
        """``T``: the index of the final latent, which is always returned."""
        return self.return_steps[-1]

    @classmethod
    def build(cls, sde_steps: tuple[int, ...] | list[int], num_steps: int) -> StepSelection:
        """The selection for ``sde_steps`` of a ``num_steps`` schedule: returns ``x_k`` and
        ``x_{k+1}`` of every SDE step (the trainer's pairs) and the final latent ``x_T``
        (NFT/SFT losses and evaluation use it)."""
        sde = tuple(sorted(sde_steps))
        for k in sde:
            if not 0 <= k < num_steps - 1:
                raise ValueError(f"SDE step {k} is outside [0, {num_steps - 1}) for {num_steps} steps (the last step is never an SDE step)")
        returned = {num_steps, *sde, *(k + 1 for k in sde)}
        return cls(sde_steps=sde, return_steps=tuple(sorted(returned)))


@dataclass(frozen=True)
class StepContext:
    """Everything a strategy may base its choice on."""

    num_steps: int
    """``T``: denoising steps of the request (``--diffusion-num-steps``)."""
    num_sde_steps: int
    """``--diffusion-num-sde-steps``; 0 means no SDE step."""
    window_range: tuple[int, int] | None
    """``--diffusion-sde-window-range`` ``[lo, hi)`` with ``hi <= T``; ``None`` means
    ``[0, T - 1)``. A window that reaches the last step ``T - 1`` runs it as the
    deterministic step (:func:`sde_window`)."""
    candidate_steps: tuple[int, ...] | None
    """``--diffusion-sde-candidate-steps``."""
    seed: int
    """The request's (microgroup's) seed; output ``i`` of the request uses ``seed + i``."""
    epoch: int
    """Rollout epoch index."""
    rollout_seed: int
    """``--rollout-seed``."""
    rollout_id: int = 0
    """The rollout the request belongs to (0 for a configuration check's dry run), so a
    strategy can change its choice over training (a curriculum over steps)."""
    config: Any = field(default=None, compare=False, repr=False)
    """The run's resolved configuration (read only), where a plugin's strategy reads the
    flags it adds with ``miles_add_arguments`` (MixGRPO's shift interval); None when a
    strategy is called outside a run."""


class StepStrategy(Protocol):
    """``strategy(ctx) -> StepSelection``: the protocol every step strategy follows."""

    def __call__(self, ctx: StepContext) -> StepSelection: ...


def sde_window(ctx: StepContext) -> StepSelection:
    """A contiguous window of ``num_sde_steps`` steps inside ``window_range`` (default
    ``[0, T - 1)``, at most ``[0, T)``), its start drawn from the request seed.

    Seeding from the request seed (not per output) means every output of one request, and
    so of one microgroup, shares the window: the engine denoises them as one batch, and a
    replay of the request picks the same window. The draw is flow_grpo's
    ``randint(lo, hi - size)`` (inclusive) over the given range, on a local
    ``random.Random(seed)`` (flow_grpo@74db691 ``scripts/train_sd3_fast.py`` hands
    ``sde_window_size`` and ``sde_window_range`` to its window sampler), so ``0,T`` draws
    as the reference's default window does.

    The window's steps are SDE steps, but for the last step ``T - 1`` (``sigma' = 0``):
    a window that reaches it keeps it as the deterministic Euler (ODE) step, with log-prob
    0 and no train pair. A window of ``n`` steps that includes ``T - 1`` thus trains
    ``n - 1`` steps (none for ``n = 1``). (flow_grpo never trains its last step either,
    but its sampler still adds noise on it; here the final latent stays noise-free.)
    """
    n, steps = ctx.num_sde_steps, ctx.num_steps
    if n < 0:
        raise ValueError(f"sde_window: --diffusion-num-sde-steps {n} must not be negative")
    if n == 0:
        return StepSelection.build((), steps)
    lo, hi = ctx.window_range if ctx.window_range is not None else (0, steps - 1)
    if not 0 <= lo < hi <= steps:
        raise ValueError(
            f"sde_window: --diffusion-sde-window-range {lo},{hi}: need 0 <= lo < hi <= --diffusion-num-steps {steps} "
            f"(a window reaching the last step {steps - 1} runs it deterministically)"
        )
    if n > hi - lo:
        raise ValueError(f"sde_window: --diffusion-num-sde-steps {n} does not fit in the window [{lo}, {hi})")
    start = random.Random(ctx.seed).randint(lo, hi - n)
    # The last step (sigma' = 0) stays the deterministic step, never an SDE step.
    return StepSelection.build(tuple(k for k in range(start, start + n) if k != steps - 1), steps)


def epoch_global_random_choice(ctx: StepContext) -> StepSelection:
    """``num_sde_steps`` of ``candidate_steps``, drawn once per epoch: every sample of an
    epoch gets the same steps (a per-rollout subset shared across the batch, as in the
    reference's Wan 2.2 / LTX / Cosmos3 recipes).

    The draw uses a local ``random.Random`` seeded from ``(rollout_seed, epoch)`` spelt as a
    string: string seeds are hashed with SHA-512, so the choice is the same in every
    process and Python run, and distinct ``(rollout_seed, epoch)`` pairs never collide the
    way ``rollout_seed + epoch`` would.
    """
    steps, n = ctx.num_steps, ctx.num_sde_steps
    if ctx.candidate_steps is None:
        raise ValueError("epoch_global_random_choice requires --diffusion-sde-candidate-steps (e.g. 1,2,3)")
    candidates = sorted(ctx.candidate_steps)  # spelling order must not change the draw
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"epoch_global_random_choice: --diffusion-sde-candidate-steps {list(ctx.candidate_steps)} repeats a step")
    bad = [k for k in candidates if not 0 <= k < steps - 1]
    if bad:
        raise ValueError(
            f"epoch_global_random_choice: --diffusion-sde-candidate-steps {bad} outside [0, {steps - 1}) "
            "(the last step is never an SDE step)"
        )
    if n < 0:
        raise ValueError(f"epoch_global_random_choice: --diffusion-num-sde-steps {n} must not be negative")
    if n > len(candidates):
        raise ValueError(
            f"epoch_global_random_choice: --diffusion-num-sde-steps {n} exceeds the {len(candidates)} --diffusion-sde-candidate-steps"
        )
    rng = random.Random(f"epoch_global_random_choice:{ctx.rollout_seed}:{ctx.epoch}")
    return StepSelection.build(tuple(rng.sample(candidates, n)), steps)


def ode_and_return_last(ctx: StepContext) -> StepSelection:
    """No SDE step, only the final latent returned (DiffusionNFT: ODE rollouts, trains on
    ``x_0``)."""
    return StepSelection.build((), ctx.num_steps)


def select_steps(config_like: Any, *, seed: int, epoch: int, strategy: StepStrategy, rollout_id: int = 0) -> StepSelection:
    """Run ``strategy`` on the context built from the step flags of ``config_like`` (a
    :class:`~miles_core.config.model.Config` or anything with the same attributes)."""
    window = config_like.diffusion_sde_window_range
    candidates = config_like.diffusion_sde_candidate_steps
    ctx = StepContext(
        num_steps=int(config_like.diffusion_num_steps),
        num_sde_steps=int(config_like.diffusion_num_sde_steps),
        window_range=None if window is None else (int(window[0]), int(window[1])),
        candidate_steps=None if candidates is None else tuple(int(k) for k in candidates),
        seed=int(seed),
        epoch=int(epoch),
        rollout_seed=int(config_like.rollout_seed),
        rollout_id=int(rollout_id),
        config=getattr(config_like, "config", None) or config_like,
    )
    return strategy(ctx)
