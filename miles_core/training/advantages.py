"""GRPO advantages: per-prompt reward normalisation (docs/design.md, "Advantages, losses and the EMA").

Rewards arrive in sample order, ``n_samples_per_prompt`` consecutive samples per prompt.
Each sample's advantage is its reward minus the group mean (the batch mean with
``--globalize-reward-mean``), divided by ``std + 1e-4`` (the batch std with
``--globalize-reward-std``; no division with ``--disable-grpo-std-normalization``, and none
when ``n_samples_per_prompt`` is 1). Every train pair of a sample carries that sample's
advantage.

``--custom-reward-post-process-path`` replaces the normalisation with a user function,
called as in the reference (``RolloutManager._post_process_rewards``)::

    def post_process_rewards(args, samples) -> tuple[raw_rewards, advantages]

A sample whose reward failed (below) reaches that function with ``sample.reward`` set to
the mean reward of its group's valid samples (0 in a group with none), so a plain group
mean/std function sees no NaN and the group's mean is unchanged; its advantage is then 0
whatever the function returns, and its reward is NaN again after the call.

Samples a per-sample filter marked ``remove_sample`` still count here: the filter masks
their loss, not their place in the group statistics (``--rollout-sample-filter-path``).

Samples whose reward failed (``reward_failed``: the reward raised or returned no finite
number, see :mod:`miles_core.training.rewards`) do not: each group's mean and std are taken
over its valid samples only, and a failed sample's advantage is 0 (its loss is masked too).
A group with one valid sample gives it advantage 0; with none, all 0.

``--reward-aggregation advantage`` (with a ``--reward-weights`` mixture): each reward
component is normalised within its group as above (same eps and flags), and the advantage
is the weighted sum ``sum_k w_k * A_k`` of the per-component advantages, so one reward's
scale cannot drown another. ``sum`` (the default) normalises the weighted sum of the raw
rewards instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from miles_core.refs import resolve_path_flag

POST_PROCESS_FLAG = "--custom-reward-post-process-path"

DEFAULT_EPS = 1e-4
"""flow_grpo's ``std + 1e-4`` (``stat_tracking.PerPromptStatTracker``), which the diffusion
reference keeps; the LLM-side miles uses 1e-6."""


def _as_float_tensor(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    tensor = rewards if torch.is_tensor(rewards) else torch.as_tensor(rewards)
    # Integer rewards (0/1 verifiers) are normalised in float32, as the reference builds
    # its tensor with dtype=torch.float; float64 input stays float64.
    return tensor if tensor.is_floating_point() else tensor.to(torch.float32)


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    n_samples_per_prompt: int,
    *,
    globalize_mean: bool = False,
    globalize_std: bool = False,
    std_normalization: bool = True,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` (shape ``[N]``, sample order).

    Args:
        rewards: one scalar per sample; samples ``k*n .. k*n + n - 1`` share prompt ``k``.
        n_samples_per_prompt: ``n``; ``N`` must be a multiple of it.
        globalize_mean: subtract the batch mean instead of each group's mean.
        globalize_std: divide by the std of all ``N`` rewards instead of each group's.
        std_normalization: divide by ``std + eps`` at all (off = Dr.GRPO). Forced off
            when ``n == 1``: a one-sample group has no spread to normalise by.
        eps: added to the std before dividing.

    Returns:
        A ``[N]`` tensor of advantages, in the rewards' floating dtype.

    Samples marked ``remove_sample`` must be included: they count for the statistics and
    are masked only in the loss.

    Raises:
        ValueError: a non-1-D or empty input, ``n < 1``, ``N`` not a multiple of ``n``,
            or a non-finite reward (it would silently poison its whole group).
    """
    flat = _as_float_tensor(rewards)
    if flat.dim() != 1 or flat.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(flat.shape)}")
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    total = flat.numel()
    if total % n_samples_per_prompt != 0:
        raise ValueError(
            f"{total} rewards do not split into groups of n_samples_per_prompt={n_samples_per_prompt} "
            f"({total} % {n_samples_per_prompt} = {total % n_samples_per_prompt})"
        )
    bad = (~torch.isfinite(flat)).nonzero().flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"reward of sample {index} is {float(flat[index])}; rewards must be finite")

    groups = flat.view(-1, n_samples_per_prompt)
    mean = flat.mean() if globalize_mean else groups.mean(dim=-1, keepdim=True)
    centered = groups - mean

    if std_normalization and n_samples_per_prompt > 1:
        # Which std: the reference (miles-diffusion's _post_process_rewards and
        # grpo_group_advantages) calls torch's Tensor.std(), the unbiased (N-1) estimate;
        # flow_grpo's PerPromptStatTracker uses np.std, the biased (N) one. We follow the
        # reference. The global std is that of the raw batch rewards (not of the centred
        # ones), as in both.
        std = flat.std() if globalize_std else groups.std(dim=-1, keepdim=True)
        centered = centered / (std + eps)

    return centered.reshape(-1)


def masked_grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    valid: torch.Tensor | Sequence[bool],
    n_samples_per_prompt: int,
    *,
    globalize_mean: bool = False,
    globalize_std: bool = False,
    std_normalization: bool = True,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """:func:`grpo_advantages` over the ``valid`` samples only: the means and stds (per
    group, or of the batch with the globalize flags) are those of the valid rewards, an
    invalid sample's advantage is 0 (its reward may be anything, NaN included), and so is
    that of a group's only valid sample when dividing by the group's std. With every
    sample valid it is exactly :func:`grpo_advantages`."""
    flat = _as_float_tensor(rewards)
    mask = torch.as_tensor(valid, dtype=torch.bool)
    if mask.shape != flat.shape:
        raise ValueError(f"valid mask of shape {tuple(mask.shape)} for rewards of shape {tuple(flat.shape)}")
    if bool(mask.all()):
        return grpo_advantages(
            flat,
            n_samples_per_prompt,
            globalize_mean=globalize_mean,
            globalize_std=globalize_std,
            std_normalization=std_normalization,
            eps=eps,
        )
    filled = torch.where(mask, flat, torch.zeros_like(flat))
    grpo_advantages(filled, n_samples_per_prompt)  # the shape checks, and finite valid rewards
    if not bool(mask.any()):
        return torch.zeros_like(flat)
    n = n_samples_per_prompt
    groups, weights = filled.view(-1, n), mask.view(-1, n).to(flat.dtype)
    count = weights.sum(dim=-1, keepdim=True)
    group_mean = groups.sum(dim=-1, keepdim=True) / count.clamp(min=1)
    mean = flat[mask].mean() if globalize_mean else group_mean
    centered = (groups - mean) * weights
    if std_normalization and n > 1:
        if globalize_std:
            kept = flat[mask]
            std = kept.std() if kept.numel() > 1 else torch.zeros((), dtype=flat.dtype)
        else:  # unbiased, as Tensor.std(), over each group's valid rewards
            var = (((groups - group_mean) * weights) ** 2).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)
            std = var.sqrt()
            # A group's only valid sample has no spread to divide by (its centred value is
            # 0 anyway unless --globalize-reward-mean): advantage 0.
            centered = torch.where(count > 1, centered, torch.zeros_like(centered))
        centered = centered / (std + eps)
    return (centered * weights).reshape(-1)


def _failed_mask(samples: Sequence[Any] | None, total: int) -> torch.Tensor:
    """``[total]`` bool: the samples whose reward failed (none without samples)."""
    if samples is None:
        return torch.zeros(total, dtype=torch.bool)
    return torch.tensor([bool(getattr(s, "reward_failed", False)) for s in samples], dtype=torch.bool)


def _grpo_options(config: Any) -> dict[str, Any]:
    return {
        "globalize_mean": bool(config.globalize_reward_mean),
        "globalize_std": bool(config.globalize_reward_std),
        "std_normalization": not config.disable_grpo_std_normalization,
    }


def component_advantages(rewards: torch.Tensor | Sequence[float], config: Any, samples: Sequence[Any], valid: torch.Tensor) -> torch.Tensor:
    """``--reward-aggregation advantage``: ``sum_k w_k * A_k`` where ``A_k`` is component
    ``k`` (each sample's ``reward_components[k]``) normalised within its group over the
    valid samples, with ``config.reward_weights`` as ``w``. A group scored by a single
    reward instead (a sample's ``metadata["rm_type"]``: no components) is normalised on
    its reward as with ``sum``."""
    flat = _as_float_tensor(rewards)
    weights = dict(getattr(config, "reward_weights", None) or {})
    if not weights:
        raise ValueError("--reward-aggregation advantage needs --reward-weights (the mixture whose rewards it normalises)")
    n, options = config.n_samples_per_prompt, _grpo_options(config)
    mixed = torch.tensor([all(k in (s.reward_components or {}) for k in weights) for s in samples], dtype=torch.bool)
    # A prompt group is scored one way: by the mixture (every valid sample has the components) or by one reward.
    for g, (is_mixed, ok) in enumerate(zip(mixed.view(-1, n).tolist(), valid.view(-1, n).tolist())):
        kinds = {m for m, v in zip(is_mixed, ok) if v}
        if len(kinds) > 1:
            raise ValueError(
                f"--reward-aggregation advantage: prompt group {g} mixes samples scored by the --reward-weights "
                "mixture with samples scored by one reward (metadata rm_type); a group needs one kind"
            )
    total = torch.zeros_like(flat)
    for name, weight in weights.items():
        keep = valid & mixed
        values = torch.tensor(
            [float(s.reward_components.get(name, math.nan)) if k else 0.0 for s, k in zip(samples, keep.tolist())], dtype=flat.dtype
        )
        total = total + weight * masked_grpo_advantages(values, keep, n, **options)
    single = valid & ~mixed
    if bool(single.any()):
        total = total + masked_grpo_advantages(flat, single, n, **options)
    return total


def _check_values(values: Any, expected: int, what: str, prefix: str, skip: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` as a float64 ``[expected]`` tensor of finite numbers, or a one-line error
    starting with ``prefix`` (the flag and its value). Positions in ``skip`` (failed
    samples) may hold anything numeric, NaN included."""
    if torch.is_tensor(values):
        tensor = values.detach()
    elif isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise ValueError(f"{prefix}: {what} must be numbers, got {', '.join(kinds)}")
        tensor = torch.tensor(list(values), dtype=torch.float64)
    else:
        raise ValueError(f"{prefix}: {what} must be a tensor or a list of floats, got {type(values).__name__}")
    if tensor.dim() != 1 or tensor.numel() != expected:
        raise ValueError(f"{prefix}: {what} must hold {expected} values (one per sample), got shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"{prefix}: {what} must be real numbers, got dtype {tensor.dtype}")
    tensor = tensor.to(torch.float64)
    finite = torch.isfinite(tensor) if skip is None else torch.isfinite(tensor) | skip
    bad = (~finite).nonzero().flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"{prefix}: {what} of sample {index} is {float(tensor[index])}; values must be finite")
    return tensor


def _neutral_fills(flat: torch.Tensor, failed: torch.Tensor, n: int) -> dict[int, float]:
    """``{position: value}`` for each failed sample: the mean reward of its group's valid
    samples (groups of ``n`` consecutive samples), or 0.0 when the group has none."""
    fills: dict[int, float] = {}
    if not bool(failed.any()):
        return fills
    if n < 1 or flat.numel() % n:
        raise ValueError(f"{flat.numel()} rewards do not split into groups of n_samples_per_prompt={n}")
    for g in range(flat.numel() // n):
        group = range(g * n, (g + 1) * n)
        valid = [float(flat[i]) for i in group if not failed[i]]
        mean = sum(valid) / len(valid) if valid else 0.0
        fills.update({i: mean for i in group if failed[i]})
    return fills


def post_process_rewards(
    rewards: torch.Tensor | Sequence[float],
    config: Any,
    samples: Sequence[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw_rewards, advantages)``, both ``[N]``: the reference's ``_post_process_rewards``.

    Without ``--custom-reward-post-process-path`` the raw rewards are ``rewards`` and the
    advantages come from :func:`masked_grpo_advantages` with the configuration's flags
    (failed samples left out, advantage 0), or from :func:`component_advantages` under
    ``--reward-aggregation advantage``. With it, the named function is called as
    ``fn(config, samples)`` (the reference's signature) and must return
    ``(raw_rewards, advantages)``, each a tensor or list of ``N`` numbers, finite except
    at failed samples; anything else is a one-line ``ValueError`` naming the flag. During
    the call a failed sample's ``reward`` is its group's mean valid reward (0 when the
    group has no valid sample; NaN again afterwards); its advantage is set to 0 and its
    raw reward to NaN.
    """
    flat = _as_float_tensor(rewards)
    failed = _failed_mask(samples, flat.numel())
    if failed.numel() != flat.numel():
        raise ValueError(f"{failed.numel()} samples for {flat.numel()} rewards")
    path = getattr(config, "custom_reward_post_process_path", None)
    if not path:
        if getattr(config, "reward_aggregation", "sum") == "advantage":
            if samples is None:
                raise ValueError("--reward-aggregation advantage: the samples (their reward components) are needed")
            return flat, component_advantages(flat, config, samples, ~failed)
        return flat, masked_grpo_advantages(flat, ~failed, config.n_samples_per_prompt, **_grpo_options(config))

    if samples is None:
        raise ValueError(f"{POST_PROCESS_FLAG} {path}: the function takes (args, samples); no samples were passed")
    if len(samples) != flat.numel():
        raise ValueError(f"{POST_PROCESS_FLAG} {path}: {len(samples)} samples for {flat.numel()} rewards")
    fn = resolve_path_flag(POST_PROCESS_FLAG, path, "callable")
    # Failed samples reach the function with their group's mean valid reward (0 in a group
    # with none), so a plain group mean/std function neither sees NaN nor moves the mean;
    # their advantages are forced to 0 below and their reward is NaN again after the call.
    fills = _neutral_fills(flat, failed, config.n_samples_per_prompt)
    originals = [(samples[i], samples[i].reward) for i in fills]
    try:
        for i, value in fills.items():
            samples[i].reward = value
        result = fn(config, samples)
    finally:
        for sample, reward in originals:
            sample.reward = reward
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(
            f"{POST_PROCESS_FLAG} {path}: must return (raw_rewards, advantages), got {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        )
    raw = _check_values(result[0], flat.numel(), "raw_rewards", f"{POST_PROCESS_FLAG} {path}", failed)
    advantages = _check_values(result[1], flat.numel(), "advantages", f"{POST_PROCESS_FLAG} {path}", failed)
    advantages = torch.where(failed, torch.zeros_like(advantages), advantages)
    raw = torch.where(failed, torch.full_like(raw, math.nan), raw)  # a failed sample has no reward
    # Hand back the dtype the built-in path would have produced, so callers see one type.
    return raw.to(flat.dtype), advantages.to(flat.dtype)


def advantages_from_config(
    rewards: torch.Tensor | Sequence[float],
    config: Any,
    samples: Sequence[Any] | None = None,
) -> torch.Tensor:
    """The ``[N]`` advantages for ``rewards`` under ``config``'s algorithm flags
    (``n_samples_per_prompt``, ``globalize_reward_mean``, ``globalize_reward_std``,
    ``disable_grpo_std_normalization``, ``custom_reward_post_process_path``).

    ``samples`` (the rollout's samples, in the rewards' order) say which rewards failed
    (``reward_failed``: left out of the statistics, advantage 0) and carry the reward
    components of ``--reward-aggregation advantage``; a custom post-process function gets
    them too. Samples with ``remove_sample`` (and a reward) are included: they count for
    normalisation and are masked only in the loss.
    """
    return post_process_rewards(rewards, config, samples)[1]


__all__ = [
    "DEFAULT_EPS",
    "POST_PROCESS_FLAG",
    "advantages_from_config",
    "component_advantages",
    "grpo_advantages",
    "masked_grpo_advantages",
    "post_process_rewards",
]
