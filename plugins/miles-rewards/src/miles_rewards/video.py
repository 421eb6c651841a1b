"""Rewards of a video as a whole: ``temporal_consistency`` and ``motion_magnitude``.

Both score videos ``[C, F, H, W]`` of at least two frames; an image (or a one-frame
video) has no consecutive frames to compare and is a one-line ``ValueError`` naming the
reward, so the core masks that sample and counts it as failed rather than training on a
made-up value (a run whose every sample is an image stops with that line).

``temporal_consistency`` = mean over t of cos(E(frame_t), E(frame_t+1)), with E the
L2-normalised projected CLIP image embedding (``get_image_features``) of the CLIPScore
model (``--clipscore-model-path``, preprocessed as CLIPScore's reference,
:class:`miles_rewards.clip_models.OpenAIClipTransform`), over every pair of consecutive
frames; in [-1, 1], 1 for a static video. This is the CLIP frame-consistency of
video-editing evaluation (e.g. adobe-research/EditVerse@8a38b23
``automatic_evaluation/clip_temporal_consistency.py``), which however clamps each pair's
cosine at 0 and embeds with the unprojected ``CLIPVisionModel.pooler_output`` of ViT-L/14.
VBench (Vchitect/VBench@45e79ec) differs more: its ``background_consistency`` (CLIP
ViT-B/32) and ``subject_consistency`` (DINO ViT-B/16) average, for each frame after the
first, ``max(0, cos)`` with the previous frame and ``max(0, cos)`` with the first frame.

``motion_magnitude`` = mean over t, pixels and channels of |frame_t+1 - frame_t| / 255 on
the ``uint8`` frames the other rewards score (``round(x * 255)`` clamped, channels as
given): in [0, 1], 0 for a static video. It is the per-pair mean absolute difference of
VBench's ``temporal_flickering`` (``np.mean(cv2.absdiff(f1, f2))`` on uint8 frames, whose
score is ``(255 - mean MAE) / 255``), so ``motion_magnitude = 1 - temporal_flickering``
on the same frames. It does not tell smooth motion from flicker (a flickering video has
the largest value); VBench's own motion measure, ``dynamic_degree``, is RAFT optical flow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from miles_rewards.clip_models import (
    ClipFrameReward,
    OpenAIClipTransform,
    features,
    load_clip_model,
    load_clip_processor,
    normalized,
    pil_frame,
    reward_device,
)
from miles_rewards.clipscore import processor_source
from miles_rewards.pixels import to_uint8_frames


def require_video(output: Any, reward: str) -> None:
    """A one-line ``ValueError`` naming ``reward`` unless ``output`` is a video
    ``[C, F, H, W]`` with at least two frames."""
    shape = tuple(output.shape) if hasattr(output, "shape") else np.shape(output)
    if len(shape) == 3:
        raise ValueError(f"{reward} scores videos [C, F, H, W] of at least 2 frames, got an image {list(shape)}")
    if len(shape) == 4 and shape[1] < 2:
        raise ValueError(f"{reward} scores videos [C, F, H, W] of at least 2 frames, got {shape[1]} frame(s) {list(shape)}")


class TemporalConsistency(ClipFrameReward):
    """The ``temporal_consistency`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]`` (prompts are not used). It
    shares the CLIP loading, the lock and the batching of the frame rewards;
    ``--clipscore-batch-size`` frames go through the model per forward, and every frame
    of a video is embedded."""

    name = "temporal_consistency"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.clipscore_batch_size)
        self.device = reward_device()
        self.model = load_clip_model("--clipscore-model-path", config.clipscore_model_path, self.name, self.device)
        flag, path = processor_source(config)
        image_processor = load_clip_processor(flag, path, self.name, images_only=True)
        self.transform = OpenAIClipTransform.from_image_processor(image_processor, flag, str(path))

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """The frames' L2-normalised image embeddings ``[B, D]``."""
        pixels = self.transform(images).to(self.device)
        return normalized(features(self.model.get_image_features(pixel_values=pixels)))

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        self.check_prompts(outputs, prompts)
        spans: list[tuple[int, int]] = []
        images: list[Image.Image] = []
        for output in outputs:
            require_video(output, self.name)
            frames = to_uint8_frames(output)
            spans.append((len(images), len(images) + len(frames)))
            images.extend(pil_frame(frame) for frame in frames)
        embeddings = self.forward_in_batches(images, [""] * len(images)).double()
        scores = []
        for start, end in spans:
            video = normalized(embeddings[start:end])  # again in float64: a static video scores 1 to 1e-15
            scores.append(float((video[:-1] * video[1:]).sum(dim=-1).mean()))
        return scores


class MotionMagnitude:
    """The ``motion_magnitude`` reward (weight-free): constructed with the run's
    configuration, called as ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "motion_magnitude"

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        scores = []
        for output in outputs:
            require_video(output, self.name)
            frames = np.stack(to_uint8_frames(output)).astype(np.int16)  # [F, H, W, C]
            scores.append(float(np.abs(np.diff(frames, axis=0)).mean() / 255.0))
        return scores
