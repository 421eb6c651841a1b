"""Registries: one per kind of component, keyed by name, filled from spec records.

Each registration remembers the plugin (distribution and version) it came from, so a
name registered twice is an error naming both, and every resolved component can say
who provides it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from miles_core.errors import ComponentLoadError, RefError, RegistrationConflict, UnknownComponentError
from miles_core.refs import load_ref
from miles_core.specs import SPEC_TYPES, Spec


@dataclass(frozen=True)
class PluginInfo:
    """Where a registration comes from."""

    name: str
    """Entry-point name (``sd3``), or the flag for a one-off dotted path."""
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


@dataclass(frozen=True)
class Registration:
    """A spec record plus its provenance."""

    spec: Spec
    plugin: PluginInfo

    @property
    def name(self) -> str:
        return self.spec.name

    def load(self) -> Any:
        """Import and return the implementation the spec's ``ref`` names, checked against
        the spec (:meth:`~miles_core.specs.Spec.check_implementation`)."""
        try:
            obj = load_ref(self.spec.ref)
        except RefError as exc:
            raise ComponentLoadError(f"{self.spec.kind} {self.spec.name!r} from {self.plugin}: {exc}") from exc
        problem = self.spec.check_implementation(obj)
        if problem is not None:
            raise ComponentLoadError(f"{self.spec.kind} {self.spec.name!r} from {self.plugin}: {problem}")
        return obj


class Registry:
    """The registrations of one kind (``loss``, ``reward``, ...)."""

    def __init__(self, kind: str) -> None:
        if kind not in SPEC_TYPES:
            raise ValueError(f"unknown registry kind {kind!r}; kinds: {', '.join(SPEC_TYPES)}")
        self.kind = kind
        self._entries: dict[str, Registration] = {}
        self.unavailable: list[str] = []
        """One-line descriptions of plugins that failed to load (for error messages)."""

    def check(self, registration: Registration) -> bool:
        """Raise on a conflicting name; return False for an identical re-registration."""
        spec = registration.spec
        if spec.kind != self.kind:
            raise TypeError(f"a {spec.kind} spec cannot go into the {self.kind} registry")
        existing = self._entries.get(spec.name)
        if existing is None:
            return True
        if existing.spec == spec:
            return False
        raise RegistrationConflict(
            f"{self.kind} {spec.name!r} is registered by both {existing.plugin} "
            f"(plugin {existing.plugin.name!r}) and {registration.plugin} (plugin "
            f"{registration.plugin.name!r}); uninstall or disable one of them "
            "(MILES_DISABLED_PLUGINS)"
        )

    def add(self, registration: Registration) -> None:
        if self.check(registration):
            self._entries[registration.spec.name] = registration

    def discard(self, name: str) -> None:
        """Withdraw ``name`` if registered (a component an application or a test added
        in-process for a while; entry-point plugins are withdrawn by uninstalling them)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> Registration:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownComponentError(self.unknown_message(name)) from None

    def unknown_message(self, name: str, flag: str | None = None) -> str:
        subject = f"{flag} {name}" if flag else f"{self.kind} {name!r}"
        message = f"{subject}: unknown {self.kind.replace('_', ' ')}; installed: {', '.join(self.names()) or '(none)'}"
        if self.unavailable:
            message += "; plugins that failed to load: " + "; ".join(self.unavailable)
        return message

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Registration]:
        return iter(self._entries[name] for name in self.names())

    def __len__(self) -> int:
        return len(self._entries)


class Registries(dict[str, Registry]):
    """Every kind's registry, keyed by kind."""

    def __init__(self) -> None:
        super().__init__({kind: Registry(kind) for kind in SPEC_TYPES})

    def __getattr__(self, kind: str) -> Registry:
        try:
            return self[kind]
        except KeyError:
            raise AttributeError(kind) from None
