"""Collateral statistics of generated images: what a reward can push around without
meaning to (the reward-hacking guard, :mod:`miles_core.training.guard`, compares them
across evaluations).

Every function takes a batch of images ``[N, C, H, W]`` with values in ``[0, 1]`` (``C``
is 3 for RGB, 1 for grey) or of videos ``[N, C, F, H, W]``, and returns one value per
sample as a float64 tensor ``[N]``; a video's value is the mean of its frames' values.
Pure functions: no state, no device work beyond the input's, nothing written.

Formulas (``Y`` is the Rec. 601 luma ``0.299 R + 0.587 G + 0.114 B``; a grey image is
its own luma; means and standard deviations run over a frame's ``H x W`` pixels):

- brightness: ``mean(Y)``;
- saturation: ``mean(S)`` with HSV saturation ``S = (max - min) / max`` over the
  channels of a pixel (0 where ``max = 0``; a grey image has none: 0);
- contrast (RMS contrast): ``std(Y)`` (population standard deviation);
- high-frequency energy: the fraction of the energy of the mean-free luma's spectrum
  ``|FFT2(Y - mean(Y))|^2`` at radial frequencies above half the Nyquist frequency,
  ``sqrt(fx^2 + fy^2) > 0.25`` cycles per pixel (0 for a constant frame);
- JPEG size: the bytes of the frame encoded by Pillow as JPEG at quality
  :data:`JPEG_QUALITY` (values rounded to 8 bits), divided by ``H x W``;
- colour entropy: the Shannon entropy in bits ``-sum p log2 p`` of the joint RGB
  histogram, each channel quantised to :data:`ENTROPY_LEVELS` levels
  (``min(floor(x * L), L - 1)``; grey: the one channel's histogram);
- diversity (:func:`pairwise_distances`): for each pair of samples of the same prompt,
  the RMS pixel distance ``sqrt(mean((a - b)^2))`` over all channels, frames and pixels
  of the two samples resized (area average) to :data:`DIVERSITY_SIZE` pixels square.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from miles_core.errors import InputError

LUMA_WEIGHTS = (0.299, 0.587, 0.114)
"""Rec. 601 luma weights of R, G, B."""
JPEG_QUALITY = 90
"""The Pillow JPEG quality of :func:`jpeg_size`."""
ENTROPY_LEVELS = 8
"""Quantisation levels per channel of :func:`color_entropy` (8^3 = 512 RGB bins, at most 9 bits)."""
DIVERSITY_SIZE = 64
"""The side, in pixels, samples are resized to before :func:`pairwise_distances`."""
HIGH_FREQUENCY_CUTOFF = 0.25
"""Half the Nyquist frequency, in cycles per pixel: :func:`high_frequency` counts the energy above it."""

Statistic = Callable[[torch.Tensor], torch.Tensor]


def _frames(images: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[N * F, C, H, W]`` float64 frames and ``F`` (1 for images)."""
    if images.ndim == 4:
        frames, count = images, 1
    elif images.ndim == 5:
        n, c, f, h, w = images.shape
        frames, count = images.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w), f
    else:
        raise InputError(f"image statistics: expected images [N, C, H, W] or videos [N, C, F, H, W], got shape {tuple(images.shape)}")
    if frames.shape[1] not in (1, 3):
        raise InputError(f"image statistics: expected 1 or 3 channels, got {frames.shape[1]}")
    return frames.detach().to("cpu", torch.float64), count


def _per_sample(values: torch.Tensor, count: int) -> torch.Tensor:
    """Per-frame values ``[N * F]`` -> per-sample means ``[N]``."""
    return values.reshape(-1, count).mean(dim=1)


def _luma(frames: torch.Tensor) -> torch.Tensor:
    """``[M, H, W]`` luma of ``[M, C, H, W]`` frames."""
    if frames.shape[1] == 1:
        return frames[:, 0]
    r, g, b = LUMA_WEIGHTS
    return r * frames[:, 0] + g * frames[:, 1] + b * frames[:, 2]


def brightness(images: torch.Tensor) -> torch.Tensor:
    """Mean Rec. 601 luma per sample."""
    frames, count = _frames(images)
    return _per_sample(_luma(frames).mean(dim=(1, 2)), count)


def saturation(images: torch.Tensor) -> torch.Tensor:
    """Mean HSV saturation ``(max - min) / max`` per sample (0 where ``max = 0``)."""
    frames, count = _frames(images)
    top = frames.amax(dim=1)
    spread = top - frames.amin(dim=1)
    sat = torch.where(top > 0, spread / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    return _per_sample(sat.mean(dim=(1, 2)), count)


def contrast(images: torch.Tensor) -> torch.Tensor:
    """RMS contrast: the population standard deviation of the luma per sample."""
    frames, count = _frames(images)
    return _per_sample(_luma(frames).std(dim=(1, 2), unbiased=False), count)


def high_frequency(images: torch.Tensor) -> torch.Tensor:
    """The fraction of the mean-free luma's spectral energy above half the Nyquist
    frequency (radial frequency > :data:`HIGH_FREQUENCY_CUTOFF` cycles per pixel)."""
    frames, count = _frames(images)
    luma = _luma(frames)
    luma = luma - luma.mean(dim=(1, 2), keepdim=True)
    energy = torch.fft.fft2(luma).abs() ** 2
    h, w = luma.shape[-2:]
    fy = torch.fft.fftfreq(h, dtype=torch.float64)[:, None]
    fx = torch.fft.fftfreq(w, dtype=torch.float64)[None, :]
    high = (fx**2 + fy**2).sqrt() > HIGH_FREQUENCY_CUTOFF
    total = energy.sum(dim=(1, 2))
    above = (energy * high).sum(dim=(1, 2))
    fraction = torch.where(total > 0, above / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))
    return _per_sample(fraction, count)


def _uint8(frame: torch.Tensor) -> np.ndarray:
    """``[C, H, W]`` in [0, 1] -> ``[H, W, C]`` uint8 (rounded)."""
    return (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def jpeg_size(images: torch.Tensor) -> torch.Tensor:
    """Bytes per pixel of each frame encoded as JPEG at :data:`JPEG_QUALITY` (Pillow)."""
    from PIL import Image

    frames, count = _frames(images)
    sizes = []
    for frame in frames:
        array = _uint8(frame)
        image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / (array.shape[0] * array.shape[1]))
    return _per_sample(torch.tensor(sizes, dtype=torch.float64), count)


def color_entropy(images: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (bits) of the joint colour histogram, :data:`ENTROPY_LEVELS`
    levels per channel."""
    frames, count = _frames(images)
    levels = ENTROPY_LEVELS
    quantised = (frames.clamp(0, 1) * levels).floor().clamp(max=levels - 1).to(torch.long)
    codes = torch.zeros(quantised.shape[0], *quantised.shape[2:], dtype=torch.long)
    for channel in range(quantised.shape[1]):
        codes = codes * levels + quantised[:, channel]
    values = []
    for frame in codes.reshape(codes.shape[0], -1):
        p = torch.bincount(frame, minlength=levels ** quantised.shape[1]).to(torch.float64)
        p = p[p > 0] / frame.numel()
        values.append(float(-(p * p.log2()).sum()))
    return _per_sample(torch.tensor(values, dtype=torch.float64), count)


STATISTICS: dict[str, Statistic] = {
    "brightness": brightness,
    "saturation": saturation,
    "contrast": contrast,
    "high_frequency": high_frequency,
    "jpeg_size": jpeg_size,
    "color_entropy": color_entropy,
}
"""The per-sample statistics by name (diversity, a per-pair one, is :func:`pairwise_distances`)."""


def pairwise_distances(images: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """Diversity: the RMS pixel distance of every pair of samples of the same prompt, the
    samples in prompt order (``samples_per_prompt`` consecutive samples per prompt), each
    resized by area average to :data:`DIVERSITY_SIZE` pixels square first. Returns one
    value per pair, ``[P * n (n - 1) / 2]``, prompt by prompt, pairs ``(i, j)`` with
    ``i < j`` in order; empty with one sample per prompt."""
    if samples_per_prompt < 1 or images.shape[0] % samples_per_prompt:
        raise InputError(f"diversity: {images.shape[0]} samples are not groups of {samples_per_prompt} per prompt")
    frames, count = _frames(images)
    size = (DIVERSITY_SIZE, DIVERSITY_SIZE)
    small = F.interpolate(frames, size=size, mode="area") if tuple(frames.shape[-2:]) != size else frames
    flat = small.reshape(images.shape[0], -1)  # a sample's frames and channels together
    distances = []
    for start in range(0, flat.shape[0], samples_per_prompt):
        group = flat[start : start + samples_per_prompt]
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                distances.append(((group[i] - group[j]) ** 2).mean().sqrt())
    return torch.stack(distances) if distances else torch.zeros(0, dtype=torch.float64)


__all__ = [
    "DIVERSITY_SIZE",
    "ENTROPY_LEVELS",
    "HIGH_FREQUENCY_CUTOFF",
    "JPEG_QUALITY",
    "LUMA_WEIGHTS",
    "STATISTICS",
    "brightness",
    "color_entropy",
    "contrast",
    "high_frequency",
    "jpeg_size",
    "pairwise_distances",
    "saturation",
]
