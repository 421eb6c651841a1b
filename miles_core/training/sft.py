"""Supervised flow matching (``--loss-type sft_loss``) on image data.

Rows of ``--prompt-data`` carry an image path under ``--sft-image-key``; each optimizer
step draws, per sample, a step of the family's schedule (shift applied) and noise from a
generator seeded by ``(--seed, optimizer step)``, forms ``x_t = (1 - σ)·x0 + σ·ε`` and
regresses the velocity on ``ε − x0`` through the same family prediction the RL losses
use. No rollout engine is involved.

The schedule is the checkpoint scheduler's over ``--diffusion-num-steps`` steps, or, with
``--fsdp-flow-shift s``, that scheduler rebuilt with ``shift = s`` (``σ' = s·σ / (1 +
(s − 1)·σ)`` on its unshifted grid). ``--sft-encoder-checkpoint DIR`` takes the
tokenizers, text encoders and VAE from another pipeline directory than the transformer
(:func:`miles_core.model_loading.load_sft_family`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import PromptDataError
from miles_core.family import GenerationParams
from miles_core.request import FLOW_SHIFT, RolloutRequest
from miles_core.rollout.data import jsonl_rows
from miles_core.training.run_context import RunContext


@dataclass(frozen=True)
class SftRow:
    prompt: str
    image: Path


def load_sft_rows(path: str | Path, *, input_key: str, image_key: str) -> list[SftRow]:
    path = Path(path)
    rows = []
    for where, row in jsonl_rows(path):
        if not isinstance(row.get(input_key), str) or not isinstance(row.get(image_key), str):
            raise PromptDataError(f"{where}: SFT rows need a string {input_key!r} and a string {image_key!r} (an image path)")
        image = (path.parent / row[image_key]).resolve()
        if not image.is_file():
            raise PromptDataError(f"{where}: image {row[image_key]!r} not found (looked at {image})")
        rows.append(SftRow(row[input_key], image))
    if not rows:
        raise PromptDataError(f"{path}: no SFT rows")
    return rows


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """An RGB image as [3, height, width] in [0, 1]: resized to cover, then center-cropped."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        scale = max(height / image.height, width / image.width)
        resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))), Image.BICUBIC)
        left, top = (resized.width - width) // 2, (resized.height - height) // 2
        cropped = resized.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(cropped, dtype=np.float32) / 255.0).permute(2, 0, 1)


def sft_params(family: Any, config: Any) -> GenerationParams:
    """The generation parameters SFT draws its steps from; ``--fsdp-flow-shift`` (no
    engine supplies scheduler metadata here) travels as the request's ``flow_shift``."""
    return family.resolve_params(sft_request(config))


def sft_request(config: Any, prompt: str = "") -> RolloutRequest:
    """The request :func:`sft_params` resolves (``prompt`` as given): SFT encodes each
    row's prompt with these parameters and no negative prompt."""
    shift = config.fsdp_flow_shift
    return RolloutRequest(
        prompt=prompt,
        num_inference_steps=config.diffusion_num_steps,
        guidance_scale=1.0,
        height=config.diffusion_height,
        width=config.diffusion_width,
        extra_sampling_params={FLOW_SHIFT: shift} if shift is not None else {},
    )


def sft_batch(
    family: Any, rows: Sequence[SftRow], params: GenerationParams, generator: torch.Generator, cache: Any = None
) -> dict[str, Any]:
    """Everything one SFT micro-batch needs: x_t, timesteps, targets and conditioning.
    ``cache`` (a :class:`~miles_core.engine.sampler.ConditioningCache`) keeps prompt
    encodings across steps: the text encoders are frozen."""
    from miles_core.family import Conditioning

    schedule = family.schedule(params)
    with torch.no_grad():
        pixels = torch.stack([load_image(row.image, params.height, params.width) for row in rows])
        x0 = family.encode_pixels(pixels, params)
        encode = family.encode if cache is None else (lambda *args: cache.encode(family, *args))
        cond = Conditioning.cat([encode(row.prompt, None, params) for row in rows])
    steps = torch.randint(0, params.num_inference_steps, (len(rows),), generator=generator)
    sigma = schedule.sigmas.cpu()[steps]
    noise = {name: torch.randn(x.shape, generator=generator, dtype=torch.float32) for name, x in x0.items()}
    shape = (-1,) + (1,) * (next(iter(x0.values())).ndim - 1)
    x_t = {name: (1 - sigma.view(shape)) * x.float().cpu() + sigma.view(shape) * noise[name] for name, x in x0.items()}
    return {
        "x_t": {name: x.to(family.device, family.dtype) for name, x in x_t.items()},
        "sigma": sigma,
        "timestep": schedule.timesteps.cpu()[steps].to(family.device),
        "noise": {name: n.to(family.device) for name, n in noise.items()},
        "x0": {name: x.float() for name, x in x0.items()},
        "cond": cond,
    }


async def sft_rollouts(run: RunContext) -> AsyncIterator[tuple[dict[str, Any], tuple[()]]]:
    """The SFT loop: each "rollout" is ``--num-steps-per-rollout`` optimizer steps over
    ``rollout_batch_size x n_samples_per_prompt`` rows of ``run.rows``."""
    from miles_core.rollout.data import PromptSource
    from miles_core.training.metrics_logging import Progress

    config, trainer = run.config, run.trainer
    progress = run.progress or Progress(enabled=False)
    # Training ranks on Ray resolve the parameters from their family (the driver loads none).
    ranks_params = getattr(trainer, "sft_params", None)
    params = ranks_params() if callable(ranks_params) else sft_params(trainer.family, config)
    source = PromptSource(run.rows, batch_size=config.rollout_batch_size * config.n_samples_per_prompt, seed=config.rollout_seed)
    for rollout_id in range(run.start, run.total):
        began = time.perf_counter()
        metrics: dict[str, Any] = {"rollout_id": rollout_id}
        run.settled = None  # mid-step the trainer holds no rollout's end state: nothing to checkpoint
        with progress.training(trainer, f"train {rollout_id + 1}/{run.total}", "step"):
            metrics.update(trainer.train_sft(source.batch(rollout_id), params, run.schedule.lr_at))
        run.settled = rollout_id
        metrics["perf/train_time"] = metrics["perf/step_time"] = time.perf_counter() - began
        yield metrics, ()
