"""MixGRPO's sliding window of SDE steps (``--diffusion-step-strategy-path mixgrpo``).

MixGRPO (Li et al., 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed
ODE-SDE", arXiv 2507.21802) samples with the SDE only inside a window of denoising steps
and with the ODE outside it, trains on the window's steps only, and moves the window
towards the end of the schedule as training goes on. Its rule, read in
Tencent-Hunyuan/MixGRPO@e5cdd6a fastvideo/utils/grpo_states.py (``GRPOTrainingStates``,
strategy ``progressive``) with the flags of its recipe
(scripts/finetune/finetune_flux_grpo_MixGRPO.sh: ``--prog_overlap --roll_back``) and
``max_timesteps = sampling_steps - 2`` (fastvideo/train_grpo_flux.py):

- iteration ``i`` trains on ``range(cur, min(cur + group_size, max_timesteps))`` and then
  calls ``update_iteration``: every ``iters_per_group`` iterations ``cur`` moves by
  ``prog_overlap_step``; once it is beyond ``max_timesteps`` it rolls back to 0;
- so ``cur`` after ``i`` iterations is ``stride · ((i // interval) mod P)`` with
  ``P = (T − 2) // stride + 1`` window positions.

Ours, with ``T = --diffusion-num-steps``, window size ``n = --diffusion-num-sde-steps``,
``interval = --mixgrpo-shift-interval`` (its ``iters_per_group``), ``stride =
--mixgrpo-shift-stride`` (its ``prog_overlap_step``; ``stride = n`` is its mode without
``--prog_overlap``) and iteration = rollout id: the same starts and the same roll-back,
and the SDE steps ``[cur, min(cur + n, T − 1))``. The one difference is the end clip:
``T − 1`` (ours) rather than ``T − 2``. Step ``T − 2`` is a valid SDE step (σ' > 0) and
the last one MixGRPO's own comment calls trainable ("the max timestep index is
sampling_steps − 2"), but its exclusive range leaves it out, which also makes its last
window (``cur = T − 2``) empty: ``interval`` iterations that train nothing. Here no window
is empty. The last step (σ' = 0) is never an SDE step, as everywhere in miles-core.

Every request of a rollout gets the same window (it depends on the rollout id only), and
the engine runs ODE steps outside it (what :class:`StepSelection` means). MixGRPO-Flash
(DPM-Solver steps after the window) is not implemented.
"""

from __future__ import annotations

from typing import Any

from miles_core.api import StepContext, StepSelection

DEFAULT_SHIFT_INTERVAL = 25
"""``--mixgrpo-shift-interval``'s default: MixGRPO's recipe's ``iters_per_group``."""
DEFAULT_SHIFT_STRIDE = 1
"""``--mixgrpo-shift-stride``'s default: MixGRPO's recipe's ``prog_overlap_step``."""


def window_start(rollout_id: int, num_steps: int, interval: int, stride: int) -> int:
    """The window's first step at rollout ``rollout_id``: ``rollout_id // interval`` shifts
    of ``stride`` from 0, rolled back to 0 after the last start ``<= num_steps - 2``
    (MixGRPO's ``update_iteration`` with ``roll_back``, in closed form)."""
    if interval < 1 or stride < 1 or num_steps < 2 or rollout_id < 0:
        raise ValueError(
            f"mixgrpo: need interval >= 1, stride >= 1, num_steps >= 2 and rollout_id >= 0, got "
            f"{interval}, {stride}, {num_steps}, {rollout_id}"
        )
    positions = (num_steps - 2) // stride + 1
    return stride * ((rollout_id // interval) % positions)


def _flag(config: Any, dest: str, default: int) -> int:
    # None outside a run; a configuration built without this plugin has no such flag.
    value = getattr(config, dest, None) if config is not None else None
    return default if value is None else int(value)


def mixgrpo(ctx: StepContext) -> StepSelection:
    """MixGRPO's window for the request's rollout: SDE steps ``[cur, min(cur + n, T − 1))``
    with ``cur = window_start(rollout_id, ...)``; every other step runs the ODE."""
    steps, n = ctx.num_steps, ctx.num_sde_steps
    if not 1 <= n <= steps - 1:
        raise ValueError(
            f"mixgrpo: --diffusion-num-sde-steps {n} (the window's size) must be between 1 and "
            f"--diffusion-num-steps {steps} - 1 (the last step is never an SDE step)"
        )
    interval = _flag(ctx.config, "mixgrpo_shift_interval", DEFAULT_SHIFT_INTERVAL)
    stride = _flag(ctx.config, "mixgrpo_shift_stride", DEFAULT_SHIFT_STRIDE)
    start = window_start(ctx.rollout_id, steps, interval, stride)
    return StepSelection.build(tuple(range(start, min(start + n, steps - 1))), steps)
