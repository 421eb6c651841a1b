"""Registration of miles-algorithms: the entry point, its records (the loss records' fields
the core acts on), its flags, and an entry-point module that imports no torch."""

from __future__ import annotations

import pytest

from miles_core import testing
from miles_core.api import LossSpec, SdeBackendSpec, StepStrategySpec
from miles_core.plugin_manager import PluginHost


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return testing.load_plugin("algorithms", "miles-algorithms")


def test_entry_point_registers_the_four_algorithms_and_the_flags(host: PluginHost) -> None:
    record = host.record("algorithms")
    assert record.entry_point == "miles_algorithms.plugin"
    assert {k: v for k, v in record.registers.items() if k != "flag"} == {
        "sde_backend": ["dance_sde"],
        "step_strategy": ["mixgrpo"],
        "loss": ["grpo_guard", "flow_dpo"],
    }
    assert record.registers["flag"] == ["--mixgrpo-shift-interval", "--mixgrpo-shift-stride", "--dpo-beta"]
    from miles_algorithms.dance_sde import DanceSde
    from miles_algorithms.mixgrpo import mixgrpo

    assert host.registries.sde_backend.get("dance_sde").load() is DanceSde
    assert host.registries.step_strategy.get("mixgrpo").load() is mixgrpo
    assert isinstance(host.registries.sde_backend.get("dance_sde").spec, SdeBackendSpec)
    assert isinstance(host.registries.step_strategy.get("mixgrpo").spec, StepStrategySpec)


def test_the_loss_records_say_what_the_core_feeds_them(host: PluginHost) -> None:
    guard = host.registries.loss.get("grpo_guard").spec
    dpo = host.registries.loss.get("flow_dpo").spec
    assert isinstance(guard, LossSpec) and isinstance(dpo, LossSpec)
    assert (guard.ref, guard.trains_on, guard.needs_sde_steps, guard.batch_keys, guard.needs_reference, guard.min_group_size) == (
        "miles_algorithms.grpo_guard:grpo_guard",
        "sde_transitions",
        True,
        ("mean", "old_mean", "transition_std", "sigma", "sigma_next"),
        False,
        1,
    )
    assert (dpo.ref, dpo.trains_on, dpo.needs_sde_steps, dpo.batch_keys, dpo.needs_reference, dpo.min_group_size) == (
        "miles_algorithms.dpo:flow_dpo",
        "preference_pairs",
        False,
        (),
        True,
        2,
    )
    assert not guard.keeps_ema and not dpo.keeps_ema


def test_flag_defaults_are_the_sources_recipes(host: PluginHost) -> None:
    flags = {owned.flag.name: owned.flag for owned in host.flags}
    assert (flags["--mixgrpo-shift-interval"].default, flags["--mixgrpo-shift-interval"].range) == (25, "[1, inf)")
    assert (flags["--mixgrpo-shift-stride"].default, flags["--mixgrpo-shift-stride"].range) == (1, "[1, inf)")
    assert (flags["--dpo-beta"].default, flags["--dpo-beta"].range) == (100.0, "(0, inf)")
    assert {flags[name].group for name in ("--mixgrpo-shift-interval", "--mixgrpo-shift-stride", "--dpo-beta")} == {"algorithms"}


def test_plugin_stays_light() -> None:
    testing.assert_plugin_is_light("algorithms", "miles-algorithms")
