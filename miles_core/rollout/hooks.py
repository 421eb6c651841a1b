"""User code in the rollout's slots, named by dotted-path flags (docs/customization.md).

``--rollout-function-path`` and ``--eval-function-path`` replace a whole rollout
(:data:`RolloutFunction`), ``--custom-generate-function-path`` only the request to the
engine inside the built-in one (:data:`GenerateFunction`), ``--data-source-path`` the
prompt source (:class:`~miles_core.rollout.data.DataSource`). Each is loaded with the rule
of its kind (:data:`miles_core.refs.PATH_KINDS`), called the same way whether it is
async or not, and what it returns is checked before the run uses it: a wrong value is a
one-line :class:`HookError` naming the flag, never a traceback deep in training.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from miles_core.engine.base import RolloutEngine
from miles_core.errors import HookError
from miles_core.refs import Hook, load_hook
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.rollout.data import DataSource, PromptRecord, PromptSource
from miles_core.rollout.sample import Sample

ROLLOUT_FLAG = "--rollout-function-path"
EVAL_FLAG = "--eval-function-path"
GENERATE_FLAG = "--custom-generate-function-path"
DATA_SOURCE_FLAG = "--data-source-path"

RolloutFunction = Callable[..., Awaitable[Sequence[Sample]] | Sequence[Sample]]
"""``(config, rollout_id, engine, data_source, *, evaluation=False) -> list[Sample]``,
async or not; ``evaluation`` is passed only to an eval rollout."""

GenerateFunction = Callable[[RolloutEngine, RolloutRequest], Awaitable[Sequence[RolloutOutput]] | Sequence[RolloutOutput]]
"""``(engine, request) -> list[RolloutOutput]``, async or not: one request's outputs."""


def rollout_hook(config: Any) -> Hook | None:
    """``--rollout-function-path``, or None for the built-in rollout."""
    return load_hook(ROLLOUT_FLAG, config.rollout_function_path, "rollout_function")


def eval_hook(config: Any) -> Hook | None:
    """``--eval-function-path``, else ``--rollout-function-path`` (the reference's
    default), else None for the built-in evaluation."""
    if config.eval_function_path is not None:
        return load_hook(EVAL_FLAG, config.eval_function_path, "eval_function")
    return load_hook(ROLLOUT_FLAG, config.rollout_function_path, "eval_function")


def check_samples(
    hook: Hook, samples: Any, group_size: int, *, size_flag: str = "--n-samples-per-prompt", expected: int | None = None
) -> list[Sample]:
    """What a rollout function returned, as the rest of the run needs it: a non-empty
    list of :class:`Sample`, whole groups of ``group_size`` consecutive samples that share
    their prompt and ``group_index`` (advantages are normalised per group)."""
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
        raise HookError(f"{hook.where}: must return a list of Sample, got {type(samples).__name__}")
    samples = list(samples)
    bad = next((item for item in samples if not isinstance(item, Sample)), None)
    if bad is not None:
        raise HookError(f"{hook.where}: must return a list of miles_core.rollout.sample.Sample, got an item of type {type(bad).__name__}")
    if not samples:
        raise HookError(f"{hook.where}: returned no samples")
    if len(samples) % group_size:
        raise HookError(
            f"{hook.where}: returned {len(samples)} samples, not whole groups of {size_flag} {group_size} "
            "(each prompt's samples consecutive)"
        )
    if expected is not None and len(samples) != expected:
        raise HookError(f"{hook.where}: returned {len(samples)} samples, expected {expected} ({size_flag} {group_size} per prompt)")
    for start in range(0, len(samples), group_size):
        if len({(s.group_index, s.prompt) for s in samples[start : start + group_size]}) > 1:
            raise HookError(
                f"{hook.where}: samples {start}..{start + group_size - 1} are not one prompt group "
                f"({size_flag} {group_size} consecutive samples share their prompt and group_index)"
            )
    return samples


def generate_function(config: Any) -> GenerateFunction:
    """``--custom-generate-function-path``, its outputs checked on every call; else the
    engine's own ``generate``."""
    hook = load_hook(GENERATE_FLAG, config.custom_generate_function_path, "generate_function")
    if hook is None:
        from miles_core.rollout.requests import engine_generate

        return engine_generate

    async def generate(engine: RolloutEngine, request: RolloutRequest) -> list[RolloutOutput]:
        return check_outputs(hook, request, await hook(engine, request))

    return generate


def check_outputs(hook: Hook, request: RolloutRequest, outputs: Any) -> list[RolloutOutput]:
    """One request's outputs: ``num_outputs_per_prompt`` RolloutOutputs, output *i* with
    seed ``request.seed + i`` (the seed layout training and replays rely on)."""
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise HookError(f"{hook.where}: must return a list of RolloutOutput, got {type(outputs).__name__}")
    bad = next((item for item in outputs if not isinstance(item, RolloutOutput)), None)
    if bad is not None:
        raise HookError(f"{hook.where}: must return a list of miles_core.request.RolloutOutput, got an item of type {type(bad).__name__}")
    if len(outputs) != request.num_outputs_per_prompt:
        raise HookError(f"{hook.where}: returned {len(outputs)} outputs for a request of {request.num_outputs_per_prompt}")
    for i, output in enumerate(outputs):
        if output.seed != request.seed + i:
            raise HookError(f"{hook.where}: output {i} has seed {output.seed}, expected {request.seed + i} (request seed + i)")
    return list(outputs)


def build_data_source(config: Any, records: list[PromptRecord] | None) -> DataSource | None:
    """``--data-source-path`` built as ``cls(config, records)``; else the built-in
    :class:`PromptSource` over ``records``; None when there are neither (a
    ``--rollout-function-path`` then finds its own prompts)."""
    hook = load_hook(DATA_SOURCE_FLAG, config.data_source_path, "data_source")
    if hook is not None:
        return hook.fn(config, records)
    if records is None:
        return None
    return PromptSource(records, batch_size=config.rollout_batch_size, seed=config.rollout_seed)


def prompt_batch(config: Any, data_source: DataSource, rollout_id: int) -> list[PromptRecord]:
    """``data_source.batch(rollout_id)``, checked: ``--rollout-batch-size`` PromptRecords
    (the seed layout numbers groups by their position in a batch of that size)."""
    prompts = data_source.batch(rollout_id)
    where = f"{DATA_SOURCE_FLAG} {config.data_source_path}" if config.data_source_path else type(data_source).__qualname__
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not all(isinstance(p, PromptRecord) for p in prompts):
        raise HookError(f"{where}: batch({rollout_id}) must return a list of miles_core.rollout.data.PromptRecord")
    if len(prompts) != config.rollout_batch_size:
        raise HookError(
            f"{where}: batch({rollout_id}) returned {len(prompts)} prompts, expected --rollout-batch-size {config.rollout_batch_size}"
        )
    return list(prompts)
