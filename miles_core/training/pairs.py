"""From rollout samples to train pairs and micro-batches.

A train pair is one (sample, SDE step k) transition: the latents before and after the
step, the step's sigmas and timestep, the engine's log-probability (the "old" policy),
the sample's advantage and its conditioning. Pairs are cut into micro-batches (one
transformer forward each): a flat ``--micro-batch-size`` of consecutive pairs, or the 2-D
``--micro-batch-size-sample x --micro-batch-size-tstep`` tile. A tile of M samples x 1
step reproduces an engine microgroup's batch exactly, which is what makes the trainer's
recomputed log-probs bit-identical to the engine's (the alignment probe).

Each pair records the trainable component that denoises it
(:meth:`~miles_core.family.ModelFamily.denoiser_for`: Wan 2.2's high-noise
``transformer`` or low-noise ``transformer_2``), and a micro-batch never mixes two: a
flat cut starts a new micro-batch, a tile is split by denoiser, order kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_core.family import Conditioning, GenerationParams
from miles_core.rollout.sample import Sample

if TYPE_CHECKING:
    from miles_core.family import ModelFamily


@dataclass
class TrainPair:
    sample_index: int
    """Position of the sample in the rollout (group-major, seed order)."""
    step: int
    x: dict[str, torch.Tensor]
    """Latent streams before the step, no batch dimension."""
    x_next: dict[str, torch.Tensor]
    timestep: torch.Tensor
    sigma: float
    sigma_next: float
    sigma_max: float
    old_log_prob: float
    advantage: float
    cond: Conditioning
    """Batch 1."""
    params: GenerationParams
    engine_velocity: torch.Tensor | None = None
    """The engine's model output at this step (debug mode), for the drift metrics."""
    loss_mask: float = 1.0
    """0 for samples a per-sample filter removed (they still counted for advantages)."""
    denoiser: str | None = None
    """The trainable component that predicts at this step (``family.denoiser_for``);
    None until the trainer fills it in (a custom expansion may leave it unset)."""


def conditioning_from_env(env: dict[str, Any]) -> Conditioning:
    def batch1(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        return None if tensors is None else {k: v.unsqueeze(0) for k, v in tensors.items()}

    return Conditioning(batch1(env["pos_cond_kwargs"]), batch1(env["neg_cond_kwargs"]))  # type: ignore[arg-type]


def params_from_env(env: dict[str, Any], num_steps: int) -> GenerationParams:
    image = env["image_kwargs"]
    guidance = dict(env["guidance"])
    scale = float(guidance.pop("guidance_scale"))
    true_cfg = guidance.pop("true_cfg_scale", None)
    return GenerationParams(
        height=int(image["height"]),
        width=int(image["width"]),
        num_inference_steps=num_steps,
        guidance_scale=scale,
        num_frames=image.get("num_frames"),
        fps=image.get("fps"),
        true_cfg_scale=true_cfg,
        extra=guidance,
    )


def build_pairs(config: Any, samples: Sequence[Sample], advantages: torch.Tensor, family: ModelFamily) -> list[TrainPair]:
    """One pair per (sample, SDE step), sample-major, steps ascending, each carrying its
    sample's advantage and its step's denoiser. The signature of
    ``--custom-expand-samples-to-train-pairs-path``, which replaces it (``config`` is
    unused here)."""
    streams = family.latent_streams
    pairs: list[TrainPair] = []
    for index, (sample, advantage) in enumerate(zip(samples, advantages.tolist())):
        output = sample.output
        trajectory = output.dit_trajectory
        env = output.denoising_env
        if trajectory is None or env is None or output.rollout_log_probs is None:
            raise ValueError(f"sample {index} (seed {sample.seed}) has no trajectory, conditioning or log-probs to train on")
        positions = {int(step): row for row, step in enumerate(trajectory["step_indices"].tolist())}
        sigmas = trajectory["sigmas"]
        timesteps = trajectory["timesteps"]
        num_steps = int(timesteps.shape[0])
        cond = conditioning_from_env(env)
        params = params_from_env(env, num_steps)
        debug = output.rollout_debug_tensors
        for k in sample.sde_step_indices:
            if k not in positions or k + 1 not in positions:
                raise ValueError(f"sample {index}: the trajectory lacks latents {k} and {k + 1} of SDE step {k}")
            pairs.append(
                TrainPair(
                    sample_index=index,
                    step=int(k),
                    x={name: trajectory[name][positions[k]] for name in streams},
                    x_next={name: trajectory[name][positions[k + 1]] for name in streams},
                    timestep=timesteps[k],
                    sigma=float(sigmas[k]),
                    sigma_next=float(sigmas[k + 1]),
                    sigma_max=float(sigmas[1]) if num_steps > 1 else float(sigmas[0]),
                    old_log_prob=float(output.rollout_log_probs[k]),
                    advantage=float(advantage),
                    cond=cond,
                    params=params,
                    engine_velocity=None if debug is None else debug["rollout_model_outputs"][k],
                    loss_mask=0.0 if sample.remove_sample else 1.0,
                    denoiser=family.denoiser_for(timesteps[k], params),
                )
            )
    return pairs


def micro_batches(pairs: Sequence[TrainPair], config: Any) -> list[list[TrainPair]]:
    """Cut one optimizer step's pairs into micro-batches, never mixing pairs whose
    denoiser, generation parameters, latent shapes or conditioning tensors' names and
    shapes differ (they cannot share a forward)."""
    if config.micro_batch_size_sample is not None:
        return _tiles(pairs, config.micro_batch_size_sample, config.micro_batch_size_tstep, config.diffusion_train_iter_order)
    size = config.micro_batch_size
    batches: list[list[TrainPair]] = []
    for pair in pairs:
        if batches and len(batches[-1]) < size and _compatible(batches[-1][0], pair):
            batches[-1].append(pair)
        else:
            batches.append([pair])
    return batches


def _compatible(a: TrainPair, b: TrainPair) -> bool:
    """Whether two pairs can share one forward: the same denoiser and parameters, and
    latents and conditioning of the same names and shapes (a text-only pair and an
    image-conditioned one of an image-to-video family never share a micro-batch)."""
    return a.denoiser == b.denoiser and a.params == b.params and shares_forward(a.x, a.cond, b.x, b.cond)


def shares_forward(
    x_a: dict[str, torch.Tensor], cond_a: Conditioning | None, x_b: dict[str, torch.Tensor], cond_b: Conditioning | None
) -> bool:
    """Whether two rows' latents and conditionings have the same tensor names and shapes,
    so that they stack into one batch (the shape part of every micro-batch rule: GRPO's
    pairs here, DiffusionNFT's items in the trainer)."""
    return (
        _same_shapes(x_a, x_b)
        and _same_shapes(_cond(cond_a, "positive"), _cond(cond_b, "positive"))
        and _same_shapes(_cond(cond_a, "negative"), _cond(cond_b, "negative"))
    )


def _cond(cond: Conditioning | None, side: str) -> dict[str, torch.Tensor] | None:
    # A custom expansion may leave the conditioning unset.
    return None if cond is None else getattr(cond, side)


def _same_shapes(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(a[name].shape == b[name].shape for name in a)


def _tiles(pairs: Sequence[TrainPair], per_sample: int, per_step: int, order: str) -> list[list[TrainPair]]:
    samples = sorted({p.sample_index for p in pairs})
    steps = sorted({p.step for p in pairs})
    index = {(p.sample_index, p.step): p for p in pairs}
    sample_blocks = [samples[i : i + per_sample] for i in range(0, len(samples), per_sample)]
    step_blocks = [steps[i : i + per_step] for i in range(0, len(steps), per_step)]
    blocks = (
        [(s, t) for s in sample_blocks for t in step_blocks]
        if order == "sample_major"
        else [(s, t) for t in step_blocks for s in sample_blocks]
    )
    tiles = []
    for sample_block, step_block in blocks:
        # Rows step by step, samples in seed order within a step: a one-step tile lists
        # its samples in the order the engine batched them.
        tile = [index[(s, k)] for k in step_block for s in sample_block if (s, k) in index]
        tiles.extend(_split(tile))
    return tiles


def _split(tile: list[TrainPair]) -> list[list[TrainPair]]:
    """A tile as one micro-batch per compatible set (one per denoiser, for a tile
    across an expert boundary), in order of first appearance, rows in tile order."""
    parts: list[list[TrainPair]] = []
    for pair in tile:
        part = next((p for p in parts if _compatible(p[0], pair)), None)
        if part is None:
            parts.append([pair])
        else:
            part.append(pair)
    return parts


def collate(batch: Sequence[TrainPair]) -> dict[str, Any]:
    """Stack a micro-batch into the tensors the forward and the loss take."""
    names = list(batch[0].x)
    return {
        "x": {name: torch.stack([p.x[name] for p in batch]) for name in names},
        "x_next": {name: torch.stack([p.x_next[name] for p in batch]) for name in names},
        "timestep": torch.stack([p.timestep for p in batch]),
        "sigma": torch.tensor([p.sigma for p in batch], dtype=torch.float32),
        "sigma_next": torch.tensor([p.sigma_next for p in batch], dtype=torch.float32),
        "sigma_max": batch[0].sigma_max,
        "old_log_prob": torch.tensor([p.old_log_prob for p in batch], dtype=torch.float32),
        "advantages": torch.tensor([p.advantage for p in batch], dtype=torch.float32),
        "loss_mask": torch.tensor([p.loss_mask for p in batch], dtype=torch.float32),
        "cond": Conditioning.cat([p.cond for p in batch]),
        "params": batch[0].params,
        "engine_velocity": (torch.stack([p.engine_velocity for p in batch]) if all(p.engine_velocity is not None for p in batch) else None),
    }


def on_device(data: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A collated micro-batch with its tensors on the model's device (the engine's
    records come back on the CPU)."""

    def move(value: Any) -> Any:
        if torch.is_tensor(value):
            return value.to(device)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    moved = {key: move(value) for key, value in data.items() if key not in ("cond", "params")}
    cond = data["cond"]
    moved["cond"] = Conditioning(move(cond.positive), move(cond.negative))
    moved["params"] = data["params"]
    return moved
