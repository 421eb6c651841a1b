"""LR schedule values at chosen steps against formulas written out here (Megatron-LM's)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_core.training.lr_schedule import LRSchedule, from_config

LR, MIN, INIT = 1e-3, 1e-5, 1e-4


def approx(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def config(**overrides):
    base = {
        "lr": LR,
        "min_lr": MIN,
        "lr_warmup_init": INIT,
        "lr_warmup_iters": 0,
        "lr_warmup_fraction": None,
        "lr_decay_style": "constant",
        "lr_decay_iters": None,
        "lr_wsd_decay_iters": None,
        "lr_wsd_decay_style": None,
    }
    base.update(overrides)
    return SimpleNamespace(**base)


# ------------------------------------------------------------------ warmup
@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_warmup_is_linear_from_init_and_reaches_lr_at_warmup_iters(style):
    s = LRSchedule(lr=LR, min_lr=MIN, warmup_init=INIT, warmup_iters=4, decay_style=style, decay_iters=20, wsd_decay_iters=5)
    assert s.lr_at(0) == approx(INIT)
    assert s.lr_at(1) == approx(INIT + (LR - INIT) * 1 / 4)
    assert s.lr_at(3) == approx(INIT + (LR - INIT) * 3 / 4)
    assert s.lr_at(4) == approx(LR)  # Megatron: step <= warmup is still warmup, = lr


def test_no_warmup_starts_at_lr():
    assert LRSchedule(lr=LR, decay_style="constant").lr_at(0) == LR


# ------------------------------------------------------------------ constant
def test_constant_stays_at_lr_forever():
    s = LRSchedule(lr=LR, min_lr=MIN, warmup_init=INIT, warmup_iters=2, decay_style="constant", decay_iters=10)
    assert [s.lr_at(k) for k in (2, 5, 10, 11, 1000)] == [LR] * 5


# ------------------------------------------------------------------ linear / cosine
def test_linear_decay_and_after_decay_ends():
    s = LRSchedule(lr=LR, min_lr=MIN, warmup_init=INIT, warmup_iters=4, decay_style="linear", decay_iters=12)
    for k in (5, 8, 11, 12):
        assert s.lr_at(k) == approx(MIN + (1 - (k - 4) / 8) * (LR - MIN)), k
    assert s.lr_at(8) == approx((LR + MIN) / 2)
    assert s.lr_at(12) == approx(MIN)
    assert s.lr_at(13) == MIN and s.lr_at(10_000) == MIN


def test_cosine_decay_and_after_decay_ends():
    s = LRSchedule(lr=LR, min_lr=MIN, warmup_iters=2, decay_style="cosine", decay_iters=10)
    for k in (3, 4, 6, 9, 10):
        r = (k - 2) / 8
        assert s.lr_at(k) == approx(MIN + 0.5 * (1 + math.cos(math.pi * r)) * (LR - MIN)), k
    assert s.lr_at(6) == approx((LR + MIN) / 2)
    assert s.lr_at(11) == MIN


# ------------------------------------------------------------------ wsd
WSD_COEFF = {
    "linear": lambda q: 1 - q,
    "cosine": lambda q: 0.5 * (1 + math.cos(math.pi * q)),
    "exponential": lambda q: 2 * 0.5**q - 1,
    "minus_sqrt": lambda q: 1 - math.sqrt(q),
}


@pytest.mark.parametrize("wsd_style", list(WSD_COEFF))
def test_wsd_stable_then_decays_over_the_last_iters(wsd_style):
    # warmup 2, decay over 20, the last 8 anneal: stable at lr for steps 3..12.
    s = LRSchedule(
        lr=LR, min_lr=MIN, warmup_init=INIT, warmup_iters=2, decay_style="wsd", decay_iters=20, wsd_decay_iters=8, wsd_decay_style=wsd_style
    )
    assert s.lr_at(1) == approx(INIT + (LR - INIT) / 2)
    for k in (3, 7, 12):
        assert s.lr_at(k) == approx(LR), k
    for k in (13, 15, 16, 19, 20):
        q = (k - 12) / 8
        assert s.lr_at(k) == approx(MIN + WSD_COEFF[wsd_style](q) * (LR - MIN)), (wsd_style, k)
    assert s.lr_at(20) == approx(MIN)  # every style ends at coefficient 0
    assert s.lr_at(21) == MIN and s.lr_at(500) == MIN


def test_wsd_style_defaults_to_megatrons_exponential():
    s = LRSchedule(lr=LR, min_lr=MIN, decay_style="wsd", decay_iters=10, wsd_decay_iters=4)
    assert s.lr_at(8) == approx(MIN + (2 * 0.5**0.5 - 1) * (LR - MIN))


# ------------------------------------------------------------------ from_config
@pytest.mark.exercises("--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters")
def test_decay_iters_default_to_the_runs_total_steps():
    s = from_config(config(lr_decay_style="linear"), total_steps=10)
    assert s.decay_iters == 10
    assert s.lr_at(5) == approx(MIN + 0.5 * (LR - MIN))
    assert s.lr_at(11) == MIN
    s = from_config(config(lr_decay_style="linear", lr_decay_iters=4), total_steps=10)
    assert s.lr_at(2) == approx(MIN + 0.5 * (LR - MIN)) and s.lr_at(5) == MIN


@pytest.mark.exercises("--lr-warmup-fraction", "--lr-warmup-init", "--lr-decay-iters")
def test_warmup_fraction_is_of_the_decay_iters_and_wins_over_warmup_iters():
    s = from_config(config(lr_decay_style="cosine", lr_warmup_fraction=0.25, lr_warmup_iters=7), total_steps=20)
    assert s.warmup_iters == 5
    assert s.lr_at(2) == approx(INIT + (LR - INIT) * 2 / 5)
    s = from_config(config(lr_decay_style="cosine", lr_warmup_fraction=0.25, lr_decay_iters=8), total_steps=20)
    assert s.warmup_iters == 2
    # fractional warmup is not rounded, as in Megatron
    s = from_config(config(lr_warmup_fraction=0.1), total_steps=15)
    assert s.lr_at(1) == approx(INIT + (LR - INIT) * 1 / 1.5)
    assert s.lr_at(2) == LR


@pytest.mark.exercises("--lr-decay-style", "--lr-wsd-decay-iters", "--lr-wsd-decay-style")
def test_from_config_wsd_flags():
    s = from_config(config(lr_decay_style="wsd", lr_wsd_decay_iters=4, lr_wsd_decay_style="linear"), total_steps=10)
    assert s.lr_at(6) == LR
    assert s.lr_at(8) == approx(MIN + 0.5 * (LR - MIN))


def test_reference_defaults_are_a_constant_lr():
    s = from_config(config(min_lr=0.0, lr_warmup_init=0.0), total_steps=3)
    assert [s.lr_at(k) for k in range(5)] == [LR] * 5


# ------------------------------------------------------------------ apply
def test_apply_sets_every_param_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    s = LRSchedule(lr=LR, min_lr=MIN, decay_style="linear", decay_iters=10)
    assert s.apply(opt, 5) == approx(MIN + 0.5 * (LR - MIN))
    assert [g["lr"] for g in opt.param_groups] == [s.lr_at(5)] * 2


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay_style": "step"}, "--lr-decay-style 'step'"),
        ({"min_lr": -1.0}, "--min-lr"),
        ({"min_lr": 1.0}, "--lr 0.001 must be >= --min-lr 1.0"),
        ({"warmup_init": 1.0}, "--lr-warmup-init"),
        ({"decay_style": "linear", "decay_iters": 0}, "needs decay iterations > 0"),
        ({"decay_style": "linear", "decay_iters": 5, "warmup_iters": 5}, "must be shorter than the decay iterations"),
        ({"decay_style": "wsd", "decay_iters": 5}, "needs --lr-wsd-decay-iters"),
        ({"decay_style": "wsd", "decay_iters": 5, "wsd_decay_iters": 6}, "--lr-wsd-decay-iters 6 must be in 1..5"),
        ({"decay_style": "wsd", "decay_iters": 5, "wsd_decay_iters": 2, "wsd_decay_style": "step"}, "--lr-wsd-decay-style 'step'"),
    ],
)
def test_invalid_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LRSchedule(lr=LR, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.exercises("--lr-warmup-iters", "--lr-warmup-init")
def test_constant_allows_warmup_longer_than_a_short_run():
    s = from_config(config(lr_warmup_iters=10), total_steps=3)
    assert s.lr_at(2) == approx(INIT + (LR - INIT) * 2 / 10)


def test_negative_step_is_an_error():
    with pytest.raises(ValueError, match="step must be >= 0"):
        LRSchedule(lr=LR).lr_at(-1)
