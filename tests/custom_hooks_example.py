"""Run hooks for tests/test_custom_hooks.py, written as a user would (docs/customization.md).

Each records what it was called with in a module-level list that the tests clear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.generate import (
    RolloutSettings,
    diffusion_rollout,
    generate_rollout,
    strategy_from_config,
)
from miles_core.rollout.sample import Sample
from miles_core.rollout.seeds import group_index, microgroups
from miles_core.step_strategies import select_steps
from miles_sd3.family import SD3Family

CALLS: list[tuple[Any, ...]] = []
OWN_SEED = 777_000

# -- --rollout-function-path / --eval-function-path -------------------------------------------


async def own_seed_rollout(config: Any, rollout_id: int, engine: Any, data_source: Any, *, evaluation: bool = False) -> list[Sample]:
    """The built-in rollout with its own seed stream (``OWN_SEED`` for ``--rollout-seed``)."""
    CALLS.append(("rollout", rollout_id, evaluation, type(data_source).__name__))
    if evaluation:
        return await diffusion_rollout(config, rollout_id, engine, data_source, evaluation=True)
    settings = dataclasses.replace(RolloutSettings.from_config(config), rollout_seed=OWN_SEED)
    groups = await generate_rollout(engine, settings, rollout_id, data_source.batch(rollout_id), strategy_from_config(config))
    return [sample for group in groups for sample in group]


def own_prompts_rollout(config: Any, rollout_id: int, engine: Any, data_source: Any) -> list[Sample]:
    """A sync rollout that makes up its own prompts (``--disable-rollout-global-dataset``)
    and builds its samples itself, with the embedded engine's blocking ``generate_sync``."""
    CALLS.append(("own prompts", rollout_id, data_source))
    settings, strategy = RolloutSettings.from_config(config), strategy_from_config(config)
    samples = []
    for position in range(config.rollout_batch_size):
        prompt = f"own prompt {rollout_id}.{position}"
        group = group_index(rollout_id, position, config.rollout_batch_size)
        for mg in microgroups(config.rollout_seed, group, config.n_samples_per_prompt, config.rollout_microgroup_size):
            steps = select_steps(settings, seed=mg.seed, epoch=0, strategy=strategy)
            outputs = engine.generate_sync(settings.request(prompt, mg, steps.sde_steps, steps.return_steps))
            samples += [
                Sample(
                    prompt=prompt,
                    metadata={},
                    rollout_id=rollout_id,
                    group_index=group,
                    index_in_group=mg.offset + i,
                    seed=output.seed,
                    sde_step_indices=steps.sde_steps,
                    output=output,
                )
                for i, output in enumerate(outputs)
            ]
    return samples


async def black_eval(config: Any, rollout_id: int, engine: Any, data_source: Any, *, evaluation: bool) -> list[Sample]:
    """The built-in evaluation with every image blacked out: all rewards equal."""
    CALLS.append(("eval", rollout_id, evaluation, data_source.name))
    samples = await diffusion_rollout(config, rollout_id, engine, data_source, evaluation=True)
    for sample in samples:
        sample.output.generated_output = torch.zeros_like(sample.output.generated_output)
    return samples


def returns_a_dict(config: Any, rollout_id: int, engine: Any, data_source: Any) -> dict[str, Any]:
    return {"samples": []}


async def drops_a_sample(config: Any, rollout_id: int, engine: Any, data_source: Any) -> list[Sample]:
    return (await diffusion_rollout(config, rollout_id, engine, data_source))[:-1]


def two_arguments(config: Any, rollout_id: int) -> list[Sample]:
    return []


# -- --custom-generate-function-path ------------------------------------------------------------


async def recording_generate(engine: Any, request: RolloutRequest) -> list[RolloutOutput]:
    CALLS.append(("generate", request.prompt, request.seed, request.num_outputs_per_prompt, request.rollout))
    return await engine.generate(request)


async def drops_an_output(engine: Any, request: RolloutRequest) -> list[RolloutOutput]:
    return (await engine.generate(request))[:-1]


# -- --data-source-path -------------------------------------------------------------------------


class CursorSource:
    """Prompts in order from a cursor that only its state remembers: a resumed run that
    did not restore the state would start again at the first prompt."""

    def __init__(self, config: Any, records: list[PromptRecord] | None) -> None:
        self.prompts = [r.prompt for r in records] if records else ["a cat", "a dog", "a fox"]
        self.batch_size = config.rollout_batch_size
        self.cursor = 0

    def batch(self, rollout_id: int) -> list[PromptRecord]:
        out = [PromptRecord(self.prompts[(self.cursor + i) % len(self.prompts)]) for i in range(self.batch_size)]
        self.cursor += self.batch_size
        CALLS.append(("batch", rollout_id, [r.prompt for r in out]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class StringSource(CursorSource):
    def batch(self, rollout_id: int) -> list[str]:  # type: ignore[override]
        return [r.prompt for r in super().batch(rollout_id)]


# -- --custom-rollout-log-function-path / --custom-eval-rollout-log-function-path ---------------


def skip_first_rollout_log(rollout_id: int, config: Any, samples: list[Sample], metrics: dict[str, Any]) -> bool:
    """Takes over rollout 0's logging; adds a metric to the others'."""
    CALLS.append(("log", rollout_id, [s.prompt for s in samples], [s.reward for s in samples], dict(metrics)))
    if rollout_id == 0:
        return True
    metrics["rollout/reward_x2"] = 2 * metrics["rollout/reward/raw_mean"]
    return False


async def skip_eval_log(rollout_id: int, config: Any, samples: dict[str, list[Sample]], metrics: dict[str, Any]) -> bool:
    CALLS.append(("eval log", rollout_id, {name: len(group) for name, group in samples.items()}, dict(metrics)))
    return True


def record_log(rollout_id: int, config: Any, samples: list[Sample], metrics: dict[str, Any]) -> None:
    CALLS.append(("log", rollout_id, [s.prompt for s in samples]))


def says_yes(rollout_id: int, config: Any, samples: list[Sample], metrics: dict[str, Any]) -> str:
    return "yes"


# -- --model-backend-path -----------------------------------------------------------------------


class CountingSD3(SD3Family):
    """Counts predictions with and without autograd: the embedded engine samples under
    no_grad, the trainer's policy forward runs with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.predictions = {"sampling": 0, "training": 0}

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self.predictions["training" if torch.is_grad_enabled() else "sampling"] += 1
        return super().predict(*args, **kwargs)


def counting_backend(config: Any) -> CountingSD3:
    family = CountingSD3.from_pretrained(config.hf_checkpoint, device="cpu", dtype=torch.float32)
    CALLS.append(("backend", family))
    return family


def pipeline_backend(config: Any) -> Any:
    return SD3Family.load_pipeline(config.hf_checkpoint)


# -- --train-pipeline-config-path -----------------------------------------------------------


class MirroredSD3(SD3Family):
    """SD3 whose decoded images are mirrored left to right: a family class of one's own
    that derives from the registered sd3 family (so its recipe defaults apply)."""

    def decode(self, latents: Any, params: Any) -> torch.Tensor:
        return super().decode(latents, params).flip(-1)


class NotAFamilyOfOurs:
    """Not a ModelFamily: refused by the path check."""


async def flag_count_eval(config: Any, rollout_id: int, engine: Any, data_source: Any, *, evaluation: bool) -> list[Sample]:
    """Samples made by hand, ``--n-samples-per-eval-prompt`` per prompt whatever the set's own count."""
    n = config.n_samples_per_eval_prompt
    rows = data_source.batch(rollout_id)
    return [
        Sample(
            prompt=r.prompt, metadata={}, rollout_id=rollout_id, group_index=j, index_in_group=i, seed=i, sde_step_indices=(), output=None
        )
        for j, r in enumerate(rows)
        for i in range(n)
    ]
