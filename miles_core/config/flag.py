"""The command-line flag record.

Flags are data: the core's table (:mod:`miles_core.config.reference_flags`) and each
plugin's ``miles_add_arguments`` hook return :class:`Flag` records, from which the
parser, the typed configuration, the YAML loader and ``docs/cli.md`` are all built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

GROUPS: dict[str, str] = {
    "general": "General",
    "cluster": "Cluster",
    "training_backend": "Training backend",
    "optimizer": "Optimizer and schedule",
    "rollout": "Rollout",
    "data": "Data and batching",
    "evaluation": "Evaluation",
    "algorithm": "Algorithm and loss",
    "reward": "Reward",
    "customization": "Rollout customization hooks",
    "lora": "LoRA",
    "ema": "EMA",
    "checkpointing": "Checkpointing",
    "logging": "Logging",
    "fault_tolerance": "Fault tolerance",
    "debugging": "Debugging",
    "ci": "CI",
}
"""Argument groups in ``--help`` order: key -> title. Plugins may add their own keys."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers like '1,2,3', got {text!r}") from None


def _int_pair(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2:
        raise ValueError(f"expected two comma-separated integers like '0,8', got {text!r}")
    return values  # type: ignore[return-value]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected a JSON object, got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


CONVERTERS: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": _bool,
    "tristate": _bool,
    "json": _json_object,
    "int_list": _int_list,
    "int_pair": _int_pair,
}
"""Flag ``type`` -> converter from text (command line) to the typed value."""

PYTHON_TYPES: dict[str, str] = {
    "int": "int",
    "float": "float",
    "str": "str",
    "bool": "bool",
    "tristate": "bool | None",
    "json": "dict",
    "int_list": "tuple[int, ...]",
    "int_pair": "tuple[int, int]",
}


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One command-line flag.

    ``type`` is one of :data:`CONVERTERS`: ``bool`` is an on/off switch
    (``store_true``), ``tristate`` is ``--x/--no-x`` with ``None`` when neither is
    given. ``nargs="+"`` makes a list of that type.
    """

    name: str
    """The long option, ``--lr``."""
    group: str
    """Key of :data:`GROUPS` (or a plugin's own group key)."""
    type: str = "str"
    default: Any = None
    help: str = ""
    choices: tuple[str, ...] | None = None
    """Fixed choices."""
    registry: str | None = None
    """Registry kind (``loss``, ``reward``, ...) whose installed names are the choices."""
    nargs: str | None = None
    aliases: tuple[str, ...] = ()
    """Other spellings (legacy names)."""
    auto: bool = False
    """The default is ``auto``: resolved from the machine (see ``differs``)."""
    path_kind: str | None = None
    """A dotted-path flag (``--custom-rm-path``): what the path must resolve to, a key of
    :data:`miles_core.refs.PATH_KINDS`."""
    metavar: str | None = None
    reference_default: str | None = None
    """The miles-diffusion reference's default, when ours differs."""
    differs: str | None = None
    """Why our default differs from the reference's (rendered in ``docs/cli.md``)."""
    hardware: str | None = None
    """Hardware-only: what the flag does on the hardware it needs (GPUs, several ranks,
    CUDA IPC). Set to a non-default value where that is missing, the run logs this as a
    note instead of silently ignoring it. The documented list in ``docs/cli.md``."""
    unavailable: str | None = None
    """Why the flag is not available in this version: a non-default value is an error
    for ``train`` (a warning for ``config``)."""

    def __post_init__(self) -> None:
        if not self.name.startswith("--") or self.name != self.name.lower() or "_" in self.name:
            raise ValueError(f"flag {self.name!r} must be a lower-case --long-option with dashes")
        if self.type not in CONVERTERS:
            raise ValueError(f"flag {self.name}: type {self.type!r} is not one of {sorted(CONVERTERS)}")
        if self.type in ("bool", "tristate") and self.nargs:
            raise ValueError(f"flag {self.name}: a {self.type} flag takes no nargs")
        if (self.reference_default is None) != (self.differs is None):
            raise ValueError(f"flag {self.name}: reference_default and differs go together")
        if self.hardware and self.unavailable:
            raise ValueError(f"flag {self.name}: hardware-only and unavailable are exclusive")

    @property
    def dest(self) -> str:
        """Attribute name in the configuration (``--lr-warmup-iters`` -> ``lr_warmup_iters``)."""
        return self.name[2:].replace("-", "_")

    def convert(self, value: Any) -> Any:
        """Convert a command-line string or a YAML value to this flag's type.

        Raises ``ValueError`` with a message that does not repeat the flag name.
        """
        if self.nargs:
            items = value if isinstance(value, (list, tuple)) else str(value).split(",")
            return [self._convert_one(item) for item in items]
        return self._convert_one(value)

    def _convert_one(self, value: Any) -> Any:
        if self.type in ("bool", "tristate"):
            if isinstance(value, bool):
                return value
            if value is None and self.type == "tristate":
                return None
            return _bool(value)
        if self.type == "json" and isinstance(value, dict):
            return value
        if self.type in ("int_list", "int_pair") and isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        if self.type == "int" and isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if self.type == "int" and isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if self.type in ("int", "float") and isinstance(value, (int, float)) and not isinstance(value, bool):
            return CONVERTERS[self.type](value)
        if self.type == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise ValueError(f"expected {PYTHON_TYPES[self.type]}, got {value!r}")
        try:
            converted = CONVERTERS[self.type](value)
        except ValueError as exc:
            if self.type in ("int", "float"):
                raise ValueError(f"expected {'an integer' if self.type == 'int' else 'a number'}, got {value!r}") from None
            raise exc
        return converted
