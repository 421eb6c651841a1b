import subprocess
import sys
import textwrap

import pytest
import yaml

from miles_core.config.model import Source
from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import PluginHost

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium"]


def resolve(*argv, host=None):
    return resolve_config(list(argv), host=host)


def errors_of(*argv, host=None):
    with pytest.raises(ConfigError) as caught:
        resolve(*argv, host=host)
    return caught.value.messages


def test_issue_example_resolves_global_batch_size():
    c = resolve(*SD35, "--rollout-batch-size", "48", "--n-samples-per-prompt", "16", "--num-steps-per-rollout", "2")
    assert c.global_batch_size == 384
    assert c.source("global_batch_size") is Source.DERIVED
    assert c.source("num_steps_per_rollout") is Source.COMMAND_LINE
    assert c.model_family == "sd3"
    assert c.source("rollout_batch_size") is Source.COMMAND_LINE
    assert c.source("lr") is Source.DEFAULT and c.lr == 1e-6
    # Grouped and typed: the group dataclass holds the same value.
    assert c.data.global_batch_size == 384
    assert type(c.algorithm).__name__ == "AlgorithmConfig"


def test_global_batch_size_given_derives_steps():
    c = resolve(*SD35, "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--global-batch-size", "8")
    assert (c.num_steps_per_rollout, c.source("num_steps_per_rollout")) == (4, Source.DERIVED)


def test_neither_given_means_one_step():
    c = resolve(*SD35, "--rollout-batch-size", "3", "--n-samples-per-prompt", "4")
    assert (c.global_batch_size, c.num_steps_per_rollout) == (12, 1)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--global-batch-size", "10", "--num-steps-per-rollout", "2"],
            "contradict rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout (4 x 4 = 16): 10 x 2 = 20",
        ),
        (["--global-batch-size", "5"], "--global-batch-size 5 must divide 4 x 4 = 16"),
        (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout 3 must divide 4 x 4 = 16"),
    ],
)
@pytest.mark.exercises("--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--num-steps-per-rollout")
def test_batch_knob_violations_show_the_numbers(extra, expected):
    (message,) = errors_of(*SD35, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", *extra)
    assert expected in message


@pytest.mark.exercises("--actor-num-gpus-per-node")
def test_global_batch_must_divide_by_data_parallel_size():
    messages = errors_of(*SD35, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--actor-num-gpus-per-node", "3")
    assert messages == ["--global-batch-size 4 must be divisible by the data-parallel size 3"]


def test_rollout_batch_size_is_required():
    assert errors_of(*SD35) == ["--rollout-batch-size is required: prompts per rollout"]


@pytest.mark.exercises("--hf-checkpoint", "--diffusion-model-family")
def test_family_from_name_patterns_and_override():
    base = ["--rollout-batch-size", "1"]
    assert (
        resolve("--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", *base, "--diffusion-guidance-scale-2", "3").model_family == "wan2_2"
    )
    assert resolve("--hf-checkpoint", "Lightricks/LTX-2", *base).model_family == "ltx"
    assert resolve("--hf-checkpoint", "Qwen/Qwen-Image", *base).model_family == "qwen_image"
    assert resolve("--hf-checkpoint", "nvidia/Cosmos3-2B", *base).model_family == "cosmos3"
    assert resolve("--hf-checkpoint", "black-forest-labs/FLUX.1-dev", *base).model_family == "flux"
    c = resolve("--hf-checkpoint", "/models/my-finetune", "--diffusion-model-family", "sd3", *base)
    assert c.model_family == "sd3" and c.components["model_family"].provider.startswith("miles-sd3 ")


@pytest.mark.exercises("--hf-checkpoint", "--diffusion-model-family")
def test_unknown_or_unmatched_family_lists_installed():
    (message,) = errors_of("--hf-checkpoint", "acme/mystery", "--rollout-batch-size", "1")
    assert (
        "as a hub id no installed model family matches its name (installed: cosmos3, flux, ltx, qwen_image, sd3, wan2_2, wan2_2_i2v, wan2_2_ti2v)"
        in message
    )
    assert "pass --diffusion-model-family" in message
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--diffusion-model-family", "hunyuan")
    assert message.startswith(
        "--diffusion-model-family hunyuan: unknown model family; installed: cosmos3, flux, ltx, qwen_image, sd3, wan2_2, wan2_2_i2v, wan2_2_ti2v"
    )


def test_family_and_pipeline_config_are_exclusive():
    messages = errors_of(
        *SD35, "--rollout-batch-size", "1", "--diffusion-model-family", "sd3", "--train-pipeline-config-path", "miles_sd3.family.SD3Family"
    )
    assert "--train-pipeline-config-path and --diffusion-model-family are mutually exclusive" in messages


@pytest.mark.exercises("--rollout-microgroup-size", "--diffusion-sde-type")
def test_family_defaults_fill_unset_flags():
    c = resolve(*SD35, "--rollout-batch-size", "2", "--n-samples-per-prompt", "16")
    assert (c.rollout_microgroup_size, c.source("rollout_microgroup_size")) == (8, Source.FAMILY)
    assert c.diffusion_sde_type == "sde"
    assert c.lora_target_modules[0] == "attn.to_q"
    # Capped at the group size.
    assert resolve(*SD35, "--rollout-batch-size", "2", "--n-samples-per-prompt", "4").rollout_microgroup_size == 4
    ltx = resolve("--hf-checkpoint", "Lightricks/LTX-2", "--rollout-batch-size", "1", "--n-samples-per-prompt", "8")
    assert (ltx.diffusion_sde_type, ltx.source("diffusion_sde_type"), ltx.rollout_microgroup_size) == ("cps", Source.FAMILY, 1)
    # A value the user set is kept.
    c = resolve("--hf-checkpoint", "Lightricks/LTX-2", "--rollout-batch-size", "1", "--diffusion-sde-type", "sde")
    assert (c.diffusion_sde_type, c.source("diffusion_sde_type")) == ("sde", Source.COMMAND_LINE)


@pytest.mark.exercises("--rollout-microgroup-size")
def test_microgroup_limits():
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "8")
    assert message == "--rollout-microgroup-size 8 exceeds --n-samples-per-prompt 4: a microgroup is part of one prompt's group"
    (message,) = errors_of(
        "--hf-checkpoint", "nvidia/cosmos3", "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"
    )
    assert "the cosmos3 family supports at most 1 output(s) per request" in message


@pytest.mark.exercises("--hf-checkpoint", "--diffusion-height", "--diffusion-width")
def test_native_size_from_local_pipeline(tiny_sd3):
    c = resolve("--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1")
    assert (c.diffusion_height, c.diffusion_width) == (64, 64)
    assert c.source("diffusion_height") is Source.FAMILY
    c = resolve(
        "--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1", "--diffusion-height", "128"
    )
    assert (c.diffusion_height, c.diffusion_width) == (128, 64)
    # A hub id cannot be read without loading: left unset, resolved when the pipeline loads.
    assert resolve(*SD35, "--rollout-batch-size", "1").diffusion_height is None


def test_machine_auto_values(monkeypatch):
    c = resolve(*SD35, "--rollout-batch-size", "1")
    assert (c.actor_num_gpus_per_node, c.distributed_backend, c.diffusion_forward_dtype, c.diffusion_generator_device) == (
        1,
        "gloo",
        "fp32",
        "cpu",
    )
    assert c.source("distributed_backend") is Source.MACHINE
    monkeypatch.setattr("miles_core.config.resolve.visible_gpu_count", lambda: 4)
    c = resolve(*SD35, "--rollout-batch-size", "4", "--diffusion-forward-dtype", "fp32")
    assert (c.actor_num_gpus_per_node, c.world_size, c.distributed_backend, c.diffusion_forward_dtype, c.diffusion_generator_device) == (
        4,
        4,
        "nccl",
        "fp32",
        "cpu",
    )


def test_visible_gpu_count_honours_cuda_visible_devices(monkeypatch):
    from miles_core.machine import visible_gpu_count

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpu_count() == 0


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--save-interval", "5"], "--save-interval requires --save (where to write checkpoints)"),
        (["--lora-ipc-weight-sync"], "--lora-ipc-weight-sync requires --use-lora (it sends only lora_A/lora_B)"),
        (
            ["--micro-batch-size-sample", "2"],
            "--micro-batch-size-sample and --micro-batch-size-tstep must be set together (a 2-D sample x tstep tile)",
        ),
        (["--colocate-reward"], "--colocate-reward requires --colocate"),
        (["--train-only", "--debug-rollout-only"], "--train-only and --debug-rollout-only are mutually exclusive"),
        (["--eval-interval", "2"], "--eval-interval requires an evaluation dataset (--eval-prompt-data NAME PATH or --eval-config FILE)"),
        (["--use-ema"], "--use-ema needs a consumer: --ref-mode ema, --ema-rollout-policy ema, or --loss-type nft"),
        (["--ref-mode", "lora_base"], "--ref-mode lora_base requires --use-lora (the reference is the model with LoRA disabled)"),
        (["--loss-type", "custom_loss"], "--loss-type custom_loss requires --custom-loss-function-path"),
        (["--over-sampling-batch-size", "3"], "--over-sampling-batch-size 3 must equal --rollout-batch-size 2"),
        (["--diffusion-noise-level", "-0.1"], "--diffusion-noise-level -0.1: must not be negative"),
        (
            ["--diffusion-sde-window-range", "4,2"],
            (
                "--diffusion-sde-window-range 4,2: need 0 <= lo < hi <= --diffusion-num-steps 10 (a window reaching the last step runs it deterministically)"
            ),
        ),
        (["--lr-decay-style", "wsd"], "--lr-decay-style wsd requires --lr-wsd-decay-iters"),
        (
            ["--rollout-engine", "http"],
            "--rollout-engine http requires --rollout-engine-urls (base URLs of running engine servers) or --rollout-num-engines N (servers the run starts)",
        ),
        (
            ["--rollout-engine", "http", "--rollout-engine-urls", "localhost:3000"],
            "--rollout-engine-urls: 'localhost:3000' is not an http:// or https:// base URL",
        ),
        (
            ["--rollout-num-engines", "2"],
            "--rollout-num-engines starts engine servers for --rollout-engine http without --rollout-engine-urls; drop one of them",
        ),
        (
            ["--rollout-engine", "http", "--rollout-engine-urls", "http://a:1", "--rollout-num-engines", "2"],
            "--rollout-num-engines starts engine servers for --rollout-engine http without --rollout-engine-urls; drop one of them",
        ),
        (["--rollout-engine", "http", "--rollout-num-engines", "0"], "--rollout-num-engines 0: must be at least 1"),
        (["--rollout-parser-num-workers", "0"], "--rollout-parser-num-workers 0: must be at least 1"),
        (["--rollout-engine", "vllm"], "--rollout-engine vllm: unknown rollout engine; installed: embedded, http, sglang"),
    ],
)
@pytest.mark.exercises(
    "--over-sampling-batch-size", "--diffusion-noise-level", "--diffusion-sde-window-range", "--rollout-engine", "--rollout-engine-urls"
)
@pytest.mark.exercises("--rollout-num-engines", "--rollout-parser-num-workers")
def test_reference_rules(extra, expected):
    assert errors_of(*SD35, "--rollout-batch-size", "2", *extra) == [expected]


def test_every_violation_is_reported_at_once():
    messages = errors_of(*SD35, "--rollout-batch-size", "2", "--save-interval", "1", "--lora-ipc-weight-sync")
    assert len(messages) == 2 and all("\n" not in m for m in messages)


@pytest.mark.exercises("--micro-batch-size-sample", "--micro-batch-size-tstep")
def test_two_d_tile_derives_micro_batch_size():
    c = resolve(*SD35, "--rollout-batch-size", "2", "--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "3")
    assert (c.micro_batch_size, c.source("micro_batch_size")) == (6, Source.DERIVED)


def test_registry_backed_choices_list_installed():
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--loss-type", "ppo")
    assert message == "--loss-type ppo: unknown loss; installed: custom_loss, flow_dpo, grpo_guard, nft, policy_loss, sft_loss"
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--rm-type", "pickscore2")
    installed = message.split("installed: ", 1)[1].split(", ")
    assert installed == sorted(installed)
    assert {"aesthetic", "brightness", "imagereward", "pickscore", "remote", "vlm_judge"} <= set(installed)
    c = resolve(*SD35, "--rollout-batch-size", "1", "--rm-type", "jpeg_compressibility")
    assert c.components["reward"].provider.startswith("miles-rewards ")
    assert c.components["loss"].provider.startswith("miles-core ")


async def good_rm(args, samples):
    return [0.0 for _ in samples]


def sync_rm(args, samples):
    return [0.0 for _ in samples]


@pytest.mark.exercises("--sde-step-backend-path")
def test_dotted_path_flags_are_validated():
    c = resolve(*SD35, "--rollout-batch-size", "1", "--custom-rm-path", "tests.test_config.good_rm")
    assert c.components["reward"].provider == "--custom-rm-path tests.test_config.good_rm"
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--custom-rm-path", "tests.test_config.sync_rm")
    assert message.startswith("--custom-rm-path tests.test_config.sync_rm: must be an async function")
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--custom-rm-path", "no_such_pkg.rm")
    assert message.startswith("--custom-rm-path no_such_pkg.rm: cannot import 'no_such_pkg': ModuleNotFoundError")
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--buffer-filter-path", "tests.test_config.NOT_THERE")
    assert message == "--buffer-filter-path tests.test_config.NOT_THERE: module 'tests.test_config' has no attribute 'NOT_THERE'"
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--sde-step-backend-path", "tests.test_config.good_rm")
    assert "must be a subclass of miles_core.sde.SdeBackend" in message
    c = resolve(*SD35, "--rollout-batch-size", "1", "--sde-step-backend-path", "miles_core.sde:CpsBackend")
    assert c.components["sde_backend"].provider == "--sde-step-backend-path miles_core.sde:CpsBackend"


def test_sglang_flags_pass_through_verbatim():
    c = resolve(
        *SD35,
        "--rollout-batch-size",
        "1",
        "--sglang-attention-backend",
        "torch_sdpa",
        "--sglang-enable-torch-compile",
        "--sglang-mem-fraction-static=0.8",
        "--sglang-server-concurrency",
        "7",
    )
    assert c.sglang_args == [
        "--sglang-attention-backend",
        "torch_sdpa",
        "--sglang-enable-torch-compile",
        "--sglang-mem-fraction-static=0.8",
    ]
    assert c.sglang_server_concurrency == 7


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.exercises("--custom-config-path")
def test_yaml_overrides_with_a_warning(tmp_path):
    path = write(
        tmp_path,
        """\
        rollout_batch_size: 6
        n-samples-per-prompt: 4
        diffusion_clip_range: 1e-5
        lora_target_modules: [to_q, to_k]
        use_lora: true
    """,
    )
    c = resolve(*SD35, "--rollout-batch-size", "2", "--lr", "3e-4", "--custom-config-path", path)
    assert (c.rollout_batch_size, c.n_samples_per_prompt, c.diffusion_clip_range) == (6, 4, 1e-5)
    assert c.lora_target_modules == ["to_q", "to_k"] and c.use_lora is True
    assert c.source("rollout_batch_size") is Source.CONFIG_FILE
    assert c.lr == 3e-4 and c.source("lr") is Source.COMMAND_LINE
    assert c.notes == [f"{path}: key 'rollout_batch_size' overrides --rollout-batch-size 2 from the command line with 6"]
    assert c.global_batch_size == 24


@pytest.mark.parametrize(
    "text, expected",
    [
        ("rollout_batchsize: 4\n", "unknown key 'rollout_batchsize' (did you mean 'rollout_batch_size'?)"),
        ("lr: fast\n", "key 'lr' (--lr): expected a number, got 'fast'"),
        ("use_lora: maybe\n", "key 'use_lora' (--use-lora): expected true or false, got 'maybe'"),
        ("train_dp_split_mode: random\n", "key 'train_dp_split_mode' (--train-dp-split-mode): 'random' is not one of contiguous, stride"),
        ("rollout_batch_size: [4\n", "not valid YAML at line 2"),
        ("- 4\n", "the top level must be a mapping of flag names to values, got list"),
    ],
)
def test_bad_yaml_is_one_line_naming_the_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    (message,) = errors_of(*SD35, "--rollout-batch-size", "2", "--custom-config-path", path)
    assert message.startswith(f"--custom-config-path {path}: ")
    assert expected in message


def test_missing_yaml_file(tmp_path):
    (message,) = errors_of(*SD35, "--rollout-batch-size", "2", "--custom-config-path", str(tmp_path / "nope.yaml"))
    assert "cannot read the file (No such file or directory)" in message


def test_plugin_flags_exist_only_with_the_plugin():
    c = resolve(*SD35, "--rollout-batch-size", "1", "--pickscore-batch-size", "4")
    assert c.pickscore_batch_size == 4 and c.owner("pickscore_batch_size").distribution == "miles-rewards"
    host = PluginHost(strict=True, disabled={"rewards"})
    with pytest.raises(SystemExit) as caught:
        resolve(*SD35, "--rollout-batch-size", "1", "--pickscore-batch-size", "4", host=host)
    assert caught.value.code == 2
    assert "pickscore_batch_size" not in resolve(*SD35, "--rollout-batch-size", "1", host=host)


@pytest.mark.exercises("--diffusion-guidance-scale-2")
def test_plugin_validation_hooks_run():
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--ocr-num-workers", "0")
    assert message == "--ocr-num-workers 0: must be at least 1"
    (message,) = errors_of("--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B", "--rollout-batch-size", "1")
    assert message.startswith("--diffusion-guidance-scale-2 is required when --update-weight-target-module trains transformer_2")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "miles_core.cli.main", *args], capture_output=True, text=True)


def test_config_command_prints_yaml_with_providers():
    result = run_cli("config", *SD35, "--rollout-batch-size", "48", "--n-samples-per-prompt", "16", "--num-steps-per-rollout", "2")
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    assert document["data"]["global_batch_size"] == 384
    assert document["components"]["model_family"]["name"] == "sd3"
    assert document["components"]["model_family"]["provided_by"].startswith("miles-sd3 ")
    assert document["components"]["loss"] == {"name": "policy_loss", "provided_by": document["components"]["loss"]["provided_by"]}
    assert document["sources"]["global_batch_size"] == "derived"
    assert document["sources"]["rollout_batch_size"] == "command line"
    assert document["resolved"]["model_family"] == "sd3"


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--rollout-batch-size", "2", "--save-interval", "3"],
            "miles-core config: error: --save-interval requires --save (where to write checkpoints)\n",
        ),
        (["--rollout-batch-size", "two"], "miles-core config: error: argument --rollout-batch-size: expected an integer, got 'two'\n"),
        (["--rollout-batch-size", "2", "--no-such-flag"], "miles-core config: error: unrecognized arguments: --no-such-flag\n"),
        (
            ["--rollout-batch-size", "2", "--train-dp-split-mode", "random"],
            "miles-core config: error: argument --train-dp-split-mode: invalid choice: 'random' (choose from 'contiguous', 'stride')\n",
        ),
    ],
)
def test_config_command_errors_are_one_line_exit_2(args, expected):
    result = run_cli("config", *SD35, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == expected


def test_help_is_grouped():
    result = run_cli("config", "--help")
    assert result.returncode == 0
    for title in (
        "Cluster:",
        "Training backend:",
        "Optimizer and schedule:",
        "Rollout:",
        "Data and batching:",
        "Evaluation:",
        "Algorithm and loss:",
        "Reward:",
        "Rollout customization hooks:",
        "LoRA:",
        "EMA:",
        "Checkpointing:",
        "Logging:",
        "Fault tolerance:",
        "Debugging:",
        "CI:",
        "Reward (plugin miles-rewards):",
    ):
        assert f"\n{title}\n" in result.stdout, title


@pytest.mark.exercises("--diffusion-num-sde-steps")
def test_training_only_rules_warn_in_config_and_list_a_fix():
    from miles_core.config.resolve import training_errors

    c = resolve(*SD35, "--rollout-batch-size", "2")
    (message,) = training_errors(c)
    assert message.startswith("--loss-type policy_loss trains on SDE steps but --diffusion-num-sde-steps is 0")
    assert "--diffusion-num-sde-steps 9" in message
    assert training_errors(resolve(*SD35, "--rollout-batch-size", "2", "--diffusion-num-sde-steps", "2")) == []
    assert training_errors(resolve(*SD35, "--rollout-batch-size", "2", "--loss-type", "nft")) == []
    result = run_cli("config", *SD35, "--rollout-batch-size", "2")
    assert result.returncode == 0
    assert "warning: a training run would stop here: --loss-type policy_loss trains on SDE steps" in result.stderr


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--diffusion-noise-level", "0"],
            "--loss-type policy_loss needs stochastic steps, but --diffusion-sde-type sde with --diffusion-noise-level 0.0 samples deterministically (no log-prob to train on)",
        ),
        (
            ["--diffusion-kl-beta", "0.04"],
            "--diffusion-kl-beta 0.04 needs a reference policy: --use-lora (reference = LoRA disabled) or --use-ema --ref-mode ema",
        ),
        (["--ref-mode", "ema"], "--ref-mode ema requires --use-ema (the EMA is the reference)"),
        (
            ["--loss-type", "nft", "--diffusion-kl-beta", "0.1"],
            "--diffusion-kl-beta 0.1 with --loss-type nft measures the KL against the base model (the LoRA adapter "
            "disabled, as DiffusionNFT does), which needs --use-lora; full fine-tuning keeps no base copy",
        ),
        (
            ["--loss-type", "nft", "--use-lora", "--diffusion-kl-beta", "0.1", "--kl-space", "latent"],
            "--kl-space latent: --loss-type nft trains on nft_pairs, which have no SDE step means to compare; use "
            "--kl-space velocity (or leave it unset)",
        ),
        (
            ["--diffusion-kl-beta", "0.04", "--kl-space", "velocity"],
            "--diffusion-kl-beta 0.04 --kl-space velocity needs a reference policy: --use-lora (reference = LoRA "
            "disabled) or --use-ema --ref-mode ema",
        ),
    ],
)
@pytest.mark.exercises("--diffusion-noise-level")
def test_training_only_rules(extra, expected):
    from miles_core.config.resolve import training_errors

    c = resolve(*SD35, "--rollout-batch-size", "2", "--diffusion-num-sde-steps", "2", *extra)
    assert training_errors(c) == [expected]
