"""The run-level hooks of docs/customization.md on the tiny SD3 pipeline: a custom rollout,
eval rollout, inner generate call, prompt source (resumed from a checkpoint), rollout and
eval logging, and model loader; and the one-line errors for hooks that do not fit."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, RunError
from miles_core.rollout.seeds import microgroups
from miles_core.training.debug_data import load_rollout_data
from miles_core.training.run import train
from tests import custom_hooks_example as hooks

HOOKS = "tests.custom_hooks_example"
EVAL = ("--eval-interval", "1", "--n-samples-per-eval-prompt", "2")


@pytest.fixture(autouse=True)
def calls():
    hooks.CALLS.clear()
    yield hooks.CALLS
    hooks.CALLS.clear()


def base_args(tiny_sd3, out, prompts=None):
    return [
        "--hf-checkpoint",
        str(tiny_sd3),
        "--diffusion-model-family",
        "sd3",
        *(["--prompt-data", str(prompts)] if prompts else []),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-microgroup-size",
        "2",
        "--diffusion-num-steps",
        "2",
        "--diffusion-num-sde-steps",
        "1",
        "--diffusion-height",
        "32",
        "--diffusion-width",
        "32",
        "--rm-type",
        "jpeg_incompressibility",
        "--use-lora",
        "--lora-rank",
        "4",
        "--output-dir",
        str(out),
    ]


def run(tiny_sd3, out, *extra, prompts=None):
    config = resolve_config([*base_args(tiny_sd3, out, prompts), *extra])
    path = asyncio.run(train(config, log=lambda line: None))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def of(calls, kind):
    return [call[1:] for call in calls if call[0] == kind]


@pytest.mark.exercises("--rollout-function-path")
def test_rollout_function_replaces_the_rollout_and_is_the_default_eval_rollout(tiny_sd3, prompts, tmp_path, calls):
    saved = str(tmp_path / "rollouts" / "{}.msgpack")
    records = run(
        tiny_sd3,
        tmp_path / "run",
        "--num-rollout",
        "2",
        "--rollout-function-path",
        f"{HOOKS}.own_seed_rollout",
        "--eval-prompt-data",
        "e",
        str(prompts),
        *EVAL,
        "--save-debug-rollout-data",
        saved,
        prompts=prompts,
    )
    for rollout_id in (0, 1):
        # The samples trained on are the function's: its own seed stream, not --rollout-seed's.
        samples, _ = load_rollout_data(saved, rollout_id)
        expected = [
            mg.seed + i for g in (2 * rollout_id, 2 * rollout_id + 1) for mg in microgroups(hooks.OWN_SEED, g, 2, 2) for i in range(mg.size)
        ]
        assert [s.seed for s in samples] == expected
    assert all("train/loss" in r and "rollout/reward/raw_mean" in r for r in records)
    # Without --eval-function-path it also runs the evaluations (before training, after each rollout).
    assert of(calls, "rollout") == [
        (0, True, "EvalPrompts"),
        (0, False, "PromptSource"),
        (0, True, "EvalPrompts"),
        (1, False, "PromptSource"),
        (1, True, "EvalPrompts"),
    ]
    assert "eval/e/paired_gain" in records[1]


@pytest.mark.exercises("--disable-rollout-global-dataset", "--rollout-function-path")
def test_a_sync_rollout_function_supplies_its_own_prompts_without_the_global_dataset(tiny_sd3, tmp_path, calls):
    saved = str(tmp_path / "rollouts" / "{}.msgpack")
    records = run(
        tiny_sd3,
        tmp_path / "run",
        "--num-rollout",
        "1",
        "--disable-rollout-global-dataset",
        "--rollout-function-path",
        f"{HOOKS}.own_prompts_rollout",
        "--save-debug-rollout-data",
        saved,
        prompts=tmp_path / "not-there.jsonl",  # never read
    )
    assert of(calls, "own prompts") == [(0, None)]  # no data source to hand it
    samples, _ = load_rollout_data(saved, 0)
    assert [s.prompt for s in samples] == ["own prompt 0.0"] * 2 + ["own prompt 0.1"] * 2
    assert records[0]["rollout/num_samples"] == 4 and "train/loss" in records[0]


@pytest.mark.exercises("--eval-function-path")
def test_eval_function_replaces_the_evaluation_and_wins_over_the_rollout_function(tiny_sd3, prompts, tmp_path, calls):
    (record,) = run(
        tiny_sd3,
        tmp_path / "run",
        "--num-rollout",
        "1",
        "--eval-prompt-data",
        "e",
        str(prompts),
        *EVAL,
        "--eval-function-path",
        f"{HOOKS}.black_eval",
        "--rollout-function-path",
        f"{HOOKS}.own_seed_rollout",
        prompts=prompts,
    )
    # Black images score alike: the built-in evaluation's random images would not.
    assert record["eval/e/reward_std"] == pytest.approx(0, abs=1e-6)
    assert record["eval/e/paired_gain"] == 0
    assert of(calls, "eval") == [(0, True, "e"), (0, True, "e")]
    assert of(calls, "rollout") == [(0, False, "PromptSource")]  # not asked to evaluate


@pytest.mark.exercises("--custom-generate-function-path")
def test_custom_generate_function_sends_every_request_of_the_built_in_rollout(tiny_sd3, prompts, tmp_path, calls):
    run(
        tiny_sd3,
        tmp_path / "run",
        "--num-rollout",
        "1",
        "--custom-generate-function-path",
        f"{HOOKS}.recording_generate",
        "--eval-prompt-data",
        "e",
        str(prompts),
        *EVAL,
        prompts=prompts,
    )
    requests = of(calls, "generate")
    train_requests = [r for r in requests if r[3]]
    # One request per microgroup, with the seed layout of the built-in rollout (--rollout-seed 42).
    assert sorted(r[1] for r in train_requests) == [mg.seed for g in (0, 1) for mg in microgroups(42, g, 2, 2)]
    assert all(r[2] == 2 for r in requests)
    assert len(requests) - len(train_requests) == 2 * 3  # two evaluations of three prompts


@pytest.mark.exercises("--data-source-path", "--disable-rollout-global-dataset")
def test_data_source_serves_the_prompts_and_resumes_from_a_checkpoint(tiny_sd3, tmp_path, calls):
    source = (
        "--disable-rollout-global-dataset",
        "--data-source-path",
        f"{HOOKS}.CursorSource",
        "--custom-rollout-log-function-path",
        f"{HOOKS}.record_log",
    )
    run(tiny_sd3, tmp_path / "whole", "--num-rollout", "3", *source)
    served = of(calls, "batch")
    assert served == [(0, ["a cat", "a dog"]), (1, ["a fox", "a cat"]), (2, ["a dog", "a fox"])]
    assert [prompts[::2] for _, prompts in of(calls, "log")] == [p for _, p in served]  # what the rollouts sampled

    calls.clear()
    ckpt = tmp_path / "ckpt"
    run(tiny_sd3, tmp_path / "resumed", "--num-rollout", "2", "--save", str(ckpt), *source)
    assert json.loads((ckpt / "iter_0000001" / "meta.json").read_text())["extra"]["data_source"] == {"cursor": 4}
    calls.clear()
    records = run(tiny_sd3, tmp_path / "resumed", "--num-rollout", "3", "--load", str(ckpt), *source)
    # The cursor came back from the checkpoint: rollout 2 gets what it got in the whole run.
    assert of(calls, "batch") == [served[2]]
    assert [r["rollout_id"] for r in records] == [0, 1, 2]


@pytest.mark.exercises("--custom-rollout-log-function-path", "--custom-eval-rollout-log-function-path")
def test_log_functions_replace_the_default_rollout_and_eval_logging(tiny_sd3, prompts, tmp_path, calls):
    out = tmp_path / "run"
    records = run(
        tiny_sd3,
        out,
        "--num-rollout",
        "2",
        "--eval-prompt-data",
        "e",
        str(prompts),
        *EVAL,
        "--custom-rollout-log-function-path",
        f"{HOOKS}.skip_first_rollout_log",
        "--custom-eval-rollout-log-function-path",
        f"{HOOKS}.skip_eval_log",
        prompts=prompts,
    )
    # Rollout 0: the function returned True, so no rollout/* keys; the rest of the record stays.
    assert not [k for k in records[0] if k.startswith("rollout/")]
    assert "train/loss" in records[0] and "perf/step_time" in records[0]
    # Rollout 1: it returned False after adding a key: the default metrics plus its own.
    assert records[1]["rollout/reward_x2"] == 2 * records[1]["rollout/reward/raw_mean"]
    logged = of(calls, "log")
    assert [entry[0] for entry in logged] == [0, 1]
    assert all(len(entry[1]) == 4 and None not in entry[2] for entry in logged)  # scored samples
    assert logged[0][3]["rollout/num_samples"] == 4
    # Evaluations: always True, so no eval/* keys and no sample grids.
    assert not [k for r in records for k in r if k.startswith("eval/")]
    assert not list(out.glob("samples/eval_*.png"))
    evals = of(calls, "eval log")
    assert [(rollout_id, sizes) for rollout_id, sizes, _ in evals] == [(0, {"e": 6}), (0, {"e": 6}), (1, {"e": 6})]
    assert "eval/e/reward_mean" in evals[0][2] and "eval/e/paired_gain" in evals[1][2]


@pytest.mark.exercises("--model-backend-path")
def test_model_backend_loads_the_family_the_trainer_and_engine_share(tiny_sd3, prompts, tmp_path, calls):
    (record,) = run(tiny_sd3, tmp_path / "run", "--num-rollout", "1", "--model-backend-path", f"{HOOKS}.counting_backend", prompts=prompts)
    ((family,),) = of(calls, "backend")  # loaded once
    assert family.predictions["sampling"] > 0 and family.predictions["training"] > 0
    assert "train/loss" in record


def errors_of(*args):
    with pytest.raises(ConfigError) as info:
        resolve_config(list(args))
    return info.value.messages


@pytest.mark.exercises(
    "--rollout-function-path",
    "--eval-function-path",
    "--data-source-path",
    "--disable-rollout-global-dataset",
    "--custom-rollout-log-function-path",
    "--model-backend-path",
)
def test_hooks_that_do_not_fit_are_configuration_errors_naming_the_flag(tiny_sd3, prompts, tmp_path):
    base = base_args(tiny_sd3, tmp_path / "run", prompts)
    (message,) = errors_of(*base, "--rollout-function-path", f"{HOOKS}.two_arguments")
    assert message.startswith(
        f"--rollout-function-path {HOOKS}.two_arguments: must be a function "
        "(config, rollout_id, engine, data_source) -> list[Sample], got function two_arguments("
    )
    (message,) = errors_of(*base, "--eval-function-path", f"{HOOKS}.no_such_function")
    assert message == f"--eval-function-path {HOOKS}.no_such_function: module '{HOOKS}' has no attribute 'no_such_function'"
    (message,) = errors_of(*base, "--data-source-path", f"{HOOKS}.record_log")
    assert message.startswith(f"--data-source-path {HOOKS}.record_log: must be a class built as cls(config, records)")
    (message,) = errors_of(*base, "--custom-rollout-log-function-path", f"{HOOKS}.CursorSource")
    assert message.startswith(f"--custom-rollout-log-function-path {HOOKS}.CursorSource: must be a function (rollout_id, ")
    (message,) = errors_of(*base, "--model-backend-path", f"{HOOKS}.two_arguments")
    assert "must be a function (config) -> miles_core.family.ModelFamily instance" in message
    # A rollout function that also evaluates must take the evaluation keyword.
    (message,) = errors_of(*base, "--rollout-function-path", f"{HOOKS}.own_prompts_rollout", *EVAL, "--eval-prompt-data", "e", str(prompts))
    assert "it also runs the evaluations (no --eval-function-path), so it must accept the keyword argument evaluation" in message
    (message,) = errors_of(*base, "--num-rollout", "1", "--disable-rollout-global-dataset")
    assert message.startswith("--disable-rollout-global-dataset: nothing would supply the prompts")
    (message,) = errors_of(*base, "--disable-rollout-global-dataset", "--data-source-path", f"{HOOKS}.CursorSource")
    assert message.startswith("--disable-rollout-global-dataset requires --num-rollout")
    (message,) = errors_of(*base, "--loss-type", "sft_loss", "--data-source-path", f"{HOOKS}.CursorSource")
    assert message.startswith("--data-source-path: RL rollout hooks; --loss-type sft_loss")


@pytest.mark.exercises(
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--data-source-path",
    "--custom-rollout-log-function-path",
    "--model-backend-path",
)
@pytest.mark.parametrize(
    ("flag", "hook", "rule"),
    [
        ("--rollout-function-path", "returns_a_dict", "must return a list of Sample, got dict"),
        ("--rollout-function-path", "drops_a_sample", "returned 3 samples, not whole groups of --n-samples-per-prompt 2"),
        ("--custom-generate-function-path", "drops_an_output", "returned 1 outputs for a request of 2"),
        ("--data-source-path", "StringSource", "batch(0) must return a list of miles_core.rollout.data.PromptRecord"),
        ("--custom-rollout-log-function-path", "says_yes", "must return True (skip the default logging), False or None, got str"),
        ("--model-backend-path", "pipeline_backend", "must return a miles_core.family.ModelFamily instance"),
    ],
)
def test_a_wrong_return_value_stops_the_run_with_one_line_naming_the_flag(tiny_sd3, prompts, tmp_path, flag, hook, rule):
    with pytest.raises(RunError) as info:
        run(tiny_sd3, tmp_path / "run", "--num-rollout", "1", flag, f"{HOOKS}.{hook}", prompts=prompts)
    message = str(info.value)
    assert message.startswith(f"{flag} {HOOKS}.{hook}: ") and rule in message and "\n" not in message
