"""GRPO-Guard's loss: the formula against an independent float64 transcription, its
invariants (ratio exactly 1 at frozen weights, the raw log-ratio's bias removed), its
gradient in closed form, and the reweighting's effect on per-step gradient sizes, on
transitions of miles-core's real ``sde`` backend."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_algorithms.grpo_guard import grpo_guard, grpo_guard_loss, normalized_log_ratio
from miles_core.losses import flow_grpo_loss
from miles_core.sde import FlowSdeBackend

ETA = 0.7


def _sigmas(steps: int = 10, shift: float = 3.0) -> list[float]:
    """SD3's shifted schedule σ = shift·t / (1 + (shift − 1)·t) on t = 1 … 0."""
    ts = [1 - i / steps for i in range(steps + 1)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def _transitions(gen: torch.Generator, batch: int, dim: int, sigma: float, sigma_next: float, sigma_max: float, dv: float):
    """SDE transitions drawn by the behaviour policy (velocity ``v_old``) and rescored under
    ``v = v_old + dv·noise``; returns (v leaf, x, x', μ_old, log_prob_old, ε)."""
    backend = FlowSdeBackend(noise_level=ETA)
    x = torch.randn(batch, dim, generator=gen)
    v_old = torch.randn(batch, dim, generator=gen)
    v = (v_old + dv * torch.randn(batch, dim, generator=gen)).requires_grad_()
    eps = torch.randn(batch, dim, generator=gen)
    step = backend.step(x, v_old, sigma, sigma_next, sigma_max=sigma_max, noise=eps)
    return v, x, step.prev_sample, step.mean, step.log_prob, eps


def _rescore(v, x, x_next, sigma, sigma_next, sigma_max):
    return FlowSdeBackend(noise_level=ETA).log_prob(x_next, x, v, sigma, sigma_next, sigma_max=sigma_max)


# ------------------------------------------------------------------ the formula
def _reference(lp, olp, adv, mu, omu, std, sig, sig_next, *, clip, cmax, reweight, no_const, kl_beta=0.0, kl=None):
    """GRPO-Guard written out per sample in float64 from the paper's description and the
    authors' code (RealGen's rationorm branch)."""
    per, ratios = [], []
    for b in range(len(lp)):
        s = float(std[b])
        delta = float(lp[b]) - float(olp[b])
        if no_const:
            delta /= 2 * s * s
        d = (mu[b].double() - omu[b].double()).flatten()
        bias = float((d * d).mean()) / (2 * s * s)
        r = math.exp((delta + bias) * s)
        a = min(max(float(adv[b]), -cmax), cmax)
        term = max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
        if reweight:
            term /= abs(float(sig[b]) - float(sig_next[b]))
        per.append(term)
        ratios.append(r)
    policy = sum(per) / len(per)
    total = policy + (kl_beta * sum(float(k) for k in kl) / len(kl) if kl_beta > 0 else 0.0)
    return policy, total, ratios


def _random_batch(gen: torch.Generator, batch: int = 8):
    shape = (batch, 2, 3, 3)
    omu = torch.randn(shape, generator=gen)
    mu = omu + 0.03 * torch.randn(shape, generator=gen)
    olp = torch.randn(batch, generator=gen)
    lp = olp + 0.2 * torch.randn(batch, generator=gen)
    std = (0.02 + 0.3 * torch.rand(batch, generator=gen)).reshape(batch, 1, 1, 1)
    sig = 0.2 + 0.7 * torch.rand(batch, generator=gen)
    sig_next = sig - (0.01 + 0.1 * torch.rand(batch, generator=gen))
    adv = 3 * torch.randn(batch, generator=gen)
    return lp, olp, adv, mu, omu, std, sig, sig_next


@pytest.mark.parametrize(("reweight", "no_const"), [(True, False), (False, False), (True, True)])
def test_loss_matches_float64_formula(reweight: bool, no_const: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lp, olp, adv, mu, omu, std, sig, sig_next = _random_batch(gen)
    _, _, ratios = _reference(lp, olp, adv, mu, omu, std, sig, sig_next, clip=1.0, cmax=2.0, reweight=reweight, no_const=no_const)
    # A clip range at the median deviation: half the samples are clipped.
    clip = sorted(abs(r - 1) for r in ratios)[len(ratios) // 2]
    policy, total, ratios = _reference(lp, olp, adv, mu, omu, std, sig, sig_next, clip=clip, cmax=2.0, reweight=reweight, no_const=no_const)
    loss, metrics = grpo_guard_loss(
        lp, olp, adv, mu, omu, std, sig, sig_next, clip_range=clip, adv_clip_max=2.0, reweight=reweight, log_prob_no_const=no_const
    )
    assert loss.item() == pytest.approx(total, rel=1e-5)
    assert metrics["policy_loss"].item() == pytest.approx(policy, rel=1e-5)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    clipped = sum(abs(r - 1) > clip for r in ratios) / len(ratios)
    assert 0 < clipped < 1 and metrics["clipfrac"].item() == pytest.approx(clipped)
    for value in metrics.values():
        assert value.ndim == 0 and not value.requires_grad


def test_frozen_weights_give_ratio_exactly_one() -> None:
    gen = torch.Generator().manual_seed(1)
    sigmas = _sigmas()
    v, x, x_next, mean_old, lp_old, _ = _transitions(gen, 6, 32, sigmas[3], sigmas[4], sigmas[1], dv=0.0)
    out = _rescore(v, x, x_next, sigmas[3], sigmas[4], sigmas[1])
    adv = torch.tensor([2.0, -1.0, 0.5, -3.0, 7.0, 0.0])
    sig, sig_next = torch.full((6,), sigmas[3]), torch.full((6,), sigmas[4])
    # Frozen weights: the rescored mean and log-prob are the behaviour policy's, bit for bit.
    assert torch.equal(out.mean, mean_old) and torch.equal(out.log_prob, lp_old)
    log_ratio, delta = normalized_log_ratio(out.log_prob, lp_old, out.mean, mean_old, out.std)
    assert torch.equal(log_ratio, torch.zeros(6)) and torch.equal(delta, torch.zeros(6))
    loss, metrics = grpo_guard_loss(lp_old, lp_old, adv, out.mean, mean_old, out.std, sig, sig_next, clip_range=2e-6, adv_clip_max=5.0)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["ratio_abs_dev"].item() == 0.0
    assert metrics["clipfrac"].item() == 0.0
    expected = -(adv.clamp(-5, 5) / (sigmas[3] - sigmas[4])).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_normalisation_removes_the_raw_ratios_bias() -> None:
    """The paper's motivation: E_ε[log r] = −mean(Δ²)/(2S²) < 0 for the raw ratio; the
    normalised log-ratio mean(ε·Δ) has mean 0. The raw ratio is the control: it fails the
    mean-zero check the normalised one passes."""
    gen = torch.Generator().manual_seed(2)
    sigmas = _sigmas()
    n, dim = 4000, 8
    for k in (1, 5, 8):
        s, s_next = sigmas[k], sigmas[k + 1]
        backend = FlowSdeBackend(noise_level=ETA)
        x = torch.randn(1, dim, generator=gen).expand(n, dim)
        v_old = torch.randn(1, dim, generator=gen).expand(n, dim)
        mean_old, std = backend.mean_std(x, v_old, s, s_next, sigma_max=sigmas[1])
        # A policy step that moves the mean by half a transition std per element.
        v_new = v_old + (0.5 * std / ((1 + ETA**2 / 2) * (s - s_next))) * torch.randn(1, dim, generator=gen).sign()
        x_next = mean_old + std * torch.randn(n, dim, generator=gen)
        lp_old = backend.log_prob(x_next, x, v_old, s, s_next, sigma_max=sigmas[1]).log_prob
        new = backend.log_prob(x_next, x, v_new, s, s_next, sigma_max=sigmas[1])
        norm, raw = normalized_log_ratio(new.log_prob.double(), lp_old.double(), new.mean.double(), mean_old.double(), std.double())
        closed_bias = -float(((new.mean[0] - mean_old[0]).double() ** 2).mean()) / (2 * float(std[0, 0]) ** 2)
        raw_se, norm_se = raw.std().item() / math.sqrt(n), norm.std().item() / math.sqrt(n)
        assert raw.mean().item() < -6 * raw_se  # biased below 0
        assert raw.mean().item() == pytest.approx(closed_bias, abs=4 * raw_se)
        assert abs(norm.mean().item()) < 4 * norm_se  # centred
        assert abs(raw.mean().item()) > 4 * raw_se  # the control fails the same check


# ---------------------------------------------------------------- the gradient
def _gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's per-element mean Gaussian log-density, written out here."""
    per = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return per.flatten(1).mean(1)


def test_gradient_wrt_mean_matches_closed_form_and_finite_differences() -> None:
    """∂ log r̃/∂μ = ε/D: the loss's gradient is −A·r̃·w·ε/(D·B) where the surrogate is
    unclipped, 0 where it is clipped."""
    gen = torch.Generator().manual_seed(3)
    batch, dim = 6, 5
    std = 0.05 + 0.2 * torch.rand(batch, 1, generator=gen, dtype=torch.float64)
    mean_old = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    eps = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    x_next = mean_old + std * eps
    lp_old = _gaussian_log_prob(x_next, mean_old, std)
    adv = torch.tensor([1.5, -0.7, 2.0, -2.5, 0.3, 1.0], dtype=torch.float64)
    sig = torch.linspace(0.9, 0.4, batch, dtype=torch.float64)
    sig_next = sig - torch.linspace(0.03, 0.12, batch, dtype=torch.float64)
    mean0 = mean_old + 0.3 * std * torch.randn(batch, dim, generator=gen, dtype=torch.float64)

    def loss_of(mean: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
        lp = _gaussian_log_prob(x_next, mean, std)
        loss, _ = grpo_guard_loss(lp, lp_old, adv, mean, mean_old, std, sig, sig_next, clip_range=clip, adv_clip_max=5.0)
        ratio = torch.exp(((mean - mean_old) * eps).mean(1))
        return loss, ratio

    for clip in (10.0, 0.01):
        mean = mean0.clone().requires_grad_()
        loss, ratio = loss_of(mean, clip)
        loss.backward()
        ratio = ratio.detach()
        w = 1 / (sig - sig_next)
        unclipped = ~(((adv > 0) & (ratio > 1 + clip)) | ((adv < 0) & (ratio < 1 - clip)))
        closed = (-adv * ratio * w * unclipped).reshape(batch, 1) * eps / (dim * batch)
        if clip < 1:
            assert 0 < int(unclipped.sum()) < batch  # both cases are exercised
        torch.testing.assert_close(mean.grad, closed, rtol=1e-9, atol=1e-12)
        # Central finite differences on a few coordinates.
        for b, i in ((0, 0), (3, 2), (5, 4)):
            h = 1e-6
            plus, minus = mean0.clone(), mean0.clone()
            plus[b, i] += h
            minus[b, i] -= h
            fd = (loss_of(plus, clip)[0] - loss_of(minus, clip)[0]).item() / (2 * h)
            assert fd == pytest.approx(mean.grad[b, i].item(), rel=1e-5, abs=1e-9)


def test_reweighting_equalises_per_step_gradients_across_sigmas() -> None:
    """On the sde backend ∂μ/∂v = (1 + η²/2)·dt for σ < 1, so with 1/|dt| the gradient with
    respect to the velocity has one size at every step; plain Flow-GRPO's and GRPO-Guard's
    without reweighting (the controls) vary over the schedule."""
    sigmas = _sigmas(10)
    batch, dim = 4, 64
    norms: dict[str, list[float]] = {"guard": [], "no_reweight": [], "flow_grpo": []}
    adv = torch.ones(batch)
    for k in range(1, len(sigmas) - 2):  # every σ < 1 of the SDE-able steps
        s, s_next = sigmas[k], sigmas[k + 1]
        for name in norms:
            gen = torch.Generator().manual_seed(4)  # the same draws at every step
            v, x, x_next, mean_old, lp_old, eps = _transitions(gen, batch, dim, s, s_next, sigmas[1], dv=0.01)
            out = _rescore(v, x, x_next, s, s_next, sigmas[1])
            if name == "flow_grpo":
                loss, _ = flow_grpo_loss(out.log_prob, lp_old, adv, clip_range=1e3, adv_clip_max=5.0)
            else:
                sig, sig_next = torch.full((batch,), s), torch.full((batch,), s_next)
                loss, _ = grpo_guard_loss(
                    out.log_prob, lp_old, adv, out.mean, mean_old, out.std, sig, sig_next,
                    clip_range=1e3, adv_clip_max=5.0, reweight=name == "guard",
                )  # fmt: skip
            loss.backward()
            norms[name].append(v.grad.norm().item())
        # The closed form at this step: |∂L/∂v| = (1 + η²/2)·|r̃·ε|/(D·B) with r̃ ≈ 1.
        ratio = torch.exp(((out.mean - mean_old) * eps).mean(1)).detach()
        closed = (1 + ETA**2 / 2) * (ratio.reshape(-1, 1) * eps).norm().item() / (dim * batch)
        assert norms["guard"][-1] == pytest.approx(closed, rel=1e-4)

    def spread(values: list[float]) -> float:
        return max(values) / min(values)

    assert spread(norms["guard"]) < 1.001
    assert spread(norms["no_reweight"]) > 3
    assert spread(norms["flow_grpo"]) > 10


# -------------------------------------------------------------------- adapter
def _config(**overrides: object) -> SimpleNamespace:
    values = {"diffusion_clip_range": 0.05, "diffusion_adv_clip_max": 2.0, "diffusion_kl_beta": 0.0, "diffusion_log_prob_no_const": False}
    values.update(overrides)
    return SimpleNamespace(**values)


def _adapter_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    lp, olp, adv, mu, omu, std, sig, sig_next = _random_batch(gen)
    return {
        "log_prob": lp, "old_log_prob": olp, "advantages": adv, "mean": mu, "old_mean": omu,
        "transition_std": std, "sigma": sig, "sigma_next": sig_next,
    }  # fmt: skip


def test_adapter_reads_flags_and_adds_the_kl_term_in_either_space() -> None:
    gen = torch.Generator().manual_seed(5)
    batch = _adapter_batch(gen)
    keys = ("log_prob", "old_log_prob", "advantages", "mean", "old_mean", "transition_std", "sigma", "sigma_next")
    args = [batch[k] for k in keys]
    loss, metrics = grpo_guard(batch, _config())
    direct, _ = grpo_guard_loss(*args, clip_range=0.05, adv_clip_max=2.0)
    assert torch.equal(loss, direct) and "kl_loss" not in metrics
    no_const, _ = grpo_guard(batch, _config(diffusion_log_prob_no_const=True))
    assert torch.equal(no_const, grpo_guard_loss(*args, clip_range=0.05, adv_clip_max=2.0, log_prob_no_const=True)[0])

    ref_mean = batch["mean"] + 0.1 * torch.randn(batch["mean"].shape, generator=gen)
    s = torch.full((8, 1, 1, 1), 0.4)
    latent = dict(batch, ref_mean=ref_mean, std=s)
    loss_l, metrics_l = grpo_guard(latent, _config(diffusion_kl_beta=0.3))
    kl_latent = (((batch["mean"].double() - ref_mean.double()) ** 2) / (2 * 0.4**2)).flatten(1).mean(1).mean().item()
    assert metrics_l["kl_loss"].item() == pytest.approx(kl_latent, rel=1e-5)
    assert loss_l.item() == pytest.approx(direct.item() + 0.3 * kl_latent, rel=1e-5)

    velocity = torch.randn(8, 2, 3, 3, generator=gen)
    ref_velocity = velocity + 0.2 * torch.randn(8, 2, 3, 3, generator=gen)
    loss_v, metrics_v = grpo_guard(dict(batch, velocity=velocity, ref_velocity=ref_velocity), _config(diffusion_kl_beta=0.3))
    kl_velocity = ((velocity.double() - ref_velocity.double()) ** 2).flatten(1).mean(1).mean().item()
    assert metrics_v["kl_loss"].item() == pytest.approx(kl_velocity, rel=1e-5)
    assert loss_v.item() == pytest.approx(direct.item() + 0.3 * kl_velocity, rel=1e-5)


def test_adapter_names_a_missing_batch_key_or_flag() -> None:
    batch = _adapter_batch(torch.Generator().manual_seed(6))
    del batch["old_mean"]
    with pytest.raises(KeyError, match="grpo_guard loss needs batch key 'old_mean'"):
        grpo_guard(batch, _config())
    batch = _adapter_batch(torch.Generator().manual_seed(6))
    with pytest.raises(AttributeError, match="--diffusion-clip-range"):
        grpo_guard(batch, SimpleNamespace(diffusion_adv_clip_max=2.0))
    with pytest.raises(KeyError, match="'ref_mean'"):
        grpo_guard(batch, _config(diffusion_kl_beta=0.1))
    bad = dict(batch, transition_std=torch.ones(8, 2))
    with pytest.raises(ValueError, match=r"transition_std must hold one value per sample"):
        grpo_guard(bad, _config())
