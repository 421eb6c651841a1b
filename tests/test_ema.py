"""EMA decay schedule and update rule against formulas written out here (docs/design.md, "Advantages, losses and the EMA")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_core.training.ema import EMA, ema_decay

F64 = torch.float64


def ref_decay(t: int, init: float, ramp: float, maximum: float, flat: int) -> float:
    return init if t <= flat else min((t - flat) * ramp, maximum)


# ------------------------------------------------------------------ decay schedule
def test_reference_defaults_ramp_from_the_first_step():
    # --ema-decay-init 0.001 --ema-decay-ramp 0.001 --ema-decay-max 0.5 --ema-decay-flat-steps 0
    kw = {"init": 0.001, "ramp": 0.001, "maximum": 0.5, "flat_steps": 0}
    assert ema_decay(0, **kw) == 0.001
    assert ema_decay(1, **kw) == pytest.approx(0.001)
    assert ema_decay(250, **kw) == pytest.approx(0.25)
    assert ema_decay(500, **kw) == pytest.approx(0.5)
    assert ema_decay(10_000, **kw) == 0.5


def test_flat_period_then_ramp_restarts_from_zero():
    kw = {"init": 0.3, "ramp": 0.01, "maximum": 0.9, "flat_steps": 10}
    assert [ema_decay(t, **kw) for t in (0, 1, 10)] == [0.3, 0.3, 0.3]
    assert ema_decay(11, **kw) == pytest.approx(0.01)  # drops below init: the ramp restarts
    assert ema_decay(40, **kw) == pytest.approx(0.30)
    assert ema_decay(100, **kw) == pytest.approx(0.9)
    assert ema_decay(101, **kw) == 0.9
    for t in range(0, 130, 7):
        assert ema_decay(t, **kw) == pytest.approx(ref_decay(t, 0.3, 0.01, 0.9, 10)), t


def test_negative_step_is_an_error():
    with pytest.raises(ValueError):
        ema_decay(-1, init=0.1, ramp=0.1, maximum=0.5, flat_steps=0)


# ------------------------------------------------------------------ update rule
def _params(seed: int = 0, dtype=torch.float32) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.nn.Parameter(torch.randn(3, 4, generator=g).to(dtype)),
        "b": torch.nn.Parameter(torch.randn(4, generator=g).to(dtype)),
    }


def test_update_follows_the_rule_in_float64():
    live = _params()
    kw = {"decay_init": 0.2, "decay_ramp": 0.15, "decay_max": 0.6, "flat_steps": 1}
    ema = EMA(live, **kw)
    ref = {k: v.detach().to(F64).clone() for k, v in live.items()}
    g = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        with torch.no_grad():
            for p in live.values():
                p.add_(torch.randn(p.shape, generator=g))
        d = ema.update(live, step)
        d_ref = ref_decay(step, 0.2, 0.15, 0.6, 1)
        assert d == pytest.approx(d_ref)
        ref = {k: d_ref * v + (1 - d_ref) * live[k].detach().to(F64) for k, v in ref.items()}
    assert ema.last_step == 6
    for k, v in ref.items():
        assert ema.shadow[k].dtype == torch.float32
        torch.testing.assert_close(ema.shadow[k].to(F64), v, rtol=1e-6, atol=1e-6)


def test_decay_zero_copies_and_decay_one_keeps():
    live = _params()
    ema = EMA(live, decay_init=0.0, decay_ramp=1.0, decay_max=1.0, flat_steps=1)
    with torch.no_grad():
        for p in live.values():
            p.mul_(2)
    ema.update(live, 1)  # d = 0: the shadow becomes the live weights
    assert all(torch.equal(ema.shadow[k], live[k].detach()) for k in live)
    before = {k: v.clone() for k, v in ema.shadow.items()}
    with torch.no_grad():
        for p in live.values():
            p.add_(5)
    ema.update(live, 2)  # d = min(1 * 1.0, 1.0) = 1: unchanged
    assert all(torch.equal(ema.shadow[k], before[k]) for k in live)


def test_shadow_is_float32_for_bf16_parameters():
    live = _params(dtype=torch.bfloat16)
    ema = EMA(live)
    assert all(t.dtype == torch.float32 for t in ema.shadow.values())
    ema.update(live, 1)
    ema.copy_to(live)
    assert all(p.dtype == torch.bfloat16 for p in live.values())


@pytest.mark.exercises("--ema-decay-init", "--ema-decay-ramp", "--ema-decay-max", "--ema-decay-flat-steps")
def test_from_config_reads_the_flags():
    cfg = SimpleNamespace(ema_decay_init=0.05, ema_decay_ramp=0.02, ema_decay_max=0.7, ema_decay_flat_steps=3)
    ema = EMA.from_config(cfg, _params())
    assert ema.decay_at(3) == 0.05 and ema.decay_at(5) == pytest.approx(0.04) and ema.decay_at(99) == 0.7


def test_module_named_parameters_are_accepted():
    module = torch.nn.Linear(3, 2)
    ema = EMA(module.named_parameters())
    assert set(ema.shadow) == {"weight", "bias"}
    ema.update(module.named_parameters(), 1)


def test_mismatched_parameters_are_errors():
    ema = EMA(_params())
    with pytest.raises(ValueError, match="missing \\['w'\\]"):
        ema.update({"b": _params()["b"]}, 1)
    with pytest.raises(ValueError, match="w has shape"):
        ema.update({"w": torch.nn.Parameter(torch.zeros(2)), "b": _params()["b"]}, 1)


# ------------------------------------------------------------------ copy_to / swap_into
def _advanced() -> tuple[dict[str, torch.nn.Parameter], EMA]:
    live = _params()
    ema = EMA(live, decay_init=0.5, decay_ramp=0.0, decay_max=0.5, flat_steps=10)
    with torch.no_grad():
        for p in live.values():
            p.add_(1.0)
    ema.update(live, 1)  # shadow = live - 0.5, so the two differ
    return live, ema


def test_copy_to_writes_the_shadow():
    live, ema = _advanced()
    ema.copy_to(live)
    assert all(torch.equal(live[k].detach(), ema.shadow[k]) for k in live)


def test_swap_into_puts_ema_weights_in_and_restores_exactly():
    live, ema = _advanced()
    original = {k: v.detach().clone() for k, v in live.items()}
    shadow = {k: v.clone() for k, v in ema.shadow.items()}
    # A forward inside the swap sees the EMA weights.
    module = torch.nn.Linear(4, 3)
    module_ema = EMA(module.named_parameters())
    with torch.no_grad():
        module.weight.add_(3.0)
    before = {k: v.detach().clone() for k, v in module.named_parameters()}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    with module_ema.swap_into(module.named_parameters()):
        torch.testing.assert_close(module(x), x @ module_ema.shadow["weight"].T + module_ema.shadow["bias"])
    assert all(torch.equal(v.detach(), before[k]) for k, v in module.named_parameters())

    with ema.swap_into(live):
        for k in live:
            assert torch.equal(live[k].detach(), shadow[k])
            assert not torch.equal(live[k].detach(), original[k])
        with pytest.raises(RuntimeError, match="inside swap_into"):
            ema.update(live, 2)
    for k in live:
        assert torch.equal(live[k].detach(), original[k])  # bit for bit
        assert torch.equal(ema.shadow[k], shadow[k])  # the shadow is untouched by a swap
    ema.update(live, 2)  # allowed again after the swap


def test_swap_into_restores_bf16_weights_exactly_even_on_error():
    live = _params(dtype=torch.bfloat16)
    ema = EMA(live)
    with torch.no_grad():
        for p in live.values():
            p.add_(0.123)
    original = {k: v.detach().clone() for k, v in live.items()}
    with pytest.raises(KeyError), ema.swap_into(live):
        raise KeyError("boom")
    assert all(torch.equal(live[k].detach(), original[k]) for k in live)
    ema.update(live, 1)  # the swapped flag was cleared


# ------------------------------------------------------------------ checkpoints
def test_state_dict_round_trip():
    live, ema = _advanced()
    state = ema.state_dict()
    assert state["last_step"] == 1
    fresh = EMA(_params(seed=5))
    fresh.load_state_dict(state)
    assert fresh.last_step == 1
    assert all(torch.equal(fresh.shadow[k], ema.shadow[k]) for k in live)
    # the state is a copy: later updates do not change it
    ema.update(live, 2)
    assert not torch.equal(state["shadow"]["w"], ema.shadow["w"])


def test_load_state_dict_rejects_other_parameters():
    ema = EMA(_params())
    with pytest.raises(ValueError, match="load_state_dict"):
        ema.load_state_dict({"shadow": {"w": torch.zeros(3, 4)}, "last_step": 0})
