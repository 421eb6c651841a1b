"""Short training runs on the tiny SD3 pipeline, shared by the run-level tests."""

from __future__ import annotations

import asyncio
import json
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
