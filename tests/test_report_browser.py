"""The run report in a real browser (Debian's Chromium driven by Playwright): the report of
a real three-evaluation tiny SD3 run, and of two runs compared, load without errors, draw
every chart, decode every image and keep a screenshot (under $MILES_TEST_ARTIFACTS, else
test-artifacts/). scripts/test.sh installs Chromium and Playwright; without them these
tests fail, saying how to install them."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.launch import train
from miles_core.report import write_report
from miles_core.testing import artifact_dir, check_report_in_browser
from tests.tiny_runs import tiny_run_args

EVAL_PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}']


@pytest.fixture(scope="module")
def two_runs(tiny_sd3, prompts, tmp_path_factory):
    """Two tiny runs of 2 rollouts evaluated before training and after each rollout (2
    prompts x 2 samples), differing only in --lr."""
    root = tmp_path_factory.mktemp("report-runs")
    held = root / "held.jsonl"
    held.write_text("\n".join(EVAL_PROMPTS) + "\n")
    runs = []
    for name, lr in (("lr-3e-3", "0.003"), ("lr-1e-4", "0.0001")):
        args = tiny_run_args(tiny_sd3, prompts, root / name, batch=1, n=2, steps=2, sde_steps=1)
        args += [
            "--num-rollout",
            "2",
            "--eval-interval",
            "1",
            "--eval-prompt-data",
            "held",
            str(held),
            "--n-samples-per-eval-prompt",
            "2",
            "--lr",
            lr,
        ]
        runs.append(asyncio.run(train(resolve_config(args), log=lambda line: None)))
    return runs


def test_the_report_of_a_run_with_three_evaluations_in_a_browser(two_runs):
    run = two_runs[0]
    manifest = [json.loads(line) for line in (run / "samples" / "eval" / "manifest.jsonl").read_text().splitlines()]
    assert sorted({(m["evaluation"], m["trained_rollouts"]) for m in manifest}) == [(0, 0), (1, 1), (2, 2)]
    out = write_report([run], run / "report.html")
    html = out.read_text()
    for section in ("rewards", "optimisation", "time", "samples", "configuration"):
        assert f'<section id="{section}">' in html
    # The evaluation charts have a point per evaluation, the one before training included (the
    # metrics hold two: the evaluation after rollout 0 overwrote the first one's keys in its record).
    for series in ("held reward mean", "held paired gain"):
        assert len(re.findall(rf'<circle [^>]*data-series="{series}"', html)) == 3, series
    # Every sample of every evaluation is in the page: 2 prompts x 2 samples x 3 evaluations.
    assert len(re.findall(r"<img src=\"data:image/png", html)) == len(manifest) == 12
    found = check_report_in_browser(out, artifact_dir() / "report-one-run.png", min_charts=6, min_images=12)
    assert len(found["images"]) == 12


def test_the_report_comparing_two_runs_in_a_browser(two_runs, tmp_path):
    out = write_report(two_runs, tmp_path / "comparison.html")
    html = out.read_text()
    assert "<code>--lr</code></td><td><code>0.003</code></td><td><code>0.0001</code>" in html
    # The samples of both runs, each under its run's name.
    assert "<h3>Run lr-3e-3</h3>" in html and "<h3>Run lr-1e-4</h3>" in html
    check_report_in_browser(out, artifact_dir() / "report-two-runs.png", min_charts=6, min_images=24)
