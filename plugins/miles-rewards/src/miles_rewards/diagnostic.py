"""Weight-free diagnostic rewards: brightness, redness and colourfulness.

Not quality measures: simple pixel statistics that a policy can visibly push up within a
few rollouts, even on a tiny model, which makes them useful for smoke-testing that a
training setup learns at all (the SD3 demo and ``tests/test_learning.py`` train on colourfulness). Computed on float pixels in
``[0, 1]`` (``uint8`` is divided by 255, floats are clamped to ``[0, 1]``). A video scores
the mean over its frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from miles_rewards.pixels import FrameReward, to_float_frames


class _FrameReward(FrameReward):
    """Frames as ``[C, H, W]`` floats in ``[0, 1]``; RGB-only rewards refuse other channel counts."""

    needs_rgb = False

    def frames(self, output: Any) -> Sequence[np.ndarray]:
        frames = to_float_frames(output)
        if self.needs_rgb and frames.shape[1] != 3:
            raise ValueError(f"{self.name} needs 3 (RGB) channels, got shape {tuple(output.shape)}")
        return frames


class Brightness(_FrameReward):
    """Reward = mean pixel value, in ``[0, 1]`` (any channel count)."""

    name = "brightness"

    def frame_score(self, frame: np.ndarray) -> float:
        return float(frame.mean())


class Redness(_FrameReward):
    """Reward = ``mean(R - (G + B) / 2)``, in ``[-1, 1]`` (RGB only)."""

    name = "redness"
    needs_rgb = True

    def frame_score(self, frame: np.ndarray) -> float:
        r, g, b = frame
        return float(np.mean(r - (g + b) / 2.0))


class Colorfulness(_FrameReward):
    """Reward = Hasler and Suesstrunk's colourfulness, on the ``[0, 1]`` pixel scale (RGB only).

    With ``rg = R - G`` and ``yb = (R + G) / 2 - B`` over a frame's pixels,
    ``sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 + mean(yb)^2)`` (population std).
    The paper (2003) works on 0-255 values; the metric is homogeneous of degree 1 in the
    pixel scale, so its value is exactly 255 times this one. The ``[0, 1]`` scale is used so
    the reward is of the same order as brightness and redness. A gray image scores 0; a pure red one
    ``0.3 * sqrt(1.25) ~ 0.335``.
    """

    name = "colorfulness"
    needs_rgb = True

    def frame_score(self, frame: np.ndarray) -> float:
        r, g, b = frame
        rg = r - g
        yb = 0.5 * (r + g) - b
        spread = np.sqrt(rg.std() ** 2 + yb.std() ** 2)
        offset = np.sqrt(rg.mean() ** 2 + yb.mean() ** 2)
        return float(spread + 0.3 * offset)
