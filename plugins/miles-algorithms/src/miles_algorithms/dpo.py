"""Online Flow-DPO (``--loss-type flow_dpo``): Diffusion-DPO on flow-matching velocities,
with each rollout group's best and worst sample as the preference pair.

Sources: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization"
(arXiv 2311.12908), the Diffusion-DPO objective (Eq. 14): the ELBO-based DPO loss, whose
per-sample term compares the policy's and the reference's denoising errors on the preferred
(w) and the dispreferred (l) sample at one noise and one timestep; and its flow-matching,
online form in yifan123/flow_grpo@ac4c86e ``scripts/train_sd3_dpo.py`` (the group's
highest- and lowest-reward samples as w and l, one noise ε shared by the pair, one timestep,
the target velocity ``ε − x0``, β = 100 in ``config/dpo.py``). Per pair b, with
``err(v, u) = mean((v − u)²)`` over the sample's elements::

    Δ_w = err(v_θ(w), u_w) − err(v_ref(w), u_w)        # the chosen's error vs the reference
    Δ_l = err(v_θ(l), u_l) − err(v_ref(l), u_l)        # the rejected's
    z_b = −½·β·(Δ_w − Δ_l)
    loss = mean_b(−log σ(z_b))

``u = ε − x0`` is the flow-matching target (``target_chosen``/``target_rejected``). As in
flow_grpo the timestep weight ``T·ω(λ_t)`` of the paper's equation is a constant folded into
β, and the reference's velocities are constants. The implicit reward of a sample is
``−½·β·Δ`` (its error shrinking against the reference's), so ``z_b`` is the chosen's
implicit reward minus the rejected's: ``implicit_acc`` is the fraction with ``z_b > 0`` and
``reward_margin`` the mean of ``z_b``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dpo_loss", "flow_dpo", "flow_matching_error"]

Metrics = dict[str, Tensor]

_NAME = "flow_dpo"
_PAIR_KEYS = ("v_chosen", "v_rejected", "ref_v_chosen", "ref_v_rejected", "target_chosen", "target_rejected")


def flow_matching_error(v: Tensor, target: Tensor) -> Tensor:
    """Per-sample ``mean((v − target)²)`` ([B]), in fp32 (float64 kept), as flow_grpo
    computes its errors (``.float()`` before the square)."""
    v = v if v.dtype == torch.float64 else v.float()
    target = target if target.dtype == torch.float64 else target.float()
    sq = (v - target) ** 2
    return sq.mean(dim=tuple(range(1, sq.ndim)))


def dpo_loss(
    v_chosen: Tensor,
    v_rejected: Tensor,
    ref_v_chosen: Tensor,
    ref_v_rejected: Tensor,
    target_chosen: Tensor,
    target_rejected: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, Metrics]:
    """The Flow-DPO loss of a batch of preference pairs (module docstring); every tensor is
    [B, ...] with one shape. The reference's velocities are detached."""
    if not beta > 0:
        raise ValueError(f"{_NAME}: beta must be > 0 (--dpo-beta), got {beta}")
    tensors = (v_chosen, v_rejected, ref_v_chosen, ref_v_rejected, target_chosen, target_rejected)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or v_chosen.ndim < 2:
        named = ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(_PAIR_KEYS, tensors))
        raise ValueError(f"{_NAME}: the pair's tensors must share one [B, ...] shape; got {named}")
    err_w = flow_matching_error(v_chosen, target_chosen)
    err_l = flow_matching_error(v_rejected, target_rejected)
    with torch.no_grad():
        ref_err_w = flow_matching_error(ref_v_chosen.detach(), target_chosen)
        ref_err_l = flow_matching_error(ref_v_rejected.detach(), target_rejected)
    diff_w = err_w - ref_err_w
    diff_l = err_l - ref_err_l
    z = -0.5 * beta * (diff_w - diff_l)
    loss = -F.logsigmoid(z).mean()

    with torch.no_grad():
        metrics: Metrics = {
            "dpo_loss": loss.detach(),
            "implicit_acc": (z > 0).float().mean(),
            "reward_margin": z.mean(),
            "chosen_err": err_w.mean(),
            "rejected_err": err_l.mean(),
            "ref_chosen_err": ref_err_w.mean(),
            "ref_rejected_err": ref_err_l.mean(),
            "chosen_err_vs_ref": diff_w.mean(),
            "rejected_err_vs_ref": diff_l.mean(),
            "loss": loss.detach(),
        }
    return loss, metrics


def flow_dpo(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type flow_dpo``: :func:`dpo_loss` on the trainer's ``preference_pairs``
    batch with ``--dpo-beta``; ``reward_chosen``/``reward_rejected``, when present, add the
    pairs' mean reward gap to the metrics."""
    missing = [key for key in _PAIR_KEYS if key not in batch]
    if missing:
        raise KeyError(f"{_NAME} loss needs batch key {missing[0]!r}; the batch has {sorted(batch)}")
    try:
        beta = float(config.dpo_beta)
    except AttributeError:
        raise AttributeError(f"{_NAME} loss needs config.dpo_beta (--dpo-beta)") from None
    loss, metrics = dpo_loss(*(batch[key] for key in _PAIR_KEYS), beta=beta)
    if "reward_chosen" in batch and "reward_rejected" in batch:
        metrics["reward_gap"] = (batch["reward_chosen"].float() - batch["reward_rejected"].float()).mean().detach()
    return loss, metrics
