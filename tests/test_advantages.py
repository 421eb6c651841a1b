"""GRPO advantages against an independent float64 implementation (docs/design.md, "Advantages, losses and the EMA")."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_core.errors import PathFlagError
from miles_core.training.advantages import (
    advantages_from_config,
    grpo_advantages,
    post_process_rewards,
)

F64 = torch.float64
EPS = 1e-4
REWARDS = [0.1, 0.9, 0.4, 0.7, 2.0, 1.0, 3.5, 0.5]  # 2 prompts x 4, or 4 x 2, or 8 x 1


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std_unbiased(xs: list[float]) -> float:
    # The reference divides by torch's default (unbiased, N-1) std.
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def expected(rewards: list[float], n: int, *, gmean: bool = False, gstd: bool = False, norm: bool = True) -> list[float]:
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    out: list[float] = []
    for group in groups:
        mean = _mean(rewards) if gmean else _mean(group)
        for r in group:
            a = r - mean
            if norm and n > 1:
                a /= (_std_unbiased(rewards) if gstd else _std_unbiased(group)) + EPS
            out.append(a)
    return out


def close(a, b, tol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=tol, atol=tol)


def config(**overrides):
    base = {
        "n_samples_per_prompt": 4,
        "globalize_reward_mean": False,
        "globalize_reward_std": False,
        "disable_grpo_std_normalization": False,
        "custom_reward_post_process_path": None,
    }
    base.update(overrides)
    return SimpleNamespace(**base)


# ------------------------------------------------------------------ grpo_advantages
@pytest.mark.parametrize("gmean", [False, True])
@pytest.mark.parametrize("gstd", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n", [2, 4])
def test_every_option_matches_the_formula(n, gmean, gstd, norm):
    adv = grpo_advantages(torch.tensor(REWARDS, dtype=F64), n, globalize_mean=gmean, globalize_std=gstd, std_normalization=norm)
    assert adv.shape == (len(REWARDS),) and adv.dtype == F64
    close(adv, expected(REWARDS, n, gmean=gmean, gstd=gstd, norm=norm))


def test_hand_computed_group():
    # Group [1, 3]: mean 2, unbiased std sqrt(2); advantages -+1/(sqrt 2 + 1e-4).
    adv = grpo_advantages(torch.tensor([1.0, 3.0], dtype=F64), 2)
    close(adv, [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)])


def test_each_option_changes_the_result():
    # A control: every flag must actually do something on these rewards.
    x = torch.tensor(REWARDS, dtype=F64)
    base = grpo_advantages(x, 4)
    for kwargs in ({"globalize_mean": True}, {"globalize_std": True}, {"std_normalization": False}):
        assert not torch.allclose(grpo_advantages(x, 4, **kwargs), base), kwargs
    assert not torch.allclose(grpo_advantages(x, 2), base)


def test_global_std_is_of_the_raw_rewards_not_the_centred_ones():
    # Two groups with very different means: the raw batch std is large, the centred one small.
    rewards = [0.0, 1.0, 10.0, 11.0]
    adv = grpo_advantages(torch.tensor(rewards, dtype=F64), 2, globalize_std=True)
    close(adv, [(r - m) / (_std_unbiased(rewards) + EPS) for r, m in zip(rewards, [0.5, 0.5, 10.5, 10.5])])


def test_group_means_are_zero_and_std_about_one():
    adv = grpo_advantages(torch.tensor(REWARDS, dtype=F64), 4).view(-1, 4)
    close(adv.mean(dim=1), [0.0, 0.0])
    close(adv.std(dim=1), [1.0, 1.0], tol=1e-3)


@pytest.mark.parametrize("gmean", [False, True])
@pytest.mark.parametrize("gstd", [False, True])
def test_n_equal_one_forces_std_normalisation_off(gmean, gstd):
    x = torch.tensor(REWARDS, dtype=F64)
    adv = grpo_advantages(x, 1, globalize_mean=gmean, globalize_std=gstd, std_normalization=True)
    assert torch.isfinite(adv).all()
    close(adv, expected(REWARDS, 1, gmean=gmean, norm=False))
    if not gmean:
        close(adv, [0.0] * len(REWARDS))  # each sample is its own group
    else:
        close(adv, [r - _mean(REWARDS) for r in REWARDS])


def test_constant_group_gives_zero_not_nan():
    adv = grpo_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5]), 4)
    assert torch.equal(adv, torch.zeros(4))


def test_lists_and_integer_rewards_become_float32():
    adv = grpo_advantages([0, 1, 1, 0], 2)
    assert adv.dtype == torch.float32
    close(adv, expected([0.0, 1.0, 1.0, 0.0], 2), tol=1e-6)


def test_indivisible_batch_names_both_numbers():
    with pytest.raises(ValueError, match=r"^7 rewards .*n_samples_per_prompt=4") as info:
        grpo_advantages(torch.ones(7), 4)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_is_an_error(bad):
    with pytest.raises(ValueError, match="reward of sample 2 is"):
        grpo_advantages(torch.tensor([0.0, 1.0, bad, 2.0]), 2)


def test_bad_shapes():
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.ones(2, 2), 2)
    with pytest.raises(ValueError, match=">= 1"):
        grpo_advantages(torch.ones(2), 0)


# ---------------------------------------------------------------- from the config
@pytest.mark.exercises("--globalize-reward-mean", "--globalize-reward-std", "--disable-grpo-std-normalization")
def test_config_flags_map_to_options():
    x = torch.tensor(REWARDS, dtype=F64)
    close(advantages_from_config(x, config()), expected(REWARDS, 4))
    close(advantages_from_config(x, config(n_samples_per_prompt=2)), expected(REWARDS, 2))
    close(advantages_from_config(x, config(globalize_reward_mean=True)), expected(REWARDS, 4, gmean=True))
    close(advantages_from_config(x, config(globalize_reward_std=True)), expected(REWARDS, 4, gstd=True))
    close(advantages_from_config(x, config(disable_grpo_std_normalization=True)), expected(REWARDS, 4, norm=False))


def test_removed_samples_still_count_for_normalisation():
    # There is no mask argument: the caller passes every sample, removed or not.
    samples = [SimpleNamespace(reward=r, remove_sample=i == 0) for i, r in enumerate(REWARDS)]
    adv = advantages_from_config(torch.tensor([s.reward for s in samples], dtype=F64), config(), samples)
    close(adv, expected(REWARDS, 4))


# --------------------------------------------------- --custom-reward-post-process-path
CALLS: list[tuple] = []


def rank_post_process(args, samples):
    """The reference's signature: (args, samples) -> (raw_rewards, advantages)."""
    CALLS.append((args, samples))
    raw = [s.reward for s in samples]
    order = sorted(range(len(raw)), key=raw.__getitem__)
    ranks = [0.0] * len(raw)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return raw, torch.tensor(ranks)


def returns_a_dict(args, samples):
    return {"advantages": [0.0] * len(samples)}


def returns_one_list(args, samples):
    return [0.0] * len(samples)


def returns_nan(args, samples):
    return [s.reward for s in samples], [0.0, float("nan")] + [0.0] * (len(samples) - 2)


def returns_too_few(args, samples):
    return [s.reward for s in samples], [0.0]


def returns_strings(args, samples):
    return [s.reward for s in samples], ["x"] * len(samples)


def _samples():
    return [SimpleNamespace(reward=r, remove_sample=False) for r in REWARDS]


@pytest.mark.exercises("--custom-reward-post-process-path")
def test_custom_post_process_replaces_normalisation():
    CALLS.clear()
    samples = _samples()
    cfg = config(custom_reward_post_process_path=f"{__name__}.rank_post_process")
    raw, adv = post_process_rewards(torch.tensor(REWARDS, dtype=F64), cfg, samples)
    assert CALLS == [(cfg, samples)]
    close(raw, REWARDS)
    close(adv, [0.0, 4.0, 1.0, 3.0, 6.0, 5.0, 7.0, 2.0])  # rank of each reward
    assert adv.dtype == F64
    close(advantages_from_config(torch.tensor(REWARDS, dtype=F64), cfg, samples), adv)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("returns_a_dict", r"must return \(raw_rewards, advantages\), got dict"),
        ("returns_one_list", r"must return \(raw_rewards, advantages\), got list of length 8"),
        ("returns_nan", r"advantages of sample 1 is nan; values must be finite"),
        ("returns_too_few", r"advantages must hold 8 values"),
        ("returns_strings", r"advantages must be numbers, got str"),
    ],
)
def test_custom_post_process_bad_returns_are_one_line_errors(fn, message):
    cfg = config(custom_reward_post_process_path=f"{__name__}.{fn}")
    with pytest.raises(ValueError, match=message) as info:
        advantages_from_config(torch.tensor(REWARDS), cfg, _samples())
    text = str(info.value)
    assert text.startswith("--custom-reward-post-process-path") and "\n" not in text


SEEN: list[list[float]] = []


def grpo_post_process(args, samples):
    """A plain GRPO function, as users write it: each group's (r - mean) / (std + eps)."""
    SEEN.append([s.reward for s in samples])
    raw = torch.tensor([s.reward for s in samples], dtype=F64)
    groups = raw.view(-1, args.n_samples_per_prompt)
    advantages = (groups - groups.mean(dim=-1, keepdim=True)) / (groups.std(dim=-1, keepdim=True) + EPS)
    return raw, advantages.flatten()


@pytest.mark.exercises("--custom-reward-post-process-path")
def test_custom_post_process_sees_failed_samples_at_their_group_mean_and_they_get_advantage_0():
    SEEN.clear()
    # Group 0: sample 1 failed; group 1: every sample failed.
    rewards = [0.1, math.nan, 0.4, 0.7, math.nan, math.nan, math.nan, math.nan]
    samples = [SimpleNamespace(reward=r, reward_failed=math.isnan(r), remove_sample=math.isnan(r)) for r in rewards]
    cfg = config(custom_reward_post_process_path=f"{__name__}.grpo_post_process")
    raw, adv = post_process_rewards(torch.tensor(rewards, dtype=F64), cfg, samples)
    # The function saw the failed sample at its group's mean valid reward (0.4: the mean
    # is unchanged) and the all-failed group at 0; no NaN reached it.
    assert SEEN == [pytest.approx([0.1, 0.4, 0.4, 0.7, 0.0, 0.0, 0.0, 0.0])]
    filled = [0.1, 0.4, 0.4, 0.7]
    group = [(r - 0.4) / (_std_unbiased(filled) + EPS) for r in filled]
    group[1] = 0.0
    close(adv, group + [0.0] * 4)
    assert [math.isnan(r) for r in raw.tolist()] == [math.isnan(r) for r in rewards]
    close(raw[[0, 2, 3]], [0.1, 0.4, 0.7])
    # The samples keep their NaN reward, and the run path gives the same advantages.
    assert [math.isnan(s.reward) for s in samples] == [math.isnan(r) for r in rewards]
    close(advantages_from_config(torch.tensor(rewards, dtype=F64), cfg, samples), adv)


def test_custom_post_process_needs_samples_and_a_real_path():
    cfg = config(custom_reward_post_process_path=f"{__name__}.rank_post_process")
    with pytest.raises(ValueError, match="no samples were passed"):
        advantages_from_config(torch.tensor(REWARDS), cfg)
    cfg = config(custom_reward_post_process_path=f"{__name__}.no_such_function")
    with pytest.raises(PathFlagError, match="^--custom-reward-post-process-path"):
        advantages_from_config(torch.tensor(REWARDS), cfg, _samples())
