"""A short training run on the tiny SD3 pipeline, shared by the run-level tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from miles_core.api import resolve_config, train


def tiny_run(tiny_sd3: Path, prompts: Path, out: Path, *extra: str) -> tuple[Any, list[dict[str, Any]]]:
    """A Flow-GRPO LoRA run at 32x32 with 4 steps, one group of 2 on ``brightness``
    (``extra`` flags added): the resolved configuration and the run's metrics records."""
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            "4",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            "--rm-type",
            "brightness",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            "1e-3",
            "--output-dir",
            str(out),
            *extra,
        ]
    )
    path = asyncio.run(train(config, log=lambda line: None))
    return config, [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
