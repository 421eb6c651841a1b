"""The guard's image statistics against numbers computed by hand (docs/guide.md,
"Reward-hacking guard"; formulas in miles_core/image_statistics.py)."""

import io
import math

import pytest
import torch
from PIL import Image

from miles_core import image_statistics as stats
from miles_core.errors import InputError


def constant(rgb, size=8):
    return torch.tensor(rgb, dtype=torch.float64).reshape(1, 3, 1, 1).expand(1, 3, size, size).clone()


def checkerboard(size=8, low=0.0, high=1.0):
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    board = torch.where((x + y) % 2 == 0, torch.tensor(high, dtype=torch.float64), torch.tensor(low, dtype=torch.float64))
    return board.expand(1, 3, size, size).clone()


def test_brightness_is_the_mean_rec601_luma():
    # Pure red, green and blue: the luma weights themselves.
    batch = torch.cat([constant([1.0, 0, 0]), constant([0, 1.0, 0]), constant([0, 0, 1.0])])
    assert stats.brightness(batch).tolist() == pytest.approx([0.299, 0.587, 0.114], abs=1e-15)
    # Half black, half white: 0.5; a grey image is its own luma.
    assert float(stats.brightness(checkerboard())) == pytest.approx(0.5, abs=1e-15)
    assert float(stats.brightness(torch.full((1, 1, 4, 4), 0.25))) == 0.25


def test_saturation_is_the_mean_hsv_saturation():
    # (max - min) / max: (0.8 - 0.2) / 0.8 = 0.75; black has none (0, not a division by zero).
    assert float(stats.saturation(constant([0.8, 0.2, 0.4]))) == pytest.approx(0.75, abs=1e-15)
    assert float(stats.saturation(constant([0.0, 0.0, 0.0]))) == 0.0
    assert float(stats.saturation(checkerboard())) == 0.0  # black and white: no colour
    half = constant([1.0, 0.0, 0.0])
    half[..., :, 4:] = 1.0  # half red (1), half white (0)
    assert float(stats.saturation(half)) == pytest.approx(0.5, abs=1e-15)


def test_contrast_is_the_std_of_the_luma():
    assert float(stats.contrast(constant([0.3, 0.6, 0.9]))) == pytest.approx(0.0, abs=1e-15)
    # Two values 0 and 1 in equal numbers: population std 0.5; 0.2 and 0.6: 0.2.
    assert float(stats.contrast(checkerboard())) == pytest.approx(0.5, abs=1e-15)
    assert float(stats.contrast(checkerboard(low=0.2, high=0.6))) == pytest.approx(0.2, abs=1e-15)


def test_high_frequency_energy_fraction():
    # A checkerboard's energy sits at (0.5, 0.5) cycles per pixel: all of it is high.
    assert float(stats.high_frequency(checkerboard())) == pytest.approx(1.0, abs=1e-12)
    # A cosine of period 8 pixels (0.125 cycles per pixel): none of it is.
    x = torch.arange(32, dtype=torch.float64)
    wave = (0.5 + 0.5 * torch.cos(2 * math.pi * x / 8)).expand(1, 3, 32, 32).clone()
    assert float(stats.high_frequency(wave)) == pytest.approx(0.0, abs=1e-12)
    # The two together, with the same amplitude: a row of N pixels of cos(2 pi k n / N) puts N/2 in
    # each of bins +-k (energy N^2 / 2), the period-2 one N in its single Nyquist bin (energy N^2),
    # so 2/3 of the energy is high. A constant image has no energy: 0 by definition.
    fine = (0.5 + 0.5 * torch.cos(math.pi * x)).expand(1, 3, 32, 32)  # period 2: 0.5 cycles per pixel
    assert float(stats.high_frequency((wave + fine) / 2)) == pytest.approx(2 / 3, abs=1e-12)
    assert float(stats.high_frequency(constant([0.4, 0.4, 0.4]))) == 0.0


def test_color_entropy_in_bits():
    assert float(stats.color_entropy(constant([0.2, 0.5, 0.9]))) == 0.0
    assert float(stats.color_entropy(checkerboard())) == pytest.approx(1.0, abs=1e-15)
    # Four colours in equal quarters: 2 bits; two values in the same bin (0.0 and 0.1 at 8 levels): one colour.
    four = constant([0.0, 0.0, 0.0])
    four[..., :4, 4:] = 1.0
    four[:, 0, 4:, :4] = 1.0
    four[:, 2, 4:, 4:] = 1.0
    assert float(stats.color_entropy(four)) == pytest.approx(2.0, abs=1e-15)
    assert float(stats.color_entropy(checkerboard(low=0.0, high=0.1))) == 0.0


def test_jpeg_size_is_bytes_per_pixel_of_pillows_encoding():
    image = checkerboard(size=16)
    buffer = io.BytesIO()
    Image.fromarray((image[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()).save(
        buffer, format="JPEG", quality=stats.JPEG_QUALITY
    )
    assert float(stats.jpeg_size(image)) == buffer.tell() / 256
    # Detail costs bytes: flat < checkerboard < noise.
    noise = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    flat = float(stats.jpeg_size(constant([0.5, 0.5, 0.5], size=16)))
    assert flat < float(stats.jpeg_size(image)) < float(stats.jpeg_size(noise))


def test_videos_average_their_frames():
    video = torch.stack([constant([0.0, 0.0, 0.0])[0], constant([1.0, 1.0, 1.0])[0]], dim=1)[None]  # [1, C, F=2, H, W]
    assert float(stats.brightness(video)) == pytest.approx(0.5, abs=1e-15)
    assert float(stats.contrast(video)) == 0.0  # each frame is flat
    with pytest.raises(InputError, match="expected images"):
        stats.brightness(torch.zeros(3, 8, 8))


def test_diversity_is_the_rms_distance_of_each_pair_of_a_prompt():
    black, white, grey = constant([0.0] * 3, 64), constant([1.0] * 3, 64), constant([0.5] * 3, 64)
    # Prompt 0: black, white, grey (pairs: 1, 0.5, 0.5); prompt 1: identical samples (0).
    batch = torch.cat([black, white, grey, grey, grey, grey])
    assert stats.pairwise_distances(batch, 3).tolist() == pytest.approx([1.0, 0.5, 0.5, 0.0, 0.0, 0.0], abs=1e-15)
    # Resized by area average first: a 128 px checkerboard becomes flat grey (distance 0 to grey).
    board = checkerboard(size=128)
    assert stats.pairwise_distances(torch.cat([board, constant([0.5] * 3, 128)]), 2).tolist() == pytest.approx([0.0], abs=1e-15)
    assert stats.pairwise_distances(batch, 1).numel() == 0
    with pytest.raises(InputError, match="groups of 4"):
        stats.pairwise_distances(batch, 4)
