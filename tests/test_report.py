"""The run report's pure parts: reading a run, the SVG scale, the config differences,
escaping, the atomic write and the command's errors. The browser checks are in
test_report_browser.py."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml

from miles_core.cli.main import main
from miles_core.config.document import config_document
from miles_core.config.resolve import resolve_config
from miles_core.errors import ReportError
from miles_core.report import load_runs, write_report
from miles_core.report.charts import Z95, paired_gain_curve
from miles_core.report.config_table import config_differences
from miles_core.report.run_files import load_run
from miles_core.report.svg_chart import HEIGHT, MARGIN_BOTTOM, MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, WIDTH, Series, line_chart, nice_ticks


def write_run(
    directory: Path,
    records: list[dict],
    *,
    args: tuple[str, ...] = (),
    manifest: list[dict] | None = None,
    alarms: list[dict] | None = None,
) -> Path:
    """A run directory in the formats a run writes: config.yaml from a resolved
    configuration, metrics.jsonl, and optionally the sample manifest and guard.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    config = resolve_config(
        [
            "--hf-checkpoint",
            "tiny/stable-diffusion-3",
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "2",
            "--output-dir",
            str(directory),
            *args,
        ]
    )
    (directory / "config.yaml").write_text(yaml.safe_dump(config_document(config), sort_keys=False))
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if manifest is not None:
        path = directory / "samples" / "eval" / "manifest.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(m) + "\n" for m in manifest))
    if alarms is not None:
        (directory / "guard.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alarms))
    return directory


RECORDS = [
    {
        "rollout_id": 0,
        "rollout/reward/raw_mean": 0.2,
        "rollout/reward/raw_std": 0.05,
        "train/loss": 0.1,
        "eval/held/reward_mean": 0.3,
        "eval/held/reward_std": 0.1,
    },
    {
        "rollout_id": 1,
        "rollout/reward/raw_mean": 0.3,
        "rollout/reward/raw_std": 0.05,
        "train/loss": 0.05,
        "eval/held/reward_mean": 0.4,
        "eval/held/reward_std": 0.1,
        "eval/held/paired_gain": 0.1,
        "eval/held/paired_gain_std": 0.2,
    },
]


def test_a_partial_last_line_of_metrics_is_ignored(tmp_path):
    run = write_run(tmp_path / "run", RECORDS)
    with open(run / "metrics.jsonl", "a") as file:
        file.write('{"rollout_id": 2, "rollout/reward/raw_mean": 0.9, "train/lo')  # killed mid-write
    assert [r["rollout_id"] for r in load_run(run).records] == [0, 1]
    html = write_report([run], run / "report.html").read_text()
    # The training reward chart has the two complete rollouts' points and nothing of the third.
    assert "<title>reward mean: 1, 0.3</title>" in html and "<title>reward mean: 2," not in html
    # Control: once the line is complete, it is read.
    with open(run / "metrics.jsonl", "a") as file:
        file.write('ss": 0.0}\n')
    assert [r["rollout_id"] for r in load_run(run).records] == [0, 1, 2]


def test_a_directory_that_is_not_a_run_is_a_one_line_error_with_exit_status_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert (
        capsys.readouterr().err
        == f"miles-core report: error: {tmp_path / 'empty'}: not a run directory (no config.yaml or metrics.jsonl)\n"
    )
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err
        == f"miles-core report: error: {tmp_path / 'missing'}: not a run directory (no config.yaml or metrics.jsonl)\n"
    )
    # A run: the report is written where the default says, and its path printed.
    run = write_run(tmp_path / "run", RECORDS)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out == f"{run / 'report.html'}\n"
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_the_report_is_written_atomically(tmp_path, monkeypatch):
    import miles_core.report as report

    run = write_run(tmp_path / "run", RECORDS)
    out = write_report([run], run / "report.html")
    before = out.read_bytes()
    files = sorted(p.name for p in run.iterdir())

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    # The temporary file is open and written when flushing it to disk fails.
    monkeypatch.setattr(report.os, "fsync", disk_full)
    with open(run / "metrics.jsonl", "a") as file:
        file.write(json.dumps({"rollout_id": 2, "rollout/reward/raw_mean": 0.5}) + "\n")
    with pytest.raises(ReportError, match=re.escape(f"{out}: cannot write the report (No space left on device)")):
        write_report([run], out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == files  # no temporary file left behind
    # Control: without the failure the new rollout reaches the report.
    monkeypatch.undo()
    write_report([run], out)
    assert out.read_bytes() != before and "<title>reward mean: 2, 0.5</title>" in out.read_text()


def test_svg_points_land_where_the_scale_puts_them():
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.2, 0.45) == [0.2, 0.25, 0.3, 0.35, 0.4, 0.45]
    assert nice_ticks(0.013, 0.087) == [0, 0.02, 0.04, 0.06, 0.08, 0.1]
    assert nice_ticks(0, 0) == [-1, -0.5, 0, 0.5, 1] and nice_ticks(2e-14, 3e-14) == [2e-14, 2.2e-14, 2.4e-14, 2.6e-14, 2.8e-14, 3e-14]
    svg = line_chart([Series("s", [0, 5, 10], [0.2, 0.3, 0.45])], x_label="rollout")
    left, right, top, bottom = MARGIN_LEFT, WIDTH - MARGIN_RIGHT, MARGIN_TOP, HEIGHT - MARGIN_BOTTOM
    points = [(float(x), float(y)) for x, y in re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', svg)]
    expected = [(left + x / 10 * (right - left), bottom - (y - 0.2) / 0.25 * (bottom - top)) for x, y in [(0, 0.2), (5, 0.3), (10, 0.45)]]
    assert [v for p in points for v in p] == pytest.approx([v for p in expected for v in p], abs=0.005)  # printed with 2 decimals
    assert expected[1] == pytest.approx((304.0, 149.6))
    # The domain is widened to the outer ticks: 0.013..0.087 is drawn on 0..0.1.
    svg = line_chart([Series("s", [0, 1], [0.013, 0.087])], x_label="rollout")
    (_, y0), (_, y1) = [(float(x), float(y)) for x, y in re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', svg)]
    assert (y0, y1) == pytest.approx((bottom - 0.13 * (bottom - top), bottom - 0.87 * (bottom - top)), abs=0.005)


def test_the_paired_gain_band_is_a_95_percent_interval_over_the_manifest_samples(tmp_path):
    manifest = [
        {"eval_set": "held", "tag": tag, "evaluation": e, "trained_rollouts": t, "rollout_id": 0 if e == 0 else 1, "prompt_index": p, "prompt": f"p{p}",
         "sample_index": s, "seed": s, "reward": 0.5, "reward_components": {}, "image": "x.png", "video": None}
        for e, (tag, t) in enumerate([("00000_before", 0), ("00002", 2)]) for p in range(2) for s in range(2)
    ]  # fmt: skip
    (run,) = load_runs([write_run(tmp_path / "run", RECORDS, manifest=manifest)])
    (curve,), source = paired_gain_curve(run, "held")
    assert source == "the sample manifest" and curve.xs == [2.0] and curve.ys == [0.1]
    half = Z95 * 0.2 / math.sqrt(4)
    assert curve.band == [(0.1 - half, 0.1 + half)]


def test_the_differences_of_two_runs_name_the_flags_that_differ(tmp_path):
    a = write_run(tmp_path / "a", RECORDS, args=("--lr", "0.003"))
    b = write_run(tmp_path / "b", RECORDS, args=("--lr", "0.001"))
    runs = load_runs([a, b])
    assert config_differences(runs) == [("--lr", ["0.003", "0.001"]), ("--output-dir", [str(a), str(b)])]
    assert config_differences(load_runs([a, a])) == []
    html = write_report([a, b], tmp_path / "both.html").read_text()
    assert '<section id="differences">' in html and "<code>--lr</code></td><td><code>0.003</code></td><td><code>0.001</code>" in html
    # Curves overlaid: each run's training reward under its own name in one chart.
    assert "a: reward mean: 1, 0.3</title>" in html and "b: reward mean: 1, 0.3</title>" in html
    # The configuration shows where a value came from; a flag left alone says default.
    assert '<tr class="set"><td><code>--lr</code></td><td><code>0.003</code></td><td>command line</td></tr>' in html
    assert "<tr><td><code>--adam-beta1</code></td><td><code>0.9</code></td><td>default</td></tr>" in html


def test_text_from_the_run_is_escaped(tmp_path):
    from PIL import Image

    evil = '<script>alert("x")</script>'
    run = tmp_path / "run"
    (run / "samples" / "eval").mkdir(parents=True)
    Image.new("RGB", (512, 300), (200, 20, 20)).save(run / "samples" / "eval" / "big.png")
    manifest = [{"eval_set": "held<b>", "tag": "00000_before", "evaluation": 0, "trained_rollouts": 0, "rollout_id": 0, "prompt_index": 0,
                 "prompt": evil, "sample_index": 0, "seed": 7, "reward": 0.25, "reward_components": {}, "image": "samples/eval/big.png", "video": None}]  # fmt: skip
    alarms = [{"rollout_id": 1, "trained_rollouts": 2, "eval_set": "held", "statistic": "diversity", "value": 0.27, "baseline": 0.32, "spread": 0.01,
               "drift": -3.4, "threshold": 2.0, "message": f"guard: alarm: {evil}"}]  # fmt: skip
    write_run(run, RECORDS, manifest=manifest, alarms=alarms)
    html = write_report([run], run / "report.html").read_text()
    assert "<script" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html and "held&lt;b&gt;" in html
    # The alarm banner is at the top, and the image is a thumbnail (<= 256 px) linking the full file.
    assert html.index('class="banner"') < html.index('id="rewards"')
    (uri,) = re.findall(r'<img src="data:image/png;base64,([^"]+)"', html)
    import base64
    import io

    assert Image.open(io.BytesIO(base64.b64decode(uri))).size == (256, 150)
    assert '<a href="samples/eval/big.png">' in html
    # Nothing in the page reaches beyond it.
    assert not re.search(r'(src|href)="(https?:)?//', html)


def test_the_report_command_stays_light():
    from miles_core.testing import assert_import_is_light

    assert_import_is_light("miles_core.report", "miles_core.cli.report")


def test_the_browser_checks_fail_saying_how_to_install_chromium(monkeypatch, tmp_path):
    import shutil

    from miles_core import testing

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match=re.escape("Debian's chromium is not on PATH")) as failure:
        testing.check_report_in_browser(tmp_path / "report.html", tmp_path / "shot.png")
    assert "apt-get install -y chromium" in str(failure.value) and "\n" not in str(failure.value)
    # The test command installs the browser and Playwright; the main job's install does not.
    root = Path(__file__).resolve().parents[1]
    test_sh, install_sh = (root / "scripts" / "test.sh").read_text(), (root / "scripts" / "install.sh").read_text()
    assert "ensure_apt_package chromium chromium" in test_sh and "-c constraints.txt playwright" in test_sh
    assert "playwright install" not in test_sh
    assert "chromium" not in install_sh and "playwright" not in install_sh


def manifest_line(evaluation: int, trained: int, prompt: int, sample: int, reward: float | None, **extra: object) -> dict:
    tag = f"{trained:05d}" + ("_before" if evaluation == 0 else "")
    return {"eval_set": "held", "tag": tag, "evaluation": evaluation, "trained_rollouts": trained, "rollout_id": max(trained - 1, 0),
            "prompt_index": prompt, "prompt": f"p{prompt}", "sample_index": sample, "seed": sample, "reward": reward,
            "reward_components": {"c": 2 * reward} if reward is not None else {}, "image": "x.png", "video": None, **extra}  # fmt: skip


# (evaluation, trained rollouts) -> rewards of (prompt, sample) (0, 0), (0, 1), (1, 0), (1, 1); None: failed.
# Evaluation 3 redoes the evaluation at 2 rollouts (a resumed run): it replaces evaluation 2.
EVALUATIONS = {
    (0, 0): [0.10, 0.20, 0.30, 0.40],
    (1, 1): [0.15, None, 0.50, 0.35],
    (2, 2): [9.0, 9.0, 9.0, 9.0],
    (3, 2): [0.30, 0.10, 0.70, 0.60],
}


def test_evaluation_curves_come_from_the_manifest_per_evaluation(tmp_path):
    import statistics

    from miles_core.report.charts import manifest_gain_curve, manifest_reward_curves

    manifest = [manifest_line(e, t, i // 2, i % 2, r) for (e, t), rewards in EVALUATIONS.items() for i, r in enumerate(rewards)]
    # The metrics lost the evaluation before training: the one after rollout 0 overwrote its keys.
    records = [dict(RECORDS[0], **{"eval/held/reward_mean": 0.35, "eval/held/paired_gain": 0.1, "eval/held/paired_gain_std": 0.1})]
    (run,) = load_runs([write_run(tmp_path / "run", records, manifest=manifest)])
    rewards = {t: r for (_, t), r in EVALUATIONS.items() if (_, t) != (2, 2)}
    mean, components = manifest_reward_curves(run, "held")
    valid = {t: [x for x in r if x is not None] for t, r in rewards.items()}
    assert mean.xs == components.xs == [0.0, 1.0, 2.0]
    # float sums in another order than statistics' exact ones: equal to rounding (1e-12)
    assert mean.ys == pytest.approx([statistics.fmean(valid[t]) for t in (0, 1, 2)], rel=1e-12)
    stds = [statistics.pstdev(valid[t]) for t in (0, 1, 2)]
    assert [hi - m for m, (_, hi) in zip(mean.ys, mean.band)] == pytest.approx(stds, rel=1e-12)
    assert components.label == "held c" and components.ys == pytest.approx([2 * m for m in mean.ys], rel=1e-12)
    (gain,) = manifest_gain_curve(run, "held")
    expected_gains, halves = [], []
    for t in (0, 1, 2):
        differences = [b - a for a, b in zip(rewards[0], rewards[t]) if a is not None and b is not None]
        expected_gains.append(statistics.fmean(differences))
        halves.append(Z95 * statistics.stdev(differences) / math.sqrt(len(differences)))
    assert gain.xs == [0.0, 1.0, 2.0] and gain.ys[0] == 0.0 and gain.band[0] == (0.0, 0.0)  # the first evaluation: drawn at 0
    assert gain.ys == pytest.approx(expected_gains, rel=1e-12, abs=1e-15)
    assert [hi - g for g, (_, hi) in zip(gain.ys, gain.band)] == pytest.approx(halves, rel=1e-12)
    # Control: the redo is what counts; with evaluation 2 the gain at 2 rollouts would be 8.75.
    assert gain.ys[2] == pytest.approx(0.175, rel=1e-12)
    # The page draws three evaluations, where the metrics alone hold one.
    html = write_report([run.path], run.path / "report.html").read_text()
    assert len(re.findall(r'<circle [^>]*data-series="held reward mean"', html)) == 3
    assert len(re.findall(r'<circle [^>]*data-series="held paired gain"', html)) == 3
    # Control: the same run without its manifest falls back to the metrics, which hold one evaluation.
    (run.path / "samples" / "eval" / "manifest.jsonl").unlink()
    html = write_report([run.path], run.path / "report.html").read_text()
    assert len(re.findall(r'<circle [^>]*data-series="held reward mean"', html)) == 1


def test_nice_ticks_end_for_any_finite_values():
    assert nice_ticks(-1e308, 1e308) == [-1e308, 1e308]  # the span overflows to inf: the endpoints
    assert nice_ticks(1.7e308, 1.7e308) == [1.7e308 * 0.9, 1.7e308]  # padding would overflow
    assert nice_ticks(5e-324, 1e-323) == [5e-324, 1e-323]  # no step below the smallest float
    assert nice_ticks(math.inf, 0.0) == [-1.0, 1.0] and nice_ticks(math.nan, math.nan) == [-1.0, 1.0]
    svg = line_chart([Series("s", [0, 1, 2, 3], [-1e308, math.nan, 1e308, math.inf])], x_label="rollout")
    assert "nan" not in svg and "inf" not in svg
    cys = [float(v) for v in re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)"', svg)]
    assert cys == [HEIGHT - MARGIN_BOTTOM, MARGIN_TOP]  # the two finite points, at the bottom and the top


def test_adjacent_tick_labels_differ():
    from miles_core.report.svg_chart import tick_labels

    assert tick_labels([0.99985, 0.9999, 0.99995, 1.0]) == ["0.99985", "0.99990", "0.99995", "1.00000"]
    assert tick_labels(nice_ticks(1e6, 1e6 + 2)) == ["1000000.0", "1000000.5", "1000001.0", "1000001.5", "1000002.0"]
    assert tick_labels([0, 0.25, 0.5]) == ["0", "0.25", "0.50"] and tick_labels([2e-14, 2.2e-14]) == ["2e-14", "2.2e-14"]
    svg = line_chart([Series("ratio", [0, 1], [0.99986, 0.99999])], x_label="rollout")
    labels = re.findall(r'text-anchor="end" class="tick">([^<]+)</text>', svg)
    assert labels == ["0.99985", "0.99990", "0.99995", "1.00000"]


def test_media_beyond_the_embedding_budget_are_linked_and_thumbnails_are_cached(tmp_path, monkeypatch):
    from PIL import Image

    from miles_core.report import samples

    run = tmp_path / "run"
    (run / "samples" / "eval").mkdir(parents=True)
    manifest = []
    for i in range(3):
        Image.new("RGB", (64, 64), (80 * i, 20, 20)).save(run / "samples" / "eval" / f"s{i}.png")
        manifest.append(manifest_line(0, 0, 0, i, 0.5, image=f"samples/eval/s{i}.png"))
    # Without the video extra a video is a GIF (and its poster): the GIF animates in an <img>, linked beside.
    frames = [Image.new("RGB", (16, 16), (c, c, c)) for c in (0, 255)]
    frames[0].save(run / "samples" / "eval" / "v.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    video = {"webm": None, "mp4": None, "gif": "samples/eval/v.gif", "frames": 2, "fps": 10.0}
    manifest.append(manifest_line(0, 0, 1, 0, 0.5, image="samples/eval/s0.png", video=video))
    write_run(run, RECORDS, manifest=manifest)
    html = write_report([run], run / "report.html").read_text()
    assert len(re.findall(r'<img src="data:image/png;base64,', html)) == 3 and "linked by relative path" not in html
    assert '<img class="gif" src="data:image/gif;base64,' in html and '<a href="samples/eval/v.gif" download>GIF</a>' in html
    thumbs = sorted((run / samples.THUMBS).iterdir())
    assert len(thumbs) == 3  # one per image file (the GIF's poster is s0.png's)
    # A budget with room for one thumbnail: the rest are linked, and the page says so.
    size = len(samples.Embedder(run).data_uri(thumbs[0].read_bytes(), "image/png"))
    monkeypatch.setattr(samples, "EMBED_BUDGET", size + 10)
    html = write_report([run], run / "report.html").read_text()
    assert len(re.findall(r'<img src="data:image/png;base64,', html)) == 1
    assert '<img src="samples/eval/s1.png"' in html and '<img src="samples/eval/s2.png"' in html
    assert '<img class="gif" src="samples/eval/v.gif"' in html
    assert "3 media files are linked by relative path, not embedded" in html
    # The cache is what the next report reads: a changed file gets a new thumbnail.
    Image.new("RGB", (64, 64), (0, 0, 255)).save(run / "samples" / "eval" / "s1.png")
    os.utime(run / "samples" / "eval" / "s1.png", ns=(1, 1))
    monkeypatch.undo()
    write_report([run], run / "report.html")
    assert len(list((run / samples.THUMBS).iterdir())) == 4


def test_the_report_file_has_the_umask_mode_and_its_directory_is_synced(tmp_path, monkeypatch):
    import stat

    import miles_core.report as report

    run = write_run(tmp_path / "run", RECORDS)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(report.os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd))[1])
    old = os.umask(0o027)
    try:
        out = write_report([run], run / "report.html")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert synced == [False, True]  # the file's data, then the directory holding its new name
    # Control: another umask, another mode.
    old = os.umask(0o002)
    try:
        assert stat.S_IMODE(write_report([run], run / "report.html").stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_the_importance_ratio_and_its_deviation_have_their_own_charts(tmp_path):
    records = [dict(r, **{"train/ratio_mean": 0.9999 + 1e-5 * i, "train/ratio_abs_dev": 1e-4 * i}) for i, r in enumerate(RECORDS)]
    html = write_report([write_run(tmp_path / "run", records)], tmp_path / "report.html").read_text()
    assert "<h4>Importance ratio</h4>" in html and "<h4>Importance ratio deviation</h4>" in html
