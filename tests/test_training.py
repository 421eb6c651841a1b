"""The training loop on the tiny SD3 pipeline: the alignment probe, clipping,
determinism, what training changes."""

import asyncio
import json
import math

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.training.run import train
from tests.tiny_runs import frozen_trainer_and_rollout, run_metrics, tiny_run_args


def run(tiny_sd3, prompts, out, *extra):
    return run_metrics([*tiny_run_args(tiny_sd3, prompts, out), *extra])


def without_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


@pytest.mark.exercises("--diffusion-debug-mode")
def test_alignment_probe_is_exactly_zero(tiny_sd3, prompts, tmp_path):
    (record,) = run(
        tiny_sd3,
        prompts,
        tmp_path / "probe",
        "--num-rollout",
        "1",
        "--debug-skip-optimizer-step",
        "--diffusion-debug-mode",
        "--micro-batch-size-sample",
        "2",
        "--micro-batch-size-tstep",
        "1",
        "--diffusion-guidance-scale",
        "4.5",
    )
    assert record["train/num_pairs"] == 16
    assert record["train/log_prob_mean_abs_diff"] == 0.0
    assert record["train/log_prob_max_abs_diff"] == 0.0
    assert record["train/model_output_mean_abs_diff"] == 0.0
    assert record["train/model_output_max_abs_diff"] == 0.0
    assert record["train/ratio_mean"] == 1.0 and record["train/clipfrac"] == 0.0
    assert all(record[f"train/log_prob_abs_diff_step_{k}"] == 0.0 for k in range(2) if f"train/log_prob_abs_diff_step_{k}" in record)


@pytest.mark.exercises("--diffusion-debug-mode")
def test_alignment_probe_sees_a_perturbed_trainer_weight(tiny_sd3, prompts):
    """Control: the probe is not zero whatever the weights are."""
    flags = ("--diffusion-debug-mode", "--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "1")
    with frozen_trainer_and_rollout(tiny_sd3, *flags) as (engine, trainer, group):
        advantages = torch.tensor([1.0, -1.0])
        assert trainer.train_rollout(group, advantages)["train/log_prob_max_abs_diff"] == 0.0
        weight = engine.family.components()["transformer"].transformer_blocks[0].attn.to_q.weight
        with torch.no_grad():
            weight[0, 0] += 1e-2
        metrics = trainer.train_rollout(group, advantages)
    assert metrics["train/log_prob_max_abs_diff"] > 0
    assert metrics["train/model_output_max_abs_diff"] > 0


def test_clipping_acts_from_the_second_optimizer_step(tiny_sd3, prompts, tmp_path):
    # Micro-batches of 2 samples x 1 step are the engine's microgroups of 2: the trainer's
    # forward then has the engine's shapes and rows (bit copies of its inputs, the same
    # modules), so the first step's log-probs are the engine's and its ratio exactly 1. A
    # flat micro-batch of 1 would be 1 ulp off on some CPUs (measured: ratio 1 + 7.5e-9).
    records = run(
        tiny_sd3,
        prompts,
        tmp_path / "clip",
        "--num-rollout",
        "2",
        "--num-steps-per-rollout",
        "2",
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "3e-3",
        "--diffusion-clip-range",
        "1e-4",
        "--micro-batch-size-sample",
        "2",
        "--micro-batch-size-tstep",
        "1",
    )
    for record in records:
        first, second = record["train/clipfrac_per_step"]
        assert first == 0.0 and record["train/ratio_mean_per_step"][0] == 1.0
        assert second > 0.0


@pytest.mark.exercises("--rollout-seed")
def test_two_runs_with_the_same_seeds_give_identical_metrics(tiny_sd3, prompts, tmp_path):
    args = ("--num-rollout", "2", "--use-lora", "--lora-rank", "4", "--lr", "1e-3", "--deterministic-mode")
    first = run(tiny_sd3, prompts, tmp_path / "a", *args)
    second = run(tiny_sd3, prompts, tmp_path / "b", *args)
    assert without_times(first) == without_times(second)
    # Control: another rollout seed gives other metrics.
    third = run(tiny_sd3, prompts, tmp_path / "c", *args, "--rollout-seed", "7")
    assert without_times(first) != without_times(third)


@pytest.mark.exercises("--output-dir")
def test_a_run_refuses_an_existing_run_directory(tiny_sd3, prompts, tmp_path):
    run(tiny_sd3, prompts, tmp_path / "once", "--num-rollout", "1")
    before = (tmp_path / "once" / "metrics.jsonl").read_text()
    from miles_core.errors import RunError

    with pytest.raises(RunError, match="already holds a run"):
        run(tiny_sd3, prompts, tmp_path / "once", "--num-rollout", "1")
    assert (tmp_path / "once" / "metrics.jsonl").read_text() == before


def test_train_command_errors_are_one_line(tiny_sd3, prompts, tmp_path):
    import subprocess
    import sys

    base = [
        sys.executable,
        "-m",
        "miles_core.cli.main",
        "train",
        "--hf-checkpoint",
        str(tiny_sd3),
        "--diffusion-model-family",
        "sd3",
        "--rollout-batch-size",
        "2",
        "--rm-type",
        "jpeg_compressibility",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    result = subprocess.run(base, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "miles-core train: error: --loss-type policy_loss trains on SDE steps but --diffusion-num-sde-steps is 0"
    )
    result = subprocess.run(base + ["--diffusion-num-sde-steps", "2", "--num-rollout", "1"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (
        2,
        "miles-core train: error: --prompt-data is required: a JSONL file with one prompt per line\n",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.exercises("--use-lora")
def test_saved_lora_loads_into_plain_diffusers_and_changes_the_output(tiny_sd3, prompts, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    run(
        tiny_sd3,
        prompts,
        tmp_path / "lora-run",
        "--num-rollout",
        "2",
        "--num-steps-per-rollout",
        "2",
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
    )
    assert (tmp_path / "lora-run" / "lora" / "pytorch_lora_weights.safetensors").is_file()

    def image(with_lora):
        pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
        pipe.set_progress_bar_config(disable=True)
        if with_lora:
            pipe.load_lora_weights(str(tmp_path / "lora-run" / "lora"))
        return pipe(
            "a red cube", num_inference_steps=4, height=32, width=32, output_type="pt", generator=torch.Generator().manual_seed(0)
        ).images

    base, tuned = image(False), image(True)
    assert (base - tuned).abs().max() > 1e-4
    assert torch.equal(base, image(False))  # control: the same call without the LoRA is the base
    # At the trained strength: the adapter's rank and alpha (default 64) travel with it, so
    # diffusers scales by alpha / rank = 16, not by 1 (what a LoRA without metadata gets).
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
    pipe.load_lora_weights(str(tmp_path / "lora-run" / "lora"))
    (config,) = pipe.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (4, 64)


def _write_sft_data(root):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    rows = []
    for i, (name, colour) in enumerate(
        [
            ("a red square", (220, 30, 30)),
            ("a blue square", (30, 30, 220)),
            ("a green square", (30, 200, 30)),
            ("a white square", (240, 240, 240)),
        ]
    ):
        Image.new("RGB", (40, 40), colour).save(root / "images" / f"{i}.png")
        rows.append(json.dumps({"input": name, "image": f"images/{i}.png"}))
    (root / "sft.jsonl").write_text("\n".join(rows) + "\n")
    return root / "sft.jsonl"


def test_sft_run_fits_its_data_and_changes_the_transformer(tiny_sd3, tmp_path):
    data = _write_sft_data(tmp_path / "data")
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(data),
            "--loss-type",
            "sft_loss",
            "--rollout-batch-size",
            "4",
            "--num-steps-per-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--diffusion-num-steps",
            "10",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            "--lr",
            "3e-3",
            "--num-rollout",
            "30",
            "--output-dir",
            str(tmp_path / "sft"),
        ]
    )
    path = asyncio.run(train(config, log=lambda line: None))
    losses = [json.loads(line)["train/loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and all(map(math.isfinite, losses))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"SFT loss: first 10 mean {first:.4f}, last 10 mean {last:.4f}")
    # Measured: 1.20 -> 1.05 (-12%; the flow-matching loss keeps the noise's variance).
    # The run is seeded, so only numerics can move it; -5% leaves that room.
    assert last < 0.95 * first
    assert (path / "model" / "transformer" / "config.json").is_file()


def test_sft_rows_need_images(tiny_sd3, tmp_path):
    from miles_core.errors import PromptDataError
    from miles_core.training.sft import load_sft_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a cat", "image": "missing.png"}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:1: image 'missing.png' not found"):
        load_sft_rows(bad, input_key="input", image_key="image")
    bad.write_text('{"input": "a cat"}\n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:1: SFT rows need a string 'input' and a string 'image'"):
        load_sft_rows(bad, input_key="input", image_key="image")


@pytest.mark.exercises("--eval-interval", "--eval-prompt-data")
def test_evaluation_is_a_paired_comparison(tiny_sd3, prompts, tmp_path):
    eval_args = (
        "--num-rollout",
        "2",
        "--eval-interval",
        "1",
        "--eval-prompt-data",
        "shapes",
        str(prompts),
        "--n-samples-per-eval-prompt",
        "2",
        "--rm-type",
        "brightness",
    )
    frozen = run(tiny_sd3, prompts, tmp_path / "frozen", *eval_args, "--debug-skip-optimizer-step")
    assert {"eval/shapes/reward_mean", "eval/shapes/reward_std"} <= frozen[0].keys()
    # Frozen weights: every evaluation sees exactly the first one's samples.
    assert [r["eval/shapes/paired_gain"] for r in frozen] == [0.0, 0.0]
    assert frozen[0]["eval/shapes/paired_gain_std"] == 0.0
    # Control: training moves the evaluation.
    trained = run(tiny_sd3, prompts, tmp_path / "trained", *eval_args, "--use-lora", "--lr", "3e-2", "--num-steps-per-rollout", "2")
    assert trained[-1]["eval/shapes/paired_gain_std"] > 0
    grids = sorted(p.name for p in (tmp_path / "trained" / "samples").glob("*.png"))  # the grids (samples/eval/: the archive)
    assert grids == ["eval_shapes_00000_before.png", "eval_shapes_00001.png", "eval_shapes_00002.png", "eval_shapes_before_after.png"]


@pytest.mark.exercises("--save", "--save-interval", "--load", "--ckpt-step", "--no-load-optim")
def test_resume_after_sigkill_gives_the_uninterrupted_metrics(tiny_sd3, prompts, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["--num-rollout", "10", "--use-lora", "--lora-rank", "4", "--lr", "1e-2", "--num-steps-per-rollout", "2", "--deterministic-mode"]
    full = run(tiny_sd3, prompts, tmp_path / "full", *args)

    ckpt = tmp_path / "ckpt"
    command = [
        sys.executable,
        "-m",
        "miles_core.cli.main",
        "train",
        "--hf-checkpoint",
        str(tiny_sd3),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-microgroup-size",
        "2",
        "--diffusion-num-steps",
        "4",
        "--diffusion-num-sde-steps",
        "2",
        "--diffusion-height",
        "32",
        "--diffusion-width",
        "32",
        "--rm-type",
        "jpeg_incompressibility",
        "--output-dir",
        str(tmp_path / "killed"),
        "--save",
        str(ckpt),
        "--save-interval",
        "1",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and int(latest.read_text().strip() or -1) >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    saved = int(latest.read_text())
    assert 1 <= saved < 9, "the run was not killed mid-way"

    resumed = run(tiny_sd3, prompts, tmp_path / "killed", *args, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1")
    assert [r["rollout_id"] for r in resumed] == list(range(10))
    assert without_times(resumed)[saved + 1 :] == without_times(full)[saved + 1 :]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "9"
    # Control: resuming without the optimizer state does not reproduce the run.
    control = run(tiny_sd3, prompts, tmp_path / "control", *args, "--load", str(ckpt), "--ckpt-step", str(saved), "--no-load-optim")
    assert [r["rollout_id"] for r in control] == list(range(saved + 1, 10))
    assert without_times(control)[1:] != without_times(full)[saved + 2 :]


@pytest.mark.exercises("--loss-type")
def test_nft_run_trains_on_final_latents_with_an_ema_old_policy(tiny_sd3, prompts, tmp_path):
    records = run(
        tiny_sd3,
        prompts,
        tmp_path / "nft",
        "--loss-type",
        "nft",
        "--diffusion-num-sde-steps",
        "0",
        "--num-rollout",
        "2",
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--diffusion-guidance-scale",
        "1.0",
        "--micro-batch-size",
        "4",
    )
    for record in records:
        assert {"train/nft_loss", "train/positive_loss", "train/negative_loss"} <= record.keys()
        assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0
    # 8 samples x int(4 steps x 0.99) = 3 trained timesteps each, in 4-pair micro-batches.
    assert (tmp_path / "nft" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_nft_trainer_old_policy_is_the_ema(tiny_sd3):
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--loss-type",
            "nft",
            "--use-lora",
            "--lora-rank",
            "4",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
        ]
    )
    engine = create_engine(config)
    host = get_host()
    trainer = Trainer(engine.family, config, host.registries.sde_backend.get("ode").load(), host.registries.loss.get("nft").load())
    assert trainer.reference_mode() == "ema" and trainer.ema is not None
    live = trainer.named_trainable()
    name = next(n for n in live if "lora_B" in n)
    with torch.no_grad():
        live[name].add_(0.5)
    trainer.optimizer_steps = 10
    trainer._after_optimizer_step()
    decay = trainer.ema.decay_at(10)
    # ema <- d * ema + (1 - d) * theta, from a shadow equal to the old value (0 for lora_B).
    assert torch.allclose(trainer.ema.shadow[name], torch.full_like(live[name], (1 - decay) * 0.5), atol=1e-6)


@pytest.mark.exercises("--diffusion-kl-beta")
def test_kl_to_the_lora_base_starts_at_zero_and_grows(tiny_sd3, prompts, tmp_path):
    (record,) = run(
        tiny_sd3,
        prompts,
        tmp_path / "kl",
        "--num-rollout",
        "1",
        "--num-steps-per-rollout",
        "2",
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "3e-2",
        "--diffusion-kl-beta",
        "0.04",
    )
    first, second = record["train/kl_loss_per_step"]
    assert first == 0.0  # LoRA starts as the identity (B = 0): the policy is its reference
    assert second > 0.0


def test_recomputed_old_log_probs_make_the_first_ratio_exactly_one(tiny_sd3, prompts, tmp_path):
    # A flat micro-batch of 1 differs in geometry from the engine's microgroups of 2, so
    # only the recomputation guarantees ratio 1 at the first step on every CPU.
    (record,) = run(
        tiny_sd3,
        prompts,
        tmp_path / "recompute",
        "--num-rollout",
        "1",
        "--num-steps-per-rollout",
        "2",
        "--use-lora",
        "--lr",
        "1e-2",
        "--diffusion-recompute-old-log-prob",
    )
    assert record["train/log_prob_max_abs_diff_per_step"][0] == 0.0
    assert record["train/ratio_mean_per_step"][0] == 1.0
    assert record["train/log_prob_max_abs_diff_per_step"][1] > 0.0  # control: the update moved the policy


@pytest.mark.exercises("--save", "--load", "--ckpt-step")
def test_resumed_nft_run_restores_its_ema(tiny_sd3, prompts, tmp_path):
    args = (
        "--loss-type",
        "nft",
        "--diffusion-num-sde-steps",
        "0",
        "--num-rollout",
        "2",
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--diffusion-guidance-scale",
        "1.0",
        "--ema-decay-init",
        "0.5",
    )
    full = run(tiny_sd3, prompts, tmp_path / "full", *args, "--save", str(tmp_path / "ckpt"), "--save-interval", "1")
    resumed = run(tiny_sd3, prompts, tmp_path / "resumed", *args, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "0")
    assert [r["rollout_id"] for r in resumed] == [1]
    # v_old comes from the EMA: only a restored EMA reproduces rollout 1.
    assert without_times(resumed) == without_times(full)[1:]


def test_config_output_never_shows_the_wandb_key():
    result = run_cli_config("--hf-checkpoint", "sd3", "--rollout-batch-size", "1", "--wandb-key", "s3cr3t")
    assert result.returncode == 0 and "s3cr3t" not in result.stdout and "wandb_key: <redacted>" in result.stdout


def run_cli_config(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "miles_core.cli.main", "config", *args], capture_output=True, text=True)
