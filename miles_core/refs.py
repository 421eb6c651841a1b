"""Resolving lazy references (``"pkg.mod:obj"``) and dotted-path flags.

Spec records name their implementation lazily; the reference's ``--*-path`` flags
(``--custom-rm-path pkg.mod.rm``) name a one-off implementation for one slot. Both are
resolved here, with one-line errors that name the culprit and the rule.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable


class RefError(ImportError):
    """A reference that cannot be imported or resolved."""


def load_ref(ref: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the object."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise RefError(f"reference {ref!r} must look like 'package.module:object'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail with anything the module raises
        raise RefError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RefError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def load_dotted(path: str) -> Any:
    """Resolve ``pkg.mod.obj`` (the reference's spelling) or ``pkg.mod:obj``."""
    if ":" in path:
        return load_ref(path)
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RefError(f"{path!r} must be a dotted path 'package.module.object'")
    return load_ref(f"{module_name}:{attr}")


def _is_async_callable(obj: Any) -> bool:
    # An async function, or an instance whose __call__ is one.
    return inspect.iscoroutinefunction(obj) or (
        not inspect.isclass(obj) and callable(obj) and inspect.iscoroutinefunction(type(obj).__call__)
    )


def _subclass_of(ref: str) -> Callable[[Any], bool]:
    def check(obj: Any) -> bool:
        return inspect.isclass(obj) and issubclass(obj, load_ref(ref))

    return check


PATH_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "callable": (callable, "must be callable"),
    "async_callable": (_is_async_callable, "must be an async function ('async def rm(args, samples) -> list[float]')"),
    "sde_backend": (_subclass_of("miles_core.sde:SdeBackend"), "must be a subclass of miles_core.sde.SdeBackend"),
    "model_family": (_subclass_of("miles_core.family:ModelFamily"), "must be a subclass of miles_core.family.ModelFamily"),
}
"""Dotted-path flag kinds: ``kind -> (check, rule)``."""


class PathFlagError(ValueError):
    """A ``--*-path`` flag that does not resolve to the right kind of object."""


def resolve_path_flag(flag_name: str, path: str, kind: str) -> Any:
    """Import the object a dotted-path flag names and check it is of ``kind``.

    Raises :class:`PathFlagError` with a one-line message naming the flag.
    """
    check, rule = PATH_KINDS[kind]
    try:
        obj = load_dotted(path)
    except RefError as exc:
        raise PathFlagError(f"{flag_name} {path}: {exc}") from None
    if not check(obj):
        raise PathFlagError(f"{flag_name} {path}: {rule}, got {type(obj).__name__} {obj!r}")
    return obj
