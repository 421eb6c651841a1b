"""The core's own built-ins, registered through the ``miles.plugins`` entry-point group
(entry point ``core``) exactly like a third-party plugin, so they are listed, selected
and disabled the same way. Only records here: the implementations are imported when a
run first uses them.
"""

from __future__ import annotations

from typing import Any

from miles_core.hookspecs import hookimpl
from miles_core.specs import LossSpec, RewardSpec, RolloutEngineSpec, RolloutFilterSpec, SdeBackendSpec, StepStrategySpec


@hookimpl
def miles_register_sde_backends() -> list[SdeBackendSpec]:
    return [
        SdeBackendSpec(
            name="sde",
            ref="miles_core.sde:FlowSdeBackend",
            description="Flow-GRPO SDE over the scheduler's sigmas, Gaussian log-prob",
        ),
        SdeBackendSpec(
            name="cps",
            ref="miles_core.sde:CpsBackend",
            description="Coefficient-preserving sampling; pairs with --diffusion-log-prob-no-const",
        ),
        SdeBackendSpec(
            name="ode",
            ref="miles_core.sde:OdeBackend",
            description="Deterministic Euler step, log-prob 0 (DiffusionNFT rollouts)",
        ),
    ]


@hookimpl
def miles_register_step_strategies() -> list[StepStrategySpec]:
    return [
        StepStrategySpec(
            name="sde_window",
            ref="miles_core.step_strategies:sde_window",
            description="Contiguous window of --diffusion-num-sde-steps SDE steps, start drawn from the request seed",
        ),
        StepStrategySpec(
            name="epoch_global_random_choice",
            ref="miles_core.step_strategies:epoch_global_random_choice",
            description="--diffusion-num-sde-steps of --diffusion-sde-candidate-steps, one draw per epoch for all samples",
        ),
        StepStrategySpec(
            name="ode_and_return_last",
            ref="miles_core.step_strategies:ode_and_return_last",
            description="No SDE step, only the final latent returned (DiffusionNFT)",
        ),
    ]


@hookimpl
def miles_register_losses() -> list[LossSpec]:
    return [
        LossSpec(
            name="policy_loss",
            ref="miles_core.losses:policy_loss",
            description="Flow-GRPO clipped policy gradient on SDE steps (+ KL to a reference)",
            needs_sde_steps=True,
        ),
        LossSpec(
            name="nft",
            ref="miles_core.losses:nft",
            description="DiffusionNFT: likelihood-free, on the forward process",
            trains_on="nft_pairs",
            keeps_ema=True,
        ),
        LossSpec(
            name="sft_loss",
            ref="miles_core.losses:sft",
            description="Supervised flow-matching loss on data (x0) samples",
            trains_on="supervised_rows",
        ),
        LossSpec(
            name="custom_loss",
            ref="miles_core.losses:custom_loss",
            description="The function named by --custom-loss-function-path",
        ),
    ]


@hookimpl
def miles_register_rollout_filters() -> list[RolloutFilterSpec]:
    return [
        RolloutFilterSpec(
            name="check_reward_nonzero_std",
            ref="miles_core.rollout.filters:check_reward_nonzero_std",
            description="Dynamic sampling (DAPO): keep a prompt group whose rewards are not all equal",
            stage="group",
        ),
        RolloutFilterSpec(
            name="pop_first",
            ref="miles_core.rollout.filters:pop_first",
            description="Train on the first --rollout-batch-size groups, in order (the reference's default)",
            stage="buffer",
        ),
    ]


@hookimpl
def miles_register_rewards() -> list[RewardSpec]:
    return [
        RewardSpec(
            name="remote",
            ref="miles_core.reward_service.remote:RemoteReward",
            description="Any reward served by miles-core serve-reward servers (--rm-url URL ...): batched, "
            "retried on the next URL, failures masked",
        ),
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    """The rollout-filter flags name a registered filter of their stage or a callable."""
    keys = ("dynamic_sampling_filter_path", "rollout_sample_filter_path", "buffer_filter_path")
    if all(config.get(key) is None for key in keys):
        return []  # nothing to check (and nothing imported)
    from miles_core.rollout.filters import filter_errors

    return filter_errors(config)


@hookimpl
def miles_register_rollout_engines() -> list[RolloutEngineSpec]:
    return [
        RolloutEngineSpec(
            name="embedded",
            ref="miles_core.engine.embedded:EmbeddedEngine",
            description="In-process engine over the family's diffusers pipeline (CPU or GPU)",
            releases_memory=True,
        ),
        RolloutEngineSpec(
            name="http",
            ref="miles_core.engine.http:HttpEngine",
            description="Servers speaking POST /rollout/generate (miles-core serve-engine, sglang-diffusion)",
            remote=True,
            releases_memory=True,
        ),
        RolloutEngineSpec(
            name="sglang",
            ref="miles_core.engine.sglang:SglangEngine",
            description="sglang-diffusion servers the run starts from --sglang-python's environment (--rollout-num-engines)",
            remote=True,
            releases_memory=True,
        ),
    ]
