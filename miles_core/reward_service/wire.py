"""The reward wire, version 1: the JSON a reward client sends to ``POST /score`` and what a
reward server answers (docs/rewards.md, "The reward wire"). Pure encoding and decoding,
no HTTP: the server (:mod:`miles_core.reward_service.server`) and the client
(``--rm-type remote``) share it.

A request::

    {"wire_version": 1, "reward": "pickscore" | null,
     "samples": [{"prompt": str, "metadata": {...}, "group": int (optional), "seed": int (optional),
                  "index_in_group": int (optional), "pixels": PIXELS}, ...]}

``PIXELS`` carries one output, an image ``[C, H, W]`` or a video ``[C, F, H, W]``:

- ``{"encoding": "png", "shape": [3, ...], "frames": [base64 PNG, ...]}``: one 8-bit RGB
  PNG per frame (an image: one) of ``round(clamp(x, 0, 1) * 255)``, decoded as
  ``uint8 / 255`` in float32. Lossless for every reward that reads 8-bit images (they
  quantise the same way), about a quarter of float32's bytes before compression.
- ``{"encoding": "float32", "shape": [...], "data": base64}``: the little-endian float32
  values in C order, exact; any channel count, values need not lie in [0, 1].

An answer: ``{"rewards": [float | null], "components": [{name: float}], "errors": [null |
str]}``, one entry per sample; a sample the reward failed on has ``null`` and its one-line
reason. NaN and infinities never appear: they are not JSON.

Decoding checks everything a client controls (types, shapes, sizes, base64, PNG headers)
and raises :class:`~miles_core.errors.RequestError` naming the field as a path
(``samples[2].pixels.shape``); a malformed answer raises
:class:`~miles_core.errors.RewardError`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from miles_core.errors import RequestError, RequestLimitError, RewardError

WIRE_VERSION = 1
PIXEL_ENCODINGS = ("png", "float32")

DEFAULT_MAX_VALUES = 1 << 30
"""Most pixel values (channels x frames x height x width, summed over the samples) one
request may declare: 4 GiB once decoded to float32. A PNG frame may inflate a thousandfold,
so the body cap alone does not bound a request's memory; this does, checked on the
declared shapes before anything is decoded."""

_FLOAT32_LE = np.dtype("<f4")
_PNG_COMPRESS_LEVEL = 1
"""zlib level of the PNGs we write: lossless at every level; 1 encodes several times faster
than Pillow's default 6 for a few percent more bytes."""

_SAMPLE_FIELDS = ("prompt", "metadata", "group", "seed", "index_in_group", "pixels")
_REQUEST_FIELDS = ("wire_version", "reward", "samples")


@dataclass(frozen=True)
class ScoreRequest:
    """A decoded ``POST /score`` body."""

    reward: str | None
    """The reward the client expects (None: any)."""
    prompts: list[str]
    metadata: list[dict[str, Any]]
    pixels: list[torch.Tensor]
    """float32 ``[C, H, W]`` or ``[C, F, H, W]``, one per sample."""
    groups: list[int] | None
    """Each sample's prompt group, or None when the request gave none."""
    seeds: list[int | None]
    """Each sample's seed where the request gave one (what a reward's messages name)."""
    indices: list[int | None]
    """Each sample's index in its prompt group where the request gave one."""


# -- pixels ------------------------------------------------------------------------------


def _shape_of(pixels: torch.Tensor) -> list[int]:
    shape = list(pixels.shape)
    if len(shape) not in (3, 4) or min(shape) < 1:
        raise RequestError("pixels", f"shape {shape}: expected an image [C, H, W] or a video [C, F, H, W] with no empty dimension")
    return shape


def encode_pixels(pixels: torch.Tensor, encoding: str) -> dict[str, Any]:
    """One output, ``[C, H, W]`` or ``[C, F, H, W]``, as the wire's pixels object;
    :class:`~miles_core.errors.RequestError` for a shape or values the encoding cannot carry."""
    if encoding not in PIXEL_ENCODINGS:
        raise RequestError("pixels.encoding", f"{encoding!r}: expected one of {', '.join(PIXEL_ENCODINGS)}")
    if not torch.is_tensor(pixels):
        raise RequestError("pixels", f"expected a tensor, got {type(pixels).__name__}")
    shape = _shape_of(pixels)
    values = pixels.detach().to("cpu", torch.float32)
    if encoding == "float32":
        data = values.contiguous().numpy().astype(_FLOAT32_LE, copy=False).tobytes()
        return {"encoding": "float32", "shape": shape, "data": base64.b64encode(data).decode("ascii")}
    if shape[0] != 3:
        raise RequestError("pixels", f"shape {shape}: png carries RGB (3 channels); send float32 for {shape[0]}")
    if not bool(torch.isfinite(values).all()):
        raise RequestError("pixels", "NaN or infinite values cannot be sent as png; send float32")
    frames = [values] if len(shape) == 3 else list(values.unbind(1))
    from PIL import Image

    encoded = []
    for frame in frames:
        # In float64, where x * 255 is exact for every float32 x, as the 8-bit rewards
        # quantise (miles_rewards.pixels): in float32 the product rounds first and a few
        # values per image land on the other side of .5. One frame at a time: a video in
        # float64 would take twice its float32 memory.
        quantised = frame.double().clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8)
        buffer = io.BytesIO()
        Image.fromarray(quantised.permute(1, 2, 0).contiguous().numpy(), "RGB").save(
            buffer, format="PNG", compress_level=_PNG_COMPRESS_LEVEL
        )
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return {"encoding": "png", "shape": shape, "frames": encoded}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_shape(obj: Mapping[str, Any], where: str) -> list[int]:
    shape = obj.get("shape")
    if not isinstance(shape, list) or len(shape) not in (3, 4):
        raise RequestError(f"{where}.shape", f"expected [C, H, W] (an image) or [C, F, H, W] (a video), got {shape!r:.80}")
    if not all(_is_int(d) and d >= 1 for d in shape):
        raise RequestError(f"{where}.shape", f"dimensions must be integers of at least 1, got {shape!r:.80}")
    return shape


def _b64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise RequestError(where, f"expected a base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(where, f"not valid base64 ({exc})") from None


def _pixels_object(obj: Any, where: str) -> tuple[str, list[int]]:
    """The pixels object's encoding and shape, checked; nothing decoded yet."""
    if not isinstance(obj, dict):
        raise RequestError(where, f"expected an object with encoding, shape and frames or data, got {type(obj).__name__}")
    encoding = obj.get("encoding")
    if encoding not in PIXEL_ENCODINGS:
        raise RequestError(f"{where}.encoding", f"{encoding!r:.40}: expected one of {', '.join(PIXEL_ENCODINGS)}")
    payload = "frames" if encoding == "png" else "data"
    unknown = sorted(set(obj) - {"encoding", "shape", payload})
    if unknown:
        raise RequestError(f"{where}.{unknown[0]}", f"unknown field of {encoding} pixels (fields: encoding, shape, {payload})")
    shape = _checked_shape(obj, where)
    if encoding == "png" and shape[0] != 3:
        raise RequestError(f"{where}.shape", f"{shape}: png pixels are RGB, so C must be 3 (send float32 for other channel counts)")
    return encoding, shape


def decode_pixels(obj: Any, where: str) -> torch.Tensor:
    """The wire's pixels object as a float32 tensor of its shape;
    :class:`~miles_core.errors.RequestError` naming ``where`` (``samples[2].pixels``) and
    the rule for anything malformed."""
    encoding, shape = _pixels_object(obj, where)
    if encoding == "float32":
        data = _b64(obj.get("data"), f"{where}.data")
        expected = math.prod(shape) * _FLOAT32_LE.itemsize
        if len(data) != expected:
            raise RequestError(f"{where}.data", f"{len(data)} bytes; shape {shape} needs {expected} (4 per float32 value)")
        return torch.from_numpy(np.frombuffer(data, dtype=_FLOAT32_LE).astype(np.float32).reshape(shape))
    frames = obj.get("frames")
    count = 1 if len(shape) == 3 else shape[1]
    if not isinstance(frames, list) or len(frames) != count:
        got = f"{len(frames)} frames" if isinstance(frames, list) else type(frames).__name__
        raise RequestError(f"{where}.frames", f"expected a list of {count} base64 PNG(s), one per frame of shape {shape}, got {got}")
    height, width = shape[-2:]
    decoded = [_png_frame(_b64(frame, f"{where}.frames[{j}]"), f"{where}.frames[{j}]", width, height) for j, frame in enumerate(frames)]
    array = torch.from_numpy(np.stack(decoded)).float().div(255.0)  # [F, H, W, 3]
    if len(shape) == 3:
        return array[0].permute(2, 0, 1).contiguous()
    return array.permute(3, 0, 1, 2).contiguous()


def _png_frame(data: bytes, where: str, width: int, height: int) -> np.ndarray:
    """One frame's ``[H, W, 3]`` uint8, its header checked against the shape before its
    pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            if image.mode != "RGB":
                raise RequestError(where, f"a PNG of mode {image.mode}; the wire's frames are 8-bit RGB")
            if image.tile and str(image.tile[0][3]).startswith("RGB;16"):
                raise RequestError(where, "a 16-bit PNG; the wire's frames are 8-bit RGB")
            if image.size != (width, height):
                raise RequestError(where, f"a {image.size[0]}x{image.size[1]} PNG; the shape says {width}x{height} (W x H)")
            array = np.asarray(image)
    except RequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise RequestError(where, f"not a readable PNG ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    return array


# -- requests ----------------------------------------------------------------------------


def encode_sample(
    pixels: torch.Tensor,
    prompt: str,
    metadata: Mapping[str, Any] | None,
    *,
    encoding: str,
    group: int | None = None,
    seed: int | None = None,
    index_in_group: int | None = None,
) -> dict[str, Any]:
    """One entry of a request's ``samples``; :class:`~miles_core.errors.RequestError`
    naming the field for what cannot go on the wire (pixels png cannot carry, metadata
    that is not JSON), so a client can fail that sample alone."""
    sample: dict[str, Any] = {"prompt": prompt, "metadata": dict(metadata or {})}
    try:
        json.dumps(sample["metadata"], allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RequestError("metadata", f"not JSON ({exc})") from None
    for name, value in (("group", group), ("seed", seed), ("index_in_group", index_in_group)):
        if value is not None:
            sample[name] = int(value)
    sample["pixels"] = encode_pixels(pixels, encoding)
    return sample


def encode_request(
    pixels: Sequence[torch.Tensor],
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    *,
    encoding: str,
    reward: str | None,
    groups: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A ``POST /score`` body for these samples (one entry of each sequence per sample)."""
    n = len(pixels)
    if len(prompts) != n or len(metadata) != n or (groups is not None and len(groups) != n):
        lengths = f"{n} pixels, {len(prompts)} prompts, {len(metadata)} metadata" + (
            f", {len(groups)} groups" if groups is not None else ""
        )
        raise RequestError("samples", f"one of each per sample is needed, got {lengths}")
    samples = []
    for i in range(n):
        try:
            samples.append(
                encode_sample(pixels[i], prompts[i], metadata[i], encoding=encoding, group=None if groups is None else groups[i])
            )
        except RequestError as exc:
            raise RequestError(f"samples[{i}].{exc.field}", str(exc).split(": ", 1)[1]) from None
    return {"wire_version": WIRE_VERSION, "reward": reward, "samples": samples}


def decode_request(body: Any, *, max_samples: int, max_values: int = DEFAULT_MAX_VALUES) -> ScoreRequest:
    """A ``POST /score`` body, checked. :class:`~miles_core.errors.RequestError` naming the
    field for anything malformed; :class:`~miles_core.errors.RequestLimitError` (413) for
    more than ``max_samples`` samples (``--max-samples``) or more than ``max_values`` pixel
    values in all (checked on the declared shapes, before any pixel is decoded)."""
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_REQUEST_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field (fields: {', '.join(_REQUEST_FIELDS)})")
    if "wire_version" not in body:
        raise RequestError("wire_version", f"missing; this server speaks wire version {WIRE_VERSION}")
    version = body["wire_version"]
    if not _is_int(version) or version != WIRE_VERSION:
        raise RequestError("wire_version", f"{version!r:.40}: this server speaks wire version {WIRE_VERSION}")
    reward = body.get("reward")
    if reward is not None and not isinstance(reward, str):
        raise RequestError("reward", f"expected the reward's name or null, got {type(reward).__name__}")
    samples = body.get("samples")
    if not isinstance(samples, list):
        raise RequestError("samples", f"expected a list of samples, got {type(samples).__name__}")
    if len(samples) > max_samples:
        raise RequestLimitError(
            "samples",
            f"{len(samples)} samples, over this server's limit of {max_samples} per request (--max-samples raises it; "
            "a client sends smaller batches)",
            value=len(samples),
            limit=max_samples,
            flag="--max-samples",
            status=413,
        )
    prompts: list[str] = []
    metadata: list[dict[str, Any]] = []
    groups: list[int] = []
    seeds: list[int | None] = []
    indices: list[int | None] = []
    grouped = False
    checked: list[tuple[str, Any]] = []
    declared = 0
    for i, sample in enumerate(samples):
        where = f"samples[{i}]"
        if not isinstance(sample, dict):
            raise RequestError(where, f"expected an object with prompt, metadata and pixels, got {type(sample).__name__}")
        unknown = sorted(set(sample) - set(_SAMPLE_FIELDS))
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"unknown field (fields: {', '.join(_SAMPLE_FIELDS)})")
        prompt = sample.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(f"{where}.prompt", f"expected a string, got {type(prompt).__name__}")
        meta = sample.get("metadata", {})
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise RequestError(f"{where}.metadata", f"expected an object, got {type(meta).__name__}")
        if i == 0:
            grouped = "group" in sample
        elif ("group" in sample) != grouped:
            raise RequestError(f"{where}.group", f"give every sample a group or none (samples[0] has {'one' if grouped else 'none'})")
        if "group" in sample:
            group = sample["group"]
            if not _is_int(group):
                raise RequestError(f"{where}.group", f"expected an integer, got {group!r:.40}")
            groups.append(group)
        for name, into in (("seed", seeds), ("index_in_group", indices)):
            value = sample.get(name)
            if value is not None and not _is_int(value):
                raise RequestError(f"{where}.{name}", f"expected an integer or null, got {value!r:.40}")
            into.append(value)
        if "pixels" not in sample:
            raise RequestError(f"{where}.pixels", "missing; every sample carries its output's pixels")
        _, shape = _pixels_object(sample["pixels"], f"{where}.pixels")
        declared += math.prod(shape)
        if declared > max_values:
            raise RequestLimitError(
                f"{where}.pixels.shape",
                f"the samples up to this one declare {declared} pixel values, over this server's limit of {max_values} per "
                "request; a client sends smaller batches",
                value=declared,
                limit=max_values,
                flag="",
                status=413,
            )
        checked.append((f"{where}.pixels", sample["pixels"]))
        prompts.append(prompt)
        metadata.append(meta)
    pixels = [decode_pixels(obj, where) for where, obj in checked]
    return ScoreRequest(
        reward=reward, prompts=prompts, metadata=metadata, pixels=pixels, groups=groups if groups else None, seeds=seeds, indices=indices
    )


# -- answers -----------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def encode_response(
    values: Sequence[float | None], components: Sequence[Mapping[str, float]], errors: Sequence[str | None]
) -> dict[str, Any]:
    """The ``200`` answer. A value that is None, NaN or infinite goes out as ``null`` with
    its error (``"returned nan"`` when none was given); non-finite components are left out."""
    if not len(values) == len(components) == len(errors):
        raise ValueError(f"one value, components and error per sample, got {len(values)}, {len(components)}, {len(errors)}")
    rewards: list[float | None] = []
    reasons: list[str | None] = []
    for value, error in zip(values, errors):
        number = None if value is None else _finite(value)
        rewards.append(number)
        if number is None:
            reasons.append(" ".join(str(error).split()) if error else ("no reward" if value is None else f"returned {value}"))
        else:
            reasons.append(None)
    parts = [{str(k): f for k, v in part.items() if (f := _finite(v)) is not None} for part in components]
    return {"rewards": rewards, "components": parts, "errors": reasons}


def decode_response(body: Any, n: int) -> list[tuple[float, dict[str, float]] | str]:
    """Per sample ``(reward, components)``, or the reason the server gave for a sample it
    could not score; :class:`~miles_core.errors.RewardError` (one line) for an answer that
    does not follow the wire or does not hold ``n`` samples. ``components`` and ``errors``
    may be left out (no components, no reasons); a reward the server sent as NaN or an
    infinity (not JSON, but Python's json writes them) fails that sample only."""
    if not isinstance(body, dict):
        raise RewardError(f"reward server answer: expected a JSON object, got {type(body).__name__}")
    rewards = body.get("rewards")
    components = body.get("components", [{}] * n)
    errors = body.get("errors", [None] * n)
    for name, value in (("rewards", rewards), ("components", components), ("errors", errors)):
        if not isinstance(value, list):
            raise RewardError(f"reward server answer: {name} must be a list, got {type(value).__name__}")
        if len(value) != n:
            raise RewardError(f"reward server answer: {name} holds {len(value)} entries for {n} samples")
    results: list[tuple[float, dict[str, float]] | str] = []
    for i, (value, parts, error) in enumerate(zip(rewards, components, errors)):
        if error is not None and not isinstance(error, str):
            raise RewardError(f"reward server answer: errors[{i}] must be a string or null, got {type(error).__name__}")
        if not isinstance(parts, dict):
            raise RewardError(f"reward server answer: components[{i}] must be an object, got {type(parts).__name__}")
        if value is None:
            results.append(" ".join(error.split()) if error else "the server gave no reward and no reason")
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward server answer: rewards[{i}] must be a number or null, got {value!r:.40}")
        if error is not None:
            raise RewardError(f"reward server answer: rewards[{i}] is a number but errors[{i}] gives a reason ({error[:80]!r})")
        if not math.isfinite(float(value)):
            results.append(f"the server answered {float(value)}")
            continue
        extras: dict[str, float] = {}
        for key, part in parts.items():
            if isinstance(part, bool) or not isinstance(part, numbers.Real):
                raise RewardError(f"reward server answer: components[{i}].{key} must be a number, got {part!r:.40}")
            if math.isfinite(float(part)):
                extras[str(key)] = float(part)
        results.append((float(value), extras))
    return results


__all__ = [
    "DEFAULT_MAX_VALUES",
    "PIXEL_ENCODINGS",
    "WIRE_VERSION",
    "ScoreRequest",
    "decode_pixels",
    "decode_request",
    "decode_response",
    "encode_pixels",
    "encode_request",
    "encode_response",
    "encode_sample",
]
