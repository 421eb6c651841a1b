"""A resumed run's directory (``--load`` into its own ``--output-dir``): the records of
rollouts it redoes move to ``*.superseded.jsonl`` (metrics, the evaluation manifest, the
guard's alarms), and a partial last line (a run killed mid-write) neither stops the resume
nor joins the next line appended."""

import json

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.errors import RunError
from miles_core.training.run_directory import output_directory

BASE = ["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2"]


def lines(rollouts, **extra):
    return [json.dumps({"rollout_id": r, **extra}) for r in rollouts]


def written(path, rows, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row + "\n" for row in rows) + tail)


def test_a_resume_supersedes_the_records_it_redoes(tmp_path):
    run = tmp_path / "run"
    written(run / "metrics.jsonl", lines([0, 1, 2, 3]))
    written(run / "samples" / "eval" / "manifest.jsonl", lines([0, 0, 1, 3, 3], eval_set="held"))
    written(run / "guard.jsonl", lines([1, 3], statistic="diversity"))
    config = resolve_config(BASE + ["--output-dir", str(run)])
    notes = []
    assert output_directory(config, 2, notes.append) == run
    for name, kept, moved in [
        ("metrics", [0, 1], [2, 3]),
        ("samples/eval/manifest", [0, 0, 1], [3, 3]),
        ("guard", [1], [3]),
    ]:
        assert [json.loads(line)["rollout_id"] for line in (run / f"{name}.jsonl").read_text().splitlines()] == kept
        superseded = (run / f"{name}.superseded.jsonl").read_text().splitlines()
        assert [json.loads(line)["rollout_id"] for line in superseded] == moved
    assert notes == []
    # A second resume from an earlier checkpoint appends to the superseded files.
    output_directory(config, 1, notes.append)
    assert [json.loads(line)["rollout_id"] for line in (run / "guard.superseded.jsonl").read_text().splitlines()] == [3, 1]
    # A fresh run never reuses the directory.
    with pytest.raises(RunError, match="already holds a run"):
        output_directory(config, None)


def test_a_partial_last_line_is_dropped_with_a_warning_and_the_next_line_starts_fresh(tmp_path):
    run = tmp_path / "run"
    written(run / "metrics.jsonl", lines([0, 1]), tail='{"rollout_id": 2, "rollout/rew')
    written(run / "guard.jsonl", lines([1]), tail='{"rollout_id": 2')
    (run / "train.log").write_text("2026-12-02 04:00:00.000 INFO    rollout 2/4  rew")
    notes = []
    output_directory(resolve_config(BASE + ["--output-dir", str(run)]), 2, notes.append)
    assert (run / "metrics.jsonl").read_text() == "".join(line + "\n" for line in lines([0, 1]))
    assert (run / "guard.jsonl").read_text() == lines([1])[0] + "\n"
    assert not (run / "metrics.superseded.jsonl").exists()  # nothing complete was redone
    assert notes == [
        f"warning: {run / 'metrics.jsonl'}: dropped a partial last line (30 characters; the run was stopped mid-write)",
        f"warning: {run / 'guard.jsonl'}: dropped a partial last line (16 characters; the run was stopped mid-write)",
    ]
    assert (run / "train.log").read_text().endswith("rew\n")  # the run log keeps its line, ended
    with (run / "metrics.jsonl").open("a") as handle:  # what the resumed run appends is a line of its own
        handle.write(lines([2])[0] + "\n")
    assert [json.loads(line)["rollout_id"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
