"""The typed, grouped configuration object.

Every flag's value lives in its group's dataclass (``config.rollout.diffusion_num_steps``,
also reachable flat as ``config.diffusion_num_steps``), and every value records where it
came from (:class:`Source`): a default, the command line, the YAML file, a model
family's default, the machine, or a derivation.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

from miles_core.config.flag import PYTHON_TYPES, Flag
from miles_core.registry import PluginInfo, Registration


class Source(str, enum.Enum):
    DEFAULT = "default"
    COMMAND_LINE = "command line"
    CONFIG_FILE = "config file"
    FAMILY = "model family"
    MACHINE = "machine"
    DERIVED = "derived"

    @property
    def user_set(self) -> bool:
        return self in (Source.COMMAND_LINE, Source.CONFIG_FILE)


@dataclasses.dataclass(frozen=True)
class FlagEntry:
    """A flag as the configuration knows it: the record and who owns it."""

    flag: Flag
    owner: PluginInfo

    @property
    def group(self) -> str:
        return self.flag.group


@dataclasses.dataclass(frozen=True)
class Component:
    """A selected component: the registration, or a one-off from a ``--*-path`` flag."""

    kind: str
    name: str
    provider: str
    """``miles-sd3 0.1.0``, or ``--custom-rm-path my.module.rm``."""

    @classmethod
    def from_registration(cls, registration: Registration) -> Component:
        return cls(registration.spec.kind, registration.spec.name, str(registration.plugin))


def _group_class(group: str, entries: list[FlagEntry]) -> type:
    fields = [
        (e.flag.dest, f"list[{PYTHON_TYPES[e.flag.type]}] | None" if e.flag.nargs else f"{PYTHON_TYPES[e.flag.type]} | None")
        for e in entries
    ]
    name = "".join(part.title() for part in group.split("_")) + "Config"
    return dataclasses.make_dataclass(name, fields, frozen=True)


class Config:
    """Resolved configuration. Read values as attributes; ask :meth:`source` where one
    came from. Built by :func:`miles_core.config.resolve.resolve_config`."""

    def __init__(self, entries: dict[str, FlagEntry]) -> None:
        self._entries = entries
        self._values: dict[str, Any] = {}
        self._sources: dict[str, Source] = {}
        self._groups: dict[str, Any] = {}
        self.model_family: str | None = None
        """Resolved family key (``sd3``), or None with ``--train-pipeline-config-path``."""
        self.world_size: int = 1
        self.data_parallel_size: int = 1
        self.components: dict[str, Component] = {}
        """Selected component per slot (``model_family``, ``loss``, ``sde_backend``, ...)."""
        self.sglang_args: list[str] = []
        """``--sglang-*`` pass-through arguments, verbatim, for the sglang engine."""
        self.command_arguments: dict[str, Any] = {}
        """A command's own arguments parsed beside the flags (``miles-core score``)."""
        self.notes: list[str] = []
        """Warnings raised while resolving (YAML overrides, ignored flags)."""
        self.given_as: dict[str, str] = {}
        """dest -> the alias flag (:attr:`Flag.alias_of`) its value was given with."""

    # -- building ------------------------------------------------------------------

    def set(self, dest: str, value: Any, source: Source) -> None:
        if self._groups:
            raise AttributeError("the configuration is frozen once resolved")
        if dest not in self._entries:
            raise KeyError(dest)
        self._values[dest] = value
        self._sources[dest] = source

    def freeze(self) -> None:
        by_group: dict[str, list[FlagEntry]] = {}
        for entry in self._entries.values():
            by_group.setdefault(entry.group, []).append(entry)
        for group, entries in by_group.items():
            cls = _group_class(group, entries)
            self._groups[group] = cls(**{e.flag.dest: self._values[e.flag.dest] for e in entries})

    # -- reading -------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not regular attributes.
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        groups = self.__dict__.get("_groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"configuration has no flag or group {name!r}")

    def __contains__(self, dest: str) -> bool:
        return dest in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def get(self, dest: str, default: Any = None) -> Any:
        return self._values.get(dest, default)

    def source(self, dest: str) -> Source:
        return self._sources[dest]

    def is_user_set(self, dest: str) -> bool:
        return self._sources[dest].user_set

    def flag(self, dest: str) -> Flag:
        return self._entries[dest].flag

    def given_name(self, dest: str) -> str:
        """The flag name the user gave ``dest``'s value with: its alias when set through one."""
        return self.given_as.get(dest) or self._entries[dest].flag.name

    def owner(self, dest: str) -> PluginInfo:
        return self._entries[dest].owner

    @property
    def groups(self) -> dict[str, Any]:
        return dict(self._groups)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """``{group: {dest: value}}`` in flag order."""
        result: dict[str, dict[str, Any]] = {}
        for dest, entry in self._entries.items():
            result.setdefault(entry.group, {})[dest] = self._values[dest]
        return result
