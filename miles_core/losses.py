"""Training losses (docs/design.md, "Advantages, losses and the EMA"): Flow-GRPO's clipped policy loss, DiffusionNFT and
SFT as pure functions on tensors, plus the ``--loss-type`` adapters.

Every adapter follows one protocol, ``loss(batch, config) -> (loss, metrics)``: ``batch``
maps names to tensors, ``config`` is any object carrying the flag attributes
(``diffusion_clip_range``, ...), and ``metrics`` maps names to detached scalar tensors.

Flow-GRPO::

    A = clamp(adv, ±adv_clip_max),  r = exp(logp_new − logp_old)
    loss = mean(max(−A·r, −A·clamp(r, 1−ε, 1+ε)))
         + β_kl · mean_b[ mean((μ_new − μ_ref)²) / (2·s²) ]     (--kl-space latent)
         + β_kl · mean_b[ mean((v_new − v_ref)²) ]              (--kl-space velocity)

DiffusionNFT (``x_t = (1−σ)·x0 + σ·ε``)::

    v₊ = β·v_new + (1−β)·v_old,  v₋ = (1+β)·v_old − β·v_new,  x0± = x_t − σ·v±
    w± = clamp(mean|x0± − x0|, 1e-5)  (detached; 1 without adaptive weighting)
    L± = mean((x0± − x0)² / w±),  r = clamp(clamp(A, ±C)/(2C) + ½, 0, 1)
    loss = mean_b[ C·(r·L₊ + (1−r)·L₋)/β ]  (+ β_kl · mean((v_new − v_base)²))

SFT::

    loss = mean((v − (ε − x0))²)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LOSSES",
    "custom_loss",
    "flow_grpo_loss",
    "kl_penalty",
    "kl_to_reference",
    "nft",
    "nft_loss",
    "policy_loss",
    "sft",
    "sft_loss",
    "velocity_kl",
]

Metrics = dict[str, Tensor]
LossFn = Callable[[Mapping[str, Tensor], Any], "tuple[Tensor, Metrics]"]


# ------------------------------------------------------------------- pure functions
def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    mean: Tensor | None = None,
    ref_mean: Tensor | None = None,
    std: Tensor | float | None = None,
    kl: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Flow-GRPO's PPO-style clipped loss on per-sample step log-probs ([B] each).

    The KL term is ``kl`` (a per-sample [B] tensor, e.g. :func:`velocity_kl`) when given,
    else :func:`kl_to_reference` of ``mean``, ``ref_mean`` and ``std``.

    ``std`` for the KL term is ``s`` (``StepOutput.noise_scale``), a float or a [B] /
    [B, 1, ..., 1] tensor: flow_grpo's ``scripts/train_sd3.py`` divides by
    ``2 * std_dev_t ** 2`` where ``std_dev_t`` is the fourth return of
    ``sde_step_with_logprob``, i.e. ``η·sqrt(σ/(1−σ̃))`` without the ``sqrt(−dt)``
    factor (for cps it is ``σ'·sin(ηπ/2)``, which is also the transition std).
    """
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(f"flow_grpo_loss: log_prob shape {tuple(log_prob.shape)} != old_log_prob shape {tuple(old_log_prob.shape)}")
    adv = torch.clamp(advantages.to(log_prob.dtype), -adv_clip_max, adv_clip_max)
    delta = log_prob - old_log_prob.detach()
    ratio = torch.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = torch.mean(torch.maximum(unclipped, clipped))
    loss = policy

    metrics: Metrics = {"policy_loss": policy.detach()}
    if kl_beta > 0:
        if kl is None:
            if mean is None or ref_mean is None or std is None:
                raise ValueError("flow_grpo_loss: kl_beta > 0 needs kl, or mean, ref_mean and std")
            kl = kl_to_reference(mean, ref_mean, std)
        kl = kl.mean()
        loss = policy + kl_beta * kl
        metrics["kl_loss"] = kl.detach()

    with torch.no_grad():
        dev = (ratio - 1.0).abs()
        metrics["clipfrac"] = (dev > clip_range).float().mean()
        metrics["approx_kl"] = 0.5 * torch.mean(delta**2)
        metrics["ratio_abs_dev"] = dev.mean()
        metrics["ratio_mean"] = ratio.mean()
        metrics["loss"] = loss.detach()
    return loss, metrics


def kl_to_reference(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """Flow-GRPO's KL term per sample, ``mean((μ_new − μ_ref)²) / (2·s²)`` over each
    sample's elements ([B]); ``std`` as in :func:`flow_grpo_loss`. The reference (LoRA
    disabled or EMA) is a fixed target: no gradient flows into it."""
    sq = (mean - ref_mean.detach()) ** 2
    s = torch.as_tensor(std, dtype=sq.dtype, device=sq.device).detach()
    if s.ndim == 1 and s.shape[0] == sq.shape[0]:
        s = s.reshape((-1,) + (1,) * (sq.ndim - 1))
    per_elem = sq / (2 * s**2)
    return per_elem.mean(dim=tuple(range(1, per_elem.ndim)))


def velocity_kl(velocity: Tensor, ref_velocity: Tensor) -> Tensor:
    """The KL term in velocity space per sample, ``mean((v − v_ref)²)`` over each sample's
    elements ([B]): DiffusionNFT's (NVlabs/DiffusionNFT@24af555 scripts/train_nft_sd3.py,
    ``config.train.beta``), ``--kl-space velocity`` for Flow-GRPO. The reference is a
    fixed target."""
    sq = (velocity - ref_velocity.detach()) ** 2
    return sq.mean(dim=tuple(range(1, sq.ndim)))


def kl_penalty(batch: Mapping[str, Tensor], loss_name: str = "kl") -> Tensor:
    """The per-sample KL term ``--diffusion-kl-beta`` weighs, from a loss's batch: in
    velocity space (``velocity``, ``ref_velocity``) when the batch carries them
    (``--kl-space velocity``), else in latent space (``mean``, ``ref_mean``, ``std``);
    ``loss_name`` names the loss in the error about a missing key."""
    if "ref_velocity" in batch:
        return velocity_kl(_need(batch, "velocity", loss_name), batch["ref_velocity"])
    return kl_to_reference(*(_need(batch, key, loss_name) for key in ("mean", "ref_mean", "std")))


def nft_loss(
    v_new: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    sigma: Tensor | float,
    advantages: Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    adaptive_weight: bool = True,
) -> tuple[Tensor, Metrics]:
    """DiffusionNFT's loss at one training sigma; ``sigma`` is per-sample [B] (or a float).

    ``v_old`` (the EMA / sampling policy) is a fixed target and is detached."""
    if beta <= 0:
        raise ValueError(f"nft_loss: beta must be > 0, got {beta}")
    if adv_clip_max <= 0:
        raise ValueError(f"nft_loss: adv_clip_max must be > 0, got {adv_clip_max}")
    dims = tuple(range(1, x0.ndim))
    sig = torch.as_tensor(sigma, dtype=x_t.dtype, device=x_t.device)
    sig = sig.reshape((-1,) + (1,) * (x_t.ndim - 1)) if sig.ndim <= 1 else sig
    v_old = v_old.detach()

    v_pos = beta * v_new + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_new
    x0_pos = x_t - sig * v_pos
    x0_neg = x_t - sig * v_neg

    def weighted_mse(pred: Tensor) -> Tensor:
        err = pred - x0
        if adaptive_weight:
            # Per-sample scale of the error, as a constant: the loss becomes roughly
            # scale-free across sigmas. Computed in float64 as DiffusionNFT does.
            with torch.no_grad():
                w = (pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
            return (err**2 / w.to(err.dtype)).mean(dim=dims)
        return (err**2).mean(dim=dims)

    loss_pos = weighted_mse(x0_pos)
    loss_neg = weighted_mse(x0_neg)
    adv = torch.clamp(advantages.to(loss_pos.dtype), -adv_clip_max, adv_clip_max)
    r = torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0.0, 1.0)
    per_sample = adv_clip_max * (r * loss_pos + (1.0 - r) * loss_neg) / beta
    loss = per_sample.mean()

    metrics: Metrics = {
        "nft_loss": loss.detach(),
        "positive_loss": loss_pos.mean().detach(),
        "negative_loss": loss_neg.mean().detach(),
        "optimality_mean": r.mean().detach(),
    }
    return loss, metrics


def sft_loss(v: Tensor, noise: Tensor, x0: Tensor) -> tuple[Tensor, Metrics]:
    """Flow-matching regression onto the target velocity ``ε − x0``."""
    loss = torch.mean((v - (noise - x0)) ** 2)
    return loss, {"sft_loss": loss.detach()}


# ----------------------------------------------------------------------- adapters
def _need(batch: Mapping[str, Tensor], key: str, loss_name: str) -> Tensor:
    try:
        return batch[key]
    except KeyError:
        raise KeyError(f"{loss_name} loss needs batch key {key!r}; the batch has {sorted(batch)}") from None


def _flag(config: Any, name: str, loss_name: str) -> Any:
    try:
        return getattr(config, name)
    except AttributeError:
        flag = "--" + name.replace("_", "-")
        raise AttributeError(f"{loss_name} loss needs config.{name} ({flag})") from None


def policy_loss(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type policy_loss``: Flow-GRPO on recomputed SDE-step log-probs."""
    name = "policy_loss"
    kl_beta = float(getattr(config, "diffusion_kl_beta", 0.0) or 0.0)
    extra: dict[str, Any] = {}
    if kl_beta > 0:
        extra = {"kl": kl_penalty(batch, name)}
    return flow_grpo_loss(
        _need(batch, "log_prob", name),
        _need(batch, "old_log_prob", name),
        _need(batch, "advantages", name),
        clip_range=float(_flag(config, "diffusion_clip_range", name)),
        adv_clip_max=float(_flag(config, "diffusion_adv_clip_max", name)),
        kl_beta=kl_beta,
        **extra,
    )


def nft(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type nft``: DiffusionNFT."""
    name = "nft"
    tensors = [_need(batch, k, name) for k in ("v_new", "v_old", "x_t", "x0", "sigma", "advantages")]
    loss, metrics = nft_loss(
        *tensors,
        beta=float(_flag(config, "diffusion_nft_beta", name)),
        adv_clip_max=float(_flag(config, "diffusion_adv_clip_max", name)),
        adaptive_weight=not bool(getattr(config, "no_diffusion_nft_adaptive_weight", False)),
    )
    kl_beta = float(getattr(config, "diffusion_kl_beta", 0.0) or 0.0)
    if kl_beta > 0:
        # DiffusionNFT's KL: the live prediction against the base model's, added to the loss.
        kl = velocity_kl(batch["v_new"], _need(batch, "v_ref", name)).mean()
        loss = loss + kl_beta * kl
        metrics["kl_loss"] = kl.detach()
    return loss, metrics


def sft(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type sft``: supervised flow matching."""
    name = "sft"
    return sft_loss(_need(batch, "v", name), _need(batch, "noise", name), _need(batch, "x0", name))


@functools.cache
def resolve_custom_loss(path: str) -> LossFn:
    """Import ``pkg.mod.func`` or ``pkg.mod:func`` once per path."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"--custom-loss-function-path {path!r} must look like 'pkg.mod.func' or 'pkg.mod:func'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--custom-loss-function-path {path!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"--custom-loss-function-path {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"--custom-loss-function-path {path!r} is not callable")
    return obj


def custom_loss(batch: Mapping[str, Tensor], config: Any) -> tuple[Tensor, Metrics]:
    """``--loss-type custom_loss``: the function named by ``--custom-loss-function-path``,
    called as ``fn(batch, config) -> (loss, metrics)``."""
    path = getattr(config, "custom_loss_function_path", None)
    if not path:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path (pkg.mod:func)")
    result = resolve_custom_loss(str(path))(batch, config)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)):
        raise TypeError(f"custom loss {path!r} must return (loss_tensor, metrics_dict), got {type(result).__name__}")
    return result


LOSSES: dict[str, LossFn] = {
    "policy_loss": policy_loss,
    "nft": nft,
    "sft": sft,
    "custom_loss": custom_loss,
}
"""The built-in ``--loss-type`` adapters by name."""
