"""Resolving lazy references (``"pkg.mod:obj"``) and dotted-path flags.

Spec records name their implementation lazily; the reference's ``--*-path`` flags
(``--custom-rm-path pkg.mod.rm``) name a one-off implementation for one slot. Both are
resolved here, with one-line errors that name the culprit and the rule.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_core.errors import HookError, PathFlagError, RefError


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


def _accepts(positional: int, *keywords: str) -> Callable[[Any], bool]:
    """A callable that takes ``positional`` positional arguments (and these keywords)."""

    def check(obj: Any) -> bool:
        if not callable(obj):
            return False
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return True
        try:
            signature.bind(*([None] * positional), **{name: None for name in keywords})
        except TypeError:
            return False
        return True

    return check


def _data_source_class(obj: Any) -> bool:
    # The run builds it as cls(config, records) and calls these three (docs/customization.md).
    return (
        inspect.isclass(obj)
        and all(callable(getattr(obj, name, None)) for name in ("batch", "state_dict", "load_state_dict"))
        and _accepts(2)(obj)
    )


PATH_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "callable": (callable, "must be callable"),
    "class": (inspect.isclass, "must be a class"),
    "async_callable": (_is_async_callable, "must be an async function ('async def rm(args, samples) -> list[float]')"),
    "sde_backend": (_subclass_of("miles_core.sde:SdeBackend"), "must be a subclass of miles_core.sde.SdeBackend"),
    "model_family": (_subclass_of("miles_core.family:ModelFamily"), "must be a subclass of miles_core.family.ModelFamily"),
    # The run-level hooks of docs/customization.md; sync or async functions alike.
    "rollout_function": (_accepts(4), "must be a function (config, rollout_id, engine, data_source) -> list[Sample]"),
    "eval_function": (
        _accepts(4, "evaluation"),
        "must be a function (config, rollout_id, engine, data_source, *, evaluation) -> list[Sample]",
    ),
    "generate_function": (_accepts(2), "must be a function (engine, request) -> list[RolloutOutput]"),
    "data_source": (
        _data_source_class,
        "must be a class built as cls(config, records) with batch(rollout_id), state_dict() and load_state_dict(state)",
    ),
    "log_function": (_accepts(4), "must be a function (rollout_id, config, samples, metrics) -> bool"),
    "model_backend": (_accepts(1), "must be a function (config) -> miles_core.family.ModelFamily instance"),
}
"""Dotted-path flag kinds: ``kind -> (check, rule)``."""


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
        raise PathFlagError(f"{flag_name} {path}: {rule}, got {describe(obj)}")
    return obj


def describe(obj: Any) -> str:
    """``function f(a, b)`` for a callable (its signature is usually what is wrong)."""
    if callable(obj):
        try:
            full = inspect.signature(obj)
            # Parameter names only: annotations make the line long and say little here.
            signature = str(
                full.replace(
                    parameters=[p.replace(annotation=p.empty) for p in full.parameters.values()],
                    return_annotation=full.empty,
                )
            )
        except (TypeError, ValueError):
            signature = ""
        name = getattr(obj, "__qualname__", None) or type(obj).__name__
        return f"{'class' if inspect.isclass(obj) else type(obj).__name__} {name}{signature}"
    return f"{type(obj).__name__} {obj!r}"


@dataclass(frozen=True)
class Hook:
    """A loaded dotted-path flag: the function (or class) and where it came from."""

    flag: str
    path: str
    fn: Callable[..., Any]

    @property
    def where(self) -> str:
        return f"{self.flag} {self.path}"

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.fn(*args, **kwargs)
        if inspect.isawaitable(result):  # async functions and sync ones alike
            result = await result
        return result


def load_hook(flag: str, path: str | None, kind: str) -> Hook | None:
    """The object ``path`` names, checked to be of ``kind``; None when the flag is unset."""
    if path is None:
        return None
    try:
        return Hook(flag, path, resolve_path_flag(flag, path, kind))
    except PathFlagError as exc:
        raise HookError(str(exc)) from None
