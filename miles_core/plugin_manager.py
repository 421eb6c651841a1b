"""Discovering and loading plugins from the ``miles.plugins`` entry-point group.

Discovery reads distribution metadata; loading imports each entry point's module (one
try per entry point), registers it with pluggy, checks its hooks, and collects its
spec records and flags. A plugin that fails any of these steps is recorded with its
distribution, version, entry point and error, a warning is issued, and everything else
keeps working. ``MILES_STRICT_PLUGINS=1`` turns such failures into errors;
``MILES_DISABLED_PLUGINS=a,b`` (or ``*``) blocks plugins before they are imported.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The stdlib's importlib.metadata has everything needed from Python 3.10 on
# (selectable entry points, EntryPoint.dist), so the backport is not a dependency.
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from miles_core import hookspecs
from miles_core.config.flag import Flag
from miles_core.errors import PluginContractError, PluginLoadError, RegistrationConflict
from miles_core.registry import PluginInfo, Registration, Registries
from miles_core.specs import SPEC_TYPES, LossSpec, Spec

CORE_PLUGIN = "core"
"""Entry-point name of the core's own built-ins (miles_core.builtins)."""

REGISTRATION_HOOKS: dict[str, str] = {
    "miles_register_model_families": "model_family",
    "miles_register_sde_backends": "sde_backend",
    "miles_register_step_strategies": "step_strategy",
    "miles_register_losses": "loss",
    "miles_register_rewards": "reward",
    "miles_register_rollout_filters": "rollout_filter",
    "miles_register_rollout_engines": "rollout_engine",
}
"""Registration hook -> registry kind."""


class PluginLoadWarning(UserWarning):
    """A plugin that could not be loaded and was skipped."""


@dataclass
class PluginRecord:
    """What ``list-plugins`` reports about one entry point."""

    name: str
    distribution: str
    version: str
    entry_point: str
    status: str = "ok"
    """``ok``, ``failed`` or ``disabled``."""
    error: str | None = None
    registers: dict[str, list[str]] = field(default_factory=dict)
    """Kind -> registered names (``flag`` for command-line flags)."""

    @property
    def info(self) -> PluginInfo:
        return PluginInfo(self.name, self.distribution, self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "status": self.status,
            "error": self.error,
            "registers": self.registers,
        }


@dataclass(frozen=True)
class OwnedFlag:
    """A flag and the plugin that contributes it."""

    flag: Flag
    owner: PluginInfo


class _MilesPluginManager(pluggy.PluginManager):
    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        # Like pytest: every ``miles_*`` function is a hook implementation, marked or
        # not, so a misspelt hook name is caught as unknown instead of ignored.
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("miles_") and callable(getattr(plugin, name, None)):
            return {}
        return opts


def _env_list(name: str) -> set[str]:
    return {part.strip() for part in os.environ.get(name, "").split(",") if part.strip()}


def strict_from_env() -> bool:
    return os.environ.get("MILES_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


class PluginHost:
    """The loaded plugins, their registries and their flags."""

    def __init__(
        self,
        *,
        strict: bool | None = None,
        disabled: Iterable[str] | None = None,
        entry_points: Sequence[metadata.EntryPoint] | None = None,
    ) -> None:
        self.strict = strict_from_env() if strict is None else strict
        self.disabled = _env_list("MILES_DISABLED_PLUGINS") if disabled is None else set(disabled)
        self.pm = _MilesPluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.registries = Registries()
        self.records: list[PluginRecord] = []
        self.flags: list[OwnedFlag] = []
        self._modules: dict[str, ModuleType] = {}
        if entry_points is None:
            entry_points = list(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
        for ep in sorted(entry_points, key=_load_order):
            self._load(ep)

    # -- loading -------------------------------------------------------------------

    def _is_disabled(self, name: str) -> bool:
        if name in self.disabled:
            return True
        return "*" in self.disabled and name != CORE_PLUGIN

    def _load(self, ep: metadata.EntryPoint) -> None:
        dist = getattr(ep, "dist", None)
        record = PluginRecord(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist is not None else "(unknown)",
            version=dist.version if dist is not None else "(unknown)",
            entry_point=ep.value,
        )
        self.records.append(record)
        if self._is_disabled(ep.name):
            record.status = "disabled"
            return
        if any(r.name == ep.name and r.status == "ok" for r in self.records[:-1]):
            self._fail(record, f"plugin name {ep.name!r} is already taken by another distribution")
            return
        try:
            module = ep.load()
        except Exception as exc:  # a plugin may fail to import with anything
            self._fail(record, f"cannot import {ep.value}: {type(exc).__name__}: {exc}")
            return
        try:
            self.pm.register(module, name=ep.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            self._fail(record, f"invalid hook: {exc}")
            return
        self._modules[ep.name] = module
        try:
            self._check_hook_names(ep.name)
            registrations, flags = self._collect(record)
            self._commit(record, registrations, flags)
        except Exception as exc:
            self.pm.unregister(name=ep.name)
            del self._modules[ep.name]
            self._fail(record, str(exc) if isinstance(exc, (PluginContractError, RegistrationConflict)) else f"{type(exc).__name__}: {exc}")

    def _fail(self, record: PluginRecord, error: str) -> None:
        record.status = "failed"
        record.error = error
        record.registers = {}
        message = f"miles plugin {record.name!r} ({record.distribution} {record.version}, entry point {record.entry_point}) failed to load: {error}"
        for registry in self.registries.values():
            registry.unavailable.append(f"{record.name} ({record.distribution} {record.version}): {error}")
        if self.strict:
            raise PluginLoadError(message + " [MILES_STRICT_PLUGINS=1]")
        warnings.warn(message, PluginLoadWarning, stacklevel=3)

    def _check_hook_names(self, plugin_name: str) -> None:
        known = [name for name in dir(hookspecs) if name.startswith("miles_")]
        for caller in self.pm.get_hookcallers(self._modules[plugin_name]) or []:
            if caller.spec is None:
                hint = difflib.get_close_matches(caller.name, known, n=1)
                raise PluginContractError(f"unknown hook {caller.name}" + (f" (did you mean {hint[0]}?)" if hint else ""))

    def _impls(self, hook_name: str, plugin_name: str) -> list[pluggy.HookImpl]:
        caller = getattr(self.pm.hook, hook_name)
        return [impl for impl in caller.get_hookimpls() if impl.plugin_name == plugin_name]

    def _call(self, impl: pluggy.HookImpl, **kwargs: Any) -> Any:
        return impl.function(**{arg: kwargs[arg] for arg in impl.argnames})

    def _collect(self, record: PluginRecord) -> tuple[list[Registration], list[OwnedFlag]]:
        info = record.info
        registrations: list[Registration] = []
        for hook_name, kind in REGISTRATION_HOOKS.items():
            for impl in self._impls(hook_name, record.name):
                result = self._call(impl)
                for spec in _as_list(result, hook_name):
                    if not isinstance(spec, SPEC_TYPES[kind]):
                        raise PluginContractError(f"{hook_name} returned {type(spec).__name__}, expected {SPEC_TYPES[kind].__name__}")
                    registrations.append(Registration(spec, info))
        flags: list[OwnedFlag] = []
        for impl in self._impls("miles_add_arguments", record.name):
            for flag in _as_list(self._call(impl), "miles_add_arguments"):
                if not isinstance(flag, Flag):
                    raise PluginContractError(f"miles_add_arguments returned {type(flag).__name__}, expected Flag")
                flags.append(OwnedFlag(flag, info))
        return registrations, flags

    def _commit(self, record: PluginRecord, registrations: list[Registration], flags: list[OwnedFlag]) -> None:
        # Check everything first so a conflicting plugin leaves no partial registrations.
        for registration in registrations:
            self.registries[registration.spec.kind].check(registration)
        taken = {spelling: f.owner for f in self.flags for spelling in (f.flag.name, *f.flag.aliases)}
        taken.update({spelling: self._core_info for flag in _core_flags() for spelling in (flag.name, *flag.aliases)})
        for owned in flags:
            for spelling in (owned.flag.name, *owned.flag.aliases):
                if spelling in taken:
                    raise PluginContractError(f"flag {spelling} is already defined by {taken[spelling]}")
        for registration in registrations:
            self.registries[registration.spec.kind].add(registration)
            names = record.registers.setdefault(registration.spec.kind, [])
            if registration.spec.name not in names:
                names.append(registration.spec.name)
        if flags:
            record.registers["flag"] = [owned.flag.name for owned in flags]
        self.flags.extend(flags)

    @property
    def _core_info(self) -> PluginInfo:
        from miles_core import __version__

        return PluginInfo(CORE_PLUGIN, "miles-core", __version__)

    # -- queries -------------------------------------------------------------------

    def record(self, name: str) -> PluginRecord:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(name)

    def validate(self, config: Any) -> list[str]:
        """Run every plugin's ``miles_validate_config``; return all messages."""
        messages: list[str] = []
        for impl in self.pm.hook.miles_validate_config.get_hookimpls():
            try:
                result = self._call(impl, config=config)
            except Exception as exc:
                record = self.record(impl.plugin_name)
                messages.append(
                    f"plugin {record.name!r} ({record.distribution} {record.version}) raised while "
                    f"validating the configuration: {type(exc).__name__}: {exc}"
                )
                continue
            messages.extend(str(message) for message in _as_list(result, "miles_validate_config"))
        return messages


def _core_flags() -> tuple[Flag, ...]:
    from miles_core.config.reference_flags import FLAGS

    return FLAGS


def _as_list(result: Any, hook_name: str) -> list[Any]:
    if result is None:
        return []
    if isinstance(result, (str, bytes, Spec, Flag)) or not isinstance(result, Iterable):
        raise PluginContractError(f"{hook_name} must return a list, got {type(result).__name__}")
    return list(result)


def _load_order(ep: metadata.EntryPoint) -> tuple[int, str, str]:
    # The core first, then by name: registration order (and who conflicts with whom)
    # does not depend on the order site-packages happens to list distributions in.
    return (0 if ep.name == CORE_PLUGIN else 1, ep.name, ep.value)


_host: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host


def loss_spec(config: Any) -> LossSpec:
    """The spec registered for ``--loss-type``: what its algorithm trains on and what it
    needs. Code that behaves differently per algorithm asks this, never the loss's name."""
    return get_host().registries.loss.get(config.loss_type).spec


def step_strategy(config: Any) -> Any:
    """The run's step strategy: ``--diffusion-step-strategy-path`` as a registered strategy
    name (``mixgrpo``) or a dotted path to a callable; unset, ``ode_and_return_last`` for
    losses that train without SDE transitions and ``sde_window`` for the rest. Raises the
    one-line :class:`~miles_core.errors.PathFlagError` of a bad path."""
    from miles_core.refs import resolve_path_flag

    registry = get_host().registries.step_strategy
    name = config.diffusion_step_strategy_path
    if not name:
        name = "sde_window" if loss_spec(config).trains_on == "sde_transitions" else "ode_and_return_last"
    if name in registry:
        return registry.get(name).load()
    return resolve_path_flag("--diffusion-step-strategy-path", name, "callable")


def reset_host() -> None:
    """Forget the process-wide host (tests, or after changing the environment)."""
    global _host
    _host = None
