"""Real distributions on disk for plugin-loading tests: a ``*.dist-info`` folder with
METADATA and entry_points.txt next to the plugin module, discovered through
``importlib.metadata`` exactly as an installed plugin is."""

from __future__ import annotations

import textwrap
from importlib import metadata
from pathlib import Path


def make_dist(root: Path, dist: str, version: str, plugins: dict[str, str]) -> None:
    """Write distribution ``dist`` with one entry point per ``plugins`` item
    (entry-point name -> module source; the module is named ``<dist>_<name>``)."""
    module_prefix = dist.replace("-", "_")
    info = root / f"{module_prefix}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[miles.plugins]"]
    for name, source in plugins.items():
        module = f"{module_prefix}_{name}"
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        lines.append(f"{name} = {module}")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def entry_points_in(root: Path) -> list[metadata.EntryPoint]:
    return [ep for dist in metadata.distributions(path=[str(root)]) for ep in dist.entry_points if ep.group == "miles.plugins"]
