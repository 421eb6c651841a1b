"""DanceGRPO's constant-noise SDE (``dance_sde``): the step against DanceGRPO's equations
written independently in float64, its log-probability against the Gaussian density, η = 0
against the ode backend, the marginals it preserves, and a training run that uses it."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from miles_algorithms.dance_sde import DanceSde
from miles_core.api import SdeBackend
from miles_core.sde import FlowSdeBackend, OdeBackend

from ._tiny_run import tiny_run

# (σ, σ') pairs: the first step (σ = 1), σ just below 1, the middle, a late step.
SIGMAS = [(1.0, 0.97), (0.999, 0.99), (0.6, 0.45), (0.12, 0.05)]


def dance_step_float64(x, v, sigma, sigma_next, eta):
    """XueZeyue/DanceGRPO@15cc71d fastvideo/train_grpo_flux.py ``flux_step`` (sde_solver=True),
    in its own order of operations, in float64: mean and std."""
    x, v = x.double(), v.double()
    dsigma = sigma_next - sigma
    mean = x + dsigma * v
    pred_original = x - sigma * v
    score = -(x - pred_original * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    return mean, eta * math.sqrt(sigma - sigma_next)


def gaussian_log_prob_float64(x_next, mean, std):
    """log N(x'; μ, std²) per element, averaged over every non-batch element."""
    density = torch.distributions.Normal(mean.double(), torch.full_like(mean.double(), std))
    return density.log_prob(x_next.double()).flatten(1).mean(dim=1)


def _tensors(seed: int, shape=(3, 4, 5, 6)):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


@pytest.mark.parametrize("eta", [0.3, 1.0])
@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMAS)
def test_step_matches_dancegrpos_equations_and_the_gaussian_density(sigma, sigma_next, eta):
    x, v, noise = _tensors(int(sigma * 1000))
    backend = DanceSde(noise_level=eta)
    out = backend.step(x, v, sigma, sigma_next, sigma_max=0.99, noise=noise)
    mean, std = dance_step_float64(x, v, sigma, sigma_next, eta)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    assert out.std.shape == (3, 1, 1, 1)
    torch.testing.assert_close(out.std.double(), torch.full((3, 1, 1, 1), std, dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.equal(out.noise_scale, torch.full((3, 1, 1, 1), eta))  # s = η at every step
    torch.testing.assert_close(out.prev_sample.double(), mean + std * noise.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.log_prob.double(), gaussian_log_prob_float64(out.prev_sample, mean, std), rtol=1e-5, atol=1e-5)
    # The trainer's rescoring of the recorded transition is the engine's value (same operations).
    again = backend.log_prob(out.prev_sample, x, v, sigma, sigma_next, sigma_max=0.99)
    assert torch.equal(again.log_prob, out.log_prob)
    # Control: Flow-GRPO's SDE (s = η·sqrt(σ/(1 − σ))) is another step.
    flow_mean, flow_std = FlowSdeBackend(noise_level=eta).mean_std(x, v, sigma, sigma_next, sigma_max=0.99)
    assert (flow_mean.double() - mean).abs().max() > 1e-3 and (flow_std.double() - std).abs().max() > 1e-3


def test_per_sample_sigmas_are_each_rows_step():
    x, v, noise = _tensors(7)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.12]), torch.tensor([0.97, 0.45, 0.05])
    out = DanceSde(noise_level=0.3).step(x, v, sigma, sigma_next, sigma_max=0.99, noise=noise)
    for row, (s, s_next) in enumerate(zip(sigma.tolist(), sigma_next.tolist())):
        mean, std = dance_step_float64(x[row : row + 1], v[row : row + 1], s, s_next, 0.3)
        torch.testing.assert_close(out.mean[row : row + 1].double(), mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.std[row].double().flatten(), torch.tensor([std], dtype=torch.float64), rtol=1e-6, atol=0)


def test_zero_noise_is_exactly_the_ode_step():
    x, v, noise = _tensors(3)
    for sigma, sigma_next in [*SIGMAS, (0.05, 0.0)]:  # the last step (σ' = 0) too
        dance = DanceSde(noise_level=0.0).step(x, v, sigma, sigma_next, sigma_max=0.99, noise=noise)
        ode = OdeBackend(noise_level=0.0).step(x, v, sigma, sigma_next, sigma_max=0.99)
        assert torch.equal(dance.prev_sample, ode.prev_sample) and torch.equal(dance.log_prob, torch.zeros(3))
    # Control: any noise moves the step off the ODE's.
    noisy = DanceSde(noise_level=0.3).step(x, v, 0.6, 0.45, sigma_max=0.99, noise=noise)
    assert (noisy.prev_sample - OdeBackend().step(x, v, 0.6, 0.45, sigma_max=0.99).prev_sample).abs().max() > 0.1


def test_the_last_step_is_never_stochastic():
    x, v, _ = _tensors(4)
    with pytest.raises(ValueError, match="dance_sde backend with noise_level=0.3 asked for a stochastic step to sigma'=0"):
        DanceSde(noise_level=0.3).step(x, v, 0.05, 0.0, sigma_max=0.99)


@pytest.mark.parametrize("eta", [0.3, 1.0])
def test_the_drift_correction_keeps_the_flow_marginals_to_second_order(eta):
    """Gaussian data x0 ~ N(0, a²): x_σ = (1 − σ)·x0 + σ·ε has variance (1 − σ)²a² + σ² and the
    exact velocity E[ε − x0 | x_σ] = k(σ)·x. One step maps that variance to A²·var + std²
    (μ = A·x). The SDE lands on var(σ') up to O(dσ²); the same noise without the drift
    correction (control) is off by η²·|dσ|."""
    a2 = 0.25

    def var(s):
        return (1 - s) ** 2 * a2 + s**2

    backend, one = DanceSde(noise_level=eta), torch.ones(1, 1, dtype=torch.float64)
    for sigma in (1.0, 0.9, 0.5, 0.1):
        errors = []
        for dsigma in (1e-2, 1e-3):
            k = (sigma - (1 - sigma) * a2) / var(sigma)
            mean, std = backend.mean_std(one, one * k, sigma, sigma - dsigma, sigma_max=1.0)
            step_var = mean.item() ** 2 * var(sigma) + std.item() ** 2
            errors.append(abs(step_var - var(sigma - dsigma)))
            uncorrected = (1 - dsigma * k) ** 2 * var(sigma) + std.item() ** 2
        assert 50 < errors[0] / errors[1] < 200, errors  # second order in dσ
        assert abs(uncorrected - var(sigma - dsigma)) > 50 * errors[1], sigma  # first order, at dσ = 1e-3


def test_is_an_sde_backend_with_its_name():
    assert issubclass(DanceSde, SdeBackend) and DanceSde.name == "dance_sde" and DanceSde.stochastic


def test_a_training_run_with_dance_sde_takes_an_optimizer_step(tiny_sd3, prompts, tmp_path):
    config, (record,) = tiny_run(
        tiny_sd3,
        prompts,
        tmp_path / "run",
        "--diffusion-sde-type",
        "dance_sde",
        "--diffusion-noise-level",
        "0.3",
        "--diffusion-num-sde-steps",
        "2",
        "--num-rollout",
        "1",
    )
    assert config.components["sde_backend"].provider.startswith("miles-algorithms ")
    # The trainer rescored the engine's transitions with the same backend (first step: the
    # rollout's weights) and trained on both SDE steps.
    assert record["train/num_pairs"] == 4 and record["train/log_prob_max_abs_diff"] < 1e-5
    assert {k for k in record if k.startswith("train/log_prob_abs_diff_step_")} == {
        "train/log_prob_abs_diff_step_0",
        "train/log_prob_abs_diff_step_1",
    }
    assert record["train/grad_norm"] > 0
    # LoRA's B matrices start at zero: non-zero ones were moved by the optimizer step.
    weights = load_file(str(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"))
    assert max(t.abs().max().item() for name, t in weights.items() if "lora_B" in name) > 0
