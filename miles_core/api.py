"""The plugin API: everything a plugin (a model family, a step backend, a reward, a loss,
a rollout filter, an engine) may import from miles-core, and nothing else.

Plugins import from here only; a test holds the in-repo plugins and examples to that.
Names listed here keep their meaning across minor versions; everything else in
``miles_core`` is internal and may change. ``docs/plugins.md`` ("The plugin API") lists
each name with what it is.

Importing this module is cheap: the hook marker, the spec records, ``Flag`` and the
error types come with it, and every torch-backed name (the family base class and its
helpers, the request record, the step backend base, the tiny tokenizers) is imported the
first time it is used. A plugin's entry-point module can therefore import its hook
marker and specs from here and keep ``miles-core list-plugins`` fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles_core.config.flag import Flag
from miles_core.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    MilesError,
    RequestError,
    RewardError,
    RewardsFailedError,
    RunError,
    RunFailedError,
    UsageError,
    WeightUpdateError,
)
from miles_core.hookspecs import hookimpl
from miles_core.specs import (
    FAMILY_GENERATION_OPTIONS,
    TRAINING_DATA,
    TRANSITION_BATCH_KEYS,
    LossSpec,
    ModelFamilySpec,
    RewardSpec,
    RolloutEngineSpec,
    RolloutFilterSpec,
    SdeBackendSpec,
    Spec,
    StepStrategySpec,
)

_LAZY: dict[str, str] = {
    # The model-family contract and the helpers every family shares.
    "ModelFamily": "miles_core.family",
    "Conditioning": "miles_core.family",
    "GenerationParams": "miles_core.family",
    "Latents": "miles_core.family",
    "Schedule": "miles_core.family",
    "check_flow_shift": "miles_core.family",
    "exact_first_sigma": "miles_core.family",
    "per_output_noise": "miles_core.family",
    "read_component_config": "miles_core.family",
    "request_extras": "miles_core.family",
    "request_fps": "miles_core.family",
    "request_max_sequence_length": "miles_core.family",
    "request_size": "miles_core.family",
    "scheduler_copy": "miles_core.family",
    # A request's conditioning image (image-to-video families).
    "ConditioningImage": "miles_core.conditioning_image",
    "load_conditioning_image": "miles_core.conditioning_image",
    "request_image": "miles_core.conditioning_image",
    # Recognising a checkpoint directory by its contents.
    "component_config": "miles_core.family_match",
    # The /rollout/generate request and its per-output result.
    "RolloutRequest": "miles_core.request",
    "RolloutOutput": "miles_core.request",
    "FLOW_SHIFT": "miles_core.request",
    # Denoising-step backends.
    "SdeBackend": "miles_core.sde",
    "FlowSdeBackend": "miles_core.sde",
    "StepOutput": "miles_core.sde",
    "broadcast_sigma": "miles_core.sde",
    "working_precision": "miles_core.sde",
    # Step strategies: ``strategy(ctx: StepContext) -> StepSelection``.
    "StepContext": "miles_core.step_strategies",
    "StepSelection": "miles_core.step_strategies",
    # Losses: ``loss(batch, config) -> (loss, metrics)``.
    "LossFn": "miles_core.losses",
    "Metrics": "miles_core.losses",
    "kl_penalty": "miles_core.losses",
    # Rollout samples (what rewards, filters and rollout functions receive).
    "Sample": "miles_core.rollout.sample",
    "FilterOutput": "miles_core.rollout.filters",
    # Rewards that call a server: retries with backoff over URLs, bounded concurrency.
    "RETRY_STATUSES": "miles_core.reward_service.retry",
    "Answer": "miles_core.reward_service.retry",
    "CallFailed": "miles_core.reward_service.retry",
    "RetryPolicy": "miles_core.reward_service.retry",
    "gather_bounded": "miles_core.reward_service.retry",
    "post_with_retries": "miles_core.reward_service.retry",
    "run_in_new_loop": "miles_core.reward_service.retry",
    # Tokenizers built offline for tiny pipelines.
    "clip_tokenizer": "miles_core.tiny.tokenizers",
    "gemma_tokenizer": "miles_core.tiny.tokenizers",
    "qwen2_tokenizer": "miles_core.tiny.tokenizers",
    "t5_tokenizer": "miles_core.tiny.tokenizers",
    # The mark a tiny pipeline's directory carries: commands load it without the hub's notices.
    "mark_tiny": "miles_core.quiet",
    # Running a configuration from Python (a family's demo, a notebook).
    "resolve_config": "miles_core.config.resolve",
    "train": "miles_core.launch",
}

__all__ = [
    "FAMILY_GENERATION_OPTIONS",
    "TRAINING_DATA",
    "TRANSITION_BATCH_KEYS",
    "CheckpointError",
    "ConfigError",
    "Flag",
    "InputError",
    "LossSpec",
    "MilesError",
    "ModelFamilySpec",
    "RequestError",
    "RewardError",
    "RewardSpec",
    "RewardsFailedError",
    "RolloutEngineSpec",
    "RolloutFilterSpec",
    "RunError",
    "RunFailedError",
    "SdeBackendSpec",
    "Spec",
    "StepStrategySpec",
    "UsageError",
    "WeightUpdateError",
    "hookimpl",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_core.api' has no attribute {name!r}; the plugin API is miles_core.api.__all__")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
