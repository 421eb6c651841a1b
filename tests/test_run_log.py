"""The run log (``RUN_DIR/train.log``), ``--log-level``, and which checkpoints keep the hub
libraries quiet."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.launch import train
from miles_core.training.run_log import RunLog
from tests.tiny_runs import tiny_run_args

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR|DEBUG) +(.*)$")


def logged(path: Path) -> list[tuple[str, str]]:
    """``(level, line)`` per line of a train.log; every line carries a timestamp."""
    lines = path.read_text(encoding="utf-8").splitlines()
    matches = [STAMP.match(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches) if not m]
    return [(m.group(1), m.group(2)) for m in matches]


@pytest.mark.exercises("--log-level")
def test_the_run_log_holds_the_lines_of_the_console_with_timestamps(tiny_sd3, prompts, tmp_path):
    console: list[str] = []
    args = [*tiny_run_args(tiny_sd3, prompts, tmp_path / "run", steps=2, sde_steps=1), "--num-rollout", "2"]
    out = asyncio.run(train(resolve_config(args), log=console.append))
    assert [line for _, line in logged(out / "train.log")] == console
    assert sum(line.startswith("rollout ") for line in console) == 2
    # --log-level warning: no rollout lines (info), on the console or in the file.
    quiet: list[str] = []
    args = [*tiny_run_args(tiny_sd3, prompts, tmp_path / "quiet", steps=2, sde_steps=1), "--num-rollout", "1", "--log-level", "warning"]
    out = asyncio.run(train(resolve_config(args), log=quiet.append))
    assert not any(line.startswith("rollout ") for line in quiet)
    assert [line for _, line in logged(out / "train.log")] == quiet


def test_lines_before_the_directory_are_kept_and_a_resumed_run_appends(tmp_path):
    log = RunLog("info", console=lambda line: None)
    log("threads: 1 for compute")
    log("warning: something to know")
    assert not (tmp_path / "train.log").exists()
    log.open(tmp_path)
    log("rollout 1/1")
    log.close()
    again = RunLog("info", console=lambda line: None)
    again.open(tmp_path)
    again("rollout 2/2")
    again.close()
    assert logged(tmp_path / "train.log") == [
        ("INFO", "threads: 1 for compute"),
        ("WARNING", "warning: something to know"),
        ("INFO", "rollout 1/1"),
        ("INFO", "rollout 2/2"),
    ]


def test_a_nested_run_log_keeps_the_lines_after_the_run_and_records_its_error(tiny_sd3, prompts, tmp_path):
    """Under --use-ray the launcher's run log is attached around the run's own ``train``
    (``miles_core.launch``): the lines logged after the run's ``train`` returns (the
    cluster's stop) still reach the file, and the error that ends the run is its last line."""
    from miles_core.errors import RunFailedError
    from miles_core.training.run import train as run_train

    args = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "run", steps=2, sde_steps=1),
        *("--num-rollout", "1", "--ci-test", "--ci-metric-checker-key", "rollout/reward/raw_mean"),
        *("--ci-metric-checker-threshold", "1e9"),  # a run that fails at its very end, after its last line
    ]
    config = resolve_config(args)
    console: list[str] = []

    async def launched() -> None:  # what miles_core.launch.train does with --use-ray, less the cluster
        with RunLog.of(console.append, config).attached() as run_log:
            try:
                await run_train(config, log=run_log)
            finally:
                run_log("cluster: stopped")

    with pytest.raises(RunFailedError) as error:
        asyncio.run(launched())
    assert str(error.value).startswith("--ci-test: metric 'rollout/reward/raw_mean' is ")
    lines = logged(tmp_path / "run" / "train.log")
    assert lines[-2:] == [("INFO", "cluster: stopped"), ("ERROR", f"error: {error.value}")]
    # The error goes to the file only: the command prints it to the console itself.
    assert [line for _, line in lines[:-1]] == console
    assert logging.getLogger("miles_core").handlers == []  # detached once the outermost block ended


@pytest.mark.exercises("--log-level")
def test_log_level_sets_what_miles_core_records_show(tiny_sd3, prompts, tmp_path):
    record = logging.getLogger("miles_core.engine.test")
    shown: dict[str, list[str]] = {}
    for level in ("debug", "warning"):
        config = resolve_config([*tiny_run_args(tiny_sd3, prompts, tmp_path / level), "--log-level", level])
        console: list[str] = []
        with RunLog.of(console.append, config).attached() as log:
            (tmp_path / level).mkdir()
            log.open(tmp_path / level)
            record.debug("a debug record")
            record.warning("a warning record")
        shown[level] = console
        assert [line for _, line in logged(tmp_path / level / "train.log")] == console
    assert shown["debug"] == ["miles_core.engine.test: a debug record", "miles_core.engine.test: a warning record"]
    assert shown["warning"] == ["miles_core.engine.test: a warning record"]
    # Detached after the run: the logger's level is back as it was.
    assert logging.getLogger("miles_core").level == logging.NOTSET


def hub_libraries() -> tuple:
    """The hub libraries' verbosities and whether each shows progress bars."""
    import diffusers
    import huggingface_hub
    import transformers

    return (
        transformers.logging.get_verbosity(),
        diffusers.utils.logging.get_verbosity(),
        huggingface_hub.utils.logging.get_verbosity(),
        transformers.utils.logging.is_progress_bar_enabled(),
        diffusers.utils.logging.is_progress_bar_enabled(),
        not huggingface_hub.utils.are_progress_bars_disabled(),
    )


@pytest.fixture
def restore_hub_libraries():
    import diffusers
    import huggingface_hub
    import transformers

    before = hub_libraries()
    yield
    transformers.logging.set_verbosity(before[0])
    diffusers.utils.logging.set_verbosity(before[1])
    huggingface_hub.utils.logging.set_verbosity(before[2])
    (transformers.logging.enable_progress_bar if before[3] else transformers.logging.disable_progress_bar)()
    (diffusers.utils.logging.enable_progress_bar if before[4] else diffusers.utils.logging.disable_progress_bar)()
    (huggingface_hub.utils.enable_progress_bars if before[5] else huggingface_hub.utils.disable_progress_bars)()


SHOWN = (logging.WARNING, logging.WARNING, logging.WARNING, True, True, True)  # --log-level info
LOADING_BAR = "Loading pipeline components"  # diffusers' progress bar while a pipeline loads


def test_only_a_tiny_pipelines_load_keeps_the_hub_libraries_quiet(tiny_sd3, tmp_path, capfd, restore_hub_libraries):
    import os
    import shutil

    from miles_core.quiet import TINY_MARKER, quiet_hub_libraries, show_hub_libraries
    from miles_sd3.family import SD3Family

    shutil.copytree(tiny_sd3, tmp_path / "tiny")
    assert (tmp_path / "tiny" / TINY_MARKER).is_file()  # the family's tiny builder marks it
    quiet_hub_libraries()  # a process that loads only tiny pipelines (make-tiny, the benchmarks)
    assert hub_libraries() == (logging.ERROR,) * 3 + (False,) * 3
    # Never through the environment: a child process, or a later download, would inherit it.
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    # train, generate, serve-engine and score: the libraries at --log-level for the process...
    show_hub_libraries("info")
    assert hub_libraries() == SHOWN
    capfd.readouterr()
    SD3Family.load_pipeline(tmp_path / "tiny")
    assert LOADING_BAR not in capfd.readouterr().err  # ...quiet while the tiny pipeline loads...
    assert hub_libraries() == SHOWN  # ...and shown again for what loads next (a reward model from the hub)
    # Control: the same pipeline without the marker is a checkpoint of the user's: its load shows its progress.
    (tmp_path / "tiny" / TINY_MARKER).unlink()
    SD3Family.load_pipeline(tmp_path / "tiny")
    assert LOADING_BAR in capfd.readouterr().err
    # --log-level error: no warnings, no bars; debug: everything.
    show_hub_libraries("error")
    assert hub_libraries() == (logging.ERROR,) * 3 + (False,) * 3
    show_hub_libraries("debug")
    assert hub_libraries() == (logging.DEBUG,) * 3 + (True,) * 3


def test_score_leaves_the_hub_libraries_shown_for_its_reward_models(tmp_path, capsys, restore_hub_libraries):
    """``miles-core score`` loads reward models, which may come from the hub: it does not
    quiet the libraries (it did, for every checkpoint)."""
    import numpy as np
    from PIL import Image

    from miles_core.cli.main import main
    from miles_core.quiet import quiet_hub_libraries

    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "black.png")
    quiet_hub_libraries()  # control: quiet before, so it is score that shows them
    assert main(["score", "--rm-type", "brightness", "--prompt", "a cube", str(tmp_path / "black.png")]) == 0
    assert hub_libraries() == SHOWN
