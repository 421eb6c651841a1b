"""DanceGRPO's constant-noise flow SDE (``--diffusion-sde-type dance_sde``).

DanceGRPO (Xue et al., 2025, "DanceGRPO: Unleashing GRPO on Visual Generation", arXiv
2505.07818), XueZeyue/DanceGRPO@15cc71d fastvideo/train_grpo_flux.py ``flux_step`` with
``sde_solver=True``: with ``dσ = σ' − σ < 0``, ``x̂0 = x − σ·v`` and the score estimate
``−(x − (1 − σ)·x̂0)/σ² = −(x + (1 − σ)·v)/σ``, the step is::

    μ   = x + dσ·[v + η²/(2σ)·(x + (1 − σ)·v)]
    std = η·sqrt(−dσ)
    s   = η                  (the diffusion coefficient, constant over the schedule)

with ``η = --diffusion-noise-level`` (DanceGRPO's ``--eta``: 0.3 in its FLUX, Wan 2.1 and
Qwen-Image recipes, 0.25 for HunyuanVideo; miles-core's default 0.7 is Flow-GRPO's and is
far noisier here, so set it). It is Flow-GRPO's drift correction with ``s = η`` instead of
``η·sqrt(σ/(1 − σ))``, so it needs no ``sigma_max`` substitute at ``σ = 1``.

The log-probability is DanceGRPO's: the Gaussian density with its constants,
``−(x' − μ)²/(2·std²) − log std − log sqrt(2π)``, averaged over every non-batch element,
which is the base class's convention without ``--diffusion-log-prob-no-const``. The step's
mean and std, stepping, scoring and the float64 fallback are the core's ``sde`` backend's
(``miles_core.api.FlowSdeBackend``) with ``s = η``, so the engine and the trainer share them.

Where we differ: DanceGRPO also takes the last step (σ' = 0, still std = η·sqrt(σ)) with
the SDE, then drops it from training and decodes that step's x̂0 = x − σ·v; here the last
step is never an SDE step, and its ODE step lands on the same x̂0. DanceGRPO samples every
other step with the SDE and trains a random ``--timestep_fraction`` of them; here
``--diffusion-num-sde-steps`` and the step strategy choose the SDE steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_core.api import FlowSdeBackend


class DanceSde(FlowSdeBackend):
    """DanceGRPO's SDE step: Flow-GRPO's step (whose drift correction keeps the ODE's
    marginals for any noise scale) with the noise scale ``s = η`` at every step.
    ``x·(1 + s²/(2σ)·dσ) + v·(1 + s²(1 − σ)/(2σ))·dσ`` is DanceGRPO's
    ``x + dσ·[v + s²/(2σ)·(x + (1 − σ)·v)]`` regrouped."""

    name = "dance_sde"

    def scale(self, sigma: Tensor, sigma_next: Tensor, sigma_max: float) -> Tensor:
        return torch.full_like(sigma * sigma_next, self.noise_level)
