"""The training loop on the tiny SD3 pipeline: the alignment probe, clipping,
determinism, what training changes."""

import asyncio
import json

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.training.run import train

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}', '{"input": "a green tree"}']


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from miles_sd3.family import SD3Family

    return SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "tiny")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def run(tiny_sd3, prompts, out, *extra):
    config = resolve_config([
        "--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--prompt-data", str(prompts),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2",
        "--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "2", "--diffusion-height", "32",
        "--diffusion-width", "32", "--rm-type", "jpeg_incompressibility", "--output-dir", str(out), *extra,
    ])
    path = asyncio.run(train(config, log=lambda line: None))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def without_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def test_alignment_probe_is_exactly_zero(tiny_sd3, prompts, tmp_path):
    (record,) = run(
        tiny_sd3, prompts, tmp_path / "probe", "--num-rollout", "1", "--debug-skip-optimizer-step",
        "--diffusion-debug-mode", "--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "1",
        "--diffusion-guidance-scale", "4.5",
    )
    assert record["train/num_pairs"] == 16
    assert record["train/log_prob_mean_abs_diff"] == 0.0
    assert record["train/log_prob_max_abs_diff"] == 0.0
    assert record["train/model_output_mean_abs_diff"] == 0.0
    assert record["train/model_output_max_abs_diff"] == 0.0
    assert record["train/ratio_mean"] == 1.0 and record["train/clipfrac"] == 0.0
    assert all(record[f"train/log_prob_abs_diff_step_{k}"] == 0.0 for k in range(2) if f"train/log_prob_abs_diff_step_{k}" in record)


def test_alignment_probe_sees_a_perturbed_trainer_weight(tiny_sd3, prompts):
    """Control: the probe is not zero whatever the weights are."""
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    config = resolve_config([
        "--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1",
        "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2", "--diffusion-num-steps", "4",
        "--diffusion-num-sde-steps", "2", "--diffusion-height", "32", "--diffusion-width", "32",
        "--debug-skip-optimizer-step", "--diffusion-debug-mode", "--micro-batch-size-sample", "2",
        "--micro-batch-size-tstep", "1",
    ])
    engine = create_engine(config)
    host = get_host()
    trainer = Trainer(engine.family, config, host.registries.sde_backend.get("sde").load(),
                      host.registries.loss.get("policy_loss").load())
    (group,) = asyncio.run(generate_rollout(engine, RolloutSettings.from_config(config), 0,
                                            [PromptRecord("a red cube")], strategy_from_config(config)))
    advantages = torch.tensor([1.0, -1.0])
    assert trainer.train_rollout(group, advantages)["train/log_prob_max_abs_diff"] == 0.0
    weight = engine.family.components()["transformer"].transformer_blocks[0].attn.to_q.weight
    with torch.no_grad():
        weight[0, 0] += 1e-2
    metrics = trainer.train_rollout(group, advantages)
    assert metrics["train/log_prob_max_abs_diff"] > 0
    assert metrics["train/model_output_max_abs_diff"] > 0


def test_clipping_acts_from_the_second_optimizer_step(tiny_sd3, prompts, tmp_path):
    records = run(
        tiny_sd3, prompts, tmp_path / "clip", "--num-rollout", "2", "--num-steps-per-rollout", "2",
        "--use-lora", "--lora-rank", "4", "--lr", "3e-3", "--diffusion-clip-range", "1e-4",
    )
    for record in records:
        first, second = record["train/clipfrac_per_step"]
        assert first == 0.0 and record["train/ratio_mean_per_step"][0] == 1.0
        assert second > 0.0


def test_two_runs_with_the_same_seeds_give_identical_metrics(tiny_sd3, prompts, tmp_path):
    args = ("--num-rollout", "2", "--use-lora", "--lora-rank", "4", "--lr", "1e-3", "--deterministic-mode")
    first = run(tiny_sd3, prompts, tmp_path / "a", *args)
    second = run(tiny_sd3, prompts, tmp_path / "b", *args)
    assert without_times(first) == without_times(second)
    # Control: another rollout seed gives other metrics.
    third = run(tiny_sd3, prompts, tmp_path / "c", *args, "--rollout-seed", "7")
    assert without_times(first) != without_times(third)


def test_a_run_refuses_an_existing_run_directory(tiny_sd3, prompts, tmp_path):
    run(tiny_sd3, prompts, tmp_path / "once", "--num-rollout", "1")
    before = (tmp_path / "once" / "metrics.jsonl").read_text()
    from miles_core.training.run import RunError

    with pytest.raises(RunError, match="already holds a run"):
        run(tiny_sd3, prompts, tmp_path / "once", "--num-rollout", "1")
    assert (tmp_path / "once" / "metrics.jsonl").read_text() == before


def test_train_command_errors_are_one_line(tiny_sd3, prompts, tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "-m", "miles_core.cli.main", "train", "--hf-checkpoint", str(tiny_sd3),
            "--diffusion-model-family", "sd3", "--rollout-batch-size", "2", "--rm-type", "jpeg_compressibility",
            "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(base, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "miles-core train: error: --loss-type policy_loss trains on SDE steps but --diffusion-num-sde-steps is 0"
    )
    result = subprocess.run(base + ["--diffusion-num-sde-steps", "2", "--num-rollout", "1"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (2, "miles-core train: error: --prompt-data is required: a JSONL file with one prompt per line\n")
    assert not (tmp_path / "run").exists()
