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


def _family(with_variants: bool) -> tuple[str, tuple[str, ...]]:
    for registration in get_host().registries.model_family:
        variants = tuple(getattr(registration.load(), "tiny_variants", ()))
        if bool(variants) == with_variants:
            return registration.name, variants
    pytest.skip(f"no installed family {'with' if with_variants else 'without'} tiny variants")


def _make_tiny_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from miles_core.cli.main import main

    with pytest.raises(SystemExit) as excinfo:
        main(["make-tiny", *args])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line: no usage block
    return err


def test_variant_on_a_family_without_variants_is_a_one_line_error(tmp_path, capsys) -> None:
    family, _ = _family(with_variants=False)
    err = _make_tiny_error([family, str(tmp_path / "x"), "--variant", "klein"], capsys)
    assert err == f"miles-core make-tiny: error: --variant klein: the {family} family builds one tiny pipeline (no variants)\n"
    assert list(tmp_path.iterdir()) == []


def test_unknown_variant_names_the_familys_variants(tmp_path, capsys) -> None:
    family, variants = _family(with_variants=True)
    err = _make_tiny_error([family, str(tmp_path / "x"), "--variant", "nope"], capsys)
    assert (
        err == f"miles-core make-tiny: error: --variant nope: not a variant of the {family} family (its variants: {', '.join(variants)})\n"
    )
    assert list(tmp_path.iterdir()) == []
