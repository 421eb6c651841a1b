"""An SDE backend supplies the diffusion coefficient ``s`` and the transition (μ, std);
stepping, log-probs and the float64 fallback come from the base class."""

import torch

from miles_core.api import SdeBackend, broadcast_sigma, working_precision


class ConstantNoiseSde(SdeBackend):
    name = "const_sde"

    def scale(self, sigma, sigma_next, sigma_max):
        return torch.full_like(sigma, self.noise_level)

    def mean_std(self, x, v, sigma, sigma_next, *, sigma_max):
        x, v = working_precision(x), working_precision(v)
        sigma, sigma_next = broadcast_sigma(sigma, x), broadcast_sigma(sigma_next, x)
        dt = sigma_next - sigma
        if self.deterministic:
            return x + dt * v, torch.zeros_like(dt)
        s = self.scale(sigma, sigma_next, sigma_max)
        # The same drift correction as Flow-GRPO's SDE, so the marginals still match
        # the ODE's for any s.
        mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, s * torch.sqrt(-dt)
