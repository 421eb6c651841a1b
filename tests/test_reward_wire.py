"""The reward wire (``miles_core.reward_service.wire``): pixels survive exactly where the
encoding says they do (png: the 1/255 grid; float32: every value), and every malformed
request or answer is refused in one line naming the field."""

from __future__ import annotations

import base64
import copy
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.errors import RequestError, RequestLimitError, RewardError
from miles_core.reward_service import wire


def grid_image(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values k/255 (float32), exactly what an 8-bit PNG holds."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=generator).float().div(255.0)


def roundtrip(pixels: torch.Tensor, encoding: str) -> torch.Tensor:
    return wire.decode_pixels(wire.encode_pixels(pixels, encoding), "pixels")


# -- pixels --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 5, 7), (3, 4, 6, 5)], ids=["image", "video"])
def test_png_is_exact_on_the_1_255_grid(shape):
    pixels = grid_image(*shape)
    back = roundtrip(pixels, "png")
    assert back.dtype == torch.float32 and back.shape == pixels.shape
    assert torch.equal(back, pixels)


def test_png_frames_are_8_bit_rgb_pngs_of_the_quantised_values():
    pixels = torch.rand(3, 2, 4, 6, generator=torch.Generator().manual_seed(1)) * 1.4 - 0.2  # some outside [0, 1]
    encoded = wire.encode_pixels(pixels, "png")
    assert encoded["shape"] == [3, 2, 4, 6] and len(encoded["frames"]) == 2
    for f, frame in enumerate(encoded["frames"]):
        image = Image.open(io.BytesIO(base64.b64decode(frame)))
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (6, 4))
        expected = np.rint(np.clip(pixels[:, f].double().numpy(), 0, 1) * 255).astype(np.uint8).transpose(1, 2, 0)
        assert np.array_equal(np.asarray(image), expected)


def test_png_quantises_in_float64_as_the_8_bit_rewards_do():
    # Values whose x * 255 in float32 rounds to the other side of .5: the rewards compute
    # round(x * 255) in float64 (exact for a float32 x), and the wire must match them.
    x = torch.rand(2_000_000, generator=torch.Generator().manual_seed(3))
    in_float64 = x.double().mul(255.0).round()
    tricky = x[x.mul(255.0).round().double() != in_float64]
    assert tricky.numel() > 0  # the control: float32 arithmetic gets these wrong
    pixels = tricky[: (tricky.numel() // 3) * 3].reshape(3, 1, -1)
    frame = np.asarray(Image.open(io.BytesIO(base64.b64decode(wire.encode_pixels(pixels, "png")["frames"][0]))))
    expected = np.clip(np.round(pixels.double().numpy() * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
    assert np.array_equal(frame, expected)
    assert not np.array_equal(frame, pixels.mul(255.0).round().to(torch.uint8).numpy().transpose(1, 2, 0))


def test_png_is_not_exact_off_the_grid():
    # The control: a value between two 8-bit levels comes back as the nearest level.
    pixels = torch.full((3, 2, 2), 0.5)
    back = roundtrip(pixels, "png")
    assert not torch.equal(back, pixels)
    assert torch.equal(back, torch.full((3, 2, 2), 128 / 255))


def test_float32_is_exact_for_any_float():
    values = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2)) * 1e3
    values.view(-1)[:6] = torch.tensor([-0.0, math.inf, -math.inf, math.nan, 1e-42, -3.25])
    back = roundtrip(values, "float32")
    assert back.dtype == torch.float32 and back.shape == values.shape
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))  # bit for bit, NaN and -0 included
    raw = base64.b64decode(wire.encode_pixels(values, "float32")["data"])
    assert raw == values.numpy().astype("<f4").tobytes()  # little-endian, C order


def test_float32_takes_other_dtypes_and_channel_counts():
    half = torch.tensor([[[0.1, -2.0]]], dtype=torch.bfloat16)  # [1, 1, 2]
    assert torch.equal(roundtrip(half, "float32"), half.float())


@pytest.mark.parametrize(
    ("pixels", "encoding", "message"),
    [
        (torch.zeros(3, 2, 2), "jpeg", "pixels.encoding: 'jpeg': expected one of png, float32"),
        (torch.zeros(2, 2), "png", "pixels: shape [2, 2]: expected an image [C, H, W] or a video [C, F, H, W] with no empty dimension"),
        (
            torch.zeros(3, 0, 2),
            "float32",
            "pixels: shape [3, 0, 2]: expected an image [C, H, W] or a video [C, F, H, W] with no empty dimension",
        ),
        (torch.zeros(1, 2, 2), "png", "pixels: shape [1, 2, 2]: png carries RGB (3 channels); send float32 for 1"),
        (torch.full((3, 1, 1), math.nan), "png", "pixels: NaN or infinite values cannot be sent as png; send float32"),
    ],
)
def test_encode_refuses_what_the_encoding_cannot_carry(pixels, encoding, message):
    with pytest.raises(RequestError) as info:
        wire.encode_pixels(pixels, encoding)
    assert str(info.value) == message


# -- requests ------------------------------------------------------------------------------


def request_body(n: int = 3, encoding: str = "png", groups=None) -> dict:
    pixels = [grid_image(3, 4, 5, seed=i) for i in range(n)]
    return wire.encode_request(
        pixels, [f"prompt {i}" for i in range(n)], [{"i": i} for i in range(n)], encoding=encoding, reward="brightness", groups=groups
    )


def test_request_roundtrip():
    pixels = [grid_image(3, 4, 5, seed=0), grid_image(3, 2, 4, 5, seed=1)]
    body = wire.encode_request(pixels, ["a", "b"], [{"x": 1}, {}], encoding="png", reward=None, groups=[7, 7])
    assert body["wire_version"] == 1 and body["reward"] is None
    decoded = wire.decode_request(body, max_samples=2)
    assert decoded.prompts == ["a", "b"] and decoded.metadata == [{"x": 1}, {}] and decoded.groups == [7, 7] and decoded.reward is None
    assert all(torch.equal(a, b) for a, b in zip(decoded.pixels, pixels))
    plain = wire.decode_request(request_body(2, "float32"), max_samples=8)
    assert plain.groups is None and plain.reward == "brightness"
    assert plain.seeds == [None, None] and plain.indices == [None, None]
    # A sample's seed and index in its group, optional: what a reward's messages name.
    sample = wire.encode_sample(pixels[0], "a", {}, encoding="float32", group=3, seed=41, index_in_group=1)
    assert (sample["group"], sample["seed"], sample["index_in_group"]) == (3, 41, 1)
    decoded = wire.decode_request({"wire_version": 1, "samples": [sample]}, max_samples=1)
    assert (decoded.groups, decoded.seeds, decoded.indices) == ([3], [41], [1])


def test_encode_request_needs_one_of_each_per_sample():
    with pytest.raises(RequestError) as info:
        wire.encode_request([torch.zeros(3, 1, 1)], ["a", "b"], [{}], encoding="png", reward=None)
    assert str(info.value) == "samples: one of each per sample is needed, got 1 pixels, 2 prompts, 1 metadata"
    with pytest.raises(RequestError) as info:
        wire.encode_request([torch.zeros(3, 1, 1), torch.zeros(1, 1, 1)], ["a", "b"], [{}, {}], encoding="png", reward=None)
    assert str(info.value) == "samples[1].pixels: shape [1, 1, 1]: png carries RGB (3 channels); send float32 for 1"


def png_b64(array: np.ndarray, mode: str | None = None) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array, mode).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _set(body: dict, path: tuple, value) -> dict:
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


_DELETE = object()
PX = ("samples", 2, "pixels")

BAD_REQUESTS = [
    (("wire_version",), _DELETE, "wire_version: missing; this server speaks wire version 1"),
    (("wire_version",), 2, "wire_version: 2: this server speaks wire version 1"),
    (("wire_version",), True, "wire_version: True: this server speaks wire version 1"),
    (("extra",), 1, "extra: unknown field (fields: wire_version, reward, samples)"),
    (("reward",), 3, "reward: expected the reward's name or null, got int"),
    (("samples",), {"a": 1}, "samples: expected a list of samples, got dict"),
    (("samples", 1), "x", "samples[1]: expected an object with prompt, metadata and pixels, got str"),
    (("samples", 1, "index"), 0, "samples[1].index: unknown field (fields: prompt, metadata, group, seed, index_in_group, pixels)"),
    (("samples", 1, "seed"), "7", "samples[1].seed: expected an integer or null, got '7'"),
    (("samples", 1, "index_in_group"), 1.0, "samples[1].index_in_group: expected an integer or null, got 1.0"),
    (("samples", 1, "prompt"), None, "samples[1].prompt: expected a string, got NoneType"),
    (("samples", 1, "metadata"), [], "samples[1].metadata: expected an object, got list"),
    (("samples", 1, "group"), 0, "samples[1].group: give every sample a group or none (samples[0] has none)"),
    (("samples", 1, "pixels"), _DELETE, "samples[1].pixels: missing; every sample carries its output's pixels"),
    (PX, [1], "samples[2].pixels: expected an object with encoding, shape and frames or data, got list"),
    ((*PX, "encoding"), "jpeg", "samples[2].pixels.encoding: 'jpeg': expected one of png, float32"),
    ((*PX, "data"), "AAAA", "samples[2].pixels.data: unknown field of png pixels (fields: encoding, shape, frames)"),
    ((*PX, "shape"), [3, 4], "samples[2].pixels.shape: expected [C, H, W] (an image) or [C, F, H, W] (a video), got [3, 4]"),
    ((*PX, "shape"), [3, 4, 0], "samples[2].pixels.shape: dimensions must be integers of at least 1, got [3, 4, 0]"),
    ((*PX, "shape"), [3, 4, 5.0], "samples[2].pixels.shape: dimensions must be integers of at least 1, got [3, 4, 5.0]"),
    ((*PX, "shape"), [3, True, 4, 5], "samples[2].pixels.shape: dimensions must be integers of at least 1, got [3, True, 4, 5]"),
    (
        (*PX, "shape"),
        [1, 4, 5],
        "samples[2].pixels.shape: [1, 4, 5]: png pixels are RGB, so C must be 3 (send float32 for other channel counts)",
    ),
    (
        (*PX, "shape"),
        [3, 2, 4, 5],
        "samples[2].pixels.frames: expected a list of 2 base64 PNG(s), one per frame of shape [3, 2, 4, 5], got 1 frames",
    ),
    ((*PX, "frames"), "abc", "samples[2].pixels.frames: expected a list of 1 base64 PNG(s), one per frame of shape [3, 4, 5], got str"),
    ((*PX, "frames", 0), 5, "samples[2].pixels.frames[0]: expected a base64 string, got int"),
    ((*PX, "frames", 0), "not base64!", "samples[2].pixels.frames[0]: not valid base64 (Only base64 data is allowed)"),
    ((*PX, "frames", 0), png_b64(np.zeros((5, 4, 3), np.uint8)), "samples[2].pixels.frames[0]: a 4x5 PNG; the shape says 5x4 (W x H)"),
    (
        (*PX, "frames", 0),
        png_b64(np.zeros((4, 5), np.uint8), "L"),
        "samples[2].pixels.frames[0]: a PNG of mode L; the wire's frames are 8-bit RGB",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), BAD_REQUESTS, ids=[m.split(":")[0] + f"-{i}" for i, (_, _, m) in enumerate(BAD_REQUESTS)]
)
def test_decode_request_names_the_field(path, value, message):
    with pytest.raises(RequestError) as info:
        wire.decode_request(_set(request_body(), path, value), max_samples=8)
    assert str(info.value) == message and "\n" not in message


def test_decode_request_refuses_bodies_that_are_not_objects_and_broken_images():
    with pytest.raises(RequestError) as info:
        wire.decode_request([1], max_samples=8)
    assert str(info.value) == "body: expected a JSON object, got list"
    jpeg = io.BytesIO()
    Image.fromarray(np.zeros((4, 5, 3), np.uint8)).save(jpeg, format="JPEG")
    body = _set(request_body(), (*PX, "frames", 0), base64.b64encode(jpeg.getvalue()).decode())
    with pytest.raises(RequestError) as info:
        wire.decode_request(body, max_samples=8)
    assert str(info.value).startswith("samples[2].pixels.frames[0]: not a readable PNG (UnidentifiedImageError: ")
    truncated = _set(
        request_body(),
        (*PX, "frames", 0),
        base64.b64encode(base64.b64decode(request_body()["samples"][2]["pixels"]["frames"][0])[:60]).decode(),
    )
    with pytest.raises(RequestError) as info:
        wire.decode_request(truncated, max_samples=8)
    assert str(info.value).startswith("samples[2].pixels.frames[0]: not a readable PNG (")


def test_decode_request_refuses_a_16_bit_png():
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + bytes(5 * 6) for _ in range(4))  # 5 pixels of 3 x 16 bits per row
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 5, 4, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    with pytest.raises(RequestError) as info:
        wire.decode_request(_set(request_body(), (*PX, "frames", 0), base64.b64encode(png).decode()), max_samples=8)
    assert str(info.value) == "samples[2].pixels.frames[0]: a 16-bit PNG; the wire's frames are 8-bit RGB"


def test_decode_float32_checks_the_byte_count():
    body = request_body(encoding="float32")
    with pytest.raises(RequestError) as info:
        wire.decode_request(_set(body, (*PX, "data"), base64.b64encode(b"\0" * 8).decode()), max_samples=8)
    assert str(info.value) == "samples[2].pixels.data: 8 bytes; shape [3, 4, 5] needs 240 (4 per float32 value)"
    with pytest.raises(RequestError) as info:
        wire.decode_request(_set(body, (*PX, "frames"), []), max_samples=8)
    assert str(info.value) == "samples[2].pixels.frames: unknown field of float32 pixels (fields: encoding, shape, data)"


def test_decode_request_limits():
    with pytest.raises(RequestLimitError) as info:
        wire.decode_request(request_body(3), max_samples=2)
    assert info.value.status == 413 and info.value.limit == 2 and info.value.value == 3
    assert str(info.value) == (
        "samples: 3 samples, over this server's limit of 2 per request (--max-samples raises it; a client sends smaller batches)"
    )
    wire.decode_request(request_body(3), max_samples=3)
    # The values limit is checked on the declared shapes, before the huge frame is decoded.
    huge = _set(request_body(3), (*PX, "shape"), [3, 100_000, 100_000])
    with pytest.raises(RequestLimitError) as info:
        wire.decode_request(huge, max_samples=8)
    assert info.value.status == 413
    assert str(info.value).startswith(
        "samples[2].pixels.shape: the samples up to this one declare 30000000120 pixel values, over this server's limit of 1073741824"
    )
    with pytest.raises(RequestLimitError):
        wire.decode_request(request_body(3), max_samples=8, max_values=3 * 60 - 1)
    wire.decode_request(request_body(3), max_samples=8, max_values=3 * 60)


def test_empty_and_grouped_requests():
    assert wire.decode_request({"wire_version": 1, "samples": []}, max_samples=1).prompts == []
    assert wire.decode_request(request_body(3, groups=[0, 0, 1]), max_samples=8).groups == [0, 0, 1]
    body = _set(request_body(2, groups=[0, 1]), ("samples", 1, "group"), "1")
    with pytest.raises(RequestError) as info:
        wire.decode_request(body, max_samples=8)
    assert str(info.value) == "samples[1].group: expected an integer, got '1'"
    body = _set(request_body(2, groups=[0, 1]), ("samples", 1, "group"), _DELETE)
    with pytest.raises(RequestError) as info:
        wire.decode_request(body, max_samples=8)
    assert str(info.value) == "samples[1].group: give every sample a group or none (samples[0] has one)"


# -- answers -------------------------------------------------------------------------------


def test_response_roundtrip_never_writes_nan():
    body = wire.encode_response(
        [0.5, None, math.nan, 2.0], [{"a": 1.0, "bad": math.inf}, {}, {}, {}], [None, "reward x: ValueError: bad\n  pixels", None, None]
    )
    assert body == {
        "rewards": [0.5, None, None, 2.0],
        "components": [{"a": 1.0}, {}, {}, {}],
        "errors": [None, "reward x: ValueError: bad pixels", "returned nan", None],
    }
    import json

    json.dumps(body, allow_nan=False)
    assert wire.decode_response(body, 4) == [(0.5, {"a": 1.0}), "reward x: ValueError: bad pixels", "returned nan", (2.0, {})]
    assert wire.decode_response({"rewards": [1, None]}, 2) == [(1.0, {}), "the server gave no reward and no reason"]
    assert wire.decode_response({"rewards": [math.nan]}, 1) == ["the server answered nan"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "reward server answer: expected a JSON object, got list"),
        ({}, "reward server answer: rewards must be a list, got NoneType"),
        ({"rewards": [1.0]}, "reward server answer: rewards holds 1 entries for 2 samples"),
        ({"rewards": [1.0, 2.0], "errors": [None]}, "reward server answer: errors holds 1 entries for 2 samples"),
        ({"rewards": [1.0, 2.0], "components": {}}, "reward server answer: components must be a list, got dict"),
        ({"rewards": [1.0, "2"]}, "reward server answer: rewards[1] must be a number or null, got '2'"),
        ({"rewards": [1.0, True]}, "reward server answer: rewards[1] must be a number or null, got True"),
        ({"rewards": [1.0, 2.0], "errors": [None, 3]}, "reward server answer: errors[1] must be a string or null, got int"),
        ({"rewards": [1.0, 2.0], "errors": [None, "x"]}, "reward server answer: rewards[1] is a number but errors[1] gives a reason ('x')"),
        ({"rewards": [1.0, 2.0], "components": [{}, []]}, "reward server answer: components[1] must be an object, got list"),
        ({"rewards": [1.0, 2.0], "components": [{}, {"a": "b"}]}, "reward server answer: components[1].a must be a number, got 'b'"),
    ],
)
def test_decode_response_refuses_malformed_answers(body, message):
    with pytest.raises(RewardError) as info:
        wire.decode_response(body, 2)
    assert str(info.value) == message
