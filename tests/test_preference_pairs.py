"""Preference pairs from rollout groups (online DPO's training data): each group's best and
worst kept sample."""

from __future__ import annotations

from types import SimpleNamespace

from miles_core.training.preferences import PreferencePair, preference_pairs


def sample(group: int, *, removed: bool = False, failed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(group_index=group, remove_sample=removed, reward_failed=failed)


def test_best_against_worst_per_group_in_rollout_order():
    samples = [sample(0), sample(0), sample(0), sample(1), sample(1), sample(1)]
    advantages = [0.1, 1.2, -0.7, 0.0, -2.0, 2.0]
    assert preference_pairs(samples, advantages) == [PreferencePair(1, 2, 0), PreferencePair(5, 4, 1)]
    # Control: another order of the advantages changes the pairs.
    assert preference_pairs(samples, [1.2, 0.1, -0.7, 0.0, -2.0, 2.0])[0] == PreferencePair(0, 2, 0)


def test_groups_without_a_preference_give_no_pair():
    samples = [sample(0), sample(0), sample(1), sample(1, removed=True), sample(2), sample(2, failed=True), sample(2)]
    advantages = [0.5, 0.5, 1.0, -1.0, 0.3, 9.0, -0.3]
    # Group 0 ties, group 1 keeps one sample, group 2's failed reward is left out.
    assert preference_pairs(samples, advantages) == [PreferencePair(4, 6, 2)]


def test_ties_take_the_first_in_seed_order():
    samples = [sample(0)] * 4
    assert preference_pairs(samples, [1.0, 1.0, -1.0, -1.0]) == [PreferencePair(0, 2, 0)]
