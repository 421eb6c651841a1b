"""Weighted reward mixtures (``--reward-weights``, ``--reward-aggregation``) and failed
samples in the advantages, checked against hand computations."""

from __future__ import annotations

import asyncio
import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, RewardError
from miles_core.plugin_manager import get_host
from miles_core.training.advantages import advantages_from_config, grpo_advantages, masked_grpo_advantages
from miles_core.training.rewards import RewardScorer

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3"]
EPS = 1e-4


def resolve(*argv):
    return resolve_config([*BASE, *argv])


def images(count=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, 4, 4, generator=generator) for _ in range(count)]


def make_samples(pixels, n=3, metadata=None):
    metadata = metadata or [{} for _ in pixels]
    return [
        SimpleNamespace(
            pixels=p,
            prompt=f"prompt {i // n}",
            metadata=m,
            seed=i,
            group_index=i // n,
            index_in_group=i % n,
            reward=None,
            reward_components={},
            reward_failed=False,
            remove_sample=False,
        )
        for i, (p, m) in enumerate(zip(pixels, metadata))
    ]


def brightness(p):
    return float(np.asarray(p, dtype=np.float64).mean())


def redness(p):
    r, g, b = np.asarray(p, dtype=np.float64)
    return float(np.mean(r - (g + b) / 2))


def normalise(values, valid=None):
    """One group's GRPO advantages by hand: (x - mean) / (unbiased std + eps) over the
    valid values; 0 for the others."""
    valid = valid or [True] * len(values)
    kept = [v for v, ok in zip(values, valid) if ok]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    return [(v - mean) / (std + EPS) if ok else 0.0 for v, ok in zip(values, valid)]


def score(config, samples):
    scorer = RewardScorer(config)
    rewards = asyncio.run(scorer.score(samples))
    return scorer, rewards


@pytest.mark.exercises("--reward-weights")
def test_a_mixture_trains_on_the_weighted_sum_and_reports_each_reward():
    pixels = images()
    config = resolve("--reward-weights", '{"brightness": 0.7, "redness": -2}')
    samples = make_samples(pixels)
    scorer, rewards = score(config, samples)
    expected = [0.7 * brightness(p) - 2 * redness(p) for p in pixels]
    assert rewards.tolist() == pytest.approx(expected, rel=1e-5)
    assert [s.reward_components for s in samples] == [
        {"brightness": pytest.approx(brightness(p), rel=1e-6), "redness": pytest.approx(redness(p), rel=1e-5, abs=1e-7)} for p in pixels
    ]
    metrics = scorer.finish(samples)
    assert metrics["rollout/reward/brightness_mean"] == pytest.approx(np.mean([brightness(p) for p in pixels]))
    assert metrics["rollout/reward/redness_mean"] == pytest.approx(np.mean([redness(p) for p in pixels]), abs=1e-7)
    assert metrics["rollout/reward/raw_mean"] == pytest.approx(np.mean(expected), rel=1e-5)
    assert scorer.name == "0.7*brightness + -2*redness"
    assert config.components["reward"].name == "0.7*brightness + -2*redness"
    # sum (the default): GRPO on the weighted sum, per group.
    advantages = advantages_from_config(rewards, config, samples)
    assert advantages.tolist() == pytest.approx(normalise(expected[:3]) + normalise(expected[3:]), rel=1e-3, abs=1e-4)


@pytest.mark.exercises("--reward-aggregation", "--reward-weights")
def test_advantage_aggregation_normalises_each_reward_within_its_group_then_weights():
    pixels = images(seed=1)
    config = resolve("--reward-weights", '{"brightness": 0.25, "colorfulness": 0.75}', "--reward-aggregation", "advantage")
    samples = make_samples(pixels)
    _, rewards = score(config, samples)
    advantages = advantages_from_config(rewards, config, samples).tolist()
    parts = {name: [s.reward_components[name] for s in samples] for name in ("brightness", "colorfulness")}
    expected = [
        0.25 * b + 0.75 * c
        for g in (slice(0, 3), slice(3, 6))
        for b, c in zip(normalise(parts["brightness"][g]), normalise(parts["colorfulness"][g]))
    ]
    assert advantages == pytest.approx(expected, rel=1e-4)
    # A reward's scale no longer matters (up to eps): colorfulness 1000x larger gives nearly the same advantages.
    for s in samples:
        s.reward_components["colorfulness"] *= 1000.0
    scaled = [
        0.25 * b + 0.75 * c
        for g in (slice(0, 3), slice(3, 6))
        for b, c in zip(normalise(parts["brightness"][g]), normalise([1000.0 * c for c in parts["colorfulness"][g]]))
    ]
    assert advantages_from_config(rewards, config, samples).tolist() == pytest.approx(scaled, rel=1e-4)
    assert scaled == pytest.approx(expected, rel=1e-2)
    # The GRPO flags apply to each component: without std normalisation, the weighted centred values.
    flat = resolve(
        "--reward-weights",
        '{"brightness": 0.25, "colorfulness": 0.75}',
        "--reward-aggregation",
        "advantage",
        "--disable-grpo-std-normalization",
    )
    for s, c in zip(samples, parts["colorfulness"]):
        s.reward_components["colorfulness"] = c
    centred = [
        0.25 * (b - statistics.fmean(parts["brightness"][g])) + 0.75 * (c - statistics.fmean(parts["colorfulness"][g]))
        for g in (slice(0, 3), slice(3, 6))
        for b, c in zip(parts["brightness"][g], parts["colorfulness"][g])
    ]
    assert advantages_from_config(rewards, flat, samples).tolist() == pytest.approx(centred, rel=1e-4, abs=1e-6)
    # The sum aggregation differs: it normalises the weighted sum instead.
    summed = resolve("--reward-weights", '{"brightness": 0.25, "colorfulness": 0.75}')
    assert advantages_from_config(rewards, summed, samples).tolist() != pytest.approx(expected, rel=1e-3)


@pytest.mark.exercises("--reward-weights")
def test_failed_samples_are_left_out_of_their_group_statistics():
    # Group 0: sample 1 failed; group 1: only sample 5 is valid.
    rewards = torch.tensor([1.0, math.nan, 4.0, 2.0, 7.0, 5.0, math.nan, math.inf, 3.0], dtype=torch.float64)
    failed = [False, True, False, False, True, True, False, False, False]
    samples = [
        SimpleNamespace(reward=float(r), reward_failed=f, remove_sample=f, reward_components={}) for r, f in zip(rewards.tolist(), failed)
    ]
    # (group 2 has a NaN and an inf that are not marked failed: an error, as before)
    with pytest.raises(ValueError, match="reward of sample 6 is nan"):
        advantages_from_config(rewards, resolve(), samples)
    for s in samples[6:]:
        s.reward_failed = True
    advantages = advantages_from_config(rewards, resolve(), samples).tolist()
    valid = [not s.reward_failed for s in samples]
    assert advantages[:3] == pytest.approx(normalise([1.0, 0.0, 4.0], valid[:3]))
    assert advantages[3:] == [0.0] * 6  # a group's only valid sample has nothing to compare with; failed ones get 0
    # Batch-wide statistics also use the valid samples only.
    config = resolve("--globalize-reward-mean", "--globalize-reward-std")
    for s in samples[6:8]:
        s.reward_failed = False
    rewards[6], rewards[7] = 3.0, 3.0
    samples[8].reward_failed = True
    kept = [1.0, 4.0, 2.0, 3.0, 3.0]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    expected = [(r - mean) / (std + EPS) if not s.reward_failed else 0.0 for r, s in zip(rewards.tolist(), samples)]
    assert advantages_from_config(rewards, config, samples).tolist() == pytest.approx(expected)


def test_masked_grpo_with_every_sample_valid_is_plain_grpo():
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(3))
    for options in ({}, {"globalize_mean": True}, {"globalize_std": True}, {"std_normalization": False}):
        assert torch.equal(
            masked_grpo_advantages(rewards, torch.ones(12, dtype=torch.bool), 4, **options), grpo_advantages(rewards, 4, **options)
        )


@pytest.mark.exercises("--reward-weights", "--reward-aggregation")
def test_a_failed_mixture_component_fails_its_sample_and_is_left_out_of_each_component():
    pixels = images(seed=2)
    pixels[1] = pixels[1][:1]  # one channel: redness raises for this sample, brightness does not
    config = resolve("--reward-weights", '{"brightness": 1, "redness": 1}', "--reward-aggregation", "advantage")
    warnings = []
    scorer = RewardScorer(config, warn=warnings.append)
    samples = make_samples(pixels)
    rewards = asyncio.run(scorer.score(samples))
    assert math.isnan(rewards[1]) and samples[1].reward_failed and samples[1].remove_sample
    assert samples[1].reward_components == {"brightness": pytest.approx(brightness(pixels[1]))}
    assert len(warnings) == 2 and warnings[0].startswith("reward redness raised ValueError")
    metrics = scorer.finish(samples)
    assert metrics["rollout/reward/failed"] == 1
    assert (metrics["rollout/reward/redness_failed"], metrics["rollout/reward/brightness_failed"]) == (1, 0)
    valid = [p for i, p in enumerate(pixels) if i != 1]
    assert metrics["rollout/reward/brightness_mean"] == pytest.approx(np.mean([brightness(p) for p in valid]))
    advantages = advantages_from_config(rewards, config, samples).tolist()
    b = [brightness(p) for p in pixels]
    r = [redness(p) if i != 1 else 0.0 for i, p in enumerate(pixels)]
    mask = [i != 1 for i in range(3)]
    expected = [x + y for x, y in zip(normalise(b[:3], mask), normalise(r[:3], mask))]
    expected += [x + y for x, y in zip(normalise(b[3:]), normalise(r[3:]))]
    assert advantages == pytest.approx(expected, rel=1e-3, abs=1e-5)
    assert advantages[1] == 0.0


@pytest.mark.exercises("--reward-weights")
def test_a_mixture_component_failing_for_every_sample_stops_the_rollout_naming_that_component():
    pixels = [p[:1] for p in images(seed=5)]  # one channel: redness raises for every sample, brightness never
    scorer = RewardScorer(resolve("--reward-weights", '{"brightness": 1, "redness": 0.5}'), warn=lambda line: None)
    samples = make_samples(pixels)
    asyncio.run(scorer.score(samples))
    assert all(s.reward_failed for s in samples)
    assert [s.reward_components for s in samples] == [{"brightness": pytest.approx(brightness(p))} for p in pixels]
    with pytest.raises(RewardError) as info:
        scorer.finish(samples)
    assert str(info.value) == (
        "reward redness failed for every sample it scored in this rollout (6 samples); last "
        "error: ValueError: redness needs 3 (RGB) channels, got shape (1, 4, 4)"
    )


@pytest.mark.exercises("--reward-weights", "--reward-aggregation")
def test_metadata_rm_type_inside_a_mixture_scores_that_group_with_one_reward():
    pixels = images(seed=4)
    config = resolve("--reward-weights", '{"brightness": 2, "redness": 1}', "--reward-aggregation", "advantage")
    samples = make_samples(pixels, metadata=[{}] * 3 + [{"rm_type": "colorfulness"}] * 3)
    rewards = asyncio.run(RewardScorer(config).score(samples))
    assert all(s.reward_components == {} for s in samples[3:])
    advantages = advantages_from_config(rewards, config, samples).tolist()
    assert advantages[3:] == pytest.approx(normalise(rewards[3:].tolist()), rel=1e-4)  # plain GRPO on colorfulness
    samples[0].reward_components = {}
    with pytest.raises(ValueError, match="prompt group 0 mixes samples scored by the --reward-weights mixture"):
        advantages_from_config(rewards, config, samples)


@pytest.mark.exercises("--reward-weights", "--eval-reward-weights", "--reward-aggregation")
def test_mixture_flags_are_checked_when_the_configuration_is_resolved(tmp_path):
    def errors(*argv):
        with pytest.raises(ConfigError) as info:
            resolve(*argv)
        return info.value.messages

    assert errors("--reward-weights", '{"brightnes": 1}') == [
        get_host().registries.reward.unknown_message("brightnes", flag="--reward-weights")
    ]
    assert errors("--reward-weights", '{"brightness": NaN, "redness": true}') == [
        "--reward-weights: the weight of brightness is nan; weights must be finite numbers",
        "--reward-weights: the weight of redness is True; weights must be finite numbers",
    ]
    assert errors("--reward-weights", "{}") == ["--reward-weights {}: name at least one registered reward and its weight"]
    assert errors("--reward-weights", '{"brightness": 1}', "--rm-type", "redness") == [
        "--reward-weights and --rm-type are mutually exclusive (the mixture is the reward)"
    ]
    assert "--reward-weights and --custom-rm-path are mutually exclusive (the mixture is the reward)" in errors(
        "--reward-weights", '{"brightness": 1}', "--custom-rm-path", "tests.reward_examples.prompt_length"
    )
    assert errors("--eval-reward-weights", '{"brightness": 1}', "--eval-rm-type", "redness") == [
        "--eval-reward-weights and --eval-rm-type are mutually exclusive (the mixture is the reward)"
    ]
    assert errors("--rm-type", "redness", "--reward-aggregation", "advantage") == [
        "--reward-aggregation advantage requires --reward-weights (it normalises each reward of the mixture within its group)"
    ]
    assert errors(
        "--reward-weights",
        '{"brightness": 1}',
        "--reward-aggregation",
        "advantage",
        "--custom-reward-post-process-path",
        "tests.test_advantages.rank_post_process",
    ) == [
        "--reward-aggregation advantage and --custom-reward-post-process-path are mutually exclusive (the custom "
        "function replaces the normalisation)"
    ]
    # The same mapping from a YAML configuration file.
    path = tmp_path / "mixture.yaml"
    path.write_text("reward_weights:\n  brightness: 0.5\n  redness: 0.5\nreward_aggregation: advantage\n")
    config = resolve("--custom-config-path", str(path))
    assert config.reward_weights == {"brightness": 0.5, "redness": 0.5} and config.reward_aggregation == "advantage"
    assert RewardScorer(config).weights == {"brightness": 0.5, "redness": 0.5}
