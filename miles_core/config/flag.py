"""The command-line flag record.

Flags are data: the core's table (:mod:`miles_core.config.reference_flags`) and each
plugin's ``miles_add_arguments`` hook return :class:`Flag` records, from which the
parser, the typed configuration, the YAML loader and ``docs/cli.md`` are all built.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GROUPS: dict[str, str] = {
    "general": "General",
    "cluster": "Cluster",
    "training_backend": "Training backend",
    "optimizer": "Optimizer and schedule",
    "rollout": "Rollout",
    "data": "Data and batching",
    "evaluation": "Evaluation",
    "guard": "Reward-hacking guard",
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


NUMERIC_TYPES: dict[str, bool] = {"int": True, "float": False, "int_list": True, "int_pair": True}
"""Flag types that take a :attr:`Flag.range`: type -> whether the values are integers."""


@dataclass(frozen=True)
class ValueRange:
    """An interval of valid values, written as in mathematics: ``[1, inf)``, ``(0, 1]``,
    ``(-inf, inf)``. ``[``/``]`` include a bound, ``(``/``)`` exclude it; an infinite
    bound is excluded by ``(-inf``/``inf)`` (the values must be finite) and included by
    ``[-inf``/``inf]``. NaN is never in a range."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool
    low_text: str
    high_text: str

    @classmethod
    def parse(cls, text: str) -> ValueRange:
        """Parse ``text``; a malformed or empty interval raises ``ValueError``."""
        stripped = text.strip()
        if len(stripped) < 5 or stripped[0] not in "[(" or stripped[-1] not in ")]" or stripped.count(",") != 1:
            raise ValueError(f"range {text!r} is not an interval like '[1, inf)' or '(0, 1]'")
        low_text, high_text = (part.strip() for part in stripped[1:-1].split(","))
        try:
            low, high = float(low_text), float(high_text)
        except ValueError:
            raise ValueError(f"range {text!r}: bounds must be numbers, inf or -inf") from None
        if math.isnan(low) or math.isnan(high):
            raise ValueError(f"range {text!r}: bounds must be numbers, inf or -inf")
        if low == math.inf or high == -math.inf:
            raise ValueError(f"range {text!r}: the low bound must be below inf and the high bound above -inf")
        value_range = cls(low, high, stripped[0] == "[", stripped[-1] == "]", low_text, high_text)
        if low > high or (low == high and not (value_range.low_closed and value_range.high_closed)):
            raise ValueError(f"range {text!r} is empty")
        return value_range

    def __str__(self) -> str:
        return f"{'[' if self.low_closed else '('}{self.low_text}, {self.high_text}{']' if self.high_closed else ')'}"

    def __contains__(self, value: float) -> bool:
        if math.isnan(value):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def rule(self, value: float) -> str:
        """What ``value``, outside the range, breaks, as ``must ...``, in the wording of
        the configuration's other one-line errors: ``must be at least 1``, ``must not be
        negative``, ``must be positive``, ``must be in (0, 1]``; ``must be a finite number
        > 0`` for NaN or an infinity where the range is finite."""
        low_open, high_open = not self.low_closed, not self.high_closed
        if math.isinf(self.low) and math.isinf(self.high):
            return "must be a finite number" if low_open and high_open else "must be a number"
        finite = math.isfinite(value)
        if self.high == math.inf and high_open:  # a lower bound only
            if not finite:
                return f"must be a finite number {'>' if low_open else '>='} {self.low_text}"
            if self.low == 0:
                return "must be positive" if low_open else "must not be negative"
            return f"must be greater than {self.low_text}" if low_open else f"must be at least {self.low_text}"
        if self.low == -math.inf and low_open:  # an upper bound only
            if not finite:
                return f"must be a finite number {'<' if high_open else '<='} {self.high_text}"
            return f"must be less than {self.high_text}" if high_open else f"must be at most {self.high_text}"
        return f"must be in {self}"


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
    alias_of: str | None = None
    """Another flag this one is a second name for (``--pickscore-num-workers`` for
    ``--reward-num-workers``), typically a plugin keeping a reference name that the core
    generalised. It keeps an entry of its own (its YAML key, its own range), but a value
    given to it sets the other flag, and after resolution both hold the other flag's
    value; both given with different values is a configuration error naming both. Its
    default is None (unset: the other flag decides) and its type the other flag's."""
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
    note instead of silently ignoring it. The documented list in ``docs/cli.md``. Like
    every flag that is not unavailable, it needs a test of its logic (the flag audit)."""
    unavailable: str | None = None
    """Why the flag is not available in this version: a non-default value is an error
    for ``train`` (a warning for ``config``)."""
    range: str | None = None
    """Valid values of a numeric flag (of each item, for a list or a pair), as a
    :class:`ValueRange` interval: ``"[1, inf)"`` (integers from 1), ``"(0, 1]"``,
    ``"(-inf, inf)"`` (any finite number). Every numeric flag declares one; the
    configuration refuses a value outside it, whichever flags go with it. An integer
    flag's finite bounds are integers, written closed (``[1, inf)``, not ``(0, inf)``)."""
    value_range: ValueRange | None = field(init=False, repr=False, compare=False, default=None)
    """:attr:`range`, parsed."""

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
        if self.alias_of is not None and (self.default is not None or self.hardware or self.unavailable or self.auto):
            raise ValueError(f"flag {self.name}: an alias of {self.alias_of} has no default, hardware note or availability of its own")
        if self.range is not None:
            object.__setattr__(self, "value_range", self._parse_range(self.range))

    def _parse_range(self, text: str) -> ValueRange:
        if self.type not in NUMERIC_TYPES:
            raise ValueError(f"flag {self.name}: a range applies to numeric flags ({', '.join(NUMERIC_TYPES)}), not {self.type}")
        try:
            value_range = ValueRange.parse(text)
        except ValueError as exc:
            raise ValueError(f"flag {self.name}: {exc}") from None
        if NUMERIC_TYPES[self.type]:
            for bound, closed in ((value_range.low, value_range.low_closed), (value_range.high, value_range.high_closed)):
                if math.isfinite(bound) and not (bound.is_integer() and closed):
                    raise ValueError(f"flag {self.name}: range {text!r}: an integer flag's finite bounds are closed integers")
        default = self.default
        items = default if isinstance(default, (list, tuple)) else [] if default is None else [default]
        for item in items:
            if item not in value_range:
                raise ValueError(f"flag {self.name}: default {default!r} is outside its range {text}")
        return value_range

    @property
    def integer(self) -> bool:
        """Whether the flag's values (or items) are integers."""
        return NUMERIC_TYPES.get(self.type, False)

    def range_error(self, value: Any) -> str | None:
        """``--flag VALUE: must ...`` when ``value`` (a converted value of this flag) is
        outside :attr:`range`; None when it is inside, unset or the flag has no range."""
        if self.value_range is None or value is None:
            return None
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        outside = [item for item in items if item not in self.value_range]
        if not outside:
            return None
        if len(items) == 1 and not isinstance(value, (list, tuple)):
            return f"{self.name} {value}: {self.value_range.rule(value)}"
        shown = ",".join(str(item) for item in items)
        return f"{self.name} {shown}: each value {self.value_range.rule(outside[0])}"

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
