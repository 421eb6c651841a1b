"""Evaluation during a run: fixed prompts, fixed seeds, deterministic sampling.

Every evaluation of a run samples the same prompts with the same seeds through the
engine in evaluation mode (``rollout: false``: ODE steps, pixels only), so two
evaluations differ only by the policy: the gain over the first evaluation is a paired
comparison (``eval/<name>/paired_gain``), far less noisy than comparing rollout means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.engine.request import RolloutRequest
from miles_core.rollout.data import PromptRecord, load_prompts
from miles_core.rollout.sample import Sample

EVAL_SEED_OFFSET = 2**30
"""Eval seeds start here (mod 2**31), away from the first training groups' seeds."""


@dataclass
class EvalResult:
    rewards: dict[str, torch.Tensor]
    images: dict[str, list[torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


class Evaluator:
    def __init__(self, config: Any, engine: Any, scorer: Any) -> None:
        self.config = config
        self.engine = engine
        self.scorer = scorer
        pairs = list(config.eval_prompt_data or [])
        key = config.eval_input_key or config.input_key
        self.datasets: dict[str, list[PromptRecord]] = {
            pairs[i]: load_prompts(pairs[i + 1], input_key=key, metadata_key=config.metadata_key)
            for i in range(0, len(pairs), 2)
        }
        self.first: EvalResult | None = None

    def requests(self, records: list[PromptRecord]) -> list[RolloutRequest]:
        config = self.config
        n = config.n_samples_per_eval_prompt
        frames = config.diffusion_output_num_frames
        extra = {"guidance_scale_2": config.diffusion_guidance_scale_2} if config.diffusion_guidance_scale_2 else {}
        return [
            RolloutRequest(
                prompt=record.prompt, negative_prompt=config.diffusion_negative_prompt,
                seed=(config.rollout_seed + EVAL_SEED_OFFSET + j * n) % 2**31, num_outputs_per_prompt=n,
                num_inference_steps=config.diffusion_eval_num_steps or config.diffusion_num_steps,
                guidance_scale=config.diffusion_guidance_scale, true_cfg_scale=config.diffusion_true_cfg_scale,
                height=config.diffusion_height, width=config.diffusion_width,
                num_frames=frames if frames and frames > 1 else None, fps=config.diffusion_fps,
                rollout=False, extra_sampling_params=extra,
            )
            for j, record in enumerate(records)
        ]

    async def evaluate(self) -> EvalResult:
        import asyncio

        result = EvalResult({}, {})
        for name, records in self.datasets.items():
            outputs = await asyncio.gather(*(self.engine.generate(r) for r in self.requests(records)))
            samples = [
                Sample(prompt=record.prompt, metadata=dict(record.metadata), rollout_id=-1, group_index=j,
                       index_in_group=i, seed=output.seed, sde_step_indices=(), output=output)
                for j, (record, group) in enumerate(zip(records, outputs))
                for i, output in enumerate(group)
            ]
            rewards = await self.scorer.score(samples)
            result.rewards[name] = rewards
            result.images[name] = [s.pixels for s in samples]
            result.metrics[f"eval/{name}/reward_mean"] = float(rewards.mean())
            result.metrics[f"eval/{name}/reward_std"] = float(rewards.std(unbiased=False))
            if self.first is not None:
                gain = rewards - self.first.rewards[name]
                result.metrics[f"eval/{name}/paired_gain"] = float(gain.mean())
                result.metrics[f"eval/{name}/paired_gain_std"] = float(gain.std(unbiased=False))
        if self.first is None:
            self.first = result
        return result


def save_grid(images: list[torch.Tensor], path: Path, columns: int) -> Path:
    """Images [C, H, W] (videos: their first frame) in [0, 1] as one PNG grid."""
    from PIL import Image

    frames = [img[:, 0] if img.ndim == 4 else img for img in images]
    height, width = frames[0].shape[-2:]
    rows = (len(frames) + columns - 1) // columns
    grid = Image.new("RGB", (columns * width, rows * height))
    for i, frame in enumerate(frames):
        array = (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        if array.shape[-1] == 1:
            array = array.repeat(3, axis=-1)
        grid.paste(Image.fromarray(array), ((i % columns) * width, (i // columns) * height))
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
