"""``--custom-config-path FILE.yaml``: flag values from a YAML mapping.

Keys are flag names with underscores or dashes (``rollout_batch_size`` or
``rollout-batch-size``), values of the flag's type. As in the reference, a key
overrides the command line; the resolver warns when it does.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from miles_core.config.model import FlagEntry
from miles_core.errors import ConfigError


def load_config_file(path: str, entries: dict[str, FlagEntry]) -> dict[str, Any]:
    """Read ``path`` and return typed values keyed by dest; raise :class:`ConfigError`."""
    import yaml

    where = f"--custom-config-path {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{line}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of flag names to values, got {type(data).__name__}")
    values: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in data.items():
        dest = str(key).replace("-", "_")
        entry = entries.get(dest)
        if entry is None:
            hint = difflib.get_close_matches(dest, list(entries), n=1)
            errors.append(
                f"{where}: unknown key {key!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + "; keys are flag names such as rollout_batch_size"
            )
            continue
        flag = entry.flag
        if raw is None:
            values[dest] = None
            continue
        try:
            value = flag.convert(raw)
        except ValueError as exc:
            errors.append(f"{where}: key {key!r} ({flag.name}): {exc}")
            continue
        if flag.choices and value not in flag.choices and not flag.nargs:
            errors.append(f"{where}: key {key!r} ({flag.name}): {value!r} is not one of {', '.join(flag.choices)}")
            continue
        values[dest] = value
    if errors:
        raise ConfigError(errors)
    return values
