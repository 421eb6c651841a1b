"""Runs on Ray (``--use-ray``), for real: a local Ray instance, training ranks as actors
forming a gloo group with FSDP2 shards, the reward on its worker.

- one rank under Ray gives exactly the one-process run (rewards scored on the worker, the
  embedded engine on its own actor, synced from the rank), and the driver holds no model
  weight while it runs;
- two FSDP2 ranks give the one-rank run's losses and final weights to float tolerance
  (a changed seed, the control, does not);
- a checkpoint saved at two ranks resumes at one and continues as an uninterrupted run;
- without Ray installed, or with a placement the cluster cannot hold, one-line errors;
- without ``--use-ray`` nothing imports Ray.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from safetensors.torch import load_file

from miles_core.config.determinism import deterministic_env
from miles_core.config.resolve import resolve_config
from miles_core.errors import RunError
from miles_core.launch import run_sync, start_session, train
from miles_core.training.checkpoint import load_checkpoint
from tests.tiny_runs import run_metrics, tiny_run_args


def _args(tiny_sd3: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        *tiny_run_args(tiny_sd3, prompts, out, batch=2, n=2, steps=3, sde_steps=2),
        "--num-rollout",
        "2",
        "--lr",
        "3e-2",
        "--use-lora",
        "--lora-rank",
        "2",
        "--global-batch-size",
        "2",
        *extra,
    ]


STABLE = ("--adam-eps", "1e-4")
"""Adam turns a gradient at rounding-noise level into a full step (m / sqrt(v) = ±1); a
larger epsilon keeps such noise from deciding the comparison of two world sizes."""


def _outcome(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def _lora(out: Path) -> dict[str, torch.Tensor]:
    (path,) = (out / "lora").rglob("*.safetensors")
    return load_file(str(path))


def _close(a: dict, b: dict, *, atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def _losses(records: list[dict]) -> list[float]:
    return [loss for r in records for loss in r.get("train/loss_per_step", [])]


def _grad_norms(records: list[dict]) -> list[float]:
    return [norm for r in records for norm in r.get("train/grad_norm_per_step", [])]


def _weights_alive() -> dict[int, weakref.ref]:
    """The model weights alive in this process: parameters, and any tensor that requires
    a gradient (the trainable ones)."""
    gc.collect()
    return {
        id(o): weakref.ref(o)
        for o in gc.get_objects()
        if issubclass(type(o), torch.Tensor) and (isinstance(o, torch.nn.Parameter) or o.requires_grad)
    }


def _run_measuring_the_driver(args: list[str]) -> tuple[list[dict], list[int]]:
    """Train with ``args`` in this process (the driver); the metrics records, and at each
    line the run logs (one per rollout, among others) the bytes of the model weights
    alive here that were not before the run."""
    before = _weights_alive()
    held: list[int] = []

    def measure(line: str) -> None:
        held.append(
            sum(
                t.numel() * t.element_size()
                for key, ref in _weights_alive().items()
                if (t := ref()) is not None and not (key in before and before[key]() is t)
            )
        )

    out = asyncio.run(train(resolve_config(args), log=measure))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], held


@pytest.mark.exercises("--use-ray")
def test_one_rank_under_ray_is_the_one_process_run(tiny_sd3, prompts, tmp_path, ray_cluster):
    plain, plain_held = _run_measuring_the_driver(_args(tiny_sd3, prompts, tmp_path / "plain"))
    on_ray, ray_held = _run_measuring_the_driver(_args(tiny_sd3, prompts, tmp_path / "ray", "--use-ray"))
    assert "rollout/reward/raw_mean" in on_ray[0] and "train/loss" in on_ray[0]
    # The embedded engine on its actor samples what the one in the process samples (its
    # LoRA synced from the rank, LoRA-only), and the rank trains what one process trains.
    assert _outcome(on_ray) == _outcome(plain)
    assert _close(_lora(tmp_path / "ray"), _lora(tmp_path / "plain"), atol=0)
    # The weights reached the engine from the rank, before each rollout, checksums checked.
    assert all(r["perf/weight_sync_bytes"] > 0 for r in on_ray)
    # The driver held no model weight at any point of the run; the one-process run (the
    # control) holds its pipeline and the trained LoRA.
    assert len(ray_held) >= 2 and max(ray_held) == 0
    assert min(plain_held[1:]) > 0
    # The Ray session let go of its actors and placement group; the instance stays (it was not ours).
    assert (
        ray.is_initialized()
        and ray.util.placement_group_table()
        and all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
    )


@pytest.mark.exercises("--actor-num-gpus-per-node", "--train-dp-split-mode")
def test_two_fsdp_ranks_match_one_rank(tiny_sd3, prompts, tmp_path, ray_cluster):
    # One rollout: both runs train on the same samples (sampled on the driver from the same
    # weights), so only the ranks' order of summation differs. A later rollout is sampled
    # from weights that differ in rounding, which the JPEG reward (byte counts of uint8
    # pixels) can turn into other rewards: measured, gradient norms 5e-3 apart.
    args = (*STABLE, "--num-rollout", "1")
    one = run_metrics(_args(tiny_sd3, prompts, tmp_path / "one", *args))
    two = run_metrics(_args(tiny_sd3, prompts, tmp_path / "two", *args, "--use-ray", "--actor-num-gpus-per-node", "2"))
    assert [r["rollout/reward/raw_mean"] for r in two] == [r["rollout/reward/raw_mean"] for r in one]
    assert len(_losses(two)) == len(_losses(one)) == 2
    # Measured on AVX-512 under MKL's default, COMPATIBLE and AVX2 paths and ATen's avx2 and
    # default kernels: losses within 5e-8, gradient norms within 2.3e-6 (relative), LoRA
    # weights within 6e-7.
    assert torch.allclose(torch.tensor(_losses(two)), torch.tensor(_losses(one)), atol=1e-6, rtol=1e-4)
    assert _grad_norms(two) == pytest.approx(_grad_norms(one), rel=1e-4)
    assert _close(_lora(tmp_path / "two"), _lora(tmp_path / "one"), atol=1e-5)
    # Control: another seed trains other weights, well beyond that tolerance.
    other = tmp_path / "other"
    run_metrics(_args(tiny_sd3, prompts, other, *args, "--seed", "7", "--rollout-seed", "7"))
    assert not _close(_lora(other), _lora(tmp_path / "one"), atol=1e-5)


@pytest.mark.exercises("--save", "--load")
def test_a_checkpoint_saved_at_two_ranks_resumes_at_one(tiny_sd3, prompts, tmp_path, ray_cluster):
    # The uninterrupted run: two ranks, two rollouts, a checkpoint after each.
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    whole = run_metrics(
        _args(
            tiny_sd3, prompts, run_dir, *STABLE, "--use-ray", "--actor-num-gpus-per-node", "2", "--save", str(ckpt), "--save-interval", "1"
        )
    )
    assert [r["rollout_id"] for r in whole] == [0, 1]
    trained = _lora(run_dir)
    # Full state, and each of the two ranks' RNG.
    extra = load_checkpoint(ckpt, 0).extra
    assert len(extra["rank_rng"]) == 2 and extra["optimizer_steps"] == 2
    # One process resumes after rollout 0 in the same folder and redoes rollout 1 from the
    # checkpoint's weights, the ones the two ranks sampled it from: the same samples and
    # rewards, bit for bit; only rollout 1's training sums in another order (a reference
    # trained at one rank throughout would sample rollout 1 from weights that differ in
    # rounding, and the JPEG reward can turn that into other rewards).
    rest = run_metrics(_args(tiny_sd3, prompts, run_dir, *STABLE, "--load", str(ckpt), "--ckpt-step", "0"))
    assert [r["rollout_id"] for r in rest] == [0, 1] and rest[0] == whole[0]  # the folder keeps rollout 0's record
    superseded = [json.loads(line) for line in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == whole[1:]
    assert rest[1]["rollout/reward/raw_mean"] == whole[1]["rollout/reward/raw_mean"]
    # Tolerances as in test_two_fsdp_ranks_match_one_rank (measured under the same kernel
    # variants: losses within 1.5e-8, LoRA weights within 1.2e-7).
    assert _losses(rest[1:]) == pytest.approx(_losses(whole[1:]), rel=1e-4, abs=1e-6)
    assert _close(_lora(run_dir), trained, atol=1e-5)
    # Control: rollout 1's training moves the weights far beyond that tolerance.
    before, after = (load_checkpoint(ckpt, step).model_state["transformer"] for step in (0, 1))
    assert not _close(after, before, atol=1e-3)


def test_without_ray_installed_the_run_says_how_to_get_it(tiny_sd3, prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RunError) as info:
        run_sync(resolve_config(_args(tiny_sd3, prompts, tmp_path / "out", "--use-ray")))
    assert str(info.value) == "--use-ray needs Ray, which is not installed here: pip install 'miles-core[ray]' (ray==2.60.0)"
    assert not (tmp_path / "out").exists()


def test_a_placement_the_cluster_cannot_hold_is_one_line(tiny_sd3, prompts, tmp_path, ray_cluster, monkeypatch):
    import miles_core.cluster.runtime as runtime

    monkeypatch.setattr(runtime, "READY_TIMEOUT", 2.0)
    with pytest.raises(RunError) as info:
        run_sync(
            resolve_config(
                _args(
                    tiny_sd3,
                    prompts,
                    tmp_path / "out",
                    "--use-ray",
                    "--actor-num-gpus-per-node",
                    "8",
                    "--rollout-batch-size",
                    "8",
                    "--global-batch-size",
                    "16",
                )
            )
        )
    message = str(info.value)
    assert message.startswith(
        "the cluster cannot place 10 bundles (placement group of 10 bundles (CPUs stand in for GPUs): "
        "8 training rank(s), 1 engine(s) x 1 CPU, a reward worker) within 2 s; available: {"
    )
    assert "\n" not in message
    assert ray.util.placement_group_table() and all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_without_use_ray_nothing_imports_ray(tiny_sd3, prompts, tmp_path):
    args = [*tiny_run_args(tiny_sd3, prompts, tmp_path / "out", batch=1, n=2, steps=2, sde_steps=1), "--num-rollout", "1"]
    code = (
        "import sys, json\n"
        "from miles_core.config.resolve import resolve_config\n"
        "from miles_core.launch import run_sync\n"
        f"run_sync(resolve_config({json.dumps(args)}))\n"
        "import miles_core.cli.main, miles_core.cluster.placement\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.exercises("--rollout-num-engines")
def test_engine_servers_run_on_ray_actors(tiny_sd3, prompts, tmp_path, ray_cluster, monkeypatch):
    # One torch thread in every server: Ray gives an actor of one CPU one thread (its servers
    # inherit it), the plain fleet's servers inherit this environment. Other thread counts
    # may split a kernel's sums otherwise, and the comparison below is exact.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    fleet = ("--rollout-engine", "http", "--rollout-num-engines", "2")
    plain = run_metrics(_args(tiny_sd3, prompts, tmp_path / "plain", *fleet))
    on_ray = run_metrics(_args(tiny_sd3, prompts, tmp_path / "ray", "--use-ray", *fleet))
    # Outputs depend only on seeds and weights: the engines on their actors (weights synced
    # from the mirror, checksums checked) give the run of a fleet without Ray.
    assert _outcome(on_ray) == _outcome(plain)
    assert on_ray[0]["perf/weight_sync_bytes"] > 0
    logs = sorted(p.name for p in (tmp_path / "ray" / "engines").iterdir())
    assert logs == ["engine_0.log", "engine_1.log"]
    assert all("serving " in (tmp_path / "ray" / "engines" / name).read_text() for name in logs)


@pytest.mark.exercises("--deterministic-mode")
def test_deterministic_mode_reaches_every_actor_of_a_ray_run(tiny_sd3, prompts, tmp_path, ray_cluster):
    """The actors a --use-ray run starts (its training rank, the embedded engine's host) and
    its reward worker's server, started as the run starts them: with --deterministic-mode each has
    cuBLAS's workspace setting in its environment and torch's deterministic algorithms on;
    without it (the control) neither. A --train-env-vars value for the variable wins."""

    def probe(actor: object) -> tuple[str | None, bool]:
        return os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.are_deterministic_algorithms_enabled()

    def config(*extra: str) -> Any:
        return resolve_config(_args(tiny_sd3, prompts, tmp_path / "out", "--use-ray", *extra))

    session = start_session(config("--deterministic-mode"), log=lambda line: None)
    try:
        # Started together (each waits on its actor's start-up); the embedded engine's host
        # has built its engine when its fleet is back.
        with ThreadPoolExecutor(3) as pool:
            fleet = pool.submit(session.engine_fleet, tmp_path / "engines")
            trainer = pool.submit(session.start_trainer)
            scorer = pool.submit(session.reward_scorer)
        try:
            actors = [*trainer.result().ranks, *fleet.result().hosts]
            assert ray.get([actor.__ray_call__.remote(probe) for actor in actors]) == [(":4096:8", True)] * 2
            # The reward worker's server process, which its host actor started.
            server = ray.get(scorer.result().worker.describe.remote(["CUBLAS_WORKSPACE_CONFIG"]))
            assert server["env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} and scorer.result().deterministic_algorithms == [True]
        finally:
            if not fleet.exception():
                fleet.result().stop()
    finally:
        session.close()
    # The control: the training rank of a run without the flag (the one environment all
    # actors start from, the same runtime options) has neither.
    session = start_session(config(), log=lambda line: None)
    try:
        (rank,) = session.start_trainer().ranks
        assert ray.get(rank.__ray_call__.remote(probe)) == (None, False)
        scorer = session.reward_scorer()
        assert ray.get(scorer.worker.describe.remote(["CUBLAS_WORKSPACE_CONFIG"]))["env"] == {}
        assert scorer.deterministic_algorithms == [False]
    finally:
        session.close()
    # The user's value (the other documented setting) is what every actor would get.
    user = config("--deterministic-mode", "--train-env-vars", '{"CUBLAS_WORKSPACE_CONFIG": ":16:8"}')
    assert deterministic_env(user) == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


@pytest.mark.exercises("--deterministic-mode")
def test_a_ray_engine_host_restarts_its_server(tiny_sd3, prompts, tmp_path, ray_cluster):
    """... in its bundle, with the run's --deterministic-mode passed to serve-engine: the
    server runs torch's deterministic algorithms and says so in /health (a serve-engine
    without the flag says false: tests/test_engine_placement.py's stand-in servers)."""
    import signal
    import urllib.request

    from miles_core.cluster.engine_hosts import RayEngineFleet
    from miles_core.cluster.runtime import RayRuntime

    args = ("--use-ray", "--rollout-engine", "http", "--rollout-num-engines", "1", "--deterministic-mode")
    config = resolve_config(_args(tiny_sd3, prompts, tmp_path / "out", *args))
    runtime = RayRuntime.start(config, engines=1)
    fleet = RayEngineFleet.start(config, runtime, tmp_path / "engines")
    try:
        (pid,) = fleet.pids()
        (before,) = fleet.placements()
        assert before.bundles == (1,) and before.pid == pid and before.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        os.kill(pid, signal.SIGKILL)
        new_url = fleet.restart(0)
        (new_pid,) = fleet.pids()
        assert new_pid != pid and fleet.urls == [new_url]
        (after,) = fleet.placements()
        assert (after.bundles, after.node_id, after.env) == (before.bundles, before.node_id, before.env)
        with urllib.request.urlopen(new_url + "/health", timeout=10) as response:
            assert response.status == 200 and json.loads(response.read()) == {"status": "ok", "deterministic": True}
    finally:
        fleet.stop()
        runtime.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(new_pid, 0)


@pytest.mark.exercises("--loss-type")
def test_nft_on_two_ranks_matches_one_rank(tiny_sd3, prompts, tmp_path, ray_cluster):
    """DiffusionNFT: the ranks keep EMA shards (the "old" policy); the driver's mirror gets
    the full EMA after each rollout. Every item sees the noise it sees in one process."""
    nft = ("--loss-type", "nft", "--diffusion-num-sde-steps", "0", "--micro-batch-size", "2", *STABLE)
    one = run_metrics(_args(tiny_sd3, prompts, tmp_path / "one", *nft))
    two = run_metrics(_args(tiny_sd3, prompts, tmp_path / "two", *nft, "--use-ray", "--actor-num-gpus-per-node", "2"))
    assert len(_losses(two)) == 4 and all("train/nft_loss" in r for r in two)
    assert torch.allclose(torch.tensor(_losses(two)), torch.tensor(_losses(one)), atol=1e-6, rtol=1e-4)
    # Measured: at most 1.5e-5 on weights of magnitude 1.5 (fp32 rounding of sums taken
    # in another order, through four Adam steps at lr 3e-2).
    assert _close(_lora(tmp_path / "two"), _lora(tmp_path / "one"), atol=1e-4)
    # Control: another seed draws other noise and trains other weights, beyond that tolerance.
    run_metrics(_args(tiny_sd3, prompts, tmp_path / "other", *nft, "--seed", "7"))
    assert not _close(_lora(tmp_path / "other"), _lora(tmp_path / "one"), atol=1e-4)


def test_sft_on_two_ranks_trains(tiny_sd3, tmp_path, ray_cluster):
    """SFT on two ranks: each trains its rows (ranks above 0 draw their own noise, so the
    loss equals one rank's in expectation only); both ranks' metrics are global."""
    import numpy as np
    from PIL import Image

    rows = []
    for i, prompt in enumerate(("a red cube", "a blue ball", "a green tree", "a white cat")):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"input": prompt, "image": f"{i}.png"}) + "\n")
    (tmp_path / "sft.jsonl").write_text("".join(rows))
    args = [
        "--hf-checkpoint",
        str(tiny_sd3),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(tmp_path / "sft.jsonl"),
        "--loss-type",
        "sft_loss",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "1",
        "--micro-batch-size",
        "1",
        "--diffusion-height",
        "32",
        "--diffusion-width",
        "32",
        "--use-lora",
        "--lora-rank",
        "2",
        "--num-rollout",
        "2",
        "--lr",
        "1e-2",
        "--output-dir",
        str(tmp_path / "run"),
        "--use-ray",
        "--actor-num-gpus-per-node",
        "2",
    ]
    records = run_metrics(args)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["train/loss"] > 0 and r["train/grad_norm"] > 0 for r in records)
    assert any(float(t.abs().max()) > 0 for k, t in _lora(tmp_path / "run").items() if "lora_B" in k)
