"""Entry-point module of miles-rewards: records only, no model code imported here."""

from __future__ import annotations

from typing import Any

from miles_core import Flag, RewardSpec, hookimpl


@hookimpl
def miles_register_rewards() -> list[RewardSpec]:
    return [
        RewardSpec(
            name="jpeg_compressibility",
            ref="miles_rewards.jpeg:JpegCompressibility",
            description="-(JPEG size in kB at quality 95): rewards images that compress well",
        ),
        RewardSpec(
            name="jpeg_incompressibility",
            ref="miles_rewards.jpeg:JpegIncompressibility",
            description="JPEG size in kB at quality 95: rewards detailed, hard-to-compress images",
        ),
        RewardSpec(
            name="brightness",
            ref="miles_rewards.diagnostic:Brightness",
            description="mean pixel value in [0, 1]: weight-free diagnostic for smoke tests, not a quality measure",
        ),
        RewardSpec(
            name="redness",
            ref="miles_rewards.diagnostic:Redness",
            description="mean(R - (G+B)/2) in [-1, 1]: weight-free diagnostic for smoke tests, not a quality measure",
        ),
        RewardSpec(
            name="colorfulness",
            ref="miles_rewards.diagnostic:Colorfulness",
            description="Hasler-Suesstrunk colourfulness on [0, 1] pixels: weight-free diagnostic for smoke tests, "
            "not a quality measure",
        ),
    ]


@hookimpl
def miles_add_arguments() -> list[Flag]:
    # The reference's reward flags; they exist exactly when this plugin is installed. The
    # PickScore and OCR rewards themselves are not in this version, so setting one of their
    # flags stops a training run instead of being ignored.
    later = "the {} reward is not in this version of miles-rewards"
    return [
        Flag(name="--pickscore-model-path", group="reward", metavar="PATH", unavailable=later.format("pickscore"),
             help="CLIP model of the PickScore reward (hub id or local directory); required with --rm-type pickscore."),
        Flag(name="--pickscore-processor-path", group="reward", metavar="PATH", unavailable=later.format("pickscore"),
             help="CLIP processor of the PickScore reward (hub id or local directory); required with --rm-type pickscore."),
        Flag(name="--pickscore-num-workers", group="reward", unavailable=later.format("pickscore"), type="int", default=1,
             help="Reward workers scoring with PickScore."),
        Flag(name="--pickscore-num-gpus-per-worker", group="reward", unavailable=later.format("pickscore"), type="float", default=1.0,
             help="GPUs per PickScore worker; fractions share a GPU."),
        Flag(name="--pickscore-batch-size", group="reward", unavailable=later.format("pickscore"), type="int", default=8,
             help="Images per PickScore forward."),
        Flag(name="--pickscore-num-frames", group="reward", unavailable=later.format("pickscore"), type="int", default=None,
             help="Frames of a video scored by PickScore, sampled evenly and averaged; unset scores all frames."),
        Flag(name="--ocr-num-workers", group="reward", unavailable=later.format("ocr"), type="int", default=4,
             help="Worker processes running the OCR reward's recogniser."),
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    errors = []
    for dest in ("pickscore_num_workers", "pickscore_batch_size", "ocr_num_workers", "pickscore_num_frames"):
        value = getattr(config, dest)
        if value is not None and value < 1:
            errors.append(f"--{dest.replace('_', '-')} {value}: must be at least 1")
    if config.pickscore_num_gpus_per_worker < 0:
        errors.append(f"--pickscore-num-gpus-per-worker {config.pickscore_num_gpus_per_worker}: must not be negative")
    return errors
