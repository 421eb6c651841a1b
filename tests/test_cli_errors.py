"""One error handling for every command (miles_core.cli.main): a MilesError is one line
``PROG: error: MESSAGE`` per message, exit 2 for bad input or configuration (a broken
plugin under MILES_STRICT_PLUGINS=1 included, for every command), exit 1 for a failure
while running, and a traceback only with --debug or MILES_DEBUG=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles_core import errors
from tests.fake_dists import make_dist

BROKEN = "raise RuntimeError('the plugin module is broken')\n"


def miles(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300
    )


@pytest.fixture(scope="module")
def broken_plugin(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("site")
    make_dist(root, "miles-broken", "1.0", {"broken": BROKEN})
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "MILES_STRICT_PLUGINS": "1"}


@pytest.mark.parametrize(
    "command",
    [
        ["config", "--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium"],
        ["list-plugins"],
        ["make-tiny", "sd3", "unused-dir"],
        ["score", "--rm-type", "brightness", "--prompt", "x", "missing.png"],
    ],
)
def test_a_broken_plugin_under_strict_mode_is_one_line_and_exit_2_for_every_command(command, broken_plugin, tmp_path):
    result = miles(*command, env=broken_plugin)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error = [line for line in lines if ": error: " in line]
    assert len(error) == 1 and "miles plugin 'broken' (miles-broken 1.0" in error[0] and "MILES_STRICT_PLUGINS=1" in error[0]
    # Control: without strict mode the same plugin is only a warning and list-plugins succeeds.
    if command == ["list-plugins"]:
        relaxed = miles(*command, env={**broken_plugin, "MILES_STRICT_PLUGINS": "0"})
        assert relaxed.returncode == 0 and "failed" in relaxed.stdout


def test_debug_prints_the_traceback_and_the_line(broken_plugin):
    for extra_args, env in ((["--debug"], {}), ([], {"MILES_DEBUG": "1"})):
        result = miles(*extra_args, "config", "--hf-checkpoint", "x/y", env={**broken_plugin, **env})
        assert result.returncode == 2
        assert "Traceback" in result.stderr and "PluginLoadError" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("miles-core config: error: miles plugin 'broken'")


def test_exit_codes_follow_the_error_kind():
    """Every error class keeps its built-in parent; input errors exit 2, failures 1, a guard stop 3."""
    assert issubclass(errors.ConfigError, ValueError) and errors.ConfigError.exit_code == 2
    assert issubclass(errors.PromptDataError, ValueError) and errors.PromptDataError.exit_code == 2
    assert issubclass(errors.RunError, RuntimeError) and errors.RunError.exit_code == 2
    assert issubclass(errors.RunFailedError, errors.RunError) and errors.RunFailedError.exit_code == 1
    assert issubclass(errors.RewardsFailedError, errors.RewardError) and errors.RewardsFailedError.exit_code == 1
    assert issubclass(errors.EngineRequestError, RuntimeError) and errors.EngineRequestError.exit_code == 1
    assert issubclass(errors.ComponentLoadError, ImportError) and errors.ComponentLoadError.exit_code == 2
    everything = [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, Exception)]
    assert all(issubclass(cls, errors.MilesError) for cls in everything)
    assert {cls.exit_code for cls in everything} == {1, 2, 3}
    # 3 is the reward-hacking guard's deliberate stop (--guard-stop-on-alarm), nothing else's.
    assert [cls for cls in everything if cls.exit_code == 3] == [errors.GuardStopError]


def test_a_failure_while_running_exits_1_with_one_line(tmp_path, capsys):
    """A --ci-test check that does not pass is a failure of the run, not of its input."""
    from miles_core.cli.main import main
    from miles_core.training.ci_check import check_ci_metric

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"rollout_id": 0, "eval/x/reward_mean": 0.1}\n')

    class Config:
        ci_test = True
        ci_metric_checker_key = "eval/x/reward_mean"
        ci_metric_checker_threshold = 0.5

    with pytest.raises(errors.RunFailedError, match="below --ci-metric-checker-threshold 0.5") as caught:
        check_ci_metric(Config(), metrics)
    assert caught.value.exit_code == 1
    # Control: at the threshold the check passes.
    Config.ci_metric_checker_threshold = 0.1
    assert check_ci_metric(Config(), metrics) == 0.1
    # And through the command line: an unknown command is a usage error (exit 2), no traceback.
    assert main(["frobnicate"]) == 2
    assert "Traceback" not in capsys.readouterr().err
