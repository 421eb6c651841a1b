"""GRPO advantages: per-prompt reward normalisation (DESIGN section 7).

Rewards arrive in sample order, ``n_samples_per_prompt`` consecutive samples per prompt.
Each sample's advantage is its reward minus the group mean (the batch mean with
``--globalize-reward-mean``), divided by ``std + 1e-4`` (the batch std with
``--globalize-reward-std``; no division with ``--disable-grpo-std-normalization``, and none
when ``n_samples_per_prompt`` is 1). Every train pair of a sample carries that sample's
advantage.

``--custom-reward-post-process-path`` replaces the normalisation with a user function,
called as in the reference (``RolloutManager._post_process_rewards``)::

    def post_process_rewards(args, samples) -> tuple[raw_rewards, advantages]

Samples a per-sample filter marked ``remove_sample`` still count here: the filter masks
their loss, not their place in the group statistics (``--rollout-sample-filter-path``).
"""

from __future__ import annotations

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


def _check_values(values: Any, expected: int, what: str, prefix: str) -> torch.Tensor:
    """``values`` as a float64 ``[expected]`` tensor of finite numbers, or a one-line error
    starting with ``prefix`` (the flag and its value)."""
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
    bad = (~torch.isfinite(tensor)).nonzero().flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"{prefix}: {what} of sample {index} is {float(tensor[index])}; values must be finite")
    return tensor


def post_process_rewards(
    rewards: torch.Tensor | Sequence[float],
    config: Any,
    samples: Sequence[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw_rewards, advantages)``, both ``[N]``: the reference's ``_post_process_rewards``.

    Without ``--custom-reward-post-process-path`` the raw rewards are ``rewards`` and the
    advantages come from :func:`grpo_advantages` with the configuration's flags. With it,
    the named function is called as ``fn(config, samples)`` (the reference's signature)
    and must return ``(raw_rewards, advantages)``, each a tensor or list of ``N`` finite
    numbers; anything else is a one-line ``ValueError`` naming the flag.
    """
    flat = _as_float_tensor(rewards)
    path = getattr(config, "custom_reward_post_process_path", None)
    if not path:
        advantages = grpo_advantages(
            flat,
            config.n_samples_per_prompt,
            globalize_mean=bool(config.globalize_reward_mean),
            globalize_std=bool(config.globalize_reward_std),
            std_normalization=not config.disable_grpo_std_normalization,
        )
        return flat, advantages

    if samples is None:
        raise ValueError(f"{POST_PROCESS_FLAG} {path}: the function takes (args, samples); no samples were passed")
    if len(samples) != flat.numel():
        raise ValueError(f"{POST_PROCESS_FLAG} {path}: {len(samples)} samples for {flat.numel()} rewards")
    fn = resolve_path_flag(POST_PROCESS_FLAG, path, "callable")
    result = fn(config, samples)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(
            f"{POST_PROCESS_FLAG} {path}: must return (raw_rewards, advantages), got {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        )
    raw = _check_values(result[0], flat.numel(), "raw_rewards", f"{POST_PROCESS_FLAG} {path}")
    advantages = _check_values(result[1], flat.numel(), "advantages", f"{POST_PROCESS_FLAG} {path}")
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

    ``samples`` (the rollout's samples, in the rewards' order) are needed only by a
    custom post-process function. Samples with ``remove_sample`` are included: they
    count for normalisation and are masked only in the loss.
    """
    return post_process_rewards(rewards, config, samples)[1]


__all__ = ["DEFAULT_EPS", "POST_PROCESS_FLAG", "advantages_from_config", "grpo_advantages", "post_process_rewards"]
