"""Short training runs on the tiny SD3 pipeline, shared by the run-level tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles_core.config.resolve import resolve_config
from miles_core.launch import train


def tiny_run_args(tiny_sd3: Path, prompts: Path, out: Path, *, batch: int = 2, n: int = 4, steps: int = 4, sde_steps: int = 2) -> list[str]:
    """A Flow-GRPO run at 32x32 on ``jpeg_incompressibility``, microgroups of 2."""
    return [
        "--hf-checkpoint",
        str(tiny_sd3),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        str(batch),
        "--n-samples-per-prompt",
        str(n),
        "--rollout-microgroup-size",
        "2",
        "--diffusion-num-steps",
        str(steps),
        "--diffusion-num-sde-steps",
        str(sde_steps),
        "--diffusion-height",
        "32",
        "--diffusion-width",
        "32",
        "--rm-type",
        "jpeg_incompressibility",
        "--output-dir",
        str(out),
    ]


def run_metrics(args: list[str], *, timeout: float | None = None) -> list[dict[str, Any]]:
    """Train with ``args``; the run's metrics.jsonl records."""
    config = resolve_config(args)
    path = asyncio.run(asyncio.wait_for(train(config, log=lambda line: None), timeout))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@contextmanager
def frozen_trainer_and_rollout(tiny_sd3: Path, *extra: str) -> Iterator[tuple[Any, Any, list[Any]]]:
    """An embedded engine on the tiny SD3 pipeline, a Flow-GRPO trainer sharing its
    modules (``--debug-skip-optimizer-step``: frozen weights; ``extra`` flags added) and
    one rollout of 2 samples of "a red cube": ``(engine, trainer, samples)``; the engine
    (and its thread) is closed on exit."""
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            "4",
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            "--debug-skip-optimizer-step",
            *extra,
        ]
    )
    engine = create_engine(config)
    host = get_host()
    trainer = Trainer(engine.family, config, host.registries.sde_backend.get("sde").load(), host.registries.loss.get("policy_loss").load())
    try:
        (group,) = asyncio.run(
            generate_rollout(engine, RolloutSettings.from_config(config), 0, [PromptRecord("a red cube")], strategy_from_config(config))
        )
        yield engine, trainer, group
    finally:
        asyncio.run(engine.close())
