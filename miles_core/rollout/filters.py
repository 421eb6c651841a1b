"""Rollout filters: which prompt groups of a scored rollout are trained on, and which
samples of them are masked in the loss.

Three slots, each a flag that takes the name of a registered filter of its stage
(:class:`~miles_core.specs.RolloutFilterSpec`, hook ``miles_register_rollout_filters``) or
a dotted path ``package.module.function`` (a one-off filter). They run in this order,
once per rollout, after every sample is scored and before the advantages:

1. ``--dynamic-sampling-filter-path`` (stage ``group``): ``fn(args, group) -> keep``,
   called once per prompt group (``group``: its ``n_samples_per_prompt`` scored samples).
   ``keep`` is a bool (or a one-element bool tensor or numpy bool, as the reference's
   ``check_reward_nonzero_std`` returns) or a :class:`FilterOutput` ``(keep, reason)``;
   a dropped group with a reason is counted under ``rollout/filter/drop_<reason>``.
   Dropped groups leave the training batch. The reference refills the batch by
   over-sampling; here ``--over-sampling-batch-size`` must equal
   ``--rollout-batch-size``, so nothing refills it: the rollout trains on fewer groups
   (the same ``--num-steps-per-rollout`` optimizer steps over them), and on none (no
   optimizer step, a warning) when every group is dropped.
2. ``--buffer-filter-path`` (stage ``buffer``): ``fn(args, rollout_id, groups,
   num_groups) -> groups``, the reference's buffer-filter signature. ``groups`` are the
   groups the dynamic filter kept, in prompt order; ``num_groups`` is
   ``--rollout-batch-size``. It returns the groups to train on, in the order they are
   trained: each one of the given groups (its samples in any order; it is trained in its
   original order), none twice; a group
   it leaves out is dropped (there is no buffer that outlives the rollout here).
3. ``--rollout-sample-filter-path`` (stage ``sample``): ``fn(args, groups) -> None``,
   called once with the groups that will be trained (``list[list[Sample]]``, as the
   reference passes them). It sets ``sample.remove_sample = True`` on the samples to leave
   out of the loss. Removed samples keep their place in their group's advantage
   statistics (the reference's rule); their train pairs get ``loss_mask`` 0.

Any filter may be ``async``. A wrong return value stops the run with one line naming the
flag. Registered built-ins: ``check_reward_nonzero_std`` (group, DAPO's dynamic sampling)
and ``pop_first`` (buffer, the reference's default: the first ``num_groups`` groups).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import FilterError
from miles_core.rollout.sample import Sample

GROUP, SAMPLE, BUFFER = "group", "sample", "buffer"

FLAGS: dict[str, tuple[str, str]] = {
    GROUP: ("--dynamic-sampling-filter-path", "dynamic_sampling_filter_path"),
    BUFFER: ("--buffer-filter-path", "buffer_filter_path"),
    SAMPLE: ("--rollout-sample-filter-path", "rollout_sample_filter_path"),
}
"""stage -> (flag, configuration key)."""

SIGNATURES: dict[str, tuple[int, str]] = {
    GROUP: (2, "fn(args, group_samples) -> bool or FilterOutput"),
    BUFFER: (4, "fn(args, rollout_id, groups, num_groups) -> list of groups"),
    SAMPLE: (2, "fn(args, groups) -> None, setting sample.remove_sample = True"),
}
"""stage -> (positional arguments, the signature as the error messages spell it)."""


@dataclass(frozen=True)
class FilterOutput:
    """A group filter's verdict: ``keep``, and why a dropped group was dropped (counted as
    ``rollout/filter/drop_<reason>``)."""

    keep: bool
    reason: str | None = None


DynamicFilterOutput = FilterOutput
"""The reference's name."""


@dataclass(frozen=True)
class LoadedFilter:
    """A resolved filter flag: the function and where it came from."""

    stage: str
    value: str
    fn: Callable[..., Any]

    @property
    def where(self) -> str:
        return f"{FLAGS[self.stage][0]} {self.value}"

    async def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        if inspect.isawaitable(result):
            result = await result
        return result


def _accepts(fn: Any, positional: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * positional))
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): nothing to check
        return True
    return True


def resolve_filter(stage: str, value: str | None) -> LoadedFilter | None:
    """The filter a flag names: a registered filter of ``stage``, or a dotted path to a
    callable taking the stage's arguments. None when the flag is unset; a
    :class:`FilterError` naming the flag otherwise."""
    from miles_core.errors import ComponentLoadError, PathFlagError
    from miles_core.plugin_manager import get_host
    from miles_core.refs import resolve_path_flag

    if value is None:
        return None
    flag = FLAGS[stage][0]
    positional, signature = SIGNATURES[stage]
    registry = get_host().registries.rollout_filter
    of_stage = [reg.name for reg in registry if reg.spec.stage == stage]
    if value in registry:
        registration = registry.get(value)
        if registration.spec.stage != stage:
            raise FilterError(
                f"{flag} {value}: {value!r} is a {registration.spec.stage} filter; this flag takes a {stage} filter "
                f"(registered: {', '.join(of_stage) or 'none'}) or a dotted path to {signature}"
            )
        try:
            fn = registration.load()
        except ComponentLoadError as exc:
            raise FilterError(f"{flag} {value}: {exc}") from None
    elif "." in value or ":" in value:
        try:
            fn = resolve_path_flag(flag, value, "callable")
        except PathFlagError as exc:
            raise FilterError(str(exc)) from None
    else:
        raise FilterError(
            f"{flag} {value}: not a registered {stage} filter (registered: {', '.join(of_stage) or 'none'}) "
            f"nor a dotted path package.module.function"
        )
    if not _accepts(fn, positional):
        from miles_core.refs import describe

        raise FilterError(f"{flag} {value}: must be {signature}, got {describe(fn)}")
    return LoadedFilter(stage, value, fn)


def filter_errors(config: Any) -> list[str]:
    """One line per filter flag that does not resolve (for ``miles_validate_config``)."""
    errors = []
    for stage, (_, key) in FLAGS.items():
        try:
            resolve_filter(stage, getattr(config, key, None))
        except FilterError as exc:
            errors.append(str(exc))
    return errors


# -- applying them ---------------------------------------------------------------------------


@dataclass
class FilterResult:
    """The groups a rollout trains on, and what the filters did."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]


class RolloutFilters:
    """The run's three filter slots, resolved once."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.group, self.buffer, self.sample = (
            resolve_filter(stage, getattr(config, FLAGS[stage][1], None)) for stage in (GROUP, BUFFER, SAMPLE)
        )

    async def apply(self, rollout_id: int, samples: Sequence[Sample]) -> FilterResult:
        """Split the scored rollout into its prompt groups (``n_samples_per_prompt``
        consecutive samples each) and run the filters. Metrics:
        ``rollout/filter/groups_dropped`` (by the dynamic-sampling filter),
        ``rollout/filter/groups_unselected`` (left out by the buffer filter),
        ``rollout/filter/groups_kept`` (trained on), ``rollout/filter/samples_removed``
        (samples of the kept groups masked in the loss: by the per-sample filter or a
        failed reward) and ``rollout/filter/drop_<reason>`` per reason a group filter gave."""
        n = self.config.n_samples_per_prompt
        groups = [list(samples[start : start + n]) for start in range(0, len(samples), n)]
        metrics: dict[str, float] = {}
        kept = groups
        if self.group is not None:
            kept = []
            for group in groups:
                verdict = _verdict(self.group, await self.group(self.config, group))
                if verdict.keep:
                    kept.append(group)
                elif verdict.reason:
                    key = f"rollout/filter/drop_{verdict.reason}"
                    metrics[key] = metrics.get(key, 0) + 1
        metrics["rollout/filter/groups_dropped"] = len(groups) - len(kept)
        selected = kept
        if self.buffer is not None:
            result = await self.buffer(self.config, rollout_id, list(kept), self.config.rollout_batch_size)
            selected = _check_selection(self.buffer, result, kept)
        metrics["rollout/filter/groups_unselected"] = len(kept) - len(selected)
        if self.sample is not None and selected:
            failed_before = [s for group in selected for s in group if getattr(s, "reward_failed", False)]
            result = await self.sample(self.config, selected)
            if result is not None:
                raise FilterError(
                    f"{self.sample.where}: must return None (it marks samples with sample.remove_sample = True), "
                    f"got {type(result).__name__}"
                )
            for index, sample in enumerate(s for group in selected for s in group):
                if not isinstance(sample.remove_sample, bool):
                    raise FilterError(
                        f"{self.sample.where}: sample.remove_sample must be True or False, got "
                        f"{type(sample.remove_sample).__name__} {sample.remove_sample!r} (sample {index} of the kept groups)"
                    )
            if any(not s.remove_sample for s in failed_before):
                raise FilterError(
                    f"{self.sample.where}: set remove_sample = False on a sample whose reward failed; a failed sample stays out of the loss"
                )
        metrics["rollout/filter/groups_kept"] = len(selected)
        metrics["rollout/filter/samples_removed"] = sum(s.remove_sample for group in selected for s in group)
        return FilterResult(selected, metrics)


def _verdict(loaded: LoadedFilter, value: Any) -> FilterOutput:
    keep = getattr(value, "keep", value)
    reason = getattr(value, "reason", None) if keep is not value else None
    if type(keep).__name__ == "bool_":  # numpy.bool_
        keep = bool(keep)
    elif not isinstance(keep, bool) and hasattr(keep, "numel") and getattr(keep, "dtype", None) is not None:
        import torch

        if keep.numel() == 1 and keep.dtype == torch.bool:
            keep = bool(keep.item())
    if not isinstance(keep, bool):
        raise FilterError(
            f"{loaded.where}: must return a bool (keep the group) or FilterOutput(keep, reason), got {type(value).__name__} {value!r}"[:300]
        )
    if reason is not None and not isinstance(reason, str):
        raise FilterError(f"{loaded.where}: FilterOutput.reason must be a str or None, got {type(reason).__name__}")
    return FilterOutput(keep, reason)


def _check_selection(loaded: LoadedFilter, result: Any, groups: list[list[Sample]]) -> list[list[Sample]]:
    """The buffer filter's return: a list of the given groups, none twice."""
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        raise FilterError(f"{loaded.where}: must return a list of groups (lists of Sample), got {type(result).__name__}")
    by_members = {frozenset(map(id, group)): index for index, group in enumerate(groups)}
    seen: set[int] = set()
    selected = []
    for position, group in enumerate(result):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not all(isinstance(s, Sample) for s in group):
            raise FilterError(f"{loaded.where}: must return a list of groups (lists of Sample); item {position} is {type(group).__name__}")
        index = by_members.get(frozenset(map(id, group)))
        if index is None or len(group) != len(groups[index]):
            raise FilterError(
                f"{loaded.where}: item {position} of its return is not one of the groups it was given "
                "(whole prompt groups only, the same Sample objects)"
            )
        if index in seen:
            raise FilterError(f"{loaded.where}: returned group {index} twice; each group is trained at most once")
        seen.add(index)
        selected.append(groups[index])
    return selected


# -- built-in filters ----------------------------------------------------------------------


def check_reward_nonzero_std(args: Any, samples: Sequence[Sample], **kwargs: Any) -> FilterOutput:
    """DAPO's dynamic-sampling rule: keep a group whose rewards are not all the same (a
    group of equal rewards has all-zero advantages and teaches nothing). The std is the
    unbiased one in float64, over the samples whose reward did not fail; keep when it is
    above 1e-8 (the reference's threshold). Fewer than two valid rewards: dropped
    (reason ``too_few_rewards``); equal rewards: reason ``zero_std_<first reward, 1 decimal>``."""
    import torch

    rewards = [
        float(s.reward)
        for s in samples
        if s.reward is not None and not getattr(s, "reward_failed", False) and math.isfinite(float(s.reward))
    ]
    if len(rewards) < 2:
        return FilterOutput(keep=False, reason="too_few_rewards")
    keep = bool(torch.tensor(rewards, dtype=torch.float64).std() > 1e-8)
    return FilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def pop_first(args: Any, rollout_id: int, groups: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """The reference's default buffer filter: the first ``num_groups`` groups, in order."""
    return list(groups[:num_groups])


__all__ = [
    "DynamicFilterOutput",
    "FilterError",
    "FilterOutput",
    "FilterResult",
    "RolloutFilters",
    "check_reward_nonzero_std",
    "filter_errors",
    "pop_first",
    "resolve_filter",
]
