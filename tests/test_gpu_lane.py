"""The GPU lane (scripts/gpu_lane.sh): its CPU dry run runs every section at the tiny size,
and its argument errors. (This module sorts after tests/test_compile.py, whose inductor
cache serves the compile section's dry run: a cold compile would cost about half a minute.)"""

from __future__ import annotations

import json
import os
import subprocess

from tests.test_benches import LANE_SECTIONS, ROOT


def _lane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_lane.sh"), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_gpu_lane_dry_run_runs_every_section(tmp_path):
    """The lane's CPU dry run: every section at the tiny size, through the same cases as on
    a GPU. A case whose feature this tree lacks may say so; none may break."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # The compile section keeps torch's inductor cache where this process has it (TMPDIR
    # would move it), so the compile tests' graphs serve its dry run.
    env = {"OUT": str(tmp_path), "TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": cache_dir()}
    result = _lane("--dry-run", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("*.json")) == sorted(f"{section}.json" for section in LANE_SECTIONS.values())
    train = json.loads((tmp_path / "train.json").read_text(encoding="utf-8"))
    assert train["dry_run"] is True and train["device"] == "CPU"
    cases = {case["case"]: case for case in train["cases"]}
    assert set(cases) == {
        "baseline",
        "--offload-train",
        "--offload-rollout",
        "--fsdp-cpu-offload",
        "probe, micro-batches = microgroups",
        "probe, flat micro-batches",
        "ring attention, SP 2",
    }
    for case in cases.values():
        assert case["status"] == "ok" or case["status"].startswith(("not available: ", "skipped: ")), case
    assert cases["baseline"]["status"] == "ok"
    assert cases["ring attention, SP 2"]["status"] == "skipped: no GPU (CPU dry run)"
    # The probe whose micro-batches reproduce the engine's microgroups reruns the engine's
    # forward (fp32, one thread): exactly no drift, ratio exactly 1.
    aligned = cases["probe, micro-batches = microgroups"]
    assert aligned["status"] == "ok"
    assert aligned["drift"] == {
        "log_prob_max_abs_diff": 0.0,
        "log_prob_mean_abs_diff": 0.0,
        "model_output_max_abs_diff": 0.0,
        "model_output_mean_abs_diff": 0.0,
        "first_ratio": 1.0,
    }
    # The per-phase audit the memory columns come from: the baseline trainer's optimizer
    # state is resident while the engine generates; --offload-train (when this tree runs
    # it) leaves none of its gradients or optimizer state there.
    held = cases["baseline"]["resident_bytes"]["rollout"]
    assert held["optimizer_state"] > 0 and held["parameters"] > 0
    if cases["--offload-train"]["status"] == "ok":
        offloaded = cases["--offload-train"]["resident_bytes"]["rollout"]
        assert offloaded["gradients"] == 0 and offloaded["optimizer_state"] == 0
        assert offloaded["parameters"] == held["parameters"]  # the embedded engine samples them
    table = (tmp_path / "train.md").read_text(encoding="utf-8")
    assert "| case | status | rollout s |" in table and "| alignment probe (fp32) |" in table

    # Weight sync to a serve-engine process: CPU shared memory standing in for CUDA-IPC
    # handles, and a gloo weight-update group (the nccl case needs two GPUs). The engine's
    # checksum equals the trainer's after every sync; one trainer weight changed afterwards
    # (the control) makes the comparison fail.
    ipc = json.loads((tmp_path / "ipc_sync.json").read_text(encoding="utf-8"))
    assert ipc["dry_run"] is True and ipc["device"] == "CPU"
    assert ipc["result"]["checksums"] == "equal after every sync" and ipc["result"]["control"] == "mismatch detected"
    assert ipc["result"]["bytes"] > 0
    group = json.loads((tmp_path / "group_sync.json").read_text(encoding="utf-8"))
    assert group["dry_run"] is True and group["device"] == "CPU" and group["gpus"] == 0
    nccl, gloo = group["result"]["cases"]
    assert nccl == {"case": "nccl, engine on its own GPU", "status": "skipped: no GPU (CPU dry run)"}
    assert gloo["case"] == "gloo, buckets staged in host memory" and gloo["status"] == "ok" and gloo["backend"] == "gloo"
    assert gloo["checksums"] == "equal after every sync" and gloo["control"] == "mismatch detected"
    assert gloo["bytes"] == group["result"]["bytes"] > 0 and gloo["transfer_s"] > 0 and gloo["checksum_s"] > 0
    for section in ("ipc_sync", "group_sync"):
        assert "| path | seconds | MB/s | ratio to in-process copy |" in (tmp_path / f"{section}.md").read_text(encoding="utf-8")

    # --compile vs eager on the compile tests' tiny shape and grad mode (no optimizer step):
    # both modes ran, something compiled, the ratios measured side by side; engine and
    # trainer ran the same no-grad graphs on the same shapes, so no drift in either mode.
    compiled = json.loads((tmp_path / "compile.json").read_text(encoding="utf-8"))
    assert compiled["dry_run"] is True and compiled["device"] == "CPU"
    assert compiled["compiled"]["graphs"] > 0
    assert set(compiled["compiled_over_eager"]) == {"rollout", "train", "step"}
    assert compiled["eager"]["first_rollout_drift"] == 0.0 and compiled["compiled"]["first_rollout_drift"] == 0.0
    assert "| phase | eager s | compiled s | compiled / eager |" in (tmp_path / "compile.md").read_text(encoding="utf-8")


def test_gpu_lane_names_its_sections_when_one_is_unknown():
    result = _lane("--only", "bogus")
    assert result.returncode == 2
    assert result.stderr == "gpu_lane.sh: unknown section 'bogus'; the sections are: train ipc_sync group_sync compile plan\n"


def test_gpu_lane_needs_the_wheels_folder(tmp_path):
    result = _lane("--only", "train", env={"GPU_WHEELS": str(tmp_path / "none"), "OUT": str(tmp_path)})
    assert result.returncode == 1
    assert "has no wheels; run scripts/gpu_wheels.sh" in result.stderr
