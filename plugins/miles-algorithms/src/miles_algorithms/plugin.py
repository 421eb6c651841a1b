"""Entry-point module of miles-algorithms: records, flags and configuration checks only;
no torch, no algorithm code imported here (a component is imported when a run uses it)."""

from __future__ import annotations

from typing import Any

from miles_core.api import Flag, LossSpec, SdeBackendSpec, StepStrategySpec, hookimpl


@hookimpl
def miles_register_sde_backends() -> list[SdeBackendSpec]:
    return [
        SdeBackendSpec(
            name="dance_sde",
            ref="miles_algorithms.dance_sde:DanceSde",
            description="DanceGRPO's constant-noise flow SDE: diffusion coefficient s = --diffusion-noise-level "
            "(DanceGRPO uses 0.3), std = s*sqrt(-dsigma), Flow-GRPO's drift correction",
        )
    ]


@hookimpl
def miles_register_step_strategies() -> list[StepStrategySpec]:
    return [
        StepStrategySpec(
            name="mixgrpo",
            ref="miles_algorithms.mixgrpo:mixgrpo",
            description="MixGRPO's sliding window: --diffusion-num-sde-steps SDE steps from a start that moves "
            "--mixgrpo-shift-stride steps every --mixgrpo-shift-interval rollouts and wraps to 0; ODE outside",
        )
    ]


@hookimpl
def miles_register_losses() -> list[LossSpec]:
    return [
        LossSpec(
            name="grpo_guard",
            ref="miles_algorithms.grpo_guard:grpo_guard",
            description="GRPO-Guard: Flow-GRPO's clipped surrogate on a per-timestep normalised log-ratio, with the "
            "gradient reweighted across timesteps",
            trains_on="sde_transitions",
            needs_sde_steps=True,
            batch_keys=("mean", "old_mean", "transition_std", "sigma", "sigma_next"),
        ),
        LossSpec(
            name="flow_dpo",
            ref="miles_algorithms.dpo:flow_dpo",
            description="online Flow-DPO (Diffusion-DPO on velocities): each group's best against its worst sample, "
            "log-ratios against the reference policy (--dpo-beta)",
            trains_on="preference_pairs",
            needs_reference=True,
            min_group_size=2,
        ),
    ]


@hookimpl
def miles_add_arguments() -> list[Flag]:
    return [
        Flag(
            name="--mixgrpo-shift-interval",
            group="algorithms",
            type="int",
            default=25,
            range="[1, inf)",
            help="MixGRPO's shift interval (its --iters_per_group, 25 in its recipe): rollouts between two moves of the "
            "sliding window of SDE steps. Read with --diffusion-step-strategy-path mixgrpo only.",
        ),
        Flag(
            name="--mixgrpo-shift-stride",
            group="algorithms",
            type="int",
            default=1,
            range="[1, inf)",
            help="Steps the MixGRPO window's start moves at each shift (its --prog_overlap_step, 1 in its recipe; "
            "--diffusion-num-sde-steps gives its non-overlapping mode). Read with --diffusion-step-strategy-path mixgrpo only.",
        ),
        Flag(
            name="--dpo-beta",
            group="algorithms",
            type="float",
            default=100.0,
            range="(0, inf)",
            help="β of the online Flow-DPO loss (--loss-type flow_dpo): the scale of the policy-vs-reference "
            "log-ratio difference inside the logistic loss (100, as flow_grpo's train_sd3_dpo.py).",
        ),
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    # The flags' own ranges (range= above) are checked by the core with every flag's.
    return _mixgrpo_errors(config)


def _mixgrpo_errors(config: Any) -> list[str]:
    """MixGRPO's window must fit in the SDE-able steps ``0 .. T - 2`` and be non-empty; the
    flags that place another strategy's window would be ignored, so they are refused."""
    if config.get("diffusion_step_strategy_path") != "mixgrpo":
        return []
    errors = []
    steps, n = config.get("diffusion_num_steps"), config.get("diffusion_num_sde_steps")
    if steps is not None and n is not None and not 1 <= n <= steps - 1:
        errors.append(
            f"--diffusion-step-strategy-path mixgrpo: --diffusion-num-sde-steps {n} (the window's size) must be between 1 "
            f"and --diffusion-num-steps {steps} - 1 (the window slides over the steps that can be SDE steps; the last "
            "step never is)"
        )
    for dest in ("diffusion_sde_window_range", "diffusion_sde_candidate_steps"):
        if config.get(dest) is not None:
            errors.append(
                f"--{dest.replace('_', '-')} has no effect with --diffusion-step-strategy-path mixgrpo (its window slides "
                "over every step but the last, placed by --mixgrpo-shift-interval and --mixgrpo-shift-stride); drop it"
            )
    return errors
