"""No flag is silently ignored.

The walker below reads the ``exercises`` markers of every suite in the repository and
fails for a flag of the training parser (core and installed plugins) that no test
exercises and that is neither hardware-only nor unavailable. The flags that are get
generic tests here: setting each one yields its note (hardware-only) or its error
(unavailable), and leaving it at its default yields neither.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core.config.flag import Flag
from miles_core.config.parser import flag_entries
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError
from miles_core.flag_audit import audit_flags, exercised_flags, test_files_under
from miles_core.plugin_manager import get_host

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
]


def all_flags() -> list[Flag]:
    return [entry.flag for entry in flag_entries(get_host().flags).values()]


def suites() -> list[Path]:
    return test_files_under([ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests"))])


def test_every_flag_is_exercised_by_a_test_or_documented():
    exercised, errors = exercised_flags(suites(), root=ROOT)
    assert errors == []
    problems = audit_flags(all_flags(), exercised)
    assert problems == [], "\n" + "\n".join(problems)


def test_audit_reports_an_unexercised_flag_and_a_misspelt_marker(tmp_path):
    # The control: the walker above can fail.
    exercised = {"--lr": ["tests/test_x.py::test_lr"]}
    lr = next(flag for flag in all_flags() if flag.name == "--lr")
    invented = Flag(name="--invented-knob", group="general", type="int", default=1, help="x")
    assert audit_flags([lr], exercised) == []
    problems = audit_flags([lr, invented], exercised)
    assert problems == ["--invented-knob: no test is marked @pytest.mark.exercises('--invented-knob'), and the flag is not unavailable"]
    suite = tmp_path / "test_typo.py"
    suite.write_text(
        "import pytest\nFLAGS = ['--lr']\n\n@pytest.mark.exercises('--lrr')\ndef test_a():\n    pass\n\n"
        "@pytest.mark.exercises(*FLAGS)\ndef test_b():\n    pass\n"
    )
    found, errors = exercised_flags([suite], root=tmp_path)
    assert found == {"--lrr": ["test_typo.py::test_a"]}
    assert errors == ["test_typo.py::test_b (line 8): exercises() takes literal '--flag' strings"]
    assert audit_flags([], found) == ["--lrr: marked as exercised by test_typo.py::test_a but no such flag exists"]
    # Unavailable flags need no marker; everything else does, hardware-only flags included.
    assert audit_flags([Flag(name="--gpu-knob", group="cluster", hardware="does things.")], {}) == [
        "--gpu-knob: no test is marked @pytest.mark.exercises('--gpu-knob'), and the flag is not unavailable"
    ]
    assert audit_flags([Flag(name="--gpu-knob", group="cluster", hardware="does things.")], {"--gpu-knob": ["t"]}) == []
    assert audit_flags([Flag(name="--later-knob", group="cluster", unavailable="not yet")], {}) == []


def _away_from_default(flag: Flag) -> list[str]:
    """Command-line arguments setting ``flag`` to something other than its default."""
    if flag.type == "bool":
        return [flag.name]
    if flag.type == "tristate":
        return [f"--no-{flag.name[2:]}" if flag.default else flag.name]
    if flag.path_kind:
        return [flag.name, "os.path.join"]  # any importable callable
    if flag.choices:
        return [flag.name, next(c for c in flag.choices if c != flag.default)]
    if flag.auto:
        return [flag.name, "1"]
    if flag.type == "int":
        return [flag.name, str((flag.default or 1) + 1)]
    if flag.type == "float":
        return [flag.name, str((flag.default or 0.0) + 1.5)]
    if flag.type == "json":
        return [flag.name, '{"MILES_AUDIT": "1"}']
    return [flag.name, "somewhere-else"]


# Flags that only resolve together with another one.
COMPANIONS = {
    "--colocate-reward": ["--colocate"],
    "--dp-replicate-size": ["--actor-num-gpus-per-node", "2"],
    "--sequence-parallel-size": ["--actor-num-gpus-per-node", "2"],
    "--ulysses-degree": ["--actor-num-gpus-per-node", "2", "--sequence-parallel-size", "2"],  # the Ulysses share of SP
    "--fsdp-cpu-offload": ["--actor-num-gpus-per-node", "2"],  # one process has no FSDP2 shards (an error)
}


@pytest.mark.parametrize("flag", [f for f in all_flags() if f.hardware], ids=lambda f: f.name)
def test_hardware_only_flag_logs_what_it_would_do(flag, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU-only case, also on a GPU machine
    config = resolve_config([*BASE, *COMPANIONS.get(flag.name, []), *_away_from_default(flag)])
    notes = [n for n in config.notes if n.startswith(flag.name)]
    assert len(notes) == 1
    # --colocate's turns (--offload-train, --offload-rollout) take effect everywhere; only its placement needs Ray.
    effect = "so it places nothing (the turns it turns on still take effect)" if flag.name == "--colocate" else "so it has no effect"
    assert flag.hardware in notes[0] and notes[0].endswith(effect)
    assert "without GPUs" in notes[0]
    # Left at its default: no note.
    assert not [n for n in resolve_config(BASE).notes if n.startswith(flag.name)]


@pytest.mark.parametrize("flag", [f for f in all_flags() if f.unavailable], ids=lambda f: f.name)
def test_unavailable_flag_stops_a_training_run_with_its_reason(flag):
    config = resolve_config([*BASE, *_away_from_default(flag)])
    errors = [e for e in training_errors(config) if e.startswith(flag.name)]
    assert len(errors) == 1 and errors[0].endswith(flag.unavailable)
    assert not [e for e in training_errors(resolve_config(BASE)) if e.startswith(flag.name)]


def test_unavailable_flag_at_its_default_given_explicitly_is_accepted():
    config = resolve_config([*BASE, "--fsdp-master-dtype", "fp32", "--rollout-health-check-interval", "30"])
    assert training_errors(config) == []


@pytest.mark.exercises("--actor-num-nodes", "--actor-num-gpus-per-node", "--use-ray", "--ray-address")
def test_several_training_ranks_need_ray():
    config = resolve_config([*BASE, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1"])
    assert config.world_size == 2 and config.data_parallel_size == 2
    assert training_errors(config) == [
        "--actor-num-nodes 2 x --actor-num-gpus-per-node 1 = world size 2: several training ranks run as Ray actors; "
        "add --use-ray (or --ray-address), or pass --actor-num-gpus-per-node 1 to train in one process"
    ]
    assert training_errors(resolve_config([*BASE, "--actor-num-gpus-per-node", "1"])) == []
    assert training_errors(resolve_config([*BASE, "--actor-num-nodes", "2", "--use-ray"])) == []
    # A cluster address means running on it.
    config = resolve_config([*BASE, "--actor-num-nodes", "2", "--ray-address", "auto"])
    assert config.use_ray is True and training_errors(config) == []


def test_sglang_pass_through_arguments_are_noted_without_an_sglang_engine():
    config = resolve_config([*BASE, "--sglang-attention-backend", "torch_sdpa"])
    assert config.sglang_args == ["--sglang-attention-backend", "torch_sdpa"]
    assert (
        "--sglang-attention-backend torch_sdpa: --sglang-* arguments are passed to sglang-diffusion servers only; "
        "--rollout-engine embedded starts none, so they have no effect"
    ) in config.notes


def test_train_refuses_an_unavailable_flag_with_one_line(tmp_path, capsys):
    from miles_core.cli.main import main

    code = main(["train", *BASE, "--use-miles-dashboard", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert "miles-core train: error: --use-miles-dashboard: the miles dashboard is a separate product" in err
    assert not (tmp_path / "run").exists()


def test_flag_records_reject_both_statuses():
    with pytest.raises(ValueError, match="exclusive"):
        Flag(name="--x-y", group="general", hardware="a.", unavailable="b")


def test_a_bad_configuration_still_reports_before_availability():
    with pytest.raises(ConfigError):
        resolve_config([*BASE, "--colocate-reward"])  # requires --colocate


@pytest.mark.exercises("--lora-rank", "--lora-alpha", "--lora-target-modules", "--lora-init-weights")
def test_lora_settings_without_lora_are_an_error():
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--lora-rank", "8", "--lora-target-modules", "to_q"])
    assert caught.value.messages == [
        "--lora-rank requires --use-lora (without it the whole model is fine-tuned and LoRA settings do nothing)",
        "--lora-target-modules requires --use-lora (without it the whole model is fine-tuned and LoRA settings do nothing)",
    ]
    # The family's default targets are not the user's: no error without --use-lora.
    assert resolve_config(BASE).lora_target_modules


@pytest.mark.exercises("--rm-type", "--custom-rm-path")
def test_rm_type_and_custom_rm_path_are_exclusive():
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--rm-type", "brightness", "--custom-rm-path", "asyncio.sleep"])
    assert caught.value.messages == [
        "--rm-type brightness and --custom-rm-path asyncio.sleep are mutually exclusive (the custom reward replaces the registered one)"
    ]


@pytest.mark.exercises("--diffusion-clip-range", "--diffusion-nft-beta", "--ref-mode", "--lora-ipc-weight-sync")
def test_flags_the_chosen_loss_or_engine_does_not_read_are_noted():
    nft = resolve_config([*BASE, "--loss-type", "nft", "--diffusion-clip-range", "0.2"])
    assert "--diffusion-clip-range 0.2 has no effect with --loss-type nft (read by policy_loss only)" in nft.notes
    grpo = resolve_config([*BASE, "--diffusion-nft-beta", "0.5", "--use-lora", "--ref-mode", "lora_base", "--lora-ipc-weight-sync"])
    assert grpo.notes == [
        "--diffusion-nft-beta 0.5 has no effect with --loss-type policy_loss (read by nft only)",
        "--ref-mode lora_base has no effect: with --diffusion-kl-beta 0 no KL term compares against the reference",
        "--lora-ipc-weight-sync has no effect with --rollout-engine embedded: the engine shares the trained module, so no weights are sent",
    ]
    # Controls: read by the loss / used by a KL term / a remote engine -> no note.
    assert resolve_config([*BASE, "--diffusion-clip-range", "0.2"]).notes == []
    assert resolve_config([*BASE, "--use-lora", "--ref-mode", "lora_base", "--diffusion-kl-beta", "0.01"]).notes == []
    custom = resolve_config(
        [*BASE, "--loss-type", "custom_loss", "--custom-loss-function-path", "os.path.join", "--diffusion-nft-beta", "0.5"]
    )
    assert custom.notes == []


@pytest.mark.exercises("--ref-mode", "--loss-type")
def test_nft_without_its_reference_stops_a_training_run():
    config = resolve_config([*BASE, "--loss-type", "nft", "--use-ema", "--ref-mode", "none"])
    assert "--ref-mode none: --loss-type nft needs its reference policy (the EMA); use --ref-mode ema or leave it unset" in training_errors(
        config
    )


@pytest.mark.exercises("--diffusion-train-iter-order", "--eval-prompt-data", "--skip-eval-before-train", "--diffusion-forward-dtype")
def test_settings_without_their_feature_are_noted(tmp_path):
    order = ["--diffusion-train-iter-order", "timestep_major"]
    flat = resolve_config([*BASE, *order])
    assert flat.notes == [
        "--diffusion-train-iter-order timestep_major has no effect without the 2-D tile "
        "(--micro-batch-size-sample and --micro-batch-size-tstep)"
    ]
    tile = ["--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "1"]
    assert resolve_config([*BASE, *order, *tile]).notes == []  # control: the tile reads it
    assert resolve_config([*BASE, *order, *tile, "--loss-type", "nft"]).notes == [
        "--diffusion-train-iter-order timestep_major has no effect with --loss-type nft: its micro-batches are flat"
    ]
    data = tmp_path / "eval.jsonl"
    data.write_text('{"input": "a"}\n')
    no_eval = resolve_config([*BASE, "--eval-prompt-data", "held", str(data), "--skip-eval-before-train"])
    assert no_eval.notes == [
        "--eval-prompt-data, --skip-eval-before-train: no evaluation runs without --eval-interval, so they have no effect"
    ]
    assert resolve_config([*BASE, "--eval-prompt-data", "held", str(data), "--eval-interval", "1"]).notes == []
    # A bf16 forward keeps --fsdp-master-dtype master weights at every world size: nothing to note.
    assert resolve_config([*BASE, "--diffusion-forward-dtype", "bf16"]).notes == []
    assert resolve_config([*BASE, "--diffusion-forward-dtype", "bf16", "--use-ray", "--actor-num-gpus-per-node", "2"]).notes == []


@pytest.mark.exercises(
    "--debug-rollout-only", "--diffusion-debug-mode", "--dump-details", "--save-debug-train-data", "--wandb-project", "--save-interval"
)
def test_debug_and_logging_settings_without_their_feature(tmp_path):
    sft = [*BASE, "--loss-type", "sft_loss"]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*sft, "--debug-rollout-only"])
    assert "--debug-rollout-only: --loss-type sft_loss has no rollouts, only training on --prompt-data rows" in caught.value.messages
    assert resolve_config([*sft, "--dump-details", str(tmp_path)]).notes == [
        "--dump-details: --loss-type sft_loss has no rollouts to dump, so it has no effect"
    ]
    assert resolve_config([*BASE, "--loss-type", "nft", "--diffusion-debug-mode"]).notes == [
        "--diffusion-debug-mode has no effect with --loss-type nft: the drift metrics compare the policy loss's "
        "recomputed log-probs with the engine's"
    ]
    assert resolve_config([*BASE, "--diffusion-debug-mode"]).notes == []  # control: policy_loss reads it
    assert resolve_config([*BASE, "--debug-rollout-only", "--save-debug-train-data", "t/{}.msgpack"]).notes == [
        "--save-debug-train-data has no effect with --debug-rollout-only: nothing is trained"
    ]
    assert resolve_config([*BASE, "--wandb-project", "p", "--wandb-mode", "offline"]).notes == [
        "--wandb-project, --wandb-mode: wandb logging is off without --use-wandb, so they have no effect"
    ]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, "--save", str(tmp_path), "--save-interval", "0"])
    assert caught.value.messages == ["--save-interval 0: must be at least 1"]


@pytest.mark.exercises("--diffusion-guidance-scale")
def test_a_family_without_cfg_training_refuses_guided_rollouts():
    ltx = [
        "--hf-checkpoint",
        "Lightricks/LTX-2",
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--diffusion-num-sde-steps",
        "2",
    ]
    assert training_errors(resolve_config([*ltx, "--diffusion-guidance-scale", "3"])) == [
        "--diffusion-guidance-scale 3.0: the ltx family does not train with classifier-free guidance (as in the "
        "reference), so rollouts must sample without it; use --diffusion-guidance-scale 1 (its recipe does)"
    ]
    assert training_errors(resolve_config([*ltx, "--diffusion-guidance-scale", "1"])) == []
    assert training_errors(resolve_config(BASE)) == []  # sd3 trains with CFG
