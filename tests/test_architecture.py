"""The codebase's structure, checked: the import-linter contracts (one-way layers, the
engine never imports training, the core never imports a plugin, plugins are
independent), no import cycle among the core's modules, no import of another module's
``_private`` names, and plugins that import only the declared plugin API
(:mod:`miles_core.api`). Each checker also runs on a small bad example that it must
reject, so a checker that silently passes everything fails here."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = (
    "miles_core",
    "miles_sd3",
    "miles_wan22",
    "miles_ltx",
    "miles_qwen_image",
    "miles_cosmos3",
    "miles_flux",
    "miles_rewards",
    "miles_algorithms",
    "miles_example",
    "miles_example_reward",
    "tests",
)
PLUGIN_SOURCES = [*sorted(ROOT.glob("plugins/*/src")), *sorted(ROOT.glob("examples/*/src"))]
PYTHON_TREES = [
    ROOT / "miles_core",
    ROOT / "tests",
    ROOT / "bench",
    ROOT / "scripts",
    *sorted(ROOT.glob("plugins/*")),
    *sorted(ROOT.glob("examples/*")),
]


def python_files(trees: Iterable[Path]) -> Iterator[Path]:
    for tree in trees:
        for path in sorted(tree.rglob("*.py")):
            if not any(part.startswith(".") or part in ("__pycache__", "build") for part in path.relative_to(ROOT).parts):
                yield path


# -- import cycles ----------------------------------------------------------------------


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every component of more than one module (a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_that():
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": []}) == []


def test_no_import_cycle_among_the_cores_modules():
    """Imports inside functions count: grimp records every import statement."""
    import grimp

    graph = grimp.build_graph("miles_core", include_external_packages=False)
    edges = {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    edges = {m: {i for i in imported if not m.startswith(i + ".") and not i.startswith(m + ".")} for m, imported in edges.items()}
    assert strongly_connected(edges) == []


# -- import-linter contracts --------------------------------------------------------------


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    command = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(command), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_linter_contracts_are_kept(tmp_path):
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Control: a contract the code breaks (training imports the engine) must be reported.
    broken = tmp_path / "broken.toml"
    broken.write_text(
        textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["miles_core"]

        [[tool.importlinter.contracts]]
        name = "control"
        type = "forbidden"
        source_modules = ["miles_core.training"]
        forbidden_modules = ["miles_core.engine"]
    """)
    )
    control = lint_imports("--config", str(broken))
    assert control.returncode != 0 and "control BROKEN" in control.stdout


# -- private names ------------------------------------------------------------------------


def _module_of(importer: Path) -> str:
    relative = importer.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] in ("plugins", "examples") and "src" in parts:
        parts = parts[parts.index("src") + 1 :]
    return ".".join(p for p in parts if p != "__init__")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, module: str) -> list[str]:
    """``from x import _name`` and ``x._name`` (``x`` a first-party module bound in the
    file) where ``x`` is another module than ``module``: line and expression."""
    tree = ast.parse(source)
    found: list[str] = []
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FIRST_PARTY:
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in FIRST_PARTY:
            for alias in node.names:
                if _private(alias.name) and node.module != module:
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                elif _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and modules[node.value.id] != module
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        # monkeypatch.setattr(module, "_name", ...): the same reach into a module, by string.
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in modules
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"line {node.lineno}: setattr({node.args[0].id}, {node.args[1].value!r})")
    return found


def test_the_private_name_check_catches_both_forms():
    bad = textwrap.dedent("""
        from miles_core.training.run_state import _hidden
        from miles_core.cli import generate
        import miles_core.losses as losses
        generate._write(1)
        losses._resolve("x")
        generate.run([])
        monkeypatch.setattr(generate, "_write", print)
    """)
    assert sorted(private_imports(bad, "tests.example"), key=lambda hit: int(hit.split()[1].rstrip(":"))) == [
        "line 2: from miles_core.training.run_state import _hidden",
        "line 5: generate._write",
        "line 6: losses._resolve",
        "line 8: setattr(generate, '_write')",
    ]


def test_no_module_imports_another_modules_private_names():
    found = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in python_files(PYTHON_TREES)
        for hit in private_imports(path.read_text(encoding="utf-8"), _module_of(path))
    ]
    assert found == []


# -- the plugin API -----------------------------------------------------------------------


def core_imports_outside_the_api(source: str) -> list[str]:
    """Imports of ``miles_core`` modules other than :mod:`miles_core.api`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "miles_core" else [f"miles_core.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0] == "miles_core" and name != "miles_core.api"]
    return found


def test_the_plugin_api_check_rejects_other_core_modules():
    source = "from miles_core.api import hookimpl\nfrom miles_core import api\nfrom miles_core.family import ModelFamily\nimport miles_core.sde\n"
    assert core_imports_outside_the_api(source) == ["line 3: miles_core.family", "line 4: miles_core.sde"]


@pytest.mark.parametrize("source", PLUGIN_SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_plugins_and_examples_import_only_the_plugin_api(source):
    found = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in python_files([source])
        for hit in core_imports_outside_the_api(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_every_plugin_api_name_resolves_and_the_module_stays_light():
    """Every listed name imports; importing the module (what entry points do) pulls in no torch."""
    import miles_core.api as api

    for name in api.__all__:
        assert getattr(api, name) is not None, name
    probe = "import sys, miles_core.api; print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    with pytest.raises(AttributeError, match="the plugin API is miles_core.api.__all__"):
        api.not_a_name  # noqa: B018
