"""``miles-core make-tiny``: the options that need no model build."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from miles_core.plugin_manager import get_host


def _family_without_scales() -> str:
    for registration in get_host().registries.model_family:
        if "scale" not in inspect.signature(registration.load().build_tiny_pipeline).parameters:
            return registration.name
    pytest.skip("every installed family takes --scale")


def test_scale_on_a_family_without_scales_is_a_one_line_error(tmp_path) -> None:
    family = _family_without_scales()
    out = tmp_path / "x"
    result = subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", "make-tiny", family, str(out), "--scale", "bench"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"miles-core make-tiny: error: --scale bench: the {family} family builds only its tiny pipeline (no --scale)\n"
    )
    assert not out.exists() and list(tmp_path.iterdir()) == []
