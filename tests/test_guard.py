"""The reward-hacking guard (docs/guide.md, "Reward-hacking guard"): its arithmetic on given
numbers, its flags, the KL to the reference, and --guard-stop-on-alarm on a tiny run. The
demo's own run raising the diversity alarm (and its frozen control raising none) is in
tests/test_learning.py, which shares those two runs with the paired-gain test."""

import asyncio
import json

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, GuardStopError
from miles_core.training.guard import (
    SPREAD_FLOOR_ABSOLUTE,
    EvalSetObservation,
    Guard,
    GuardSettings,
)
from miles_core.training.run import train
from tests.tiny_runs import frozen_trainer_and_rollout, tiny_run_args


def observation(**values):
    rewards = values.pop("rewards", torch.tensor([0.5, 0.5]))
    judge = values.pop("judge", None)
    return {"held": EvalSetObservation({k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}, rewards, judge)}


def test_drift_is_in_units_of_the_first_evaluations_spread():
    guard = Guard(GuardSettings(threshold=2.0))
    first = guard.check(rollout_id=0, trained_rollouts=0, eval_sets=observation(brightness=[0.3, 0.5], diversity=[0.2, 0.4]))
    # Baseline 0.4, spread std([0.3, 0.5]) = 0.1414...; no drift, no alarm at the baseline.
    assert first.metrics["guard/held/brightness"] == pytest.approx(0.4)
    assert first.metrics["guard/held/brightness/drift"] == 0.0 and first.metrics["guard/alarms"] == 0.0
    spread = float(torch.tensor([0.3, 0.5], dtype=torch.float64).std())
    # Brightness up by 2.5 spreads: an alarm (either direction); diversity up: none (it alarms when it falls).
    later = guard.check(
        rollout_id=9,
        trained_rollouts=10,
        eval_sets=observation(brightness=[0.4 + 2.5 * spread] * 2, diversity=[0.3 + 3 * spread] * 2),
    )
    assert later.metrics["guard/held/brightness/drift"] == pytest.approx(2.5)
    assert later.metrics["guard/held/brightness/alarm"] == 1.0
    assert later.metrics["guard/held/diversity/alarm"] == 0.0
    (alarm,) = later.alarms
    assert (alarm.statistic, alarm.eval_set, alarm.rollout_id, alarm.trained_rollouts) == ("brightness", "held", 9, 10)
    assert alarm.baseline == pytest.approx(0.4) and alarm.spread == pytest.approx(spread) and alarm.threshold == 2.0
    assert alarm.message == "guard: alarm: held brightness rose 2.5 spreads above the first evaluation (0.4 -> 0.754; threshold 2)"
    # Diversity falling by 2.1 spreads: an alarm; brightness back within 2 spreads: none.
    fell = guard.check(rollout_id=19, trained_rollouts=20, eval_sets=observation(brightness=[0.4, 0.4], diversity=[0.3 - 2.1 * spread] * 2))
    assert fell.metrics["guard/held/diversity/drift"] == pytest.approx(-2.1)
    assert [a.statistic for a in fell.alarms] == ["diversity"] and fell.metrics["guard/alarms"] == 1.0
    assert "held diversity fell 2.1 spreads below the first evaluation" in fell.alarms[0].message


def test_a_constant_statistic_has_a_floored_spread():
    guard = Guard(GuardSettings(threshold=3.0))
    guard.check(rollout_id=0, trained_rollouts=0, eval_sets=observation(saturation=[0.0, 0.0]))
    # std 0 and baseline 0: the absolute floor; any change is then many spreads.
    report = guard.check(rollout_id=1, trained_rollouts=1, eval_sets=observation(saturation=[1e-6, 1e-6]))
    assert report.metrics["guard/held/saturation/drift"] == pytest.approx(1e-6 / SPREAD_FLOOR_ABSOLUTE)
    guard.check(rollout_id=0, trained_rollouts=0, eval_sets=observation(contrast=[0.5, 0.5]))
    # A constant 0.5: the relative floor, 1% of it.
    report = guard.check(rollout_id=1, trained_rollouts=1, eval_sets=observation(contrast=[0.51, 0.51]))
    assert report.metrics["guard/held/contrast/drift"] == pytest.approx(2.0)


def test_per_statistic_thresholds_and_the_reward_gap():
    guard = Guard(GuardSettings(threshold=100.0, thresholds={"reward_gap": 1.0}))
    rewards = torch.tensor([0.4, 0.6, float("nan")], dtype=torch.float64)  # a failed sample (NaN) counts nowhere
    first = guard.check(rollout_id=0, trained_rollouts=0, eval_sets=observation(rewards=rewards))
    assert "guard/held/reward_gap" not in first.metrics  # no training rollouts before the first evaluation
    # Training reward 0.5, held-out 0.4 and 0.6: gap 0, spread std([0.1, -0.1]) = 0.1414.
    base = guard.check(rollout_id=9, trained_rollouts=10, eval_sets=observation(rewards=rewards), training_reward=0.5)
    assert base.metrics["guard/held/reward_gap"] == pytest.approx(0.0, abs=1e-12)
    grown = guard.check(rollout_id=19, trained_rollouts=20, eval_sets=observation(rewards=rewards), training_reward=0.7)
    assert grown.metrics["guard/held/reward_gap/drift"] == pytest.approx(0.2 / 0.1414213562373095)
    assert [a.statistic for a in grown.alarms] == ["reward_gap"] and grown.alarms[0].threshold == 1.0
    shrunk = guard.check(rollout_id=29, trained_rollouts=30, eval_sets=observation(rewards=rewards), training_reward=0.3)
    assert shrunk.alarms == []  # the gap alarms only when it grows


@pytest.mark.exercises("--guard-rm-type")
def test_the_judge_alarms_only_when_it_falls_while_the_trained_reward_rises():
    guard = Guard(GuardSettings(threshold=2.0, judge="brightness"))
    judge = torch.tensor([0.5, 0.7])  # baseline 0.6, spread 0.1414
    guard.check(rollout_id=0, trained_rollouts=0, eval_sets=observation(rewards=torch.tensor([0.3, 0.3]), judge=judge))
    falling = judge - 0.5
    # The judge fell 3.5 spreads but the trained reward fell too: no alarm.
    both = guard.check(rollout_id=9, trained_rollouts=10, eval_sets=observation(rewards=torch.tensor([0.2, 0.2]), judge=falling))
    assert both.metrics["guard/held/judge_reward/drift"] == pytest.approx(-0.5 / 0.1414213562373095)
    assert both.metrics["guard/held/judge_reward/alarm"] == 0.0
    # The trained reward rose while the judge fell: the alarm.
    hacked = guard.check(rollout_id=19, trained_rollouts=20, eval_sets=observation(rewards=torch.tensor([0.4, 0.4]), judge=falling))
    (alarm,) = hacked.alarms
    assert alarm.statistic == "judge_reward"
    assert alarm.message.startswith("guard: alarm: held judge reward (brightness) fell 3.5 spreads below the first evaluation while")


def test_the_kl_has_an_absolute_bound():
    guard = Guard(GuardSettings(threshold=2.0, kl_max=0.01))
    quiet = guard.check(rollout_id=0, trained_rollouts=0, eval_sets={}, kl=0.0)
    assert quiet.metrics == {"guard/kl": 0.0, "guard/kl/drift": 0.0, "guard/kl/alarm": 0.0, "guard/alarms": 0.0}
    loud = guard.check(rollout_id=9, trained_rollouts=10, eval_sets={}, kl=0.02)
    assert loud.metrics["guard/kl/alarm"] == 1.0
    assert loud.alarms[0].message == "guard: alarm: KL to the reference 0.02 exceeds its bound (--guard-kl-max 0.01)"
    assert "guard/kl" not in guard.check(rollout_id=19, trained_rollouts=20, eval_sets={}).metrics  # not measured


BASE = ["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2"]
EVAL = ["--eval-interval", "1", "--eval-prompt-data", "held", "p.jsonl"]


@pytest.mark.exercises("--guard-threshold", "--guard-thresholds", "--guard-kl-max", "--no-guard")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--guard-thresholds", "diversity=2", "sharpness=3"],
            "--guard-thresholds sharpness=3: unknown statistic 'sharpness'; known: brightness,",
        ),
        (["--guard-thresholds", "diversity"], "--guard-thresholds diversity: expected STAT=X (for example diversity=2.5)"),
        (
            ["--guard-thresholds", "diversity=-1"],
            "--guard-thresholds diversity=-1: the threshold must be a finite number above 0 (in spreads)",
        ),
        (
            ["--guard-thresholds", "diversity=nan"],
            "--guard-thresholds diversity=nan: the threshold must be a finite number above 0 (in spreads)",
        ),
        (["--guard-threshold", "0"], "--guard-threshold 0.0: must be positive"),
        (["--guard-kl-max", "-1"], "--guard-kl-max -1.0: must be positive"),
        (["--no-guard", "--guard-threshold", "3"], "--no-guard and --guard-threshold are mutually exclusive (the guard is off)"),
    ],
)
def test_bad_guard_flags_are_one_line_config_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError) as caught:
        resolve_config(BASE + EVAL + extra)
    lines = [line for line in str(caught.value).splitlines() if "guard" in line]
    assert len(lines) == 1 and lines[0].startswith(message), str(caught.value)


@pytest.mark.exercises("--guard-stop-on-alarm")
def test_guard_flags_without_evaluations_are_an_error():
    with pytest.raises(
        ConfigError, match=r"--guard-stop-on-alarm: the guard checks evaluations; set --eval-interval and --eval-prompt-data"
    ):
        resolve_config(BASE + ["--guard-stop-on-alarm"])


def test_reference_kl_is_zero_at_frozen_lora_weights_and_not_after_a_nudge(tiny_sd3):
    with frozen_trainer_and_rollout(tiny_sd3, "--use-lora", "--lora-rank", "4") as (_, trainer, group):
        assert trainer.kl_reference() == "lora_base"
        assert trainer.reference_kl() is None  # before any rollout trained: nothing to measure on
        trainer.train_rollout(group, torch.tensor([1.0, -1.0]))  # frozen: no optimizer step
        # LoRA B starts at zero, so the adapted forward adds exact zeros: the same means, bit for bit.
        assert trainer.reference_kl() == 0.0
        lora_b = next(p for name, p in trainer.modules["transformer"].named_parameters() if "lora_B" in name)
        with torch.no_grad():
            lora_b[0, 0] += 1e-2  # the control: one weight of the policy nudged
        assert trainer.reference_kl() > 0.0


def test_reference_kl_needs_a_reference(tiny_sd3):
    with frozen_trainer_and_rollout(tiny_sd3) as (_, trainer, _):  # full fine-tuning without an EMA
        assert trainer.kl_reference() is None and trainer.reference_kl() is None


def eval_result(levels, rewards):
    """An evaluation's result as the RL loop hands it to the guard: flat grey 8x8 images
    (two samples per prompt) and their held-out rewards."""
    from types import SimpleNamespace

    images = [torch.full((3, 8, 8), float(level)) for level in levels]
    return SimpleNamespace(images={"held": images}, samples={"held": []}, rewards={"held": torch.tensor(rewards)})


def run_guard(tmp_path, *extra):
    from miles_core.training.guard import guard_for_run

    config = resolve_config(BASE + EVAL + ["--n-samples-per-eval-prompt", "2", *extra])
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = []
    guard = guard_for_run(config, None, None, tmp_path, lines.append, on_engine_thread=False)
    return guard, lines


def test_a_restored_guard_goes_on_as_if_uninterrupted(tmp_path):
    """The guard's state in a checkpoint: the baselines, and the training rewards noted
    since the last evaluation, which still count after a resume (the resumed run's
    evaluation before its first rollout re-measures the checkpoint's weights and
    consumes none)."""
    first, later = eval_result([0.2, 0.4, 0.6, 0.9], [0.3, 0.5]), eval_result([0.3, 0.3, 0.7, 0.7], [0.4, 0.6])
    whole, _ = run_guard(tmp_path / "whole")
    asyncio.run(whole.after_evaluation(first, 0, 0))
    whole.training_reward({"rollout/reward/raw_mean": 0.7})  # rollout 0 ...
    state = json.loads(json.dumps(whole.state_dict()))  # ... then a checkpoint: JSON round-trips the floats exactly
    whole.training_reward({"rollout/reward/raw_mean": 0.9})
    expected = asyncio.run(whole.after_evaluation(later, 1, 2))

    resumed, _ = run_guard(tmp_path / "resumed")
    resumed.load_state_dict(state)
    asyncio.run(resumed.after_evaluation(later, 1, 1))  # the resumed run's evaluation before rollout 1
    resumed.training_reward({"rollout/reward/raw_mean": 0.9})
    assert asyncio.run(resumed.after_evaluation(later, 1, 2)) == expected
    assert expected["guard/held/reward_gap"] == pytest.approx(0.8 - 0.5)  # both rollouts' training reward, mean 0.8
    # The control: a fresh guard takes this evaluation as its baseline.
    fresh, _ = run_guard(tmp_path / "fresh")
    assert asyncio.run(fresh.after_evaluation(later, 1, 2))["guard/held/brightness/drift"] == 0.0
    assert expected["guard/held/brightness/drift"] != 0.0


def test_under_nft_the_kl_is_not_measured_and_says_why(tmp_path):
    guard, lines = run_guard(tmp_path, "--loss-type", "nft", "--diffusion-num-sde-steps", "0", "--use-lora")
    assert guard.measure_kl is None
    assert "guard: the KL to the reference is not measured: --loss-type nft trains on final latents" in "\n".join(lines)
    metrics = asyncio.run(guard.after_evaluation(eval_result([0.2, 0.4, 0.6, 0.9], [0.3, 0.5]), 0, 0))
    assert "guard/held/brightness" in metrics and not any(key.startswith("guard/kl") for key in metrics)


@pytest.mark.exercises("--guard-rm-type", "--eval-reward-key")
def test_a_dict_valued_judge_is_read_at_the_evaluations_key(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from miles_core.errors import RewardError
    from miles_core.plugin_manager import get_host
    from miles_core.registry import PluginInfo, Registration
    from miles_core.specs import RewardSpec

    spec = RewardSpec(name="tones", ref="tests.reward_examples:Tones", description="brightness and contrast")
    monkeypatch.setitem(get_host().registries.reward._entries, "tones", Registration(spec, PluginInfo("tones", "tests", "0")))
    levels = [0.2, 0.4]

    def samples():
        return [
            SimpleNamespace(pixels=torch.full((3, 4, 4), v), prompt="p", metadata={}, seed=i, group_index=0, index_in_group=i)
            for i, v in enumerate(levels)
        ]

    keyed, _ = run_guard(tmp_path / "keyed", "--guard-rm-type", "tones", "--eval-reward-key", "brightness")
    assert asyncio.run(keyed._judge_rewards(samples())).tolist() == pytest.approx(levels)
    keyless, _ = run_guard(tmp_path / "keyless", "--guard-rm-type", "tones")
    with pytest.raises(RewardError) as caught:
        asyncio.run(keyless._judge_rewards(samples()))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--guard-rm-type tones: reward tones returns a dict per sample (keys: brightness, contrast)")


def strip_guard_state(checkpoint, step):
    """The checkpoint as a version without the guard's state wrote it."""
    from miles_core.training.checkpoint import iteration_dir

    meta = iteration_dir(checkpoint, step) / "meta.json"
    document = json.loads(meta.read_text())
    del document["extra"]["guard"]
    meta.write_text(json.dumps(document))


@pytest.mark.exercises("--guard-stop-on-alarm", "--guard-thresholds", "--guard-rm-type", "--log-level")
def test_stop_on_alarm_checkpoints_exits_3_and_a_resume_keeps_the_baselines(tiny_sd3, prompts, tmp_path):
    # Training with a large learning rate moves every statistic; a tiny threshold makes
    # any move an alarm at the first evaluation after training.
    def args(out, *extra):
        return tiny_run_args(tiny_sd3, prompts, out) + [
            "--num-rollout",
            "2",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            "3e-2",
            "--eval-interval",
            "1",
            "--eval-prompt-data",
            "held",
            str(prompts),
            "--n-samples-per-eval-prompt",
            "2",
            "--guard-thresholds",
            "brightness=1e-9",
            "--guard-rm-type",
            "brightness",
            "--log-level",
            "warning",
            *extra,
        ]

    def records(run, name="metrics.jsonl"):
        return [json.loads(line) for line in (run / name).read_text().splitlines()]

    def guard_metrics(record):
        return {key: value for key, value in record.items() if key.startswith("guard/")}

    lines = []
    stopped_run = tmp_path / "stopped"
    with pytest.raises(GuardStopError) as caught:
        asyncio.run(train(resolve_config(args(stopped_run, "--guard-stop-on-alarm")), log=lines.append))
    stopped = records(stopped_run)
    assert [r["rollout_id"] for r in stopped] == [0] and stopped[0]["guard/held/brightness/alarm"] == 1.0
    assert caught.value.exit_code == 3
    message = str(caught.value)
    checkpoint = stopped_run / "guard_checkpoint"
    assert "\n" not in message and "held/brightness" in message and f"checkpoint at {checkpoint}" in message
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert (stopped_run / "lora").is_dir()  # the final weights are still written
    # The judge scored copies of the samples: the evaluation's own reward (jpeg_incompressibility) is untouched.
    judged, evaluated = stopped[0]["guard/held/judge_reward"], stopped[0]["eval/held/reward_mean"]
    assert 0.0 < judged < 1.0 and judged != evaluated
    alarms = records(stopped_run, "guard.jsonl")
    assert {a["statistic"] for a in alarms} >= {"brightness"} and all(a["rollout_id"] == 0 for a in alarms)
    # At --log-level warning the alarms are warnings: on the console and in train.log; rollout lines are not.
    assert [a["message"] for a in alarms] == [line for line in lines if line.startswith("guard: alarm:")]
    train_log = (stopped_run / "train.log").read_text()
    assert all(f"WARNING {a['message']}" in train_log for a in alarms) and "rollout 1/2" not in train_log

    # The control: without the flag the run trains all its rollouts and still records the alarms.
    whole_run = tmp_path / "whole"
    asyncio.run(train(resolve_config(args(whole_run)), log=lambda line: None))
    whole = records(whole_run)
    assert [r["rollout_id"] for r in whole] == [0, 1] and guard_metrics(whole[0]) == guard_metrics(stopped[0])
    assert whole[1]["guard/held/brightness/alarm"] == 1.0 and records(whole_run, "guard.jsonl")[: len(alarms)] == alarms

    # Resumed from the guard's checkpoint into the whole run's directory (a partial last
    # line left by a kill mid-write): rollout 1 is redone, its records superseded, and its
    # guard compares with the original first evaluation: the same metrics, bit for bit.
    with (whole_run / "metrics.jsonl").open("a") as handle:
        handle.write('{"rollout_id": 2, "perf/st')
    asyncio.run(train(resolve_config(args(whole_run, "--load", str(checkpoint))), log=lambda line: None))
    resumed = records(whole_run)
    assert [r["rollout_id"] for r in resumed] == [0, 1] and records(whole_run, "metrics.superseded.jsonl") == whole[1:]
    assert guard_metrics(resumed[1]) == guard_metrics(whole[1])
    assert any(r["rollout_id"] == 1 for r in records(whole_run, "guard.superseded.jsonl"))
    assert "held/brightness" in [f"{a['eval_set']}/{a['statistic']}" for a in records(whole_run, "guard.jsonl") if a["rollout_id"] == 1]

    # The control: from a checkpoint without the guard's state the resumed run's first
    # evaluation is a new baseline, so its drifts are 0 where the restored guard's are not.
    strip_guard_state(checkpoint, 0)
    fresh_run = tmp_path / "fresh"
    asyncio.run(train(resolve_config(args(fresh_run, "--load", str(checkpoint), "--skip-eval-before-train")), log=lambda line: None))
    (fresh,) = records(fresh_run)
    drifts = {key: value for key, value in guard_metrics(fresh).items() if key.endswith("/drift") and "/kl/" not in key}
    assert drifts and set(drifts.values()) == {0.0}
    # Only the KL may alarm: it has an absolute bound (--guard-kl-max), no baseline.
    assert [key for key, value in guard_metrics(fresh).items() if key.endswith("/alarm") and value] in ([], ["guard/kl/alarm"])
    assert resumed[1]["guard/held/brightness/drift"] != 0.0


@pytest.mark.exercises("--no-guard")
def test_no_guard_measures_nothing(tiny_sd3, prompts, tmp_path):
    args = tiny_run_args(tiny_sd3, prompts, tmp_path / "run") + [
        "--num-rollout",
        "1",
        "--eval-interval",
        "1",
        "--eval-prompt-data",
        "held",
        str(prompts),
        "--n-samples-per-eval-prompt",
        "2",
        "--no-guard",
    ]
    asyncio.run(train(resolve_config(args), log=lambda line: None))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/held/reward_mean" in records[0] and not any(k.startswith("guard/") for r in records for k in r)
