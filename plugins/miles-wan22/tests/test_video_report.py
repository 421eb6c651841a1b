"""A Wan 2.2 run's report plays its evaluation videos in a real browser: a short tiny run
evaluated twice (before training and after its last rollout) saves every sample as WebM
(VP9) with a PNG poster; the report embeds the WebM in a <video> element that Chromium
can play and does play (its currentTime advances), with the MP4 offered beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core import family_checks
from miles_core.testing import check_run_report
from miles_wan22.family import Wan22Family

SIZE, FRAMES = 32, 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Wan22Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-tiny")


def test_the_report_of_a_video_run_plays_its_samples(tiny: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"input": "a red cube"}) + "\n")
    args = family_checks.tiny_train_args(
        tiny,
        run,
        "--diffusion-height",
        str(SIZE),
        "--diffusion-width",
        str(SIZE),
        "--diffusion-output-num-frames",
        str(FRAMES),
        "--diffusion-guidance-scale-2",
        "1.0",
    )
    args += ["--eval-interval", "2", "--eval-prompt-data", "held", str(held), "--n-samples-per-eval-prompt", "2"]
    family_checks.run_training(args)
    manifest = [json.loads(line) for line in (run / "samples" / "eval" / "manifest.jsonl").read_text().splitlines()]
    assert [(m["evaluation"], m["trained_rollouts"], m["sample_index"]) for m in manifest] == [(0, 0, 0), (0, 0, 1), (1, 2, 0), (1, 2, 1)]
    assert all(m["video"]["webm"] and m["video"]["frames"] == FRAMES for m in manifest)
    found = check_run_report(run, "report-wan22-video.png", min_charts=4, min_videos=4)
    assert [v["type"] for v in found["videos"]] == ["video/webm"] * 4
    html = (run / "report.html").read_text()
    # The MP4 is offered for download beside each video when the run wrote one (the video extra).
    assert html.count("download>MP4</a>") == sum(bool(m["video"]["mp4"]) for m in manifest)
