"""Turning generated outputs into the uint8 frames that image rewards score."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def to_uint8_frames(output: Any) -> list[np.ndarray]:
    """One generated output -> its frames as ``uint8`` ``[H, W, C]`` arrays.

    ``output`` is an image ``[C, H, W]`` or a video ``[C, F, H, W]``: a float tensor or
    array in ``[0, 1]`` (what the engine returns) or already ``uint8``. Floats are
    scaled as the Flow-GRPO rewards do: ``round(x * 255)`` clamped to ``[0, 255]``.
    Half-precision tensors (``bfloat16``, which numpy has no type for, and ``float16``)
    are converted to ``float32`` first, exactly: the frames are those of the same values
    in ``float32``.
    """
    if hasattr(output, "detach"):
        output = output.detach().cpu()
        if output.is_floating_point() and output.element_size() < 4:
            output = output.float()
    array = np.asarray(output)
    if array.ndim not in (3, 4):
        raise ValueError(f"expected an image [C,H,W] or a video [C,F,H,W], got shape {array.shape}")
    if array.shape[0] not in (1, 3):
        raise ValueError(f"expected 1 or 3 channels first, got shape {array.shape}")
    if array.dtype != np.uint8:
        array = np.clip(np.round(array.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    if array.ndim == 3:
        array = array[:, None]
    # [C, F, H, W] -> F frames of [H, W, C]
    return [np.ascontiguousarray(frame) for frame in array.transpose(1, 2, 3, 0)]


def to_float_frames(output: Any) -> np.ndarray:
    """One generated output -> its frames as a ``float64`` ``[F, C, H, W]`` array in ``[0, 1]``.

    ``output`` is an image ``[C, H, W]`` or a video ``[C, F, H, W]`` with 1 or 3 channels:
    ``uint8`` is divided by 255; floats (any precision, bfloat16 tensors included) are
    clamped to ``[0, 1]``, the range the engine's outputs are meant to have.
    """
    if hasattr(output, "detach"):
        output = output.detach().cpu()
        if str(output.dtype) != "torch.uint8":
            output = output.double()  # numpy cannot take bfloat16
    array = np.asarray(output)
    if array.ndim not in (3, 4):
        raise ValueError(f"expected an image [C,H,W] or a video [C,F,H,W], got shape {array.shape}")
    if array.shape[0] not in (1, 3):
        raise ValueError(f"expected 1 or 3 channels first, got shape {array.shape}")
    if array.dtype == np.uint8:
        array = array.astype(np.float64) / 255.0
    else:
        array = np.clip(array.astype(np.float64), 0.0, 1.0)
    if array.ndim == 3:
        array = array[:, None]
    return array.transpose(1, 0, 2, 3)  # [C, F, H, W] -> [F, C, H, W]


class FrameReward:
    """Base of the rewards that score each frame of an output and average over frames.

    Subclasses set ``frames`` (how an output becomes frames) and implement
    ``frame_score``; constructed with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = ""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def frames(self, output: Any) -> Sequence[np.ndarray]:
        raise NotImplementedError

    def frame_score(self, frame: np.ndarray) -> float:
        raise NotImplementedError

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        return [float(np.mean([self.frame_score(frame) for frame in self.frames(output)])) for output in outputs]
