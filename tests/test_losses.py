"""Losses against hand-computed values and float64 reimplementations (docs/design.md, "Advantages, losses and the EMA")."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_core import losses
from miles_core.losses import (
    LOSSES,
    custom_loss,
    flow_grpo_loss,
    nft,
    nft_loss,
    policy_loss,
    sft,
    sft_loss,
)

torch.set_num_threads(1)
F64 = torch.float64


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a).to(F64), torch.as_tensor(b).to(F64), rtol=tol, atol=tol)


# ----------------------------------------------------------------------- Flow-GRPO
def test_identical_log_probs_give_minus_mean_clamped_advantage():
    logp = torch.tensor([-1.0, 0.5, 2.0, -3.0])
    adv = torch.tensor([3.0, -0.5, 1.0, -7.0])
    loss, m = flow_grpo_loss(logp, logp.clone(), adv, clip_range=1e-4, adv_clip_max=5.0)
    close(loss, -torch.tensor([3.0, -0.5, 1.0, -5.0]).mean())
    close(m["clipfrac"], 0.0)
    close(m["approx_kl"], 0.0)
    close(m["ratio_mean"], 1.0)
    close(m["ratio_abs_dev"], 0.0)
    assert "kl_loss" not in m


def test_clipping_binds_by_hand():
    # r = 1.5 or 0.5 against A = ±1, clip range 0.2:
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2   (clipped)
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8   (clipped)
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = flow_grpo_loss(new, old, adv, clip_range=0.2, adv_clip_max=5.0)
    close(loss, (-1.2 + 1.5 - 0.5 + 0.8) / 4)
    close(m["clipfrac"], 1.0)
    close(m["ratio_abs_dev"], 0.5)
    close(m["ratio_mean"], 1.0)
    close(m["approx_kl"], 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2, tol=1e-6)
    loss.backward()
    # Clipped rows get no gradient; the others get d(-A·r)/dlogp / B = -A·r / 4.
    close(new.grad, torch.tensor([0.0, 1.5 / 4, -0.5 / 4, 0.0]))


def test_clipping_does_not_bind_with_a_wide_range():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = flow_grpo_loss(new, old, adv, clip_range=0.6, adv_clip_max=5.0)
    close(loss, (-1.5 + 1.5 - 0.5 + 0.5) / 4)
    close(m["clipfrac"], 0.0)


def test_kl_term_matches_formula_and_leaves_reference_alone():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, 4, 4, generator=g).requires_grad_(True)
    ref_mean = torch.randn(3, 2, 4, 4, generator=g).requires_grad_(True)
    s = torch.tensor([0.9, 0.5, 0.3])
    logp = torch.tensor([-1.0, -2.0, -0.5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    beta = 0.04
    loss, m = flow_grpo_loss(logp, logp, adv, clip_range=1e-4, adv_clip_max=5.0, kl_beta=beta, mean=mean, ref_mean=ref_mean, std=s)
    expected_kl = (
        sum(((mean[b].detach().to(F64) - ref_mean[b].detach().to(F64)) ** 2).mean().item() / (2 * float(s[b]) ** 2) for b in range(3)) / 3
    )
    close(m["kl_loss"], expected_kl, tol=1e-6)
    close(loss, -adv.mean().item() + beta * expected_kl, tol=1e-6)
    loss.backward()
    assert mean.grad is not None and ref_mean.grad is None
    # std as [B, 1, 1, 1] (StepOutput.noise_scale's shape) and as a float agree too
    _, m2 = flow_grpo_loss(
        logp, logp, adv, clip_range=1e-4, adv_clip_max=5.0, kl_beta=beta, mean=mean, ref_mean=ref_mean, std=s.view(-1, 1, 1, 1)
    )
    close(m2["kl_loss"], expected_kl, tol=1e-6)
    _, m3 = flow_grpo_loss(logp, logp, adv, clip_range=1e-4, adv_clip_max=5.0, kl_beta=beta, mean=mean, ref_mean=ref_mean, std=0.5)
    close(m3["kl_loss"], ((mean.detach().double() - ref_mean.detach().double()) ** 2).mean() / 0.5, tol=1e-6)


def test_kl_needs_means():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="mean, ref_mean and std"):
        flow_grpo_loss(x, x, x, clip_range=0.1, adv_clip_max=1.0, kl_beta=0.1)


# ---------------------------------------------------------------------- DiffusionNFT
def nft_reference(v_new, v_old, x_t, x0, sigma, adv, beta, c, adaptive):
    """Straight float64 transcription of the DiffusionNFT loss in docs/design.md, sample by sample."""
    total, pos_all, neg_all = 0.0, 0.0, 0.0
    batch = x0.shape[0]
    for b in range(batch):
        vn, vo, xt, z = (t[b].to(F64) for t in (v_new, v_old, x_t, x0))
        sg = float(sigma[b])
        v_pos = beta * vn + (1 - beta) * vo
        v_neg = (1 + beta) * vo - beta * vn
        e_pos = (xt - sg * v_pos) - z
        e_neg = (xt - sg * v_neg) - z
        w_pos = max(e_pos.abs().mean().item(), 1e-5) if adaptive else 1.0
        w_neg = max(e_neg.abs().mean().item(), 1e-5) if adaptive else 1.0
        l_pos = (e_pos**2 / w_pos).mean().item()
        l_neg = (e_neg**2 / w_neg).mean().item()
        a = min(max(float(adv[b]), -c), c)
        r = min(max(a / (2 * c) + 0.5, 0.0), 1.0)
        total += c * (r * l_pos + (1 - r) * l_neg) / beta
        pos_all += l_pos
        neg_all += l_neg
    return total / batch, pos_all / batch, neg_all / batch


def nft_inputs(shape=(4, 2, 4, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(shape, generator=g)
    eps = torch.randn(shape, generator=g)
    sigma = torch.tensor([0.9, 0.6, 0.3, 0.1])[: shape[0]]
    sb = sigma.view(-1, *([1] * (len(shape) - 1)))
    x_t = (1 - sb) * x0 + sb * eps
    v_old = eps - x0 + 0.1 * torch.randn(shape, generator=g)
    v_new = v_old + 0.05 * torch.randn(shape, generator=g)
    adv = torch.tensor([2.0, -0.3, 0.7, -9.0])[: shape[0]]
    return v_new, v_old, x_t, x0, sigma, adv


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("shape", [(4, 2, 4, 4), (4, 2, 2, 3, 3)], ids=["BCHW", "BCFHW"])
def test_nft_matches_float64_reimplementation(adaptive, shape):
    v_new, v_old, x_t, x0, sigma, adv = nft_inputs(shape)
    v_new.requires_grad_(True)
    v_old.requires_grad_(True)
    loss, m = nft_loss(v_new, v_old, x_t, x0, sigma, adv, beta=0.1, adv_clip_max=5.0, adaptive_weight=adaptive)
    exp_loss, exp_pos, exp_neg = nft_reference(v_new.detach(), v_old.detach(), x_t, x0, sigma, adv, 0.1, 5.0, adaptive)
    close(loss, exp_loss, tol=1e-5)
    close(m["nft_loss"], exp_loss, tol=1e-5)
    close(m["positive_loss"], exp_pos, tol=1e-5)
    close(m["negative_loss"], exp_neg, tol=1e-5)
    loss.backward()
    assert v_new.grad is not None and v_old.grad is None  # the old policy is a fixed target


def test_nft_adaptive_weight_changes_the_loss():
    args = nft_inputs()
    on, _ = nft_loss(*args, beta=0.1, adv_clip_max=5.0, adaptive_weight=True)
    off, _ = nft_loss(*args, beta=0.1, adv_clip_max=5.0, adaptive_weight=False)
    assert not torch.allclose(on, off)


def test_nft_extreme_advantages_select_one_side():
    v_new, v_old, x_t, x0, sigma, _ = nft_inputs()
    c, beta = 2.0, 0.5
    pos_only, m = nft_loss(v_new, v_old, x_t, x0, sigma, torch.full((4,), 10.0), beta=beta, adv_clip_max=c)
    close(pos_only, c * m["positive_loss"] / beta, tol=1e-5)
    neg_only, m = nft_loss(v_new, v_old, x_t, x0, sigma, torch.full((4,), -10.0), beta=beta, adv_clip_max=c)
    close(neg_only, c * m["negative_loss"] / beta, tol=1e-5)


def test_nft_rejects_bad_beta():
    with pytest.raises(ValueError, match="beta"):
        nft_loss(*nft_inputs(), beta=0.0, adv_clip_max=5.0)


# ------------------------------------------------------------------------------- SFT
def test_sft_loss():
    g = torch.Generator().manual_seed(1)
    v, noise, x0 = (torch.randn(2, 2, 3, 3, generator=g) for _ in range(3))
    loss, m = sft_loss(v, noise, x0)
    close(loss, ((v.double() - (noise.double() - x0.double())) ** 2).mean())
    close(m["sft_loss"], loss)
    zero, _ = sft_loss(noise - x0, noise, x0)
    assert zero.item() == 0.0


# -------------------------------------------------------------------------- adapters
def grpo_config(**kw):
    base = dict(diffusion_clip_range=0.2, diffusion_adv_clip_max=5.0, diffusion_kl_beta=0.0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_registry():
    assert LOSSES == {"policy_loss": policy_loss, "nft": nft, "sft": sft, "custom_loss": custom_loss}


@pytest.mark.exercises("--diffusion-clip-range")
def test_policy_loss_adapter_matches_pure_function():
    batch = {
        "log_prob": torch.log(torch.tensor([1.5, 0.5])),
        "old_log_prob": torch.zeros(2),
        "advantages": torch.tensor([1.0, -1.0]),
    }
    loss, m = policy_loss(batch, grpo_config())
    expected, _ = flow_grpo_loss(batch["log_prob"], batch["old_log_prob"], batch["advantages"], clip_range=0.2, adv_clip_max=5.0)
    close(loss, expected)
    close(loss, (-1.2 + 0.8) / 2)
    with pytest.raises(KeyError, match=r"policy_loss.*'old_log_prob'"):
        policy_loss({"log_prob": batch["log_prob"], "advantages": batch["advantages"]}, grpo_config())
    with pytest.raises(KeyError, match=r"policy_loss.*'ref_mean'"):
        policy_loss({**batch, "mean": torch.zeros(2, 1), "std": torch.ones(2)}, grpo_config(diffusion_kl_beta=0.1))


@pytest.mark.exercises("--diffusion-kl-beta")
def test_policy_loss_adapter_with_kl():
    batch = {
        "log_prob": torch.zeros(2),
        "old_log_prob": torch.zeros(2),
        "advantages": torch.tensor([1.0, 1.0]),
        "mean": torch.ones(2, 3),
        "ref_mean": torch.zeros(2, 3),
        "std": torch.tensor([1.0, 0.5]),
    }
    loss, m = policy_loss(batch, grpo_config(diffusion_kl_beta=0.5))
    kl = (1 / 2 + 1 / 0.5) / 2  # mean over batch of 1/(2 s²)
    close(m["kl_loss"], kl)
    close(loss, -1.0 + 0.5 * kl)


@pytest.mark.exercises("--diffusion-nft-beta", "--no-diffusion-nft-adaptive-weight")
def test_nft_adapter_reads_flags():
    v_new, v_old, x_t, x0, sigma, adv = nft_inputs()
    batch = dict(v_new=v_new, v_old=v_old, x_t=x_t, x0=x0, sigma=sigma, advantages=adv)
    cfg = SimpleNamespace(diffusion_nft_beta=0.1, diffusion_adv_clip_max=5.0, no_diffusion_nft_adaptive_weight=False)
    on, _ = nft(batch, cfg)
    close(on, nft_reference(v_new, v_old, x_t, x0, sigma, adv, 0.1, 5.0, True)[0], tol=1e-5)
    cfg.no_diffusion_nft_adaptive_weight = True
    off, _ = nft(batch, cfg)
    close(off, nft_reference(v_new, v_old, x_t, x0, sigma, adv, 0.1, 5.0, False)[0], tol=1e-5)
    with pytest.raises(KeyError, match=r"nft.*'sigma'"):
        nft({k: t for k, t in batch.items() if k != "sigma"}, cfg)


def test_sft_adapter():
    g = torch.Generator().manual_seed(2)
    batch = {k: torch.randn(2, 3, generator=g) for k in ("v", "noise", "x0")}
    loss, _ = sft(batch, SimpleNamespace())
    close(loss, sft_loss(batch["v"], batch["noise"], batch["x0"])[0])
    with pytest.raises(KeyError, match=r"sft.*'noise'"):
        sft({"v": batch["v"], "x0": batch["x0"]}, SimpleNamespace())


CALLS: list[str] = []


def my_custom_loss(batch, config):
    CALLS.append(config.tag)
    loss = (batch["v"] ** 2).mean() * config.scale
    return loss, {"custom": loss.detach()}


def bad_custom_loss(batch, config):
    return 1.0


@pytest.mark.parametrize("sep", [".", ":"])
def test_custom_loss_resolves_and_calls(sep):
    path = f"{__name__}{sep}my_custom_loss"
    batch = {"v": torch.tensor([1.0, 2.0, 3.0])}
    cfg = SimpleNamespace(custom_loss_function_path=path, scale=2.0, tag=sep)
    loss, m = custom_loss(batch, cfg)
    close(loss, 2.0 * 14 / 3)
    assert set(m) == {"custom"} and CALLS[-1] == sep
    assert losses.resolve_custom_loss(path) is my_custom_loss
    hits = losses.resolve_custom_loss.cache_info().hits
    custom_loss(batch, cfg)
    assert losses.resolve_custom_loss.cache_info().hits == hits + 1


def test_custom_loss_errors():
    batch = {"v": torch.ones(2)}
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        custom_loss(batch, SimpleNamespace())
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        custom_loss(batch, SimpleNamespace(custom_loss_function_path=None))
    with pytest.raises(ValueError, match="cannot import"):
        custom_loss(batch, SimpleNamespace(custom_loss_function_path="no_such_module_xyz.fn"))
    with pytest.raises(ValueError, match="no attribute"):
        custom_loss(batch, SimpleNamespace(custom_loss_function_path=f"{__name__}:missing_fn"))
    with pytest.raises(ValueError, match="must look like"):
        custom_loss(batch, SimpleNamespace(custom_loss_function_path="justaname"))
    with pytest.raises(TypeError, match=r"\(loss_tensor, metrics_dict\)"):
        custom_loss(batch, SimpleNamespace(custom_loss_function_path=f"{__name__}:bad_custom_loss"))
