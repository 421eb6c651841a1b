"""Online Flow-DPO's loss: the formula against an independent float64 transcription of
Diffusion-DPO's objective on velocities, log 2 and the gradient's direction at policy ==
reference, the chosen/rejected symmetry, and the adapter's errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_algorithms.dpo import dpo_loss, flow_dpo

KEYS = ("v_chosen", "v_rejected", "ref_v_chosen", "ref_v_rejected", "target_chosen", "target_rejected")


def _pairs(seed: int, batch: int = 8, shape: tuple[int, ...] = (2, 4, 4), spread: float = 0.05) -> dict[str, torch.Tensor]:
    """Preference pairs: the targets ε − x0, the reference's velocities near them, the
    policy's near the reference's."""
    gen = torch.Generator().manual_seed(seed)
    full = (batch, *shape)
    out = {}
    for side in ("chosen", "rejected"):
        target = torch.randn(full, generator=gen)
        ref = target + 0.5 * torch.randn(full, generator=gen)
        out[f"target_{side}"] = target
        out[f"ref_v_{side}"] = ref
        out[f"v_{side}"] = ref + spread * torch.randn(full, generator=gen)
    return out


def _reference(pairs: dict[str, torch.Tensor], beta: float) -> tuple[float, list[float]]:
    """L = mean_b −log σ(−½β[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))]), e = mean((v − u)²),
    per pair in float64 (Wallace et al. 2023, Eq. 14; flow_grpo's train_sd3_dpo.py)."""

    def err(v: torch.Tensor, u: torch.Tensor) -> float:
        return float(((v.double() - u.double()) ** 2).mean())

    zs, losses = [], []
    for b in range(pairs["v_chosen"].shape[0]):
        dw = err(pairs["v_chosen"][b], pairs["target_chosen"][b]) - err(pairs["ref_v_chosen"][b], pairs["target_chosen"][b])
        dl = err(pairs["v_rejected"][b], pairs["target_rejected"][b]) - err(pairs["ref_v_rejected"][b], pairs["target_rejected"][b])
        z = -0.5 * beta * (dw - dl)
        zs.append(z)
        losses.append(math.log1p(math.exp(-z)))  # −log σ(z)
    return sum(losses) / len(losses), zs


def test_loss_matches_float64_formula() -> None:
    pairs = _pairs(0)
    loss, metrics = dpo_loss(*(pairs[k] for k in KEYS), beta=100.0)
    expected, zs = _reference(pairs, 100.0)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["reward_margin"].item() == pytest.approx(sum(zs) / len(zs), rel=1e-4, abs=1e-6)
    acc = sum(z > 0 for z in zs) / len(zs)
    assert 0 < acc < 1 and metrics["implicit_acc"].item() == pytest.approx(acc)
    err_w = ((pairs["v_chosen"].double() - pairs["target_chosen"].double()) ** 2).flatten(1).mean(1)
    ref_w = ((pairs["ref_v_chosen"].double() - pairs["target_chosen"].double()) ** 2).flatten(1).mean(1)
    assert metrics["chosen_err"].item() == pytest.approx(err_w.mean().item(), rel=1e-6)
    assert metrics["chosen_err_vs_ref"].item() == pytest.approx((err_w - ref_w).mean().item(), rel=1e-4, abs=1e-7)
    for value in metrics.values():
        assert value.ndim == 0 and not value.requires_grad


def test_policy_equal_to_reference_gives_log2_and_the_right_gradient() -> None:
    """At θ = ref, z = 0 exactly (the same errors subtracted), L = log 2, and
    ∂L/∂v_w = +β·(v_w − u_w)/(2·D·B), ∂L/∂v_l = −β·(v_l − u_l)/(2·D·B): descent lowers the
    chosen's error and raises the rejected's."""
    beta = 100.0
    pairs = _pairs(1, spread=0.0)
    batch, dim = pairs["v_chosen"].shape[0], pairs["v_chosen"][0].numel()
    v_w = pairs["v_chosen"].clone().requires_grad_()
    v_l = pairs["v_rejected"].clone().requires_grad_()
    args = dict(pairs, v_chosen=v_w, v_rejected=v_l)
    loss, metrics = dpo_loss(*(args[k] for k in KEYS), beta=beta)
    assert metrics["reward_margin"].item() == 0.0 and metrics["implicit_acc"].item() == 0.0
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    loss.backward()
    torch.testing.assert_close(v_w.grad, beta * (pairs["v_chosen"] - pairs["target_chosen"]) / (2 * dim * batch))
    torch.testing.assert_close(v_l.grad, -beta * (pairs["v_rejected"] - pairs["target_rejected"]) / (2 * dim * batch))

    def err(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return ((v - u) ** 2).flatten(1).mean(1)

    with torch.no_grad():
        step = 1e-3
        after_w = err(v_w - step * v_w.grad, pairs["target_chosen"])
        after_l = err(v_l - step * v_l.grad, pairs["target_rejected"])
    assert bool((after_w < err(pairs["v_chosen"], pairs["target_chosen"])).all())
    assert bool((after_l > err(pairs["v_rejected"], pairs["target_rejected"])).all())


def test_swapping_chosen_and_rejected_maps_z_to_minus_z() -> None:
    """L(z) = −log σ(z) per pair and the swap negates z, so L_swapped − L = mean(z)
    (softplus(z) − softplus(−z) = z) and the implicit accuracy flips."""
    pairs = _pairs(2)
    swapped = {
        "v_chosen": pairs["v_rejected"], "v_rejected": pairs["v_chosen"],
        "ref_v_chosen": pairs["ref_v_rejected"], "ref_v_rejected": pairs["ref_v_chosen"],
        "target_chosen": pairs["target_rejected"], "target_rejected": pairs["target_chosen"],
    }  # fmt: skip
    loss, metrics = dpo_loss(*(pairs[k] for k in KEYS), beta=100.0)
    loss_s, metrics_s = dpo_loss(*(swapped[k] for k in KEYS), beta=100.0)
    assert metrics_s["reward_margin"].item() == pytest.approx(-metrics["reward_margin"].item(), rel=1e-6)
    assert (loss_s - loss).item() == pytest.approx(metrics["reward_margin"].item(), rel=1e-4, abs=1e-6)
    assert metrics_s["implicit_acc"].item() == pytest.approx(1 - metrics["implicit_acc"].item())


@pytest.mark.exercises("--dpo-beta")
def test_adapter_reads_dpo_beta_and_names_what_is_missing() -> None:
    pairs = _pairs(3)
    batch = dict(pairs, sigma=torch.rand(8), reward_chosen=torch.full((8,), 0.9), reward_rejected=torch.full((8,), 0.2))
    loss, metrics = flow_dpo(batch, SimpleNamespace(dpo_beta=50.0))
    assert torch.equal(loss, dpo_loss(*(pairs[k] for k in KEYS), beta=50.0)[0])
    assert metrics["reward_gap"].item() == pytest.approx(0.7)
    without = {k: v for k, v in batch.items() if k != "ref_v_rejected"}
    with pytest.raises(KeyError, match="flow_dpo loss needs batch key 'ref_v_rejected'"):
        flow_dpo(without, SimpleNamespace(dpo_beta=50.0))
    with pytest.raises(AttributeError, match="--dpo-beta"):
        flow_dpo(batch, SimpleNamespace())
    with pytest.raises(ValueError, match=r"beta must be > 0 \(--dpo-beta\)"):
        flow_dpo(batch, SimpleNamespace(dpo_beta=0.0))
    bad = dict(batch, target_rejected=torch.zeros(8, 3))
    with pytest.raises(ValueError, match="must share one"):
        flow_dpo(bad, SimpleNamespace(dpo_beta=50.0))
