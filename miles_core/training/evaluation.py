"""Evaluation during a run: fixed prompts, fixed seeds, deterministic sampling.

Every evaluation of a run samples the same prompts with the same seeds through the
engine in evaluation mode (``rollout: false``: ODE steps, pixels only), so two
evaluations differ only by the policy: the gain over the first evaluation is a paired
comparison (``eval/<name>/paired_gain``), far less noisy than comparing rollout means.

``--eval-function-path`` (else ``--rollout-function-path``) replaces the sampling of each
eval set: it is called with ``evaluation=True`` and an :class:`EvalPrompts` source, and
its samples are scored and compared like the built-in ones.

Evaluations are scored by their own :class:`~miles_core.training.rewards.RewardScorer`
(``evaluation=True``, built with the :class:`Evaluator`, when the run starts):
``--eval-rm-type`` or ``--eval-reward-weights`` when set (a held-out reward watches for
reward hacking; it scores every sample, whatever a row's ``metadata.rm_type``), else the
training reward, with ``--eval-reward-key``
(default ``--reward-key``) picking the scalar of a dict reward. Each eval set reports
``eval/<name>/reward_mean`` and ``reward_std`` over its samples whose reward did not fail,
``eval/<name>/reward/<component>_mean`` per reward component, ``eval/<name>/reward/failed``
and the paired gain over the samples valid in both evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.request import RolloutRequest
from miles_core.rollout.data import PromptRecord, load_prompts
from miles_core.rollout.evaluation import EvalPrompts, eval_requests
from miles_core.rollout.generate import diffusion_rollout
from miles_core.rollout.hooks import check_samples, eval_hook
from miles_core.rollout.sample import Sample


@dataclass
class EvalResult:
    rewards: dict[str, torch.Tensor]
    images: dict[str, list[torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    """Each eval set's scored samples (what ``--custom-eval-rollout-log-function-path`` gets)."""


class Evaluator:
    def __init__(self, config: Any, engine: Any, scorer: Any = None) -> None:
        """``scorer``: an evaluation scorer (``RewardScorer(config, evaluation=True)``) to
        use, or the run's training scorer, whose built reward models the evaluation scorer
        then shares. The evaluation scorer is built here, when the run starts, so an eval
        reward that cannot be built (missing weights) stops the run before its first
        rollout, not at its first evaluation."""
        from miles_core.training.rewards import RewardScorer

        self.config = config
        self.engine = engine
        self.training_scorer = None if getattr(scorer, "evaluation", True) else scorer
        self.scorer = scorer if self.training_scorer is None else None
        if self.scorer is None:
            # A reward on a Ray worker (--use-ray) evaluates there too, with the same models.
            sibling = getattr(self.training_scorer, "evaluation_scorer", None)
            self.scorer = sibling() if sibling is not None else RewardScorer(config, evaluation=True, share=self.training_scorer)
        pairs = list(config.eval_prompt_data or [])
        key = config.eval_input_key or config.input_key
        self.datasets: dict[str, list[PromptRecord]] = {
            pairs[i]: load_prompts(pairs[i + 1], input_key=key, metadata_key=config.metadata_key) for i in range(0, len(pairs), 2)
        }
        self.first: EvalResult | None = None
        self.hook = eval_hook(config)  # None: the built-in evaluation

    def requests(self, records: list[PromptRecord]) -> list[RolloutRequest]:
        return eval_requests(self.config, records)

    async def sample(self, name: str, records: list[PromptRecord], rollout_id: int) -> list[Sample]:
        """One eval set's samples: the built-in evaluation, or the eval rollout function's
        (checked: ``--n-samples-per-eval-prompt`` samples per prompt, in prompt order, so
        paired gains compare the same prompt and seed)."""
        config, source = self.config, EvalPrompts(name, records)
        if self.hook is None:
            return await diffusion_rollout(config, rollout_id, self.engine, source, evaluation=True)
        n = config.n_samples_per_eval_prompt
        samples = await self.hook(config, rollout_id, self.engine, source, evaluation=True)
        return check_samples(self.hook, samples, n, size_flag="--n-samples-per-eval-prompt", expected=len(records) * n)

    async def evaluate(self, rollout_id: int = -1) -> EvalResult:
        """Sample and score every eval set; ``rollout_id`` is the rollout whose record
        the result goes into (passed on to an eval rollout function)."""
        result = EvalResult({}, {})
        scorer = self.scorer
        for name, records in self.datasets.items():
            samples = await self.sample(name, records, rollout_id)
            rewards = await scorer.score(samples)
            result.samples[name] = samples
            result.rewards[name] = rewards
            result.images[name] = [s.pixels for s in samples]
            # RewardError when every sample failed; rewards of failed samples are NaN.
            reward = scorer.finish(samples, prefix=f"eval/{name}/reward/")
            result.metrics[f"eval/{name}/reward_mean"] = reward.pop(f"eval/{name}/reward/raw_mean")
            result.metrics[f"eval/{name}/reward_std"] = reward.pop(f"eval/{name}/reward/raw_std")
            for stat in ("raw_min", "raw_max"):
                reward.pop(f"eval/{name}/reward/{stat}")
            result.metrics.update(reward)
            if self.first is not None:
                gain = rewards - self.first.rewards[name]
                gain = gain[torch.isfinite(gain)]  # the samples whose reward did not fail, now and then
                if gain.numel():
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
