"""JPEG (in)compressibility: the size of the output saved as a JPEG at quality 95.

As flow_grpo defines them (``flow_grpo/rewards.py``), so that results are comparable:
``jpeg_incompressibility`` is the size in kB (1 kB = 1000 bytes);
``jpeg_compressibility`` is ``-size_kB / 500`` (flow_grpo scales compressibility
only; ddpo-pytorch, where both rewards come from, has ``-size_kB``). A video scores
the mean over its frames. Weight-free and fast (Pillow only), which makes it a good
first reward for checking a setup.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from miles_rewards.pixels import FrameReward, to_uint8_frames

JPEG_QUALITY = 95
COMPRESSIBILITY_SCALE = 500.0
"""flow_grpo's ``jpeg_compressibility`` is ``-size_kB / 500``."""


def jpeg_size_kb(frame: np.ndarray) -> float:
    """Size in kB of one ``uint8`` ``[H, W, C]`` frame saved as JPEG at quality 95."""
    if frame.shape[-1] == 1:
        frame = frame[..., 0]
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000.0


class JpegIncompressibility(FrameReward):
    """Reward = JPEG size in kB (larger is better)."""

    name = "jpeg_incompressibility"
    sign = 1.0
    scale = 1.0

    def frames(self, output: Any) -> Sequence[np.ndarray]:
        return to_uint8_frames(output)

    def frame_score(self, frame: np.ndarray) -> float:
        return self.sign * jpeg_size_kb(frame) / self.scale


class JpegCompressibility(JpegIncompressibility):
    """Reward = -(JPEG size in kB) / 500 (smaller files are better)."""

    name = "jpeg_compressibility"
    sign = -1.0
    scale = COMPRESSIBILITY_SCALE
