"""GRPO-Guard (``--loss-type grpo_guard``): Flow-GRPO's clipped surrogate on a normalised
importance ratio, with the per-step loss reweighted across timesteps.

Source: Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching
via Regulated Clipping", arXiv 2510.22319, whose two components are *ratio normalisation*
("RatioNorm": the log-ratio of one SDE step is re-centred to mean 0 and rescaled to a
step-independent spread, so the ratio is "balanced and step-consistent") and *gradient
reweighting* (the per-step loss is scaled by ``1/|dt|`` so the policy gradient has the same
size at every noise level). The formula is the one the authors' code computes:
yejy53/RealGen@35de0a2 ``RealGen_v2/scripts/train_flux_fast_guard_realgen.py`` (the
``config.rationorm`` branch of the training loop, with ``sqrt_dt = sqrt(−dt)`` from
``RealGen_v2/flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``); verl-omni's
documentation of its ``grpo_guard`` loss mode (``docs/algo/grpo_guard.md``) states the same.

One SDE step of the behaviour policy draws ``x' = μ_old + S·ε`` with ``S`` the transition's
standard deviation (``S = s·sqrt(−dt)`` for the ``sde`` backend: the batch key
``transition_std``). With ``Δ = μ_θ − μ_old`` and Flow-GRPO's per-element mean log-density,
the raw log-ratio is ``δ = mean(ε·Δ)/S − mean(Δ²)/(2S²)``: its expectation over ε is
``−mean(Δ²)/(2S²) < 0`` (the ratio's mean falls below 1, the bias the paper measures) and its
spread ``∝ 1/S`` differs from step to step. GRPO-Guard uses, per sample b::

    r̃_b = exp( (δ_b + mean((μ_θ − μ_old)²)/(2·S_b²)) · S_b )        # RatioNorm = exp(mean(ε·Δ))
    A_b = clamp(adv_b, ±adv_clip_max)
    ℓ_b = max(−A_b·r̃_b, −A_b·clamp(r̃_b, 1 − ε_clip, 1 + ε_clip))     # Flow-GRPO's surrogate
    w_b = 1 / |dt_b| = 1 / (σ_b − σ'_b)                                 # gradient reweighting
    loss = mean_b(w_b·ℓ_b) + β_kl · mean_b(KL_b)

Why ``w_b``: ``log r̃ = mean(ε·Δ)``, so ``∂ log r̃/∂μ_θ = ε/D`` (D elements) at every step,
and for the ``sde`` backend ``∂μ/∂v = (1 + η²/2)·dt`` at every σ < 1 (``s² = η²σ/(1−σ)``):
dividing by ``|dt|`` makes the gradient with respect to the velocity the same size at every
step; plain Flow-GRPO's is ``∝ sqrt|dt|/s``, which varies over the schedule.

Where the implementations differ, and what this module follows:

- Flow-Factory (X-GenGroup/Flow-Factory@a0b2bc5 ``src/flow_factory/trainers/grpo.py``,
  ``GRPOGuardTrainer.optimize``) computes the same ``r̃`` but does not divide by ``|dt|``;
  RealGen and verl-omni do, and the paper names the reweighting as one of its two parts, so
  ``w_b`` is applied (``reweight=False`` of :func:`grpo_guard_loss` gives Flow-Factory's
  variant; no flag exposes it).
- RealGen takes ``std_dev_t`` and ``sqrt(−dt)`` as means over its micro-batch (which shares
  one timestep there); here ``S_b`` and ``dt_b`` are per sample, the same when the timestep
  is shared.
- The KL term is added after the reweighting, unweighted, as RealGen adds it; it is
  Flow-GRPO's term, in latent space (``mean((μ_θ − μ_ref)²)/(2s²)``, ``s`` = batch ``std``)
  or, when the batch carries ``velocity``/``ref_velocity`` (``--kl-space velocity``),
  ``mean((v − v_ref)²)``: the core's own term, ``miles_core.api.kl_penalty``.
- ``S`` is the backend's transition std (``transition_std``), so RatioNorm is the same
  statement for any Gaussian step backend; with ``--diffusion-log-prob-no-const`` the stored
  log-probs are ``−mean((x' − μ)²)`` (``2S²`` times the log-density's quadratic part), and
  the log-ratio is divided by ``2S²`` first to recover ``δ``.

RatioNorm shrinks the log-ratio by ``S`` (a few 1e-2 over a run's steps), so the clip range
that bites is far smaller than Flow-GRPO's: RealGen's GRPO-Guard recipes use
``--diffusion-clip-range`` 2e-6 to 4e-6 (``RealGen_v1/flow_grpo/config/grpo.py``
``flux_fast_guard``; ``RealGen_v2/config/realgen.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from miles_core.api import kl_penalty

__all__ = ["grpo_guard", "grpo_guard_loss", "normalized_log_ratio"]

Metrics = dict[str, Tensor]

_NAME = "grpo_guard"


def _per_sample(value: Tensor, batch: int, what: str) -> Tensor:
    """A per-sample scalar as [B] from a [B] or [B, 1, ..., 1] tensor, or one value shared
    by the batch (0-d or [1, ..., 1], as a step backend returns for a float sigma)."""
    if value.numel() == 1:
        return value.reshape(()).expand(batch)
    if value.shape[0] != batch or value.numel() != batch:
        raise ValueError(f"{_NAME}: {what} must hold one value per sample ([B] or [B, 1, ..., 1], B={batch}), got {tuple(value.shape)}")
    return value.reshape(batch)


def normalized_log_ratio(
    log_prob: Tensor,
    old_log_prob: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    transition_std: Tensor,
    *,
    log_prob_no_const: bool = False,
) -> tuple[Tensor, Tensor]:
    """RatioNorm's log-ratio ``(δ + mean((μ − μ_old)²)/(2S²))·S`` and the raw ``δ``, both [B].

    ``δ = log_prob − old_log_prob`` (divided by ``2S²`` under ``log_prob_no_const``); the
    behaviour policy's ``old_log_prob`` and ``old_mean`` are constants."""
    if log_prob.shape != old_log_prob.shape or log_prob.ndim != 1:
        raise ValueError(f"{_NAME}: log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} must both be [B]")
    batch = log_prob.shape[0]
    if mean.shape != old_mean.shape or mean.shape[0] != batch:
        raise ValueError(f"{_NAME}: mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must both be [B={batch}, ...]")
    std = _per_sample(transition_std.detach().to(log_prob.dtype), batch, "transition_std")
    var2 = 2 * std**2
    delta = log_prob - old_log_prob.detach()
    if log_prob_no_const:
        delta = delta / var2
    sq = (mean - old_mean.detach()) ** 2
    bias = sq.mean(dim=tuple(range(1, sq.ndim))).to(delta.dtype) / var2
    return (delta + bias) * std, delta


def grpo_guard_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    transition_std: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    reweight: bool = True,
    log_prob_no_const: bool = False,
    kl_beta: float = 0.0,
    kl: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GRPO-Guard's loss on one micro-batch of SDE transitions (module docstring).

    ``log_prob``, ``old_log_prob``, ``advantages``, ``sigma``, ``sigma_next``: [B];
    ``mean``, ``old_mean``: [B, ...]; ``transition_std``: [B] or [B, 1, ..., 1].
    ``kl``: the per-sample KL term [B], required when ``kl_beta > 0``. ``reweight=False``
    drops the ``1/|dt|`` weights (Flow-Factory's variant)."""
    ratio_log, delta = normalized_log_ratio(log_prob, old_log_prob, mean, old_mean, transition_std, log_prob_no_const=log_prob_no_const)
    batch = log_prob.shape[0]
    ratio = torch.exp(ratio_log)
    adv = torch.clamp(_per_sample(advantages, batch, "advantages").to(ratio.dtype), -adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    if reweight:
        dt = _per_sample(sigma, batch, "sigma") - _per_sample(sigma_next, batch, "sigma_next")
        weight = 1.0 / dt.detach().to(per_sample.dtype).abs()
        per_sample = per_sample * weight
    policy = per_sample.mean()
    loss = policy

    metrics: Metrics = {"policy_loss": policy.detach()}
    if kl_beta > 0:
        if kl is None:
            raise ValueError(f"{_NAME}: kl_beta > 0 needs the per-sample kl term")
        kl_mean = kl.mean()
        loss = policy + kl_beta * kl_mean
        metrics["kl_loss"] = kl_mean.detach()

    with torch.no_grad():
        dev = (ratio - 1.0).abs()
        metrics["clipfrac"] = (dev > clip_range).float().mean()
        # The policy's own movement, from the raw log-ratio (as Flow-GRPO reports it).
        metrics["approx_kl"] = 0.5 * torch.mean(delta**2)
        metrics["ratio_abs_dev"] = dev.mean()
        metrics["ratio_mean"] = ratio.mean()
        # The uncorrected ratio's mean: below 1 by the bias RatioNorm removes.
        metrics["raw_ratio_mean"] = torch.exp(delta).mean()
        if reweight:
            metrics["reweight_mean"] = weight.mean()
        metrics["loss"] = loss.detach()
    return loss, metrics


# ----------------------------------------------------------------------- adapter
def _need(batch: Mapping[str, Tensor], key: str) -> Tensor:
    try:
        return batch[key]
    except KeyError:
        raise KeyError(f"{_NAME} loss needs batch key {key!r}; the batch has {sorted(batch)}") from None


def _flag(config: Any, name: str) -> Any:
    try:
        return getattr(config, name)
    except AttributeError:
        raise AttributeError(f"{_NAME} loss needs config.{name} (--{name.replace('_', '-')})") from None


def grpo_guard(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type grpo_guard``: :func:`grpo_guard_loss` on the trainer's batch of SDE
    transitions, with ``--diffusion-clip-range``, ``--diffusion-adv-clip-max``,
    ``--diffusion-kl-beta`` and ``--diffusion-log-prob-no-const``."""
    kl_beta = float(getattr(config, "diffusion_kl_beta", 0.0) or 0.0)
    tensors = [
        _need(batch, key) for key in ("log_prob", "old_log_prob", "advantages", "mean", "old_mean", "transition_std", "sigma", "sigma_next")
    ]
    return grpo_guard_loss(
        *tensors,
        clip_range=float(_flag(config, "diffusion_clip_range")),
        adv_clip_max=float(_flag(config, "diffusion_adv_clip_max")),
        log_prob_no_const=bool(getattr(config, "diffusion_log_prob_no_const", False)),
        kl_beta=kl_beta,
        kl=kl_penalty(batch, "grpo_guard") if kl_beta > 0 else None,
    )
