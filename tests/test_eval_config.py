"""``--eval-config``: the reference's OmegaConf eval file (miles_core.config.eval_config),
its priority rules (dataset > eval.defaults > flag), its errors, and a run that evaluates
two sets with their own sample counts, steps and rewards."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from miles_core.config.eval_config import EvalDataset, eval_datasets
from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_core.training.evaluation import Evaluator
from tests.tiny_runs import run_metrics, tiny_run_args

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1", "--rm-type", "brightness"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def eval_files(tmp_path):
    """Two prompt files in ``tmp/data/`` and a config in ``tmp/conf/`` naming them relatively."""
    write(tmp_path / "data" / "a.jsonl", '{"caption": "a red cube", "input": "x", "metadata": {"split": "train", "k": 1}}\n')
    write(tmp_path / "data" / "b.jsonl", '{"caption": "a green tree", "input": "y"}\n{"caption": "a blue ball", "input": "z"}\n')
    return tmp_path


@pytest.mark.exercises("--eval-config", "--n-samples-per-eval-prompt", "--diffusion-eval-num-steps", "--eval-input-key")
def test_dataset_values_win_over_defaults_which_win_over_flags(eval_files):
    conf = write(
        eval_files / "conf" / "eval.yaml",
        """\
        eval:
          defaults:
            n_samples_per_eval_prompt: 2
            metadata_overrides: {split: test, source: defaults}
          datasets:
            - name: cubes
              path: ../data/a.jsonl
              n_samples_per_eval_prompt: 3
              diffusion_eval_num_steps: 2
              input_key: caption
              rm_type: redness
              metadata_overrides: {source: cubes}
            - name: trees
              path: ../data/b.jsonl
        """,
    )
    flags = [*SD35, "--diffusion-num-steps", "6", "--eval-input-key", "input", "--n-samples-per-eval-prompt", "5"]
    config = resolve_config([*flags, "--eval-config", str(conf), "--diffusion-eval-num-steps", "4"])
    cubes, trees = eval_datasets(config)
    assert cubes == EvalDataset(
        name="cubes",
        path=str(conf.parent / "../data/a.jsonl"),  # against the config file's folder, not the working directory
        input_key="caption",
        metadata_key="metadata",
        image_key=None,
        n_samples_per_eval_prompt=3,
        num_steps=2,
        rm_type="redness",
        metadata_overrides={"split": "test", "source": "cubes"},
        source=str(conf),
    )
    assert (trees.input_key, trees.n_samples_per_eval_prompt, trees.num_steps, trees.rm_type) == ("input", 2, 4, None)
    evaluator = Evaluator(config, engine=None, scorer=None)
    # Rows: the set's own prompt key; overrides merged into each row's metadata, rm_type too.
    (row,) = evaluator.datasets["cubes"]
    assert (row.prompt, row.metadata) == ("a red cube", {"split": "test", "k": 1, "source": "cubes", "rm_type": "redness"})
    assert [(r.prompt, r.metadata) for r in evaluator.datasets["trees"]] == [
        ("y", {"split": "test", "source": "defaults"}),
        ("z", {"split": "test", "source": "defaults"}),
    ]
    # Requests: each set's samples per prompt and steps; seeds spaced by its own count.
    cube_requests = evaluator.requests(evaluator.datasets["cubes"], "cubes")
    tree_requests = evaluator.requests(evaluator.datasets["trees"], "trees")
    assert [(r.num_outputs_per_prompt, r.num_inference_steps) for r in cube_requests] == [(3, 2)]
    assert [(r.num_outputs_per_prompt, r.num_inference_steps) for r in tree_requests] == [(2, 4)] * 2
    assert tree_requests[1].seed - tree_requests[0].seed == 2
    # The prompt-embedding precompute encodes exactly the requests the evaluation sends.
    from miles_core.training.prompt_embeddings import run_requests

    assert run_requests(config, [], supervised=False) == cube_requests + tree_requests
    # Control: without the step flag the set falls back on --diffusion-num-steps.
    (_, trees) = eval_datasets(resolve_config([*flags, "--eval-config", str(conf)]))
    assert trees.num_steps == 6


@pytest.mark.exercises("--eval-config")
def test_json_files_and_omegaconf_interpolation(eval_files):
    conf = write(
        eval_files / "eval.json",
        json.dumps(
            {
                "eval": {
                    "defaults": {"diffusion_eval_num_steps": 3},
                    "datasets": [
                        {"name": "b", "path": str(eval_files / "data" / "b.jsonl"), "input_key": "caption"},
                        {"name": "c", "path": "data/a.jsonl", "n_samples_per_eval_prompt": "${eval.defaults.diffusion_eval_num_steps}"},
                    ],
                }
            }
        ),
    )
    b, c = eval_datasets(resolve_config([*SD35, "--eval-config", str(conf)]))
    assert (b.path, b.num_steps) == (str(eval_files / "data" / "b.jsonl"), 3)  # an absolute path stays
    assert (c.path, c.n_samples_per_eval_prompt, c.input_key) == (str(eval_files / "data" / "a.jsonl"), 3, "input")  # --input-key's default


BAD = [
    ("eval: [unclosed", "cannot be read as YAML/JSON: "),
    ("datasets: []\n", "eval.datasets must be a non-empty list (or name -> dataset mapping) of datasets"),  # no eval: root
    ("- 1\n", "the top level must be a mapping: 'eval' (or 'datasets' and 'defaults' directly)"),
    ("eval: {datasets: []}\n", "eval.datasets must be a non-empty list (or name -> dataset mapping) of datasets"),
    ("eval: {defaults: {n_samples_per_eval_prompt: 1}}\n", "eval.datasets must be a non-empty list (or name -> dataset mapping) of"),
    ("eval: {datasets: {a: {name: b, path: p}}}\n", "dataset 'a': name 'b' disagrees with its key 'a'"),
    ("eval: {datasets: {a: p}}\n", "dataset 'a': must be a mapping with path, got 'p'"),
    ("datasets: [{name: a, path: p}]\nother: 1\n", "eval: unknown key 'other'; allowed: defaults, datasets"),
    ("eval: {datasets: [{name: a, path: '???'}]}\n", "a value cannot be resolved: eval.datasets[0].path (Missing mandatory value: path)"),
    ("eval: {datasets: [{name: a, path: p}]}\nother: 1\n", "unknown top-level key 'other'; the file holds 'eval' only"),
    ("eval: {datasets: [{name: a, path: p}], extra: 1}\n", "eval: unknown key 'extra'; allowed: defaults, datasets"),
    ("eval: {datasets: [{path: p}]}\n", "dataset 0: name is required"),
    ("eval: {datasets: [{name: a}]}\n", "dataset 'a': path is required"),
    ("eval: {datasets: [{name: a, path: p}, {name: a, path: q}]}\n", "dataset 'a': duplicate name (eval set names must be unique)"),
    (
        "eval: {datasets: [{name: a, path: p, seed: 3}]}\n",
        "dataset 'a': unknown key 'seed'; allowed: name, path, n_samples_per_eval_prompt, ",
    ),
    (
        "eval: {datasets: [{name: a, path: p, n_samples_per_eval_prompt: 0}]}\n",
        "dataset 'a': n_samples_per_eval_prompt must be an integer >= 1, got 0",
    ),
    (
        "eval: {datasets: [{name: a, path: p, diffusion_eval_num_steps: 2.5}]}\n",
        "dataset 'a': diffusion_eval_num_steps must be an integer >= 1, got 2.5",
    ),
    ("eval: {datasets: [{name: a, path: p, input_key: ''}]}\n", "dataset 'a': input_key must be a non-empty string, got ''"),
    ("eval: {datasets: [{name: 3, path: p}]}\n", "dataset 0: name must be a non-empty string, got 3"),
    ("eval: {datasets: [{name: a, path: p, metadata_overrides: [1]}]}\n", "dataset 'a': metadata_overrides must be a mapping, got [1]"),
    (
        "eval: {defaults: {name: x}, datasets: [{name: a, path: p}]}\n",
        "eval.defaults: unknown key 'name'; allowed: n_samples_per_eval_prompt, ",
    ),
    (
        "eval: {defaults: {n_samples_per_eval_prompt: -1}, datasets: [{name: a, path: p}]}\n",
        "eval.defaults: n_samples_per_eval_prompt must be",
    ),
    ("eval: {datasets: [{name: a, path: p, rm_type: brightnes}]}\n", "dataset 'a': rm_type brightnes: unknown reward; installed: "),
    (
        "eval: {datasets: [{name: a, path: '${eval.nowhere}'}]}\n",
        "a value cannot be resolved: eval.datasets[0].path (Interpolation key 'eval.nowhere' not found)",
    ),
]


@pytest.mark.exercises("--eval-config")
@pytest.mark.parametrize("text, message", BAD)
def test_a_bad_file_is_one_line_naming_the_file_and_the_rule(tmp_path, text, message):
    conf = write(tmp_path / "eval.yaml", text)
    with pytest.raises(ConfigError) as caught:
        resolve_config([*SD35, "--eval-config", str(conf), "--eval-interval", "1"])
    (line,) = caught.value.messages
    assert line.startswith(f"--eval-config {conf}: {message}") and "\n" not in line


@pytest.mark.exercises("--eval-config")
def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"^--eval-config {tmp_path}/none.yaml: no such file$"):
        resolve_config([*SD35, "--eval-config", str(tmp_path / "none.yaml")])


@pytest.mark.exercises("--eval-config", "--eval-rm-type", "--eval-reward-weights")
def test_a_dataset_reward_conflicts_with_a_held_out_eval_reward(tmp_path):
    conf = write(tmp_path / "eval.yaml", "eval: {datasets: [{name: a, path: p, rm_type: redness}]}\n")
    for flag, value in (("--eval-rm-type", "brightness"), ("--eval-reward-weights", '{"brightness": 1}')):
        with pytest.raises(ConfigError) as caught:
            resolve_config([*SD35, "--eval-config", str(conf), flag, value])
        assert caught.value.messages == [
            f"--eval-config {conf}: dataset 'a': rm_type redness conflicts with {flag}, which scores every evaluation sample; drop one of them"
        ]
    resolve_config([*SD35, "--eval-config", str(conf)])  # control: alone it is fine


@pytest.mark.exercises("--eval-config", "--eval-prompt-data")
def test_the_config_overrides_eval_prompt_data_with_a_warning(eval_files):
    conf = write(eval_files / "eval.yaml", "eval: {datasets: [{name: trees, path: data/b.jsonl}]}\n")
    prompt_data = ["--eval-prompt-data", "cubes", str(eval_files / "data" / "a.jsonl")]
    config = resolve_config([*SD35, *prompt_data, "--eval-config", str(conf)])
    assert f"--eval-prompt-data is ignored: --eval-config {conf} names the eval datasets (it overrides --eval-prompt-data)" in config.notes
    assert list(Evaluator(config, engine=None, scorer=None).datasets) == ["trees"]
    alone = resolve_config([*SD35, *prompt_data])  # control: no warning, its own set
    assert not any("--eval-prompt-data is ignored" in note for note in alone.notes)
    assert list(Evaluator(alone, engine=None, scorer=None).datasets) == ["cubes"]


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples" / "eval" / "manifest.jsonl").read_text().splitlines()]


@pytest.mark.exercises("--eval-config", "--eval-interval", "--n-samples-per-eval-prompt", "--diffusion-eval-num-steps")
def test_a_run_evaluates_each_set_with_its_own_samples_steps_and_reward(tiny_sd3, prompts, tmp_path):
    conf = write(
        tmp_path / "conf" / "eval.yaml",
        f"""\
        eval:
          defaults: {{diffusion_eval_num_steps: 2}}
          datasets:
            - {{name: one, path: {prompts}, n_samples_per_eval_prompt: 1}}
            - {{name: same, path: {prompts}, n_samples_per_eval_prompt: 2}}
            - {{name: bright, path: {prompts}, n_samples_per_eval_prompt: 2, diffusion_eval_num_steps: 3, rm_type: brightness}}
        """,
    )
    base = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "cfg"),
        "--num-rollout",
        "1",
        "--eval-interval",
        "1",
        "--debug-skip-optimizer-step",
    ]
    records = run_metrics([*base, "--eval-config", str(conf), "--eval-prompt-data", "ignored", str(prompts)])
    rows = manifest(tmp_path / "cfg")
    first = [row for row in rows if row["evaluation"] == 0]
    counts = {name: sum(row["eval_set"] == name for row in first) for name in ("one", "same", "bright", "ignored")}
    assert counts == {"one": 3, "same": 6, "bright": 6, "ignored": 0}  # 3 prompts x the set's own samples per prompt
    pairs = {name: [(r["prompt_index"], r["sample_index"]) for r in first if r["eval_set"] == name] for name in ("one", "bright")}
    assert pairs == {"one": [(0, 0), (1, 0), (2, 0)], "bright": [(p, s) for p in range(3) for s in range(2)]}
    assert {"eval/one/reward_mean", "eval/same/reward_mean", "eval/bright/reward_mean"} <= records[0].keys()
    assert not any(key.startswith("eval/ignored/") for record in records for key in record)
    # The set's rm_type scored its rows; the others got the training reward.
    assert "eval/bright/reward/brightness_failed" in records[0] and "eval/bright/reward/jpeg_incompressibility_failed" not in records[0]
    assert "eval/one/reward/jpeg_incompressibility_failed" in records[0] and "eval/one/reward/brightness_failed" not in records[0]
    out = tmp_path / "cfg"
    for row in (r for r in first if r["eval_set"] == "bright"):  # brightness: the mean pixel value
        assert row["reward"] == pytest.approx(np.asarray(Image.open(out / row["image"])).mean() / 255, abs=2 / 255)

    def pixels(name: str, prompt: int) -> np.ndarray:
        (row,) = [r for r in first if r["eval_set"] == name and r["prompt_index"] == prompt and r["sample_index"] == 0]
        return np.asarray(Image.open(out / row["image"]), dtype=np.int16)

    # Prompt 0's first sample has the same seed in every set: the same steps give the same
    # image (one = same), the set's own steps a different one (bright: 3 steps).
    assert np.abs(pixels("one", 0) - pixels("same", 0)).max() <= 1
    assert np.abs(pixels("bright", 0) - pixels("same", 0)).max() > 8
    # Control: --eval-prompt-data alone evaluates with the flags' counts.
    plain = [
        *tiny_run_args(tiny_sd3, prompts, tmp_path / "flags"),
        "--num-rollout",
        "1",
        "--eval-interval",
        "1",
        "--debug-skip-optimizer-step",
    ]
    records = run_metrics([*plain, "--eval-prompt-data", "ignored", str(prompts), "--n-samples-per-eval-prompt", "2"])
    assert [row["eval_set"] for row in manifest(tmp_path / "flags") if row["evaluation"] == 0] == ["ignored"] * 6
    assert "eval/ignored/reward/jpeg_incompressibility_failed" in records[0]


@pytest.mark.exercises("--eval-config", "--custom-rm-path")
def test_a_dataset_reward_conflicts_with_a_custom_reward(tmp_path):
    conf = write(tmp_path / "eval.yaml", "eval: {datasets: [{name: a, path: p, rm_type: redness}]}\n")
    custom = ["--custom-rm-path", "tests.custom_hooks_example.flag_count_eval"]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*SD35[:-2], "--eval-config", str(conf), *custom])
    assert caught.value.messages == [
        f"--eval-config {conf}: dataset 'a': rm_type redness conflicts with --custom-rm-path, which scores every evaluation sample; drop one of them"
    ]
    plain = write(tmp_path / "plain.yaml", "eval: {datasets: [{name: a, path: p}]}\n")
    resolve_config([*SD35[:-2], "--eval-config", str(plain), *custom])  # control: without the dataset's rm_type


@pytest.mark.exercises("--eval-config")
def test_metadata_overrides_rm_type_wins_over_rm_type_as_in_the_reference(eval_files):
    from miles_core.config.eval_config import eval_config_rewards
    from miles_core.training.rewards import RewardScorer

    conf = write(
        eval_files / "eval.yaml",
        "eval:\n  defaults: {rm_type: brightness}\n  datasets:\n"
        "    - {name: x, path: data/b.jsonl, metadata_overrides: {rm_type: redness}}\n    - {name: y, path: data/b.jsonl}\n",
    )
    config = resolve_config([*SD35, "--eval-config", str(conf)])
    x, y = eval_datasets(config)
    assert (x.reward(), y.reward()) == (("metadata_overrides.rm_type", "redness"), ("rm_type", "brightness"))
    assert eval_config_rewards(config) == ["redness", "brightness"]
    evaluator, scorer = Evaluator(config, engine=None, scorer=None), RewardScorer(config, evaluation=True)
    assert {scorer.reward_set(row) for row in evaluator.datasets["x"]} == {"redness"}
    assert {scorer.reward_set(row) for row in evaluator.datasets["y"]} == {"brightness"}  # control
    # The effective reward is the one checked: a bad override is named by its key.
    bad = write(
        eval_files / "bad.yaml", "eval: {datasets: [{name: x, path: p, rm_type: brightness, metadata_overrides: {rm_type: nope}}]}\n"
    )
    with pytest.raises(ConfigError, match=r"dataset 'x': metadata_overrides\.rm_type nope: unknown reward"):
        resolve_config([*SD35, "--eval-config", str(bad)])


@pytest.mark.exercises("--eval-config")
def test_the_references_other_shapes_a_mapping_of_datasets_and_no_eval_root(eval_files):
    conf = write(
        eval_files / "eval.yaml",
        "defaults: {n_samples_per_eval_prompt: 2}\ndatasets:\n  trees: {path: data/b.jsonl}\n  cubes: {name: cubes, path: data/a.jsonl}\n",
    )
    trees, cubes = eval_datasets(resolve_config([*SD35, "--eval-config", str(conf)]))
    assert (trees.name, trees.path, trees.n_samples_per_eval_prompt) == ("trees", str(eval_files / "data" / "b.jsonl"), 2)
    assert (cubes.name, cubes.path) == ("cubes", str(eval_files / "data" / "a.jsonl"))


@pytest.mark.exercises("--eval-config")
def test_the_file_is_read_once_while_it_stays_the_same(eval_files, monkeypatch):
    from omegaconf import OmegaConf

    conf = write(eval_files / "eval.yaml", "eval: {datasets: [{name: a, path: data/a.jsonl}]}\n")
    config = resolve_config([*SD35, "--eval-config", str(conf)])
    reads = []
    load = OmegaConf.load
    monkeypatch.setattr(OmegaConf, "load", lambda file: reads.append(file) or load(file))
    assert [d.name for d in eval_datasets(config)] == [d.name for d in eval_datasets(config)] == ["a"]
    assert reads == []  # resolve_config read it: the run's other readers reuse that
    write(conf, "eval: {datasets: [{name: b, path: data/a.jsonl}, {name: c, path: data/b.jsonl}]}\n")  # control: changed, read again
    assert [d.name for d in eval_datasets(config)] == ["b", "c"] and len(reads) == 1


@pytest.mark.exercises("--eval-config", "--eval-function-path")
def test_an_eval_function_must_return_the_sets_own_count(eval_files):
    import asyncio

    from miles_core.errors import HookError

    conf = write(eval_files / "eval.yaml", "eval: {datasets: [{name: b, path: data/b.jsonl, n_samples_per_eval_prompt: 2}]}\n")
    hook = ["--eval-function-path", "tests.custom_hooks_example.flag_count_eval", "--eval-config", str(conf)]
    evaluator = Evaluator(resolve_config([*SD35, *hook]), engine=None, scorer=None)
    with pytest.raises(
        HookError, match=rf"returned 2 samples, expected 4 \(--eval-config {conf}: dataset 'b' n_samples_per_eval_prompt 2 per prompt\)$"
    ):
        asyncio.run(evaluator.sample("b", evaluator.datasets["b"], 0))
    control = Evaluator(resolve_config([*SD35, *hook, "--n-samples-per-eval-prompt", "2"]), engine=None, scorer=None)
    assert len(asyncio.run(control.sample("b", control.datasets["b"], 0))) == 4


@pytest.mark.exercises("--eval-config")
def test_a_bad_eval_row_names_the_file_the_dataset_and_its_key(eval_files):
    from miles_core.errors import PromptDataError

    conf = write(eval_files / "eval.yaml", "eval: {datasets: [{name: b, path: data/b.jsonl, input_key: text}]}\n")
    rows = eval_files / "data" / "b.jsonl"
    with pytest.raises(PromptDataError) as caught:
        Evaluator(resolve_config([*SD35, "--eval-config", str(conf)]), engine=None, scorer=None)
    assert (
        str(caught.value) == f"--eval-config {conf}: dataset 'b': {rows}:1: no 'text' key (set the dataset's input_key to the prompt's key)"
    )
    # Control: --eval-prompt-data keeps load_prompts' own message (its key is a flag's).
    with pytest.raises(PromptDataError, match=rf"^{rows}:1: no 'text' key \(set --input-key"):
        Evaluator(resolve_config([*SD35, "--eval-prompt-data", "b", str(rows), "--eval-input-key", "text"]), engine=None, scorer=None)


@pytest.mark.exercises("--eval-config")
def test_the_guard_measures_diversity_per_set(eval_files):
    import asyncio
    from types import SimpleNamespace

    import torch

    from miles_core.training.guard import RunGuard

    conf = write(
        eval_files / "eval.yaml",
        "eval: {datasets: [{name: one, path: data/b.jsonl, n_samples_per_eval_prompt: 1}, {name: two, path: data/b.jsonl, n_samples_per_eval_prompt: 2}]}\n",
    )
    lines: list[str] = []
    guard = RunGuard(resolve_config([*SD35, "--eval-config", str(conf), "--eval-interval", "1"]), eval_files, lines.append)
    assert guard.samples_per_prompt == {"one": 1, "two": 2}
    assert "guard: diversity is not measured on eval set(s) one: it needs 2 or more samples per prompt" in lines
    images = [torch.full((3, 8, 8), level) for level in (0.2, 0.4, 0.6, 0.9)]
    result = SimpleNamespace(
        images={"one": images[:2], "two": images},
        samples={},
        rewards={"one": torch.tensor([0.3, 0.5]), "two": torch.tensor([0.3, 0.5, 0.2, 0.1])},
    )
    metrics = asyncio.run(guard.after_evaluation(result, 0, 0))
    assert "guard/two/diversity" in metrics and "guard/one/diversity" not in metrics
    assert "guard/one/brightness" in metrics  # control: the single-sample set is still watched
