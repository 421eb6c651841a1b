"""JPEG (in)compressibility: the size of the output saved as a JPEG at quality 95.

As in the Flow-GRPO line of work: size in kB (1 kB = 1000 bytes), negated for
compressibility. A video scores the mean over its frames. Weight-free and fast
(Pillow only), which makes it a good first reward for checking a setup.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
from PIL import Image

from miles_rewards.pixels import to_uint8_frames

JPEG_QUALITY = 95


def jpeg_size_kb(frame: np.ndarray) -> float:
    """Size in kB of one ``uint8`` ``[H, W, C]`` frame saved as JPEG at quality 95."""
    if frame.shape[-1] == 1:
        frame = frame[..., 0]
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000.0


class JpegIncompressibility:
    """Reward = JPEG size in kB (larger is better)."""

    sign = 1.0

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        rewards = []
        for output in outputs:
            sizes = [jpeg_size_kb(frame) for frame in to_uint8_frames(output)]
            rewards.append(self.sign * float(np.mean(sizes)))
        return rewards


class JpegCompressibility(JpegIncompressibility):
    """Reward = -(JPEG size in kB) (smaller files are better)."""

    sign = -1.0
