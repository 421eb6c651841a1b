"""Hook specifications of the ``miles`` plugin system.

A plugin is a module registered under the entry-point group ``miles.plugins``. It
implements any of these hooks as module-level functions decorated with
:data:`miles_core.api.hookimpl`. Registration hooks return *records* (frozen spec
dataclasses from :mod:`miles_core.specs`) and must have no side effects: the core calls
them to build its registries without importing torch, diffusers or any model code.

Every hook is called once per plugin and each plugin's result is kept separately, so a
plugin that raises is reported (with its distribution and version) without taking the
others down. Any function named ``miles_*`` in a plugin module is treated as a hook
implementation, so a misspelt hook name is reported instead of silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from miles_core.config.flag import Flag
    from miles_core.config.model import Config
    from miles_core.specs import (
        LossSpec,
        ModelFamilySpec,
        RewardSpec,
        RolloutEngineSpec,
        RolloutFilterSpec,
        SdeBackendSpec,
        StepStrategySpec,
    )

PROJECT = "miles"
ENTRY_POINT_GROUP = "miles.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def miles_register_model_families() -> Iterable[ModelFamilySpec]:
    """Return the model families this plugin provides.

    Called once when the registries are built. All results are collected; a family
    name registered by two distributions is an error naming both.
    """


@hookspec
def miles_register_sde_backends() -> Iterable[SdeBackendSpec]:
    """Return the denoising-step backends (``--diffusion-sde-type`` values) this
    plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_register_step_strategies() -> Iterable[StepStrategySpec]:
    """Return the step strategies (which steps run the SDE, which latents are
    returned) this plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_register_losses() -> Iterable[LossSpec]:
    """Return the training losses (``--loss-type`` values) this plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_register_rewards() -> Iterable[RewardSpec]:
    """Return the reward models (``--rm-type`` values) this plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_register_rollout_filters() -> Iterable[RolloutFilterSpec]:
    """Return the rollout filters (dynamic-sampling group filters, per-sample filters,
    buffer filters) this plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_register_rollout_engines() -> Iterable[RolloutEngineSpec]:
    """Return the rollout engines (``--rollout-engine`` values) this plugin provides.

    Called once when the registries are built; all results are collected.
    """


@hookspec
def miles_add_arguments() -> Iterable[Flag]:
    """Return the command-line flags this plugin owns.

    Called once when the ``train`` / ``config`` parser is built. The flags exist exactly
    when the plugin is installed and enabled; they are listed under the plugin's name
    in ``--help`` and ``docs/cli.md``, and may be set from ``--custom-config-path``
    YAML like any core flag. A flag name already taken is an error naming both owners.
    """


@hookspec
def miles_validate_config(config: Config) -> Iterable[str] | None:
    """Check the parsed, resolved configuration; return one-line error messages.

    Called once per ``train`` / ``config`` invocation after the core's own checks
    passed and before anything heavy is loaded. Each message must name the flags
    involved and the rule broken (``--pickscore-model-path is required with --rm-type
    pickscore``). Return ``None`` or an empty iterable when everything is fine. All
    messages of all plugins are reported together; any message makes the command exit
    with status 2.
    """
