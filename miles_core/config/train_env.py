"""``--train-env-vars``: extra environment variables for the training processes.

A single-process run sets them in ``os.environ`` at the start of the run, before the
model loads (:func:`apply_train_env_vars`); values must be strings, or numbers, which
are converted with ``str``. Variables read when a library is imported (torch's
``OMP_NUM_THREADS``, ...) act only on what is imported afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


def train_env_vars_errors(value: Any) -> list[str]:
    """One line per entry of a ``--train-env-vars`` value that cannot be an environment
    variable (the configuration's check; empty when all are fine)."""
    if not isinstance(value, Mapping):
        return [f"--train-env-vars: must be a JSON object of NAME: value, got {type(value).__name__}"]
    errors = []
    for name, item in value.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            errors.append(f"--train-env-vars: {name!r} is not a valid environment variable name")
        elif isinstance(item, bool) or not isinstance(item, (str, int, float)):
            errors.append(f"--train-env-vars: the value of {name} must be a string or a number, got {type(item).__name__} {item!r}")
        elif "\0" in str(item):
            errors.append(f"--train-env-vars: the value of {name} holds a NUL character")
    return errors


def apply_train_env_vars(config: Any, log: Callable[[str], None]) -> dict[str, str]:
    """Set ``--train-env-vars`` in ``os.environ`` (numbers as ``str``); log one line with
    their names; return what was set. A bad entry raises ``ValueError`` naming it, before
    anything is set."""
    value = config.train_env_vars or {}
    errors = train_env_vars_errors(value)
    if errors:
        raise ValueError(errors[0])
    applied = {name: str(item) for name, item in value.items()}
    os.environ.update(applied)
    if applied:
        log(f"--train-env-vars: set {', '.join(sorted(applied))}")
    return applied
