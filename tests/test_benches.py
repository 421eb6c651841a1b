"""Every benchmark under ``bench/`` runs one tiny round, so none can rot unnoticed (the
numbers in docs/benchmarks.md come from the full runs; nothing here checks speed). The
GPU lane's sections run in its CPU dry run (tests/test_gpu_lane.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE_ARGS: dict[str, list[str]] = {
    "train_step.py": ["--repeats", "1", "--sizes", "tiny"],
    "reward_streaming.py": ["--repeats", "1", "--prompts", "1", "--n", "2", "--microgroup", "2", "--steps", "4", "--cost-ms", "1"],
    "rollout.py": ["--steps", "2", "--repeats", "1", "--no-http"],
    "fleet.py": ["--repeats", "1", "--requests", "2", "--outputs", "1", "--steps", "2", "--sync-scale", "tiny"],
    "memory.py": ["--smoke"],
    "anchor.py": ["--smoke"],
    "prompt_embeddings.py": ["--smoke"],
    "plan_accuracy.py": ["--smoke"],
    "decode_chunks.py": ["--smoke"],
}
"""One tiny round of each benchmark: the smallest arguments that still run every phase it measures."""

LANE_SECTIONS = {
    "gpu_train.py": "train",
    "gpu_ipc_sync.py": "ipc_sync",
    "gpu_group_sync.py": "group_sync",
    "compile.py": "compile",
    "gpu_plan.py": "plan",
}
"""The GPU lane's sections under ``bench/``: their dry run is the lane's (tests/test_gpu_lane.py),
also the smoke round of ``compile.py`` (a CPU benchmark too): a second round would compile again."""


def test_every_benchmark_has_a_smoke_run():
    assert sorted(path.name for path in (ROOT / "bench").glob("*.py")) == sorted([*SMOKE_ARGS, *LANE_SECTIONS])


@pytest.mark.parametrize("script", sorted(SMOKE_ARGS))
def test_benchmark_runs_one_tiny_round(script, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *SMOKE_ARGS[script]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Each benchmark ends with ratios measured side by side in the same run.
    assert "x" in result.stdout and any("ratio" in line or " / " in line for line in result.stdout.splitlines())
