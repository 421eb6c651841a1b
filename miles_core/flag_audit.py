"""The flag audit: every command-line flag is exercised by a test, or is documented as
unavailable.

Tests declare what they exercise with ``@pytest.mark.exercises("--flag", ...)`` (the
marker comes from :mod:`miles_core.pytest_plugin`). The audit reads those markers
statically (``ast``), so it sees every suite of the monorepo without running them, and
reports flags no test exercises. Hardware-only flags (:attr:`Flag.hardware`) need a test
too: their logic runs on this machine (several gloo ranks, a local Ray instance), only
the devices differ. Flags marked :attr:`Flag.unavailable` (their feature is not in this
version) are covered by the generic availability tests instead, which walk that
attribute. Plugin suites can run the same audit over their own flags.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from miles_core.config.flag import Flag


def _is_exercises(node: ast.expr) -> bool:
    """``pytest.mark.exercises(...)`` or ``mark.exercises(...)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "exercises"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "mark"
    )


class _MarkerVisitor(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.scope: list[str] = []
        self.found: list[tuple[str, str]] = []
        self.errors: list[str] = []

    def _definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition

    def visit_Call(self, node: ast.Call) -> None:
        if _is_exercises(node):
            test = f"{self.where}::{'::'.join(self.scope) or '<module>'}"
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    self.found.append((arg.value, test))
                else:
                    self.errors.append(f"{test} (line {node.lineno}): exercises() takes literal '--flag' strings")
        self.generic_visit(node)


def exercised_flags(test_files: Iterable[Path], *, root: Path | None = None) -> tuple[dict[str, list[str]], list[str]]:
    """``({flag: [test ids]}, errors)`` from the ``exercises`` markers in ``test_files``."""
    exercised: dict[str, list[str]] = {}
    errors: list[str] = []
    for path in sorted(test_files):
        where = str(path.relative_to(root)) if root else str(path)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            errors.append(f"{where}: cannot parse ({exc.msg}, line {exc.lineno})")
            continue
        visitor = _MarkerVisitor(where)
        visitor.visit(tree)
        errors.extend(visitor.errors)
        for flag, test in visitor.found:
            exercised.setdefault(flag, []).append(test)
    return exercised, errors


def test_files_under(roots: Iterable[Path]) -> list[Path]:
    """Every ``test_*.py`` below the given suite directories."""
    return sorted(path for root in roots for path in Path(root).rglob("test_*.py"))


test_files_under.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def audit_flags(flags: Iterable[Flag], exercised: Mapping[str, list[str]]) -> list[str]:
    """One line per problem: a flag that no test exercises and that is not unavailable
    (hardware-only flags included), or a marker naming a flag that does not exist."""
    flags = list(flags)
    known = {name for flag in flags for name in (flag.name, *flag.aliases)}
    problems = [
        f"{flag.name}: no test is marked @pytest.mark.exercises({flag.name!r}), and the flag is not unavailable"
        for flag in flags
        if not flag.unavailable and flag.name not in exercised
    ]
    for name, tests in sorted(exercised.items()):
        if name not in known:
            problems.append(f"{name}: marked as exercised by {tests[0]} but no such flag exists")
    return problems
