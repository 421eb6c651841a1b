"""Run-level flags: the learning-rate schedule on resume (``--use-checkpoint-lr-scheduler``,
``--override-lr-scheduler``), the CI metric check (``--ci-test``,
``--ci-metric-checker-key``, ``--ci-metric-checker-threshold``) and the training
environment (``--train-env-vars``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, RunError
from miles_core.training.checkpoint import read_extra, save_checkpoint
from miles_core.training.lr_schedule import (
    SCHEDULE_KEY,
    from_config,
    resolve_schedule_on_resume,
    resume_schedule,
    schedule_state,
)


@pytest.fixture
def base(tiny_sd3, prompts) -> list[str]:
    return ["--hf-checkpoint", str(tiny_sd3), "--prompt-data", str(prompts), "--rollout-batch-size", "1"]


def config_errors(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        resolve_config(argv)
    return excinfo.value.messages


# -- the learning-rate schedule on resume -----------------------------------------------


def saved_run_schedule(base: list[str]):
    """The schedule of the run that wrote the checkpoint: cosine from 1e-3 over its 10 steps."""
    config = resolve_config([*base, "--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"])
    return from_config(config, 10)


@pytest.mark.exercises("--use-checkpoint-lr-scheduler", "--override-lr-scheduler")
def test_resume_takes_the_checkpoints_schedule_unless_overridden(base):
    saved = schedule_state(saved_run_schedule(base))
    assert json.loads(json.dumps(saved)) == saved  # plain JSON in the checkpoint's extra
    # The resumed command line: another lr, linear decay, and a longer run (20 steps).
    resumed = [*base, "--lr", "2e-3", "--min-lr", "1e-5", "--lr-decay-style", "linear", "--lr-warmup-iters", "2"]
    command_line = from_config(resolve_config(resumed), 20)

    chosen, warnings = resolve_schedule_on_resume(resolve_config(resumed), command_line, saved)  # default: on
    assert chosen == saved_run_schedule(base)
    # Numbers: the checkpoint's cosine over 10 steps, not the command line's linear over 20.
    step = 6
    ratio = (step - 2) / (10 - 2)
    assert chosen.lr_at(step) == pytest.approx(1e-5 + 0.5 * (1 + math.cos(math.pi * ratio)) * (1e-3 - 1e-5), rel=1e-12)
    assert chosen.lr_at(step) != command_line.lr_at(step)
    assert warnings == [
        "--lr: the checkpoint's 0.001 is used, not the command line's 0.002 (--override-lr-scheduler keeps the command line's)",
        "--lr-decay-style: the checkpoint's 'cosine' is used, not the command line's 'linear' "
        "(--override-lr-scheduler keeps the command line's)",
        "--lr-decay-iters (or the run's total optimizer steps): the checkpoint's 10 is used, not the command "
        "line's 20 (--override-lr-scheduler keeps the command line's)",
    ]
    for flag in ("--override-lr-scheduler", "--no-use-checkpoint-lr-scheduler"):
        chosen, warnings = resolve_schedule_on_resume(resolve_config([*resumed, flag]), command_line, saved)
        assert chosen == command_line
        assert warnings[0] == "--lr: the command line's 0.002 is used, not the checkpoint's 0.001"
    # The same schedule on both sides: nothing to say.
    same = saved_run_schedule(base)
    assert resolve_schedule_on_resume(resolve_config(base), same, schedule_state(same)) == (same, [])


@pytest.mark.exercises("--use-checkpoint-lr-scheduler")
def test_resume_schedule_reads_the_checkpoint_and_logs(base, tmp_path):
    schedule = saved_run_schedule(base)
    ema_shadow = {"shadow": {"w": torch.ones(2)}}  # a tensor-valued extra entry is skipped by read_extra
    save_checkpoint(
        tmp_path / "ckpt",
        3,
        model_state={"transformer": {"w": torch.zeros(1)}},
        optimizer_state=None,
        rng_state={},
        extra={"optimizer_steps": 4, SCHEDULE_KEY: schedule_state(schedule), "ema": ema_shadow},
    )
    assert read_extra(tmp_path / "ckpt") == {"optimizer_steps": 4, SCHEDULE_KEY: schedule_state(schedule)}
    assert read_extra(tmp_path / "empty") is None  # nothing saved yet: nothing to resume

    config = resolve_config([*base, "--load", str(tmp_path / "ckpt"), "--lr", "5e-4"])
    lines: list[str] = []
    chosen = resume_schedule(config, from_config(config, 40), lines.append)
    assert chosen == schedule
    assert lines[0] == (
        "warning: --lr: the checkpoint's 0.001 is used, not the command line's 0.0005 (--override-lr-scheduler keeps the command line's)"
    )
    # No --load: the command line's, untouched; a checkpoint saved before schedules were: a warning.
    plain = resolve_config(base)
    assert resume_schedule(plain, from_config(plain, 40), lines.append) == from_config(plain, 40)
    save_checkpoint(tmp_path / "old", 0, model_state={}, optimizer_state=None, rng_state={}, extra={})
    old = resolve_config([*base, "--load", str(tmp_path / "old")])
    lines.clear()
    assert resume_schedule(old, from_config(old, 40), lines.append) == from_config(old, 40)
    assert lines == ["warning: the checkpoint holds no learning-rate schedule (saved before schedules were); using the command line's"]
    # A corrupt saved schedule is a one-line run error.
    bad = {**schedule_state(schedule), "decay_style": "zigzag"}
    save_checkpoint(tmp_path / "bad", 0, model_state={}, optimizer_state=None, rng_state={}, extra={SCHEDULE_KEY: bad})
    config = resolve_config([*base, "--load", str(tmp_path / "bad")])
    with pytest.raises(
        RunError,
        match=r"^--load \S+bad: the checkpoint's learning-rate schedule is invalid "
        r"\(--lr-decay-style 'zigzag': choose one of",
    ):
        resume_schedule(config, from_config(config, 40), lines.append)


@pytest.mark.exercises("--use-checkpoint-lr-scheduler", "--override-lr-scheduler")
def test_override_and_use_checkpoint_lr_scheduler_together_is_a_config_error(base):
    assert config_errors([*base, "--override-lr-scheduler", "--use-checkpoint-lr-scheduler"]) == [
        "--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive (the command line's "
        "learning-rate schedule or the checkpoint's)"
    ]
    # Controls: the default (on) with --override-lr-scheduler, and the explicit off.
    resolve_config([*base, "--override-lr-scheduler"])
    resolve_config([*base, "--override-lr-scheduler", "--no-use-checkpoint-lr-scheduler"])


# -- --ci-test ------------------------------------------------------------------------


def write_metrics(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


CI_RECORDS = [
    {"rollout_id": 0, "rollout/reward/raw_mean": 0.2, "eval/shapes/reward_mean": 0.4},
    {"rollout_id": 1, "rollout/reward/raw_mean": 0.5},
    {"rollout_id": 2, "rollout/reward/raw_mean": 0.3},  # the last record: the one checked
]


@pytest.mark.exercises("--ci-test", "--ci-metric-checker-key", "--ci-metric-checker-threshold")
def test_ci_check_uses_the_last_record_that_has_the_key(base, tmp_path):
    from miles_core.training.ci_check import check_ci_metric

    metrics = write_metrics(tmp_path / "metrics.jsonl", CI_RECORDS)

    def ci(key: str, threshold: str):
        return resolve_config([*base, "--ci-test", "--ci-metric-checker-key", key, "--ci-metric-checker-threshold", threshold])

    assert check_ci_metric(ci("rollout/reward/raw_mean", "0.3"), metrics) == 0.3  # >= passes, at equality too
    with pytest.raises(RunError) as excinfo:
        check_ci_metric(ci("rollout/reward/raw_mean", "0.45"), metrics)  # 0.5 earlier does not count
    assert str(excinfo.value) == (
        f"--ci-test: metric 'rollout/reward/raw_mean' is 0.3, below --ci-metric-checker-threshold 0.45 (last record of {metrics})"
    )
    # A key only some records have (evaluations): its last record.
    assert check_ci_metric(ci("eval/shapes/reward_mean", "0.4"), metrics) == 0.4
    with pytest.raises(RunError, match=r"^--ci-test: no record of \S+ has --ci-metric-checker-key 'train/loss'$"):
        check_ci_metric(ci("train/loss", "0"), metrics)
    write_metrics(tmp_path / "text.jsonl", [{"rollout_id": 0, "note": "n/a"}])
    with pytest.raises(RunError, match=r"^--ci-test: metric 'note' is 'n/a', not a number \(threshold 0.0\)$"):
        check_ci_metric(ci("note", "0"), tmp_path / "text.jsonl")
    # Control: without --ci-test nothing is checked, even with a failing metric file.
    assert check_ci_metric(resolve_config(base), metrics) is None


@pytest.mark.exercises("--ci-test", "--ci-metric-checker-key", "--ci-metric-checker-threshold")
def test_ci_flags_go_together(base):
    assert config_errors([*base, "--ci-test"]) == [
        "--ci-test requires --ci-metric-checker-key and --ci-metric-checker-threshold (the metric the run must reach)"
    ]
    assert config_errors([*base, "--ci-test", "--ci-metric-checker-key", "k"])[0].startswith("--ci-test requires")
    assert config_errors([*base, "--ci-metric-checker-key", "k", "--ci-metric-checker-threshold", "1"]) == [
        "--ci-metric-checker-key and --ci-metric-checker-threshold require --ci-test"
    ]
    assert config_errors([*base, "--ci-test", "--ci-metric-checker-key", "k", "--ci-metric-checker-threshold", "inf"]) == [
        "--ci-metric-checker-threshold inf: must be a finite number"
    ]
    config = resolve_config([*base, "--ci-test", "--ci-metric-checker-key", "k", "--ci-metric-checker-threshold", "1"])
    assert (config.ci_test, config.ci_metric_checker_key, config.ci_metric_checker_threshold) == (True, "k", 1.0)


# -- --train-env-vars ----------------------------------------------------------------------


@pytest.fixture
def restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.exercises("--train-env-vars")
def test_train_env_vars_are_set_as_strings_and_logged(base, restore_environ):
    from miles_core.config.train_env import apply_train_env_vars

    os.environ.pop("MILES_TEST_A", None)
    config = resolve_config([*base, "--train-env-vars", '{"MILES_TEST_B": "x y", "MILES_TEST_A": 3, "MILES_TEST_C": 0.5}'])
    lines: list[str] = []
    applied = apply_train_env_vars(config, lines.append)
    assert applied == {"MILES_TEST_B": "x y", "MILES_TEST_A": "3", "MILES_TEST_C": "0.5"}
    assert (os.environ["MILES_TEST_A"], os.environ["MILES_TEST_B"], os.environ["MILES_TEST_C"]) == ("3", "x y", "0.5")
    assert lines == ["--train-env-vars: set MILES_TEST_A, MILES_TEST_B, MILES_TEST_C"]
    # Control: the default ({}) sets and logs nothing.
    lines.clear()
    assert apply_train_env_vars(resolve_config(base), lines.append) == {} and lines == []


@pytest.mark.exercises("--train-env-vars")
def test_bad_train_env_vars_are_one_line_errors(base, restore_environ):
    from types import SimpleNamespace

    from miles_core.config.train_env import apply_train_env_vars

    cases = [
        ('{"MILES_TEST_X": [1]}', "--train-env-vars: the value of MILES_TEST_X must be a string or a number, got list [1]"),
        ('{"MILES_TEST_X": true}', "--train-env-vars: the value of MILES_TEST_X must be a string or a number, got bool True"),
        ('{"MILES_TEST_X": null}', "--train-env-vars: the value of MILES_TEST_X must be a string or a number, got NoneType None"),
        ('{"A=B": "1"}', "--train-env-vars: 'A=B' is not a valid environment variable name"),
        ('{"": "1"}', "--train-env-vars: '' is not a valid environment variable name"),
    ]
    for text, message in cases:
        assert config_errors([*base, "--train-env-vars", text]) == [message]
    # The function itself refuses them too, before setting anything.
    os.environ.pop("MILES_TEST_OK", None)
    bad = SimpleNamespace(train_env_vars={"MILES_TEST_OK": "1", "MILES_TEST_X": {"a": 1}})
    with pytest.raises(ValueError, match=r"^--train-env-vars: the value of MILES_TEST_X must be a string or a number"):
        apply_train_env_vars(bad, print)
    assert "MILES_TEST_OK" not in os.environ
