"""The run loop behind ``miles-core train``: rollout, reward, advantages, optimizer
steps, weight sync, metrics; one record per rollout in ``metrics.jsonl``."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

from miles_core.config.model import Config


class RunError(RuntimeError):
    """A run that cannot start or go on; the message names the cause."""


def output_directory(config: Config) -> Path:
    path = Path(config.output_dir) if config.output_dir else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if (path / "metrics.jsonl").exists():
        raise RunError(f"--output-dir {path}: already holds a run (metrics.jsonl); choose another directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def number_of_rollouts(config: Config, num_prompts: int) -> int:
    if config.num_rollout is not None:
        return config.num_rollout
    if config.num_epoch is not None:
        return math.ceil(config.num_epoch * num_prompts / config.rollout_batch_size)
    raise RunError("set --num-rollout (rollouts to run) or --num-epoch (passes over --prompt-data)")


async def train(config: Config, *, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Path:
    """Run the training loop; return the run directory."""
    from miles_core.cli.config_command import config_document
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.refs import resolve_path_flag
    from miles_core.rollout.data import PromptSource, load_prompts
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.advantages import advantages_from_config
    from miles_core.training.lr_schedule import from_config as lr_schedule_from_config
    from miles_core.training.rewards import RewardScorer
    from miles_core.training.trainer import Trainer

    if not config.prompt_data:
        raise RunError("--prompt-data is required: a JSONL file with one prompt per line")
    records = load_prompts(config.prompt_data, input_key=config.input_key, metadata_key=config.metadata_key)
    total_rollouts = number_of_rollouts(config, len(records))
    out = output_directory(config)
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump(config_document(config), sort_keys=False), encoding="utf-8")
    torch.manual_seed(config.seed)
    if config.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    engine = create_engine(config)
    if not isinstance(engine, EmbeddedEngine):
        raise RunError(
            f"--rollout-engine {config.rollout_engine}: training with a remote engine needs weight sync over HTTP, "
            "which the run loop does not do yet; use --rollout-engine embedded"
        )
    host = get_host()
    if config.sde_step_backend_path:
        backend_cls = resolve_path_flag("--sde-step-backend-path", config.sde_step_backend_path, "sde_backend")
    else:
        backend_cls = host.registries.sde_backend.get(config.diffusion_sde_type).load()
    loss_fn = host.registries.loss.get(config.loss_type).load()
    trainer = Trainer(engine.family, config, backend_cls, loss_fn)  # shares the engine's modules
    schedule = lr_schedule_from_config(config, total_rollouts * config.num_steps_per_rollout)
    scorer = RewardScorer(config)
    settings = RolloutSettings.from_config(config)
    strategy = strategy_from_config(config)
    source = PromptSource(records, batch_size=config.rollout_batch_size, seed=config.rollout_seed)
    start = config.start_rollout_id or 0
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as metrics_file:
        for rollout_id in range(start, total_rollouts):
            began = time.perf_counter()
            groups = await generate_rollout(
                engine, settings, rollout_id, source.batch(rollout_id), strategy, epoch=source.epoch_of(rollout_id)
            )
            samples = [sample for group in groups for sample in group]
            generated = time.perf_counter()
            rewards = await scorer.score(samples)
            advantages = advantages_from_config(rewards, config, samples)
            scored = time.perf_counter()
            metrics: dict[str, Any] = {"rollout_id": rollout_id}
            if not config.debug_rollout_only:
                metrics.update(trainer.train_rollout(samples, advantages, schedule.lr_at))
            trained = time.perf_counter()
            fallbacks = sum(s.output.log_prob_fallbacks for s in samples)
            metrics.update({
                "rollout/reward/raw_mean": float(rewards.mean()),
                "rollout/reward/raw_std": float(rewards.std(unbiased=False)),
                "rollout/reward/raw_min": float(rewards.min()),
                "rollout/reward/raw_max": float(rewards.max()),
                "rollout/advantages/abs_mean": float(advantages.abs().mean()),
                "rollout/num_samples": len(samples),
                "rollout/log_prob_fallbacks": fallbacks,
                "perf/rollout_time": generated - began,
                "perf/reward_time": scored - generated,
                "perf/train_time": trained - scored,
                "perf/step_time": trained - began,
            })
            metrics_file.write(json.dumps(metrics) + "\n")
            metrics_file.flush()
            summary = f"rollout {rollout_id + 1}/{total_rollouts}  reward {metrics['rollout/reward/raw_mean']:+.4f}"
            if "train/loss" in metrics:
                summary += f"  loss {metrics['train/loss']:+.4e}  clipfrac {metrics.get('train/clipfrac', 0.0):.3f}"
            log(summary + f"  {metrics['perf/step_time']:.2f}s")
    return out


def run_sync(config: Config) -> Path:
    return asyncio.run(train(config))
