"""The built-in evaluation's sampling: fixed prompts, fixed seeds, deterministic (ODE)
sampling, pixels only; scoring and paired gains are the trainer side's
(:mod:`miles_core.training.evaluation`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from miles_core.request import RolloutRequest
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.requests import Generate, engine_generate, extra_sampling_params
from miles_core.rollout.sample import Sample

EVAL_SEED_OFFSET = 2**30
"""Eval seeds start here (mod 2**31), away from the first training groups' seeds."""


class EvalPrompts:
    """One eval set as a data source: :meth:`batch` gives all its prompts, every time;
    :attr:`dataset` holds its own settings (an
    :class:`~miles_core.config.eval_config.EvalDataset`: samples per prompt, steps, keys);
    None (a source built by hand) means the flags'."""

    def __init__(self, name: str, records: Sequence[PromptRecord], dataset: Any = None) -> None:
        self.name = name
        self.records = list(records)
        self.dataset = dataset

    def batch(self, rollout_id: int) -> list[PromptRecord]:
        return list(self.records)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def eval_requests(config: Any, records: Sequence[PromptRecord], dataset: Any = None) -> list[RolloutRequest]:
    """One request per prompt: the set's ``n_samples_per_eval_prompt`` outputs and steps
    (``dataset``, an :class:`~miles_core.config.eval_config.EvalDataset`; None: the flags'
    set, :func:`~miles_core.config.eval_config.flag_dataset`), seeds fixed for the run
    (prompt ``j`` of every eval set gets the same seeds), ODE sampling."""
    from miles_core.config.eval_config import flag_dataset

    dataset = dataset if dataset is not None else flag_dataset(config)
    n, steps = dataset.n_samples_per_eval_prompt, dataset.num_steps
    frames = config.diffusion_output_num_frames
    return [
        RolloutRequest(
            prompt=record.prompt,
            negative_prompt=config.diffusion_negative_prompt,
            seed=(config.rollout_seed + EVAL_SEED_OFFSET + j * n) % 2**31,
            num_outputs_per_prompt=n,
            num_inference_steps=steps,
            guidance_scale=config.diffusion_guidance_scale,
            true_cfg_scale=config.diffusion_true_cfg_scale,
            height=config.diffusion_height,
            width=config.diffusion_width,
            num_frames=frames if frames and frames > 1 else None,
            fps=config.diffusion_fps,
            rollout=False,
            extra_sampling_params=extra_sampling_params(config),
            image_path=None if record.image is None else (record.image,),
            generator_device=config.diffusion_generator_device,
        )
        for j, record in enumerate(records)
    ]


async def eval_samples(
    config: Any, engine: Any, records: Sequence[PromptRecord], generate: Generate = engine_generate, dataset: Any = None
) -> list[Sample]:
    """The built-in evaluation's samples of one eval set (``dataset``: its settings, see
    :func:`eval_requests`), prompt after prompt."""

    outputs = await asyncio.gather(*(generate(engine, r) for r in eval_requests(config, records, dataset)))
    return [
        Sample(
            prompt=record.prompt,
            metadata=dict(record.metadata),
            rollout_id=-1,
            group_index=j,
            index_in_group=i,
            seed=output.seed,
            sde_step_indices=(),
            output=output,
            image=record.image,
        )
        for j, (record, group) in enumerate(zip(records, outputs))
        for i, output in enumerate(group)
    ]
