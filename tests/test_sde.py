"""The denoising-step backends against docs/design.md, "The SDE step and its log-probability", with references in float64
written here (not the module's helpers)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_core.errors import NonFiniteLogProbError
from miles_core.sde import BACKENDS, CpsBackend, FlowSdeBackend, OdeBackend, SdeBackend

torch.set_num_threads(1)

F64 = torch.float64
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# ----------------------------------------------------------------- float64 references
def ref_sde(x, v, sigmas, sigmas_next, sigma_max, eta):
    """Per-row Flow-GRPO SDE mean and std in float64."""
    means, stds = [], []
    for b, (sg, sn) in enumerate(zip(sigmas, sigmas_next)):
        xb, vb = x[b].to(F64), v[b].to(F64)
        dt = sn - sg
        denom = 1 - (sigma_max if sg == 1 else sg)
        s = eta * math.sqrt(sg / denom)
        means.append(xb * (1 + s * s / (2 * sg) * dt) + vb * (1 + s * s * (1 - sg) / (2 * sg)) * dt)
        stds.append(s * math.sqrt(-dt))
    return torch.stack(means), torch.tensor(stds, dtype=F64)


def ref_cps(x, v, sigmas, sigmas_next, eta):
    means, stds = [], []
    for b, (sg, sn) in enumerate(zip(sigmas, sigmas_next)):
        xb, vb = x[b].to(F64), v[b].to(F64)
        s = sn * math.sin(eta * math.pi / 2)
        x0 = xb - sg * vb
        x1 = xb + (1 - sg) * vb
        means.append((1 - sn) * x0 + math.sqrt(sn * sn - s * s) * x1)
        stds.append(s)
    return torch.stack(means), torch.tensor(stds, dtype=F64)


def ref_log_prob(x_next, mean, std, no_const=False):
    """Mean over non-batch elements of the Gaussian log-density, float64; std is [B]."""
    out = []
    for b in range(x_next.shape[0]):
        d = x_next[b].to(F64) - mean[b].to(F64)
        if no_const:
            out.append(-(d**2).mean())
        else:
            sd = float(std[b])
            out.append((-(d**2) / (2 * sd * sd) - math.log(sd) - LOG_SQRT_2PI).mean())
    return torch.stack(out)


def latents(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


SIGMAS = [1.0, 0.7, 0.4]
SIGMAS_NEXT = [0.9, 0.5, 0.2]
SIGMA_MAX = 0.95  # the schedule's sigma_1


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.to(F64), b.to(F64), rtol=tol, atol=tol)


# ------------------------------------------------------------------------- the math
def test_registry_names():
    assert {k: c.name for k, c in BACKENDS.items()} == {"sde": "sde", "cps": "cps", "ode": "ode"}
    assert BACKENDS["sde"] is FlowSdeBackend and issubclass(OdeBackend, SdeBackend)


def test_sde_mean_std_match_formula_per_sample_sigmas():
    x, v = latents((3, 2, 4, 4))
    be = FlowSdeBackend(noise_level=0.7)
    mean, std = be.mean_std(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT), sigma_max=SIGMA_MAX)
    rmean, rstd = ref_sde(x, v, SIGMAS, SIGMAS_NEXT, SIGMA_MAX, 0.7)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32
    close(mean, rmean)
    close(std.flatten(), rstd)


def test_sde_sigma_one_uses_sigma_max():
    x, v = latents((2, 2, 3, 3))
    be = FlowSdeBackend(noise_level=0.5)
    out = be.step(x, v, 1.0, 0.9, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(1))
    expected_s = 0.5 * math.sqrt(1.0 / (1 - SIGMA_MAX))
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.log_prob).all()
    close(out.std.flatten(), torch.full((2,), expected_s * math.sqrt(0.1), dtype=F64))
    close(out.noise_scale.flatten(), torch.full((2,), expected_s, dtype=F64))
    # Control: a different sigma_max changes the step, so the edge really is used.
    other = be.mean_std(x, v, 1.0, 0.9, sigma_max=0.8)[1]
    assert not torch.allclose(other.flatten(), out.std.flatten())


def test_sde_noise_scale_and_std_relation():
    be = FlowSdeBackend(noise_level=0.7)
    x, v = latents((3, 2, 2, 2))
    out = be.step(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT), sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(0))
    sqrt_mdt = torch.tensor([math.sqrt(a - b) for a, b in zip(SIGMAS, SIGMAS_NEXT)], dtype=F64)
    close(out.std.flatten(), out.noise_scale.flatten().to(F64) * sqrt_mdt)
    assert out.std.shape == (3, 1, 1, 1)


def test_cps_mean_std_match_formula():
    x, v = latents((3, 2, 4, 4), seed=3)
    be = CpsBackend(noise_level=0.8)
    mean, std = be.mean_std(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT), sigma_max=SIGMA_MAX)
    rmean, rstd = ref_cps(x, v, SIGMAS, SIGMAS_NEXT, 0.8)
    close(mean, rmean)
    close(std.flatten(), rstd)


def test_ode_step_and_zero_log_prob():
    x, v = latents((2, 2, 3, 3))
    out = OdeBackend().step(x, v, 0.6, 0.0, sigma_max=SIGMA_MAX)  # sigma'=0 is fine for ode
    close(out.prev_sample, x.to(F64) + (0.0 - 0.6) * v.to(F64))
    assert torch.equal(out.log_prob, torch.zeros(2)) and out.noise is None
    assert torch.equal(out.std, torch.zeros(2, 1, 1, 1))
    rescored = OdeBackend().log_prob(out.prev_sample, x, v, 0.6, 0.0, sigma_max=SIGMA_MAX)
    assert torch.equal(rescored.log_prob, torch.zeros(2))


@pytest.mark.parametrize("cls", [FlowSdeBackend, CpsBackend])
def test_noise_level_zero_is_exactly_ode(cls):
    x, v = latents((2, 2, 3, 3))
    be = cls(noise_level=0.0)
    out = be.step(x, v, 0.6, 0.4, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(0))
    ode = OdeBackend().step(x, v, 0.6, 0.4, sigma_max=SIGMA_MAX)
    assert torch.equal(out.prev_sample, ode.prev_sample)
    assert torch.equal(out.log_prob, torch.zeros(2)) and out.noise is None
    assert be.deterministic
    # sigma'=0 is allowed: it is an ODE step
    be.step(x, v, 0.2, 0.0, sigma_max=SIGMA_MAX)


def test_sde_mean_tends_to_ode_step_as_noise_level_vanishes():
    x, v = latents((2, 2, 3, 3))
    x64, v64 = x.to(F64), v.to(F64)
    ode = x64 + (0.3 - 0.5) * v64
    errs = []
    for eta in (0.5, 0.1, 0.02):
        mean, _ = FlowSdeBackend(noise_level=eta).mean_std(x, v, 0.5, 0.3, sigma_max=SIGMA_MAX)
        errs.append((mean.to(F64) - ode).abs().max().item())
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 1e-3  # the correction is O(eta^2)


# --------------------------------------------------------------------------- log-prob
@pytest.mark.parametrize("shape", [(3, 2, 4, 4), (3, 2, 3, 2, 2)], ids=["BCHW", "BCFHW"])
def test_sde_log_prob_is_mean_over_non_batch_elements(shape):
    x, v = latents(shape, seed=5)
    be = FlowSdeBackend(noise_level=0.7)
    sig, sig_next = torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT)
    out = be.step(x, v, sig, sig_next, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(2))
    rmean, rstd = ref_sde(x, v, SIGMAS, SIGMAS_NEXT, SIGMA_MAX, 0.7)
    assert out.log_prob.shape == (3,)
    close(out.log_prob, ref_log_prob(out.prev_sample, rmean, rstd), tol=1e-4)
    # Mean, not sum: tiling the latent along channels leaves the log-prob unchanged.
    tiled = be.log_prob(
        out.prev_sample.repeat(1, 2, *([1] * (len(shape) - 2))),
        x.repeat(1, 2, *([1] * (len(shape) - 2))),
        v.repeat(1, 2, *([1] * (len(shape) - 2))),
        sig,
        sig_next,
        sigma_max=SIGMA_MAX,
    )
    close(tiled.log_prob, out.log_prob, tol=1e-5)


def test_cps_log_prob_with_and_without_constants():
    x, v = latents((3, 2, 4, 4), seed=6)
    sig, sig_next = torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    rmean, rstd = ref_cps(x, v, SIGMAS, SIGMAS_NEXT, 0.8)
    full = CpsBackend(noise_level=0.8).step(x, v, sig, sig_next, sigma_max=SIGMA_MAX, noise=noise)
    noconst = CpsBackend(noise_level=0.8, log_prob_no_const=True).step(x, v, sig, sig_next, sigma_max=SIGMA_MAX, noise=noise)
    assert torch.equal(full.prev_sample, noconst.prev_sample)
    close(full.prev_sample, rmean + rstd.view(-1, 1, 1, 1) * noise.to(F64))
    close(full.log_prob, ref_log_prob(full.prev_sample, rmean, rstd), tol=1e-4)
    close(noconst.log_prob, ref_log_prob(noconst.prev_sample, rmean, rstd, no_const=True), tol=1e-6)
    assert (noconst.log_prob <= 0).all()


@pytest.mark.parametrize("cls,no_const", [(FlowSdeBackend, False), (CpsBackend, True), (CpsBackend, False)])
def test_sampled_log_prob_equals_recomputation(cls, no_const):
    x, v = latents((4, 2, 3, 3), seed=7)
    be = cls(noise_level=0.7, log_prob_no_const=no_const)
    sig, sig_next = torch.tensor([1.0, 0.8, 0.5, 0.3]), torch.tensor([0.8, 0.5, 0.3, 0.1])
    out = be.step(x, v, sig, sig_next, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(4))
    again = be.log_prob(out.prev_sample, x, v, sig, sig_next, sigma_max=SIGMA_MAX, step_index=3)
    assert torch.equal(out.log_prob, again.log_prob)
    assert torch.equal(out.mean, again.mean) and torch.equal(out.std, again.std)
    # Control: scoring under a different velocity gives a different log-prob.
    other = be.log_prob(out.prev_sample, x, v + 0.1, sig, sig_next, sigma_max=SIGMA_MAX)
    assert not torch.allclose(other.log_prob, out.log_prob)


def test_per_sample_sigma_matches_single_row_float_sigma():
    x, v = latents((3, 2, 3, 3), seed=8)
    be = FlowSdeBackend(noise_level=0.7)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    batched = be.step(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_NEXT), sigma_max=SIGMA_MAX, noise=noise)
    for b in range(3):
        row = be.step(x[b : b + 1], v[b : b + 1], SIGMAS[b], SIGMAS_NEXT[b], sigma_max=SIGMA_MAX, noise=noise[b : b + 1])
        close(row.prev_sample, batched.prev_sample[b : b + 1], tol=1e-6)
        close(row.log_prob, batched.log_prob[b : b + 1], tol=1e-6)


def test_low_precision_inputs_compute_in_fp32():
    x, v = latents((2, 2, 3, 3))
    out = FlowSdeBackend().step(x.bfloat16(), v.bfloat16(), 0.5, 0.3, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(0))
    for t in (out.prev_sample, out.mean, out.std, out.log_prob, out.noise):
        assert t.dtype == torch.float32


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("cls", [FlowSdeBackend, CpsBackend])
def test_stochastic_step_to_sigma_zero_raises(cls):
    x, v = latents((2, 2, 3, 3))
    be = cls(noise_level=0.7)
    with pytest.raises(ValueError, match="never an SDE step"):
        be.step(x, v, 0.2, 0.0, sigma_max=SIGMA_MAX)
    with pytest.raises(ValueError, match=r"step 9"):
        be.log_prob(x, x, v, torch.tensor([0.3, 0.2]), torch.tensor([0.1, 0.0]), sigma_max=SIGMA_MAX, step_index=9)
    be.step(x, v, 0.2, 0.1, sigma_max=SIGMA_MAX)  # control: sigma' > 0 is fine


def test_float64_fallback_recovers_fp32_overflow():
    x, v = latents((3, 2, 4, 4), seed=11)
    v = v.clone().requires_grad_(True)
    be = FlowSdeBackend(noise_level=0.7)
    sig, sig_next = 0.5, 0.3
    clean = be.step(x, v.detach(), sig, sig_next, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(0))
    x_next = clean.prev_sample.clone()
    x_next[1, 0, 0, 0] = 2e19  # (x'−μ)² = 4e38 overflows fp32; the row's mean fits
    fp32_naive = (-((x_next - clean.mean) ** 2) / (2 * clean.std**2)).mean(dim=(1, 2, 3))
    assert torch.isinf(fp32_naive[1])  # the fp32 formula really overflows

    out = be.log_prob(x_next, x, v, sig, sig_next, sigma_max=SIGMA_MAX, step_index=4)
    assert out.fallback_count == 1 and out.log_prob.dtype == torch.float32
    assert torch.isfinite(out.log_prob).all()
    rmean, rstd = ref_sde(x, v.detach(), [sig] * 3, [sig_next] * 3, SIGMA_MAX, 0.7)
    close(out.log_prob, ref_log_prob(x_next, rmean, rstd), tol=1e-5)
    assert torch.equal(out.log_prob[[0, 2]], clean.log_prob[[0, 2]])
    assert clean.fallback_count == 0
    out.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_non_finite_even_in_float64_raises_naming_step_and_samples():
    x, v = latents((4, 2, 3, 3), seed=12)
    x = x.clone()
    x[2, 1, 1, 1] = float("nan")
    be = FlowSdeBackend(noise_level=0.7)
    with pytest.raises(NonFiniteLogProbError, match=r"step 6.*\[2\]") as info:
        be.log_prob(x.nan_to_num(), x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, step_index=6)
    assert isinstance(info.value, ArithmeticError)
    assert info.value.step_index == 6 and info.value.sample_indices == [2]
    with pytest.raises(NonFiniteLogProbError, match=r"samples?\(s\) \[2\]"):
        be.step(x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(0))


def test_float64_value_outside_fp32_range_raises():
    x, v = latents((2, 2, 3, 3), seed=13)
    be = FlowSdeBackend(noise_level=0.7)
    x_next = x.clone()
    x_next[0, 0, 0, 0] = 1e30
    with pytest.raises(NonFiniteLogProbError, match="float32 range"):
        be.log_prob(x_next, x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, step_index=0)


# ------------------------------------------------------------------------ determinism
def test_seeded_generator_is_deterministic_and_seed_matters():
    x, v = latents((2, 2, 3, 3))
    be = FlowSdeBackend(noise_level=0.7)
    a = be.step(x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(123))
    b = be.step(x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(123))
    c = be.step(x, v, 0.5, 0.3, sigma_max=SIGMA_MAX, generator=torch.Generator().manual_seed(124))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
    assert not torch.allclose(a.prev_sample, c.prev_sample)
    expected = torch.randn(x.shape, generator=torch.Generator().manual_seed(123))
    assert torch.equal(a.noise, expected)


def test_bad_arguments():
    with pytest.raises(ValueError):
        FlowSdeBackend(noise_level=-0.1)
    x, v = latents((2, 2, 3, 3))
    with pytest.raises(ValueError, match="shape"):
        FlowSdeBackend().mean_std(x, v, torch.tensor([0.5, 0.4, 0.3]), 0.2, sigma_max=SIGMA_MAX)
