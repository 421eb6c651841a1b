"""Reward dispatch (``miles_core.training.rewards``): ``--rm-type``, per-sample
``metadata.rm_type``, dict rewards and ``--reward-key``, ``--custom-rm-path``,
``--group-rm``, per-sample failures, evaluation rewards, and saved rollouts that keep it all."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, RewardError
from miles_core.plugin_manager import get_host
from miles_core.training.advantages import advantages_from_config
from miles_core.training.rewards import RewardScorer
from tests import reward_examples
from tests.tiny_runs import run_metrics, tiny_run_args

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
EXAMPLES = "tests.reward_examples"


def resolve(*argv):
    return resolve_config([*BASE, *argv])


def make_samples(levels=(0.1, 0.5, 0.9, 0.3), prompts=None, metadata=None, n=2):
    """One sample per level: a flat grey image of that value; ``n`` samples per prompt group."""
    prompts = prompts or [f"prompt {i // n}" for i in range(len(levels))]
    metadata = metadata or [{} for _ in levels]
    return [
        SimpleNamespace(
            pixels=torch.full((3, 4, 4), float(level)),
            prompt=prompt,
            metadata=meta,
            seed=100 + i,
            group_index=i // n,
            index_in_group=i % n,
            reward=None,
            reward_components={},
            reward_failed=False,
            remove_sample=False,
        )
        for i, (level, prompt, meta) in enumerate(zip(levels, prompts, metadata))
    ]


def without_rm_type(args):
    i = args.index("--rm-type")
    return args[:i] + args[i + 2 :]


def score(scorer, samples):
    return asyncio.run(scorer.score(samples)).tolist()


def redness(pixels):
    r, g, b = np.asarray(pixels, dtype=np.float64)
    return float(np.mean(r - (g + b) / 2))


@pytest.fixture
def recorded(monkeypatch):
    """Calls to the registered brightness and redness rewards: (reward, number of outputs),
    and how often each was built."""
    from miles_rewards.diagnostic import Brightness, Redness

    calls, built = [], []
    for cls in (Brightness, Redness):
        original_call, original_init = cls.__call__, cls.__init__

        def call(self, outputs, prompts=None, metadata=None, _original=original_call):
            calls.append((self.name, len(outputs)))
            return _original(self, outputs, prompts, metadata)

        def init(self, config=None, _original=original_init):
            built.append(type(self).__name__.lower())
            _original(self, config)

        monkeypatch.setattr(cls, "__call__", call)
        monkeypatch.setattr(cls, "__init__", init)
    return SimpleNamespace(calls=calls, built=built)


@pytest.fixture
def tones(monkeypatch):
    """Registers reward_examples.Tones (a dict-valued reward) as ``tones`` for one test."""
    from miles_core.registry import PluginInfo, Registration
    from miles_core.specs import RewardSpec

    registry = get_host().registries.reward
    spec = RewardSpec(name="tones", ref="tests.reward_examples:Tones", description="brightness and contrast")
    monkeypatch.setitem(registry._entries, "tones", Registration(spec, PluginInfo("tones", "tests", "0")))
    reward_examples.Tones.built = 0
    return reward_examples.Tones


@pytest.fixture
def register(monkeypatch):
    """``register(name, cls)``: registers ``tests.reward_examples.<cls>`` as reward ``name`` for one test."""
    from miles_core.registry import PluginInfo, Registration
    from miles_core.specs import RewardSpec

    registry = get_host().registries.reward

    def add(name, cls):
        spec = RewardSpec(name=name, ref=f"tests.reward_examples:{cls}", description=f"test reward {cls}")
        monkeypatch.setitem(registry._entries, name, Registration(spec, PluginInfo(name, "tests", "0")))

    return add


@pytest.fixture(autouse=True)
def clear_calls():
    reward_examples.CALLS.clear()


# -- dispatch --------------------------------------------------------------------------------


@pytest.mark.exercises("--rm-type")
def test_rm_type_is_built_once_and_scores_every_sample_in_one_call(recorded):
    scorer = RewardScorer(resolve("--rm-type", "brightness"))
    samples = make_samples()
    assert score(scorer, samples) == pytest.approx([0.1, 0.5, 0.9, 0.3])
    score(scorer, make_samples())
    assert recorded.built == ["brightness"] and recorded.calls == [("brightness", 4)] * 2
    assert [(s.reward_components, s.reward_failed, s.remove_sample) for s in samples] == [({}, False, False)] * 4
    assert scorer.finish(samples) == {
        "rollout/reward/raw_mean": pytest.approx(0.45),
        "rollout/reward/raw_std": pytest.approx(math.sqrt(0.0875)),
        "rollout/reward/raw_min": pytest.approx(0.1),
        "rollout/reward/raw_max": pytest.approx(0.9),
        "rollout/reward/failed": 0,
        "rollout/reward/brightness_failed": 0,
    }


@pytest.mark.exercises("--rm-type")
def test_a_registered_reward_runs_off_the_event_loop_and_concurrent_calls_are_safe(monkeypatch):
    import threading
    import time

    from miles_rewards.diagnostic import Brightness

    original, threads = Brightness.__call__, []

    def slow(self, outputs, prompts=None, metadata=None):
        threads.append((threading.get_ident(), len(outputs)))
        time.sleep(0.2)  # CPU-bound work, as far as the event loop can tell
        return original(self, outputs, prompts, metadata)

    monkeypatch.setattr(Brightness, "__call__", slow)
    scorer = RewardScorer(resolve("--rm-type", "brightness"))
    first, second = make_samples(levels=(0.1, 0.2)), make_samples(levels=(0.3, 0.4))
    ticks = []

    async def main():
        async def tick():
            while len(ticks) < 1000:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        scored = await asyncio.gather(scorer.score(first), scorer.score(second))
        ticker.cancel()
        return scored

    a, b = asyncio.run(main())
    assert a.tolist() == pytest.approx([0.1, 0.2]) and b.tolist() == pytest.approx([0.3, 0.4])
    assert len(ticks) >= 10  # the loop kept running during 0.2 s of reward work
    # Both score() calls submitted their samples before the reward was free: one call for the four.
    assert [n for _, n in threads] == [4] and threading.get_ident() not in [t for t, _ in threads]


@pytest.mark.exercises("--rm-type")
def test_metadata_rm_type_routes_samples_to_their_reward(recorded):
    pixels = [torch.tensor([[[1.0]], [[0.5]], [[0.0]]]).expand(3, 4, 4)] * 4
    samples = make_samples(metadata=[{"rm_type": "redness"}, {}, {"rm_type": "redness"}, {"rm_type": " "}])
    for sample, image in zip(samples, pixels):
        sample.pixels = image
    scorer = RewardScorer(resolve("--rm-type", "brightness"))
    assert score(scorer, samples) == pytest.approx([0.75, 0.5, 0.75, 0.5])  # redness = 1 - 0.25, brightness = 0.5
    # One call per reward, for all of its samples; each reward built once and kept.
    assert sorted(recorded.calls) == [("brightness", 2), ("redness", 2)]
    score(scorer, samples)
    assert sorted(recorded.built) == ["brightness", "redness"]
    assert scorer.reward_set(samples[0]) == "redness" and scorer.reward_set(samples[3]) is None


@pytest.mark.exercises("--rm-type")
def test_unknown_reward_names_list_the_installed_ones():
    scorer = RewardScorer(resolve("--rm-type", "brightness"))
    samples = make_samples(metadata=[{"rm_type": "brightnes"}, {}, {}, {}])
    with pytest.raises(RewardError) as info:
        score(scorer, samples)
    message = str(info.value)
    assert message.startswith("metadata rm_type of sample 'prompt 0' (seed 100): reward 'brightnes': unknown reward; installed: ")
    installed = message.split("installed: ", 1)[1].split(", ")
    assert {"brightness", "colorfulness"} <= set(installed) and installed == sorted(installed) and "\n" not in message
    with pytest.raises(ConfigError, match="^--rm-type brightnes: unknown reward; installed: .*brightness, .*colorfulness"):
        resolve("--rm-type", "brightnes")


@pytest.mark.exercises("--reward-key")
def test_dict_rewards_train_on_the_reward_key_and_report_the_other_keys(tones):
    samples = make_samples(levels=(0.2, 0.6))
    scorer = RewardScorer(resolve("--rm-type", "tones", "--reward-key", "contrast"))
    samples[1].pixels = torch.stack([torch.zeros(4, 4), torch.ones(4, 4), torch.full((4, 4), 0.5)])
    assert score(scorer, samples) == pytest.approx([0.0, math.sqrt(1 / 6)])
    assert [s.reward_components for s in samples] == [{"brightness": pytest.approx(0.2)}, {"brightness": pytest.approx(0.5)}]
    assert scorer.finish(samples)["rollout/reward/brightness_mean"] == pytest.approx(0.35)
    assert tones.built == 1
    # A custom reward may return dicts too; keys that are not numbers are not components.
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.length_parts", "--reward-key", "words"))
    samples = make_samples(levels=(0.2, 0.6), prompts=["a red cube", "night"])
    assert score(scorer, samples) == [3.0, 1.0]
    assert [s.reward_components for s in samples] == [{"length": 10.0}, {"length": 5.0}]


@pytest.mark.exercises("--reward-key")
def test_a_dict_reward_without_a_usable_key_is_a_one_line_error_listing_its_keys(tones):
    with pytest.raises(RewardError) as info:
        score(RewardScorer(resolve("--rm-type", "tones")), make_samples())
    assert str(info.value) == (
        "reward tones returns a dict per sample (keys: brightness, contrast); choose the trained one with --reward-key"
    )
    with pytest.raises(RewardError) as info:
        score(RewardScorer(resolve("--rm-type", "tones", "--reward-key", "sharpness")), make_samples())
    assert str(info.value) == "--reward-key sharpness: reward tones returns no such key (keys: brightness, contrast)"


@pytest.mark.exercises("--custom-rm-path")
def test_custom_rm_gets_every_sample_in_one_batched_call_and_overrides_metadata_rm_type():
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.prompt_length"))
    prompts = ["a", "bb", "ccc", "dddd"]
    samples = make_samples(prompts=prompts, metadata=[{"rm_type": "redness"}, {}, {}, {}])
    assert score(scorer, samples) == [1.0, 2.0, 3.0, 4.0]
    assert reward_examples.CALLS == [prompts]
    assert not scorer.needs_whole_groups


@pytest.mark.exercises("--group-rm", "--custom-rm-path")
def test_group_rm_calls_the_custom_reward_once_per_prompt_group():
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.rank_in_group", "--group-rm"))
    assert scorer.needs_whole_groups
    samples = make_samples(levels=(0.9, 0.1, 0.2, 0.8), prompts=["x", "x", "y", "y"])
    assert score(scorer, samples) == [1.0, 0.0, 0.0, 1.0]  # ranks within each group, not across the batch
    assert sorted(reward_examples.CALLS) == [["x", "x"], ["y", "y"]]


@pytest.mark.exercises("--group-rm", "--rm-type")
def test_group_rm_calls_a_registered_reward_once_per_prompt_group(recorded):
    samples = make_samples(levels=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6), n=3)
    assert score(RewardScorer(resolve("--rm-type", "brightness", "--group-rm")), samples) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert recorded.calls == [("brightness", 3), ("brightness", 3)]


@pytest.fixture
def slow_redness(monkeypatch):
    """The registered redness reward, 0.3 s a call of several outputs (20 ms for one); the
    number of outputs of each call."""
    import time

    from miles_rewards.diagnostic import Redness

    original, sizes = Redness.__call__, []

    def slow(self, outputs, prompts=None, metadata=None):
        sizes.append(len(outputs))
        time.sleep(0.3 if len(outputs) > 1 else 0.02)
        return original(self, outputs, prompts, metadata)

    monkeypatch.setattr(Redness, "__call__", slow)
    return sizes


def stream(scorer, microgroups, pause=0.01):
    """Scores ``microgroups`` as a streaming rollout does (``StreamingScores``): the first,
    then, while its call runs, the others one by one."""
    from miles_core.training.rollout_scoring import StreamingScores

    async def main():
        pending = StreamingScores(scorer, 2)
        pending.add(microgroups[0])
        await asyncio.sleep(0.05)  # the first microgroup's call is running
        for group in microgroups[1:]:
            pending.add(group)
            await asyncio.sleep(pause)
        await pending.wait()

    asyncio.run(main())


@pytest.mark.exercises("--rm-type")
def test_microgroups_arriving_while_a_reward_call_runs_go_into_its_next_call(slow_redness):
    generator = torch.Generator().manual_seed(5)
    samples = make_samples(levels=[0.5] * 10)
    for sample in samples:
        sample.pixels = torch.rand(3, 4, 4, generator=generator)
    microgroups = [samples[i : i + 2] for i in range(0, 10, 2)]
    stream(RewardScorer(resolve("--rm-type", "redness")), microgroups)
    # Five microgroups, two calls: the four that arrived during the first call went in one.
    assert slow_redness == [2, 8]
    streamed = [s.reward for s in samples]
    # The same values as one call for the whole rollout (--no-streaming-reward).
    slow_redness.clear()
    whole = make_samples(levels=[0.5] * 10)
    for sample, original in zip(whole, samples):
        sample.pixels = original.pixels
    score(RewardScorer(resolve("--rm-type", "redness")), whole)
    assert [s.reward for s in whole] == streamed
    assert slow_redness == [10] and streamed == pytest.approx([redness(s.pixels) for s in samples])


@pytest.mark.exercises("--rm-type")
def test_a_coalesced_call_that_raises_is_retried_one_sample_at_a_time(slow_redness):
    warnings: list[str] = []
    samples = make_samples(levels=[0.2, 0.4, 0.6, 0.8, 0.3, 0.7])
    samples[3].pixels = torch.zeros(1, 4, 4)  # redness raises for this one
    scorer = RewardScorer(resolve("--rm-type", "redness"), warn=warnings.append)
    stream(scorer, [samples[0:2], samples[2:4], samples[4:6]])
    assert slow_redness == [2, 4, 1, 1, 1, 1]  # the call of the two later microgroups raised: one at a time
    assert [s.reward_failed for s in samples] == [False, False, False, True, False, False]
    assert [s.reward for i, s in enumerate(samples) if i != 3] == [0.0] * 5  # grey: no redness
    assert warnings == [
        "reward redness raised ValueError: redness needs 3 (RGB) channels, got shape (1, 4, 4) on a call of 4 samples; "
        "scoring them one at a time",
        "reward redness: 1 of 4 sample(s) failed on their own and are masked: 'prompt 1' (seed 103): ValueError: "
        "redness needs 3 (RGB) channels, got shape (1, 4, 4)",
    ]
    assert scorer.finish(samples)["rollout/reward/redness_failed"] == 1


# -- failures --------------------------------------------------------------------------------


@pytest.mark.exercises("--custom-rm-path")
def test_one_sample_raising_or_nan_is_warned_about_masked_and_counted():
    warnings: list[str] = []
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.flaky"), warn=warnings.append)
    prompts = ["ok one", "boom", "good two", "a nan"]
    samples = make_samples(prompts=prompts)
    rewards = score(scorer, samples)
    assert rewards[0] == 6.0 and rewards[2] == 8.0 and math.isnan(rewards[1]) and math.isnan(rewards[3])
    assert [s.reward_failed for s in samples] == [False, True, False, True]
    assert [s.remove_sample for s in samples] == [False, True, False, True]
    # The batched call raised: one warning, then each sample on its own (the boom sample raises again).
    assert reward_examples.CALLS == [prompts, ["ok one"], ["boom"], ["good two"], ["a nan"]]
    assert warnings == [
        f"--custom-rm-path {EXAMPLES}.flaky raised ValueError: cannot read the boom prompt on a call of 4 samples; "
        "scoring them one at a time",
        f"--custom-rm-path {EXAMPLES}.flaky: 2 of 4 sample(s) failed on their own and are masked: 'boom' (seed 101): "
        "ValueError: cannot read the boom prompt; 'a nan' (seed 103): returned nan",
    ]
    metrics = scorer.finish(samples)
    assert metrics["rollout/reward/failed"] == 2 and metrics["rollout/reward/raw_mean"] == pytest.approx(7.0)
    assert metrics["rollout/reward/custom_rm_failed"] == 2
    # Failed samples: out of their group's statistics and advantage 0.
    advantages = advantages_from_config(torch.tensor(rewards), resolve(), samples)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]  # each group has one valid sample left

    # NaN, inf and a non-number fail only their sample, with one warning for the call.
    warnings.clear()
    samples = make_samples(prompts=["fine", "an inf", "text", "also fine"])
    rewards = score(scorer, samples)
    assert [s.reward_failed for s in samples] == [False, True, True, False] and rewards[3] == 9.0
    assert warnings == [
        f"--custom-rm-path {EXAMPLES}.flaky: 2 of 4 sample(s) got no finite reward and are masked: 'an inf' (seed 101) "
        "returned inf; 'text' (seed 102) returned 'high' (str), not a number"
    ]


@pytest.mark.exercises("--rm-type")
def test_a_registered_reward_raising_goes_to_the_rewards_logger(caplog):
    samples = make_samples()
    samples[2].pixels = torch.zeros(1, 4, 4)  # redness needs 3 channels: this one raises
    with caplog.at_level("WARNING", logger="miles_core.rewards"):
        rewards = score(RewardScorer(resolve("--rm-type", "redness")), samples)
    assert [math.isnan(r) for r in rewards] == [False, False, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "reward redness raised ValueError: redness needs 3 (RGB) channels, got shape (1, 4, 4) on a call of 4 samples; "
        "scoring them one at a time",
        "reward redness: 1 of 4 sample(s) failed on their own and are masked: 'prompt 1' (seed 102): ValueError: "
        "redness needs 3 (RGB) channels, got shape (1, 4, 4)",
    ]


@pytest.mark.exercises("--group-rm", "--custom-rm-path")
def test_a_group_reward_that_raises_fails_its_group_without_retries():
    warnings: list[str] = []
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.flaky", "--group-rm"), warn=warnings.append)
    samples = make_samples(prompts=["boom", "boom", "fine", "fine"])
    rewards = score(scorer, samples)
    assert [math.isnan(r) for r in rewards] == [True, True, False, False]
    assert sorted(reward_examples.CALLS) == [["boom", "boom"], ["fine", "fine"]]
    assert warnings == [
        f"--custom-rm-path {EXAMPLES}.flaky raised ValueError: cannot read the boom prompt on the "
        "group of 'boom' (seed 100); 2 sample(s) masked"
    ]


@pytest.mark.exercises("--custom-rm-path", "--rm-type")
def test_a_reward_failing_for_every_sample_stops_the_rollout_naming_it():
    warnings: list[str] = []
    scorer = RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.always_fails"), warn=warnings.append)
    samples = make_samples()
    score(scorer, samples)  # per-sample failures: no exception yet
    assert len(warnings) == 2 and all(s.reward_failed for s in samples)
    with pytest.raises(RewardError) as info:
        scorer.finish(samples)
    assert str(info.value) == (
        f"reward --custom-rm-path {EXAMPLES}.always_fails failed for every sample it scored in "
        "this rollout (4 samples); last error: RuntimeError: the reward server is offline"
    )
    # Shape errors are not per sample: they stop at once.
    with pytest.raises(RewardError, match=f"^--custom-rm-path {EXAMPLES}.wrong_length returned 1 values for 4 samples$"):
        score(RewardScorer(resolve("--custom-rm-path", f"{EXAMPLES}.wrong_length")), make_samples())
    # A registered reward failing everywhere is named too.
    scorer = RewardScorer(resolve("--rm-type", "redness"), warn=warnings.append)
    samples = make_samples()
    for sample in samples:
        sample.pixels = torch.zeros(1, 4, 4)
    score(scorer, samples)
    with pytest.raises(
        RewardError,
        match=r"^reward redness failed for every sample it scored in this rollout \(4 "
        r"samples\); last error: ValueError: redness needs 3 \(RGB\) channels, got shape \(1, 4, 4\)$",
    ):
        scorer.finish(samples)


@pytest.mark.exercises("--rm-type")
def test_a_row_reward_failing_on_all_of_its_samples_stops_the_rollout_while_the_others_score():
    warnings: list[str] = []
    samples = make_samples(levels=(0.1, 0.5, 0.9, 0.3), metadata=[{"rm_type": "redness"}, {}, {"rm_type": "redness"}, {}])
    for sample in samples[0::2]:
        sample.pixels = torch.zeros(1, 4, 4)  # redness needs 3 channels
    scorer = RewardScorer(resolve("--rm-type", "brightness"), warn=warnings.append)
    rewards = score(scorer, samples)
    assert rewards[1::2] == pytest.approx([0.5, 0.3]) and all(math.isnan(r) for r in rewards[0::2])
    with pytest.raises(RewardError) as info:
        scorer.finish(samples)
    assert str(info.value) == (
        "reward redness failed for every sample it scored in this rollout (2 samples); last "
        "error: ValueError: redness needs 3 (RGB) channels, got shape (1, 4, 4)"
    )
    # One of its samples scored: no error, and each reward's failures are counted.
    samples = make_samples(levels=(0.1, 0.5, 0.9, 0.3), metadata=[{"rm_type": "redness"}, {}, {"rm_type": "redness"}, {}])
    samples[0].pixels = torch.zeros(1, 4, 4)
    score(scorer, samples)
    metrics = scorer.finish(samples)
    assert (metrics["rollout/reward/failed"], metrics["rollout/reward/redness_failed"], metrics["rollout/reward/brightness_failed"]) == (
        1,
        1,
        0,
    )


# -- evaluation rewards ---------------------------------------------------------------------


@pytest.mark.exercises("--eval-rm-type", "--eval-reward-key", "--reward-key")
def test_evaluation_scorer_uses_the_eval_reward_and_key(tones):
    config = resolve("--rm-type", "tones", "--reward-key", "contrast", "--eval-rm-type", "brightness")
    training, evaluation = RewardScorer(config), RewardScorer(config, evaluation=True)
    assert (training.name, evaluation.name, evaluation.evaluation) == ("tones", "brightness", True)
    samples = make_samples(levels=(0.2, 0.6))
    assert score(evaluation, samples) == pytest.approx([0.2, 0.6])
    assert score(training, make_samples(levels=(0.2, 0.6))) == [0.0, 0.0]
    # --eval-reward-key picks another key of the same dict reward; it defaults to --reward-key.
    config = resolve("--rm-type", "tones", "--reward-key", "contrast", "--eval-reward-key", "brightness")
    assert score(RewardScorer(config, evaluation=True), make_samples(levels=(0.2, 0.6))) == pytest.approx([0.2, 0.6])
    assert score(RewardScorer(config), make_samples(levels=(0.2, 0.6))) == [0.0, 0.0]
    config = resolve("--rm-type", "tones", "--reward-key", "contrast")
    assert score(RewardScorer(config, evaluation=True), make_samples(levels=(0.2, 0.6))) == [0.0, 0.0]
    # The evaluation scorer shares the training scorer's built rewards.
    shared = RewardScorer(config, evaluation=True, share=RewardScorer(config))
    assert tones.built == 5 and shared._rewards["tones"] is not None
    # Without --eval-interval the eval reward flags do nothing, and say so.
    assert any(
        n.startswith("--eval-reward-key, --eval-rm-type: no evaluation runs without --eval-interval")
        for n in resolve("--eval-reward-key", "x", "--eval-rm-type", "redness").notes
    )


@pytest.mark.exercises("--eval-reward-weights", "--eval-rm-type")
def test_a_short_run_evaluates_with_its_own_rewards(tiny_sd3, prompts, tmp_path):
    from miles_rewards.diagnostic import Brightness, Colorfulness, Redness

    def run(name, *eval_reward):
        reward_examples.LOGGED.update(rollout=[], eval=[])
        args = without_rm_type(tiny_run_args(tiny_sd3, prompts, tmp_path / name, batch=1, n=2))
        (record,) = run_metrics(
            [
                *args,
                "--rm-type",
                "brightness",
                "--num-rollout",
                "1",
                "--debug-rollout-only",
                "--eval-interval",
                "1",
                "--eval-prompt-data",
                "shapes",
                str(prompts),
                "--skip-eval-before-train",
                *eval_reward,
                "--custom-rollout-log-function-path",
                f"{EXAMPLES}.log_rollout",
                "--custom-eval-rollout-log-function-path",
                f"{EXAMPLES}.log_eval",
            ]
        )
        (rollout,), (evaluation,) = reward_examples.LOGGED["rollout"], reward_examples.LOGGED["eval"]
        return record, rollout, evaluation["shapes"]

    record, rollout, eval_samples = run("mixture", "--eval-reward-weights", '{"redness": 1.0, "colorfulness": 0.5}')
    pixels = [s.pixels for s in rollout]
    assert [s.reward for s in rollout] == pytest.approx(Brightness()(pixels))  # training: --rm-type
    red, colour = Redness()([s.pixels for s in eval_samples]), Colorfulness()([s.pixels for s in eval_samples])
    assert len(eval_samples) == 3
    assert [s.reward for s in eval_samples] == pytest.approx([r + 0.5 * c for r, c in zip(red, colour)])
    assert [s.reward_components for s in eval_samples] == [
        {"redness": pytest.approx(r), "colorfulness": pytest.approx(c)} for r, c in zip(red, colour)
    ]
    assert record["eval/shapes/reward_mean"] == pytest.approx(float(np.mean([s.reward for s in eval_samples])), rel=1e-5)
    assert record["eval/shapes/reward/redness_mean"] == pytest.approx(float(np.mean(red)))
    assert record["eval/shapes/reward/colorfulness_mean"] == pytest.approx(float(np.mean(colour)))
    assert record["eval/shapes/reward/failed"] == 0
    assert record["rollout/reward/raw_mean"] == pytest.approx(float(np.mean(Brightness()(pixels))), rel=1e-5)

    # --eval-rm-type: one held-out reward.
    record, rollout, eval_samples = run("single", "--eval-rm-type", "redness")
    assert [s.reward for s in eval_samples] == pytest.approx(Redness()([s.pixels for s in eval_samples]))
    assert all(s.reward_components == {} for s in eval_samples)
    assert [s.reward for s in rollout] == pytest.approx(Brightness()([s.pixels for s in rollout]))


@pytest.mark.exercises("--eval-rm-type", "--eval-reward-weights")
def test_an_eval_reward_set_scores_every_eval_row_whatever_its_rm_type():
    pixels = torch.tensor([[[1.0]], [[0.5]], [[0.0]]]).expand(3, 4, 4)  # brightness 0.5, redness 0.75

    def scored(scorer):
        samples = make_samples(levels=(0.5, 0.5), metadata=[{"rm_type": "redness"}, {}])
        for sample in samples:
            sample.pixels = pixels
        return score(scorer, samples), samples

    config = resolve("--rm-type", "colorfulness", "--eval-rm-type", "brightness")
    assert scored(RewardScorer(config, evaluation=True))[0] == pytest.approx([0.5, 0.5])  # the row's redness ignored
    training, _ = scored(RewardScorer(config))
    assert training[0] == pytest.approx(0.75)  # training still follows the row
    config = resolve("--rm-type", "colorfulness", "--eval-reward-weights", '{"brightness": 1, "redness": 2}')
    rewards, samples = scored(RewardScorer(config, evaluation=True))
    assert rewards == pytest.approx([2.0, 2.0])
    assert samples[0].reward_components == {"brightness": pytest.approx(0.5), "redness": pytest.approx(0.75)}
    # Without an eval reward set, evaluations score as training does: the row's reward.
    assert scored(RewardScorer(resolve("--rm-type", "brightness"), evaluation=True))[0] == pytest.approx([0.75, 0.5])


@pytest.mark.exercises("--eval-rm-type", "--eval-interval", "--skip-eval-before-train")
def test_an_eval_reward_that_cannot_be_built_stops_the_run_before_its_first_rollout(register, tiny_sd3, prompts, tmp_path):
    register("unbuildable", "Unbuildable")
    reward_examples.LOGGED.update(rollout=[], eval=[])
    args = tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=1, n=2)
    with pytest.raises(RewardError) as info:
        run_metrics(
            [
                *args,
                "--num-rollout",
                "1",
                "--debug-rollout-only",
                "--eval-interval",
                "1",
                "--eval-prompt-data",
                "shapes",
                str(prompts),
                "--skip-eval-before-train",
                "--eval-rm-type",
                "unbuildable",
                "--custom-rollout-log-function-path",
                f"{EXAMPLES}.log_rollout",
            ]
        )
    assert str(info.value) == "reward unbuildable: cannot be built: OSError: no weights at /nowhere/model.safetensors"
    assert reward_examples.LOGGED["rollout"] == []  # no rollout was generated first
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.exercises("--rm-type", "--eval-rm-type")
def test_a_reward_with_pop_metrics_reports_them_after_each_rollout(register):
    register("counting", "Counting")
    config = resolve("--rm-type", "counting", "--eval-rm-type", "counting")
    scorer = RewardScorer(config)
    samples = make_samples()
    score(scorer, samples[:2])
    score(scorer, samples[2:])
    metrics = scorer.finish(samples)
    assert (metrics["rollout/reward/counting/calls"], metrics["rollout/reward/counting/outputs"]) == (2, 4)
    score(scorer, samples[:3])
    metrics = scorer.finish(samples[:3])
    assert (metrics["rollout/reward/counting/calls"], metrics["rollout/reward/counting/outputs"]) == (1, 3)
    # An evaluation reports its own counts under its prefix, from the instance it shares with training.
    evaluation = RewardScorer(config, evaluation=True, share=scorer)
    score(evaluation, samples[:2])
    assert evaluation.finish(samples[:2], prefix="eval/shapes/reward/")["eval/shapes/reward/counting/outputs"] == 2
    # In a mixture, only the rewards that have pop_metrics report.
    metrics = RewardScorer(resolve("--reward-weights", '{"counting": 1, "brightness": 1}'))
    score(metrics, samples)
    assert {k for k in metrics.finish(samples) if "/counting/" in k or "/brightness/" in k} == {
        "rollout/reward/counting/calls",
        "rollout/reward/counting/outputs",
    }


# -- failed samples in a run, saved and replayed ----------------------------------------------


@pytest.mark.exercises("--custom-rm-path", "--save-debug-rollout-data", "--load-debug-rollout-data")
def test_failed_samples_are_masked_in_training_and_survive_a_replay(tiny_sd3, prompts, tmp_path):
    from miles_core.training.debug_data import load_rollout_data, load_train_data

    rollout_data, train_data = str(tmp_path / "rollouts" / "{}.msgpack"), str(tmp_path / "train" / "{}.msgpack")
    common = [
        "--num-rollout",
        "1",
        "--use-lora",
        "--lora-rank",
        "4",
        "--save-debug-train-data",
        train_data,
        "--custom-rm-path",
        f"{EXAMPLES}.fails_first_sample",
    ]
    base = without_rm_type(tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=2, n=3))
    run_metrics([*base, *common, "--save-debug-rollout-data", rollout_data])
    samples, rewards = load_rollout_data(rollout_data, 0)
    assert [s.reward_failed for s in samples] == [True, False, False] * 2
    assert [s.remove_sample for s in samples] == [True, False, False] * 2
    assert [math.isnan(r) for r in rewards.tolist()] == [True, False, False] * 2
    trained = load_train_data(train_data.format(0))
    assert trained["samples"]["reward_failed"] == [True, False, False] * 2

    def check(trained):
        # The group statistics over the two valid samples: +-(r1 - r2) / 2 / (std + 1e-4).
        advantages = trained["advantages"].tolist()
        for g in range(2):
            r1, r2 = rewards[3 * g + 1].item(), rewards[3 * g + 2].item()
            std = abs(r1 - r2) / math.sqrt(2)  # unbiased std of two values
            expected = [0.0, (r1 - r2) / 2 / (std + 1e-4), (r2 - r1) / 2 / (std + 1e-4)]
            # The advantages are computed in fp32 from close rewards (mean pixel values a
            # few 1e-4 apart): a few fp32 ulps of the rewards, divided by the denominator.
            fp32 = 8 * torch.finfo(torch.float32).eps * max(abs(r1), abs(r2)) / (std + 1e-4)
            assert advantages[3 * g : 3 * g + 3] == pytest.approx(expected, rel=1e-4, abs=max(1e-6, fp32))
        pairs = trained["pairs"]
        failed = [i for i in range(6) if i % 3 == 0]
        for index, mask, advantage in zip(pairs["sample_index"].tolist(), pairs["loss_mask"].tolist(), pairs["advantage"].tolist()):
            assert mask == (0.0 if index in failed else 1.0)
            if index in failed:
                assert advantage == 0.0

    check(trained)
    # Replayed with no engine: the same failures, the same advantages.
    replay_train = str(tmp_path / "replay" / "{}.msgpack")
    replay = tiny_run_args(tiny_sd3, prompts, tmp_path / "replay-run", batch=2, n=3)
    run_metrics(
        [
            *replay,
            "--num-rollout",
            "1",
            "--use-lora",
            "--lora-rank",
            "4",
            "--load-debug-rollout-data",
            rollout_data,
            "--save-debug-train-data",
            replay_train,
        ]
    )
    replayed = load_train_data(replay_train.format(0))
    assert replayed["samples"]["reward_failed"] == [True, False, False] * 2
    check(replayed)
