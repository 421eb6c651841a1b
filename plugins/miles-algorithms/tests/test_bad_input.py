"""The issue's bad input, each one line and exit status 2 from ``train`` before anything
loads: online DPO with groups of 1 or without a reference policy, and a KL term (velocity
space included) without a reference. (MixGRPO's window larger than the SDE steps:
test_mixgrpo.py.)"""

from __future__ import annotations

import pytest

from miles_core.cli.main import main

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--loss-type", "flow_dpo", "--use-lora", "--n-samples-per-prompt", "1"],
            "--n-samples-per-prompt 1: --loss-type flow_dpo needs groups of at least 2 samples (a preference pair is a "
            "group's best and worst sample)",
        ),
        (
            ["--loss-type", "flow_dpo", "--n-samples-per-prompt", "4"],
            "--loss-type flow_dpo compares the policy with a reference policy, and there is none: --use-lora (reference = "
            "LoRA disabled) or --use-ema --ref-mode ema",
        ),
        (
            [
                "--loss-type",
                "grpo_guard",
                "--n-samples-per-prompt",
                "4",
                "--diffusion-num-sde-steps",
                "2",
                "--diffusion-kl-beta",
                "0.1",
                "--kl-space",
                "velocity",
            ],
            "--diffusion-kl-beta 0.1 --kl-space velocity needs a reference policy: --use-lora (reference = LoRA disabled) "
            "or --use-ema --ref-mode ema",
        ),
    ],
)
def test_one_line_and_exit_2(extra, message, capsys, tmp_path):
    assert main(["train", *BASE, *extra, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"miles-core train: error: {message}\n"
    assert not (tmp_path / "run").exists()  # refused before anything was written
    # Control: the same run with what it lacked passes these checks (it would go on to load).
    from miles_core.api import resolve_config
    from miles_core.config.resolve import training_errors

    fixed = [*BASE, *extra, "--use-lora", "--n-samples-per-prompt", "4"]
    assert training_errors(resolve_config(fixed)) == []


def test_what_runs_on_one_data_parallel_rank_only():
    """Online DPO, and a window that may reach the last step, with two data-parallel ranks:
    the ranks' shares would hold different numbers of pairs (control: one rank is fine)."""
    from miles_core.api import resolve_config
    from miles_core.config.resolve import training_errors

    two = ["--actor-num-gpus-per-node", "2", "--use-ray", "--use-lora", "--n-samples-per-prompt", "4"]
    (message,) = training_errors(resolve_config([*BASE, *two, "--loss-type", "flow_dpo"]))
    assert message.startswith("--loss-type flow_dpo: preference pairs (one per group whose rewards differ) train on one data-parallel rank")
    window = ["--diffusion-num-steps", "10", "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,10"]
    (message,) = training_errors(resolve_config([*BASE, *two, *window]))
    assert message.startswith("--diffusion-sde-window-range 0,10: a window drawn onto the last step trains one step fewer")
    one = ["--use-lora", "--n-samples-per-prompt", "4"]
    assert training_errors(resolve_config([*BASE, *one, "--loss-type", "flow_dpo"])) == []
    assert training_errors(resolve_config([*BASE, *one, *window])) == []
    assert training_errors(resolve_config([*BASE, *two, *window[:4], "--diffusion-sde-window-range", "0,9"])) == []


def test_dpo_has_no_kl_term():
    from miles_core.api import resolve_config
    from miles_core.config.resolve import training_errors

    args = [*BASE, "--use-lora", "--n-samples-per-prompt", "4", "--loss-type", "flow_dpo", "--diffusion-kl-beta", "0.1"]
    assert training_errors(resolve_config(args)) == [
        "--diffusion-kl-beta 0.1: --loss-type flow_dpo has no KL term (its log-ratios already compare the policy with the "
        "reference policy); leave it at 0"
    ]
