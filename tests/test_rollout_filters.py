"""Rollout filters: the dynamic-sampling group filter (``check_reward_nonzero_std`` built
in), the buffer filter and the per-sample filter, as registered plugins or dotted paths;
their metrics; their errors; and what the trainer does with the smaller batch.

The filter-level tests build samples by hand (no pipeline); the run-level ones train the
tiny SD3 pipeline for a rollout or two.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, FilterError
from miles_core.rollout.filters import FilterOutput, RolloutFilters
from miles_core.rollout.sample import Sample
from miles_core.training.advantages import grpo_advantages
from miles_core.training.run import train
from tests.tiny_runs import tiny_run_args

HERE = "tests.test_rollout_filters"
NAN = float("nan")


def make_samples(*groups: list[float]) -> list[Sample]:
    """Scored samples, one list of rewards per prompt group (NaN: the reward failed)."""
    samples = []
    for g, rewards in enumerate(groups):
        for i, reward in enumerate(rewards):
            failed = reward != reward
            samples.append(
                Sample(
                    prompt=f"prompt {g}",
                    metadata={},
                    rollout_id=0,
                    group_index=g,
                    index_in_group=i,
                    seed=100 * g + i,
                    sde_step_indices=(),
                    output=None,
                    reward=reward,
                    reward_failed=failed,
                    remove_sample=failed,
                )
            )
    return samples


def settings(n: int = 4, batch: int = 3, *, group=None, buffer=None, sample=None):
    return SimpleNamespace(
        n_samples_per_prompt=n,
        rollout_batch_size=batch,
        dynamic_sampling_filter_path=group,
        buffer_filter_path=buffer,
        rollout_sample_filter_path=sample,
    )


def apply(config, samples, rollout_id: int = 0):
    return asyncio.run(RolloutFilters(config).apply(rollout_id, samples))


# -- user filters (dotted paths) ------------------------------------------------------------


def keep_even_groups(args, group):
    return group[0].group_index % 2 == 0


async def keep_odd_groups_async(args, group):
    return FilterOutput(keep=group[0].group_index % 2 == 1, reason=None if group[0].group_index % 2 else "even")


def keep_as_tensor(args, group):
    return torch.tensor(group[0].group_index > 0)


def says_yes(args, group):
    return "yes"


def last_two_reversed(args, rollout_id, groups, num_groups):
    assert num_groups == args.rollout_batch_size
    return list(reversed(groups))[:2]


def returns_a_dict(args, rollout_id, groups, num_groups):
    return {"groups": groups}


def returns_a_foreign_group(args, rollout_id, groups, num_groups):
    return [groups[0][:2]]


def returns_a_group_twice(args, rollout_id, groups, num_groups):
    return [groups[0], groups[0]]


def mask_first_sample(args, groups):
    for group in groups:
        group[0].remove_sample = True


def returns_the_groups(args, groups):
    return groups


def masks_with_an_int(args, groups):
    groups[0][1].remove_sample = 1


def unmasks_everything(args, groups):
    for group in groups:
        for sample in group:
            sample.remove_sample = False


def takes_one_argument(args):
    return True


# -- the group filter -------------------------------------------------------------------------


@pytest.mark.exercises("--dynamic-sampling-filter-path")
def test_check_reward_nonzero_std_keeps_the_groups_whose_rewards_differ():
    samples = make_samples(
        [1.0, 1.0, 1.0, 1.0],  # no spread: dropped
        [0.0, 1.0, 0.0, 1.0],  # kept
        [2.0, 2.0, 2.0, 2.0],  # dropped
        [0.5, NAN, 0.7, 0.5],  # a failed reward does not count; the others differ: kept
        [0.3, NAN, NAN, NAN],  # one valid reward: dropped
        [0.4, NAN, 0.4, 0.4],  # the valid ones are equal: dropped
    )
    result = apply(settings(batch=6, group="check_reward_nonzero_std"), samples)
    assert [group[0].group_index for group in result.groups] == [1, 3]
    assert result.samples == samples[4:8] + samples[12:16]
    assert result.metrics == {
        "rollout/filter/drop_zero_std_1.0": 1,
        "rollout/filter/drop_zero_std_2.0": 1,
        "rollout/filter/drop_zero_std_0.4": 1,
        "rollout/filter/drop_too_few_rewards": 1,
        "rollout/filter/groups_dropped": 4,
        "rollout/filter/groups_unselected": 0,
        "rollout/filter/groups_kept": 2,
        "rollout/filter/samples_removed": 1,  # group 3's failed sample stays masked
    }


@pytest.mark.exercises("--dynamic-sampling-filter-path")
def test_a_dotted_path_group_filter_may_return_a_bool_a_filter_output_or_a_bool_tensor():
    samples = make_samples([0.0, 1.0], [0.0, 1.0], [0.0, 1.0])
    even = apply(settings(n=2, group=f"{HERE}.keep_even_groups"), samples)
    assert [g[0].group_index for g in even.groups] == [0, 2] and even.metrics["rollout/filter/groups_dropped"] == 1
    odd = apply(settings(n=2, group=f"{HERE}.keep_odd_groups_async"), samples)
    assert [g[0].group_index for g in odd.groups] == [1]
    assert odd.metrics["rollout/filter/drop_even"] == 2
    tensor = apply(settings(n=2, group=f"{HERE}.keep_as_tensor"), samples)
    assert [g[0].group_index for g in tensor.groups] == [1, 2]


@pytest.mark.exercises("--dynamic-sampling-filter-path")
def test_a_group_filter_that_returns_something_else_stops_the_run_naming_the_flag():
    with pytest.raises(FilterError) as error:
        apply(settings(n=2, group=f"{HERE}.says_yes"), make_samples([0.0, 1.0]))
    assert str(error.value) == (
        f"--dynamic-sampling-filter-path {HERE}.says_yes: must return a bool (keep the group) or FilterOutput(keep, reason), got str 'yes'"
    )


# -- the buffer filter ------------------------------------------------------------------------


@pytest.mark.exercises("--buffer-filter-path", "--dynamic-sampling-filter-path")
def test_a_buffer_filter_chooses_and_orders_the_groups_that_are_trained():
    samples = make_samples([0.0, 1.0], [3.0, 3.0], [0.0, 2.0], [1.0, 0.0])
    # The dynamic filter runs first (group 1 dropped); the buffer filter sees the other three.
    result = apply(settings(n=2, batch=4, group="check_reward_nonzero_std", buffer=f"{HERE}.last_two_reversed"), samples)
    assert [g[0].group_index for g in result.groups] == [3, 2]
    assert result.samples == samples[6:8] + samples[4:6]
    assert (
        result.metrics["rollout/filter/groups_dropped"],
        result.metrics["rollout/filter/groups_unselected"],
        result.metrics["rollout/filter/groups_kept"],
    ) == (1, 1, 2)
    # The registered pop_first: the first --rollout-batch-size groups, in order.
    first = apply(settings(n=2, batch=4, buffer="pop_first"), samples)
    assert first.samples == samples and first.metrics["rollout/filter/groups_unselected"] == 0


@pytest.mark.exercises("--buffer-filter-path")
@pytest.mark.parametrize(
    "fn, message",
    [
        ("returns_a_dict", "must return a list of groups (lists of Sample), got dict"),
        (
            "returns_a_foreign_group",
            "item 0 of its return is not one of the groups it was given (whole prompt groups only, the same Sample objects)",
        ),
        ("returns_a_group_twice", "returned group 0 twice; each group is trained at most once"),
    ],
)
def test_a_buffer_filter_must_return_groups_it_was_given(fn, message):
    with pytest.raises(FilterError) as error:
        apply(settings(n=4, batch=2, buffer=f"{HERE}.{fn}"), make_samples([0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]))
    assert str(error.value) == f"--buffer-filter-path {HERE}.{fn}: {message}"


# -- the per-sample filter --------------------------------------------------------------------


@pytest.mark.exercises("--rollout-sample-filter-path")
def test_a_sample_filter_masks_samples_without_dropping_them():
    samples = make_samples([0.0, 1.0, 2.0], [5.0, NAN, 7.0])
    result = apply(settings(n=3, batch=2, sample=f"{HERE}.mask_first_sample"), samples)
    assert result.samples == samples  # nothing leaves the batch
    assert [s.remove_sample for s in samples] == [True, False, False, True, True, False]
    assert result.metrics["rollout/filter/samples_removed"] == 3  # two by the filter, one failed reward
    assert result.metrics["rollout/filter/groups_kept"] == 2


@pytest.mark.exercises("--rollout-sample-filter-path")
@pytest.mark.parametrize(
    "fn, message",
    [
        ("returns_the_groups", "must return None (it marks samples with sample.remove_sample = True), got list"),
        ("masks_with_an_int", "sample.remove_sample must be True or False, got int 1 (sample 1 of the kept groups)"),
        ("unmasks_everything", "set remove_sample = False on a sample whose reward failed; a failed sample stays out of the loss"),
    ],
)
def test_a_sample_filter_with_a_wrong_result_stops_the_run_naming_the_flag(fn, message):
    with pytest.raises(FilterError) as error:
        apply(settings(n=2, batch=2, sample=f"{HERE}.{fn}"), make_samples([0.0, 1.0], [NAN, 2.0]))
    assert str(error.value) == f"--rollout-sample-filter-path {HERE}.{fn}: {message}"


# -- the flags at configuration time ----------------------------------------------------------

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
    "--rm-type",
    "brightness",
]


@pytest.mark.exercises("--dynamic-sampling-filter-path", "--buffer-filter-path", "--rollout-sample-filter-path")
def test_filter_flags_take_a_registered_filter_of_their_stage_or_a_callable():
    config = resolve_config(
        [
            *BASE,
            "--dynamic-sampling-filter-path",
            "check_reward_nonzero_std",
            "--buffer-filter-path",
            "pop_first",
            "--rollout-sample-filter-path",
            f"{HERE}.mask_first_sample",
        ]
    )
    assert config.dynamic_sampling_filter_path == "check_reward_nonzero_std"
    with pytest.raises(ConfigError) as error:
        resolve_config(
            [
                *BASE,
                "--dynamic-sampling-filter-path",
                "nonzero_std",
                "--buffer-filter-path",
                "check_reward_nonzero_std",
                "--rollout-sample-filter-path",
                f"{HERE}.takes_one_argument",
            ]
        )
    assert error.value.messages == [
        "--dynamic-sampling-filter-path nonzero_std: not a registered group filter (registered: "
        "check_reward_nonzero_std) nor a dotted path package.module.function",
        "--buffer-filter-path check_reward_nonzero_std: 'check_reward_nonzero_std' is a group filter; this flag "
        "takes a buffer filter (registered: pop_first) or a dotted path to fn(args, rollout_id, groups, num_groups) "
        "-> list of groups",
        f"--rollout-sample-filter-path {HERE}.takes_one_argument: must be fn(args, groups) -> None, setting "
        "sample.remove_sample = True, got function takes_one_argument(args)",
    ]
    with pytest.raises(ConfigError) as error:
        resolve_config([*BASE, "--dynamic-sampling-filter-path", f"{HERE}.no_such_filter"])
    assert error.value.messages == [
        f"--dynamic-sampling-filter-path {HERE}.no_such_filter: module '{HERE}' has no attribute 'no_such_filter'"
    ]


# -- runs ---------------------------------------------------------------------------------------


async def even_groups_constant_rm(args, samples):
    """Rollout r has groups 2r and 2r+1: the even one gets 0.5 everywhere, the odd one a
    spread that depends on the seed."""
    return [0.5 if s.group_index % 2 == 0 else float(s.seed % 7) / 6 for s in samples]


async def constant_rm(args, samples):
    return [1.0] * len(samples)


def run(args, *extra):
    lines: list[str] = []
    config = resolve_config([*args, *extra])
    path = asyncio.run(train(config, log=lines.append))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()], lines


def tiny(tiny_sd3, prompts, out):
    args = tiny_run_args(tiny_sd3, prompts, out)
    at = args.index("--rm-type")
    del args[at : at + 2]
    return [*args, "--num-steps-per-rollout", "2", "--use-lora", "--lora-rank", "4", "--lr", "1e-2", "--deterministic-mode"]


@pytest.mark.exercises(
    "--dynamic-sampling-filter-path", "--rollout-sample-filter-path", "--num-steps-per-rollout", "--save-debug-train-data"
)
def test_dropped_groups_are_not_trained_and_the_kept_ones_keep_their_advantages(tiny_sd3, prompts, tmp_path):
    from miles_core.training.debug_data import load_train_data

    reward = ["--custom-rm-path", f"{HERE}.even_groups_constant_rm", "--num-rollout", "2"]
    plain, _ = run(
        tiny(tiny_sd3, prompts, tmp_path / "plain"), *reward, "--save-debug-train-data", str(tmp_path / "plain-train" / "{}.msgpack")
    )
    filtered, _ = run(
        tiny(tiny_sd3, prompts, tmp_path / "filtered"),
        *reward,
        "--dynamic-sampling-filter-path",
        "check_reward_nonzero_std",
        "--rollout-sample-filter-path",
        f"{HERE}.mask_first_sample",
        "--save-debug-train-data",
        str(tmp_path / "filtered-train" / "{}.msgpack"),
    )
    for before, after in zip(plain, filtered):
        # The even group (all 0.5) is dropped; the odd one is trained, its first sample masked.
        assert (
            after["rollout/filter/groups_kept"],
            after["rollout/filter/groups_dropped"],
            after["rollout/filter/drop_zero_std_0.5"],
            after["rollout/filter/samples_removed"],
        ) == (1, 1, 1, 1)
        assert (before["rollout/filter/groups_kept"], before["rollout/filter/groups_dropped"]) == (2, 0)
        assert (before["rollout/num_samples"], after["rollout/num_samples"]) == (8, 4)
        # 4 samples x 2 SDE steps, over the same 2 optimizer steps; the reward metrics cover the whole rollout.
        assert (before["train/num_pairs"], after["train/num_pairs"]) == (16, 8)
        assert len(after["train/loss_per_step"]) == len(before["train/loss_per_step"]) == 2
        assert after["rollout/reward/raw_mean"] == before["rollout/reward/raw_mean"]
    for rollout_id in (0, 1):
        full = load_train_data(tmp_path / "plain-train" / f"{rollout_id}.msgpack")
        kept = load_train_data(tmp_path / "filtered-train" / f"{rollout_id}.msgpack")
        assert kept["samples"]["group_index"] == [2 * rollout_id + 1] * 4
        assert kept["samples"]["remove_sample"] == [True, False, False, False]
        # The kept group's advantages are those of the unfiltered run, the masked sample counted in its group's
        # statistics: GRPO over all four rewards.
        assert torch.equal(kept["rewards"], full["rewards"][4:])
        assert torch.allclose(kept["advantages"], full["advantages"][4:])
        assert torch.allclose(kept["advantages"], grpo_advantages(kept["rewards"].double(), 4).float())
        assert float(kept["advantages"][0]) != 0.0
        # The masked sample's pairs carry loss mask 0, the others 1.
        pairs = kept["pairs"]
        assert pairs["loss_mask"].tolist() == [0.0 if i == 0 else 1.0 for i in pairs["sample_index"].tolist()]


@pytest.mark.exercises("--dynamic-sampling-filter-path")
def test_a_rollout_whose_groups_are_all_dropped_trains_nothing(tiny_sd3, prompts, tmp_path):
    records, lines = run(
        tiny(tiny_sd3, prompts, tmp_path / "run"),
        "--custom-rm-path",
        f"{HERE}.constant_rm",
        "--num-rollout",
        "1",
        "--dynamic-sampling-filter-path",
        "check_reward_nonzero_std",
    )
    (record,) = records
    assert (
        record["rollout/filter/groups_kept"],
        record["rollout/filter/groups_dropped"],
        record["rollout/filter/drop_zero_std_1.0"],
        record["rollout/num_samples"],
    ) == (0, 2, 2, 0)
    assert not [key for key in record if key.startswith("train/")]
    assert "rollout/advantages/abs_mean" not in record and record["rollout/reward/raw_mean"] == 1.0
    assert lines[0].startswith("threads: ")  # the run's thread plan, then the rollout's warning
    assert lines[1] == (
        "warning: rollout 0: the rollout filters kept no prompt group (2 dropped by --dynamic-sampling-filter-path, "
        "0 left out by --buffer-filter-path); no optimizer step this rollout"
    )


@pytest.mark.exercises("--dynamic-sampling-filter-path")
def test_the_filter_example_of_the_docs_works(monkeypatch):
    """docs/rewards.md's example group filter, run as the module it says to write."""
    import re
    import sys
    import types
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "def not_all_failed" in block]
    module = types.ModuleType("my_filters")
    exec(compile(code, "my_filters.py", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_filters", module)
    result = apply(settings(n=2, batch=3, group="my_filters.not_all_failed"), make_samples([NAN, NAN], [1.0, NAN], [2.0, 2.0]))
    assert [g[0].group_index for g in result.groups] == [1, 2]
    assert result.metrics["rollout/filter/drop_all_failed"] == 1


@pytest.mark.exercises("--num-steps-per-rollout")
@pytest.mark.parametrize(
    "count, steps, sizes",
    [
        (16, 2, [8, 8]),  # a full rollout: --global-batch-size samples per step
        (8, 2, [4, 4]),  # half the groups dropped: the same two steps, half as large
        (6, 4, [2, 2, 1, 1]),  # sizes differ by at most one
        (2, 4, [1, 1]),  # fewer samples than steps: one step per sample, none empty
        (0, 4, []),
    ],
)
def test_a_smaller_batch_is_spread_over_the_same_optimizer_steps(count, steps, sizes):
    from miles_core.training.trainer import Trainer

    trainer = SimpleNamespace(config=SimpleNamespace(num_steps_per_rollout=steps))
    windows = Trainer._step_windows(trainer, count)
    assert [len(w) for w in windows] == sizes
    assert [i for w in windows for i in w] == list(range(count))  # contiguous, in order
