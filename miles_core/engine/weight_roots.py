"""Where a server may load weights from: ``/update_weights_from_disk`` (and, behind the
sglang proxy, ``/v1/set_lora``) accepts only paths under the roots the server was started
with, links resolved first, so that a client cannot make it read weights from any
directory the server's user can read. A run's servers get the run's weight-sync folders;
``--allowed-weight-roots`` adds more. docs/engine.md, "Authentication", has the threat
model. serve-engine (:mod:`miles_core.engine.server`) and the sglang proxy
(:mod:`miles_core.engine.auth_proxy`) share this one rule and its words."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from miles_core.errors import ConfigError

ROOTS_FLAG = "--allowed-weight-roots"


def resolve_roots(roots: Iterable[str | os.PathLike[str]], *, flag: str = ROOTS_FLAG) -> tuple[Path, ...]:
    """Each root with its links resolved (duplicates dropped, order kept); a root that is
    not an existing directory raises :class:`ConfigError` naming it."""
    resolved: list[Path] = []
    for root in roots:
        real = _real(root)
        if real is None or not real.is_dir():
            what = "not a directory" if real is not None and real.exists() else "no such directory"
            raise ConfigError(f"{flag} {os.fspath(root)}: {what}")
        if real not in resolved:
            resolved.append(real)
    return tuple(resolved)


def is_under_roots(path: str | os.PathLike[str], roots: Sequence[Path]) -> bool:
    """Whether ``path`` (relative: to the working directory), its links resolved, is one
    of ``roots`` (as :func:`resolve_roots` gives them) or lies under one."""
    real = _real(path)
    return real is not None and any(real.is_relative_to(root) for root in roots)


def weight_path_refusal(path: str | os.PathLike[str], roots: Sequence[Path], *, field: str = "model_path") -> str | None:
    """Why loading weights from ``path`` (the request's ``field``) is refused, the rule in
    one line, or None when it lies under ``roots``. The answer does not depend on whether
    ``path`` exists."""
    if is_under_roots(path, roots):
        return None
    allowed = ", ".join(str(root) for root in roots) or "none"
    shown = repr(os.fspath(path))
    real, given = _real(path), os.path.abspath(path)
    # A link inside a root that leads out: say where (only then: the answer tells nothing
    # about the disk outside the roots).
    if real is not None and str(real) != given and any(Path(given).is_relative_to(root) for root in roots):
        shown += f" (resolves to {str(real)!r})"
    return (
        f"{field} {shown} is outside the allowed weight roots ({allowed}): this server loads weights "
        f"only from directories under the roots it was started with, links resolved ({ROOTS_FLAG} adds roots)"
    )


def _real(path: str | os.PathLike[str]) -> Path | None:
    """``path`` with every link resolved (None when it cannot be: a NUL byte, a loop)."""
    try:
        return Path(os.path.realpath(os.fspath(path), strict=False))
    except (OSError, ValueError):
        return None


__all__ = ["ROOTS_FLAG", "is_under_roots", "resolve_roots", "weight_path_refusal"]
