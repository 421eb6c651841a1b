import math

import numpy as np
import pytest
import torch

from miles_rewards.diagnostic import Brightness, Colorfulness, Redness


def _random_image(seed: int, size: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).random((3, size, size))


# Direct numpy computations on one float [C, H, W] frame in [0, 1].
def _brightness(x):
    return x.mean()


def _redness(x):
    return (x[0] - (x[1] + x[2]) / 2).mean()


def _colorfulness(x):
    rg = x[0] - x[1]
    yb = 0.5 * (x[0] + x[1]) - x[2]
    return math.sqrt(np.var(rg) + np.var(yb)) + 0.3 * math.sqrt(np.mean(rg) ** 2 + np.mean(yb) ** 2)


CASES = [(Brightness, _brightness), (Redness, _redness), (Colorfulness, _colorfulness)]


@pytest.mark.parametrize("reward_cls, direct", CASES)
def test_matches_direct_numpy_on_random_images(reward_cls, direct):
    images = [_random_image(seed) for seed in range(3)]
    # A skewed image too, so redness and the colourfulness mean term are far from 0.
    images.append(images[0] * np.array([1.0, 0.3, 0.6])[:, None, None])
    expected = [direct(x) for x in images]
    assert reward_cls()(images) == pytest.approx(expected, rel=1e-12)
    assert reward_cls()([torch.from_numpy(x) for x in images]) == pytest.approx(expected, rel=1e-12)
    assert len(set(expected)) == len(expected)  # control: the images really differ


def test_known_images():
    black, white, gray = np.zeros((3, 8, 8)), np.ones((3, 8, 8)), np.full((3, 8, 8), 0.4)
    red = np.zeros((3, 8, 8))
    red[0] = 1.0
    assert Brightness()([black, white, gray]) == [0.0, 1.0, pytest.approx(0.4)]
    assert Redness()([red, gray, white]) == [1.0, 0.0, 0.0]
    # Pure red: rg = 1, yb = 0.5 everywhere -> std 0, 0.3 * sqrt(1 + 0.25).
    assert Colorfulness()([red]) == [pytest.approx(0.3 * math.sqrt(1.25))]
    assert Colorfulness()([gray, black, white]) == [0.0, 0.0, 0.0]
    # Half red, half green: rg = +-1 (std 1), yb = 0.5 (std 0) -> 1 + 0.3 * 0.5.
    half = np.zeros((3, 8, 8))
    half[0, :4] = 1.0
    half[1, 4:] = 1.0
    assert Colorfulness()([half]) == [pytest.approx(1.15)]


@pytest.mark.parametrize("reward_cls, direct", CASES)
def test_video_scores_the_mean_over_frames(reward_cls, direct):
    frames = [_random_image(10), np.full((3, 32, 32), 0.2), _random_image(11) ** 3]
    video = np.stack(frames, axis=1)  # [C, F, H, W]
    expected = np.mean([direct(f) for f in frames])
    assert reward_cls()([video]) == [pytest.approx(expected, rel=1e-12)]
    assert reward_cls()([torch.from_numpy(video)]) == [pytest.approx(expected, rel=1e-12)]


@pytest.mark.parametrize("reward_cls", [Brightness, Redness, Colorfulness])
def test_uint8_and_float_agree(reward_cls):
    as_uint8 = np.random.default_rng(5).integers(0, 256, (3, 16, 16), dtype=np.uint8)
    as_float = as_uint8 / 255.0
    from_uint8 = reward_cls()([as_uint8, torch.from_numpy(as_uint8)])
    assert from_uint8 == pytest.approx(reward_cls()([as_float]) * 2, rel=1e-12)
    # Control: uint8 read as float (without /255) would give another value.
    assert reward_cls()([as_uint8.astype(np.float64)]) != pytest.approx(from_uint8[:1])


def test_floats_are_clamped_and_low_precision_tensors_work():
    image = torch.full((3, 4, 4), 1.5)
    image[1:] = -0.5
    assert Brightness()([image]) == [pytest.approx(1 / 3)]
    assert Redness()([image]) == [1.0]
    assert Brightness()([torch.full((3, 4, 4), 0.5, dtype=torch.bfloat16)]) == [0.5]


def test_grayscale_brightness_works_colour_rewards_raise():
    gray = np.full((1, 8, 8), 0.25)
    assert Brightness()([gray, gray[:, None].repeat(2, axis=1)]) == [0.25, 0.25]
    for reward_cls, name in ((Redness, "redness"), (Colorfulness, "colorfulness")):
        with pytest.raises(ValueError, match=rf"{name} needs 3 \(RGB\) channels, got shape \(1, 8, 8\)"):
            reward_cls()([gray])


@pytest.mark.parametrize("reward_cls", [Brightness, Redness, Colorfulness])
@pytest.mark.parametrize("shape", [(64, 64), (2, 3, 64, 64, 1), (4, 64, 64), (2, 64, 64)])
def test_bad_shapes_are_rejected(reward_cls, shape):
    with pytest.raises(ValueError, match="shape"):
        reward_cls()([np.zeros(shape, dtype=np.uint8)])


def test_registered():
    from importlib.metadata import entry_points

    from miles_core.refs import load_ref

    (ep,) = [ep for ep in entry_points(group="miles.plugins") if ep.name == "rewards"]
    specs = {spec.name: spec for spec in ep.load().miles_register_rewards()}
    for name, cls in (("brightness", Brightness), ("redness", Redness), ("colorfulness", Colorfulness)):
        assert specs[name].ref == f"miles_rewards.diagnostic:{cls.__name__}"
        assert "weight-free diagnostic" in specs[name].description
        assert "not a quality measure" in specs[name].description
        assert load_ref(specs[name].ref) is cls
