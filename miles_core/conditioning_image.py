"""A request's conditioning image (image-to-video): the file, its content hash, its pixels.

A request names its image by path (``image_path``, sglang-diffusion's field); the engine
reads the file, so the path must be readable where the engine runs (the same machine for
the embedded engine and loopback servers, a shared filesystem on a cluster). A family
that takes an image (:attr:`~miles_core.family.ModelFamily.image_input`) puts a
:class:`ConditioningImage` on the request's
:class:`~miles_core.family.GenerationParams` in ``resolve_params``
(:func:`request_image`). Its ``repr`` carries the file's SHA-256, so every key built from
the parameters (the engine's conditioning cache, ``--precompute-prompt-embeddings``'
store) changes with the image's content, not only with its name.

The family encodes the image once, in ``encode``, into tensors of its
:class:`~miles_core.family.Conditioning`: they travel to the trainer in the output's
``denoising_env`` with the text embeddings, so the trainer conditions on exactly what the
engine did and never reads the file itself.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_core.errors import RequestError

if TYPE_CHECKING:
    from PIL import Image

    from miles_core.request import RolloutRequest

IMAGE_PATH = "image_path"
"""The request field (sglang-diffusion's name)."""
IMAGE_INPUTS = ("none", "optional", "required")
"""What :attr:`~miles_core.family.ModelFamily.image_input` may be."""
MAX_IMAGE_BYTES = 64 * 1024 * 1024
"""The largest conditioning image file read (a request naming a huge file, or a device
that never ends, is refused before its bytes are read)."""


@dataclass(frozen=True)
class ConditioningImage:
    """One conditioning image: where it is and what it holds."""

    path: str
    sha256: str
    """Hex SHA-256 of the file's bytes: part of every cache key built from the parameters."""

    def load(self) -> Image.Image:
        """The image as RGB pixels; :class:`~miles_core.errors.RequestError` (field
        ``image_path``) when the file changed since it was hashed or is not an image."""
        return load_conditioning_image(self)


def _read(path: str) -> bytes:
    """The file's bytes: a regular file of at most :data:`MAX_IMAGE_BYTES` (a directory,
    a FIFO or a device such as ``/dev/zero`` would block or never end)."""
    try:
        # O_NONBLOCK: opening a FIFO without a writer would block (no effect on files).
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise RequestError(IMAGE_PATH, f"{path} is not a regular file")
            if info.st_size > MAX_IMAGE_BYTES:
                raise RequestError(
                    IMAGE_PATH, f"{path} holds {info.st_size} bytes; a conditioning image may hold at most {MAX_IMAGE_BYTES}"
                )
            # One byte past the cap tells a file that grew since fstat.
            data = handle.read(MAX_IMAGE_BYTES + 1)
    except IsADirectoryError:
        raise RequestError(IMAGE_PATH, f"{path} is not a regular file") from None
    except OSError as exc:
        raise RequestError(IMAGE_PATH, f"cannot read {path} ({exc.strerror or exc})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(
            IMAGE_PATH, f"{path} holds more than {MAX_IMAGE_BYTES} bytes; a conditioning image may hold at most {MAX_IMAGE_BYTES}"
        )
    return data


def request_image(request: RolloutRequest) -> ConditioningImage | None:
    """The request's conditioning image (its first ``image_path``), hashed; None when the
    request names none. An unreadable file is a :class:`~miles_core.errors.RequestError`
    naming ``image_path``."""
    if not request.image_path:
        return None
    path = request.image_path[0]
    return ConditioningImage(path, hashlib.sha256(_read(path)).hexdigest())


def load_conditioning_image(image: ConditioningImage) -> Image.Image:
    """``image``'s pixels as an RGB PIL image, turned upright by its EXIF orientation
    (as ``diffusers.utils.load_image`` does) before the conversion. The bytes must still
    hash to ``image.sha256`` (what every cache key was built from); a file that changed
    since, that PIL cannot decode, or whose pixel count PIL refuses as a decompression
    bomb, is a :class:`~miles_core.errors.RequestError` naming ``image_path``."""
    import io

    from PIL import Image, ImageOps, UnidentifiedImageError

    data = _read(image.path)
    if hashlib.sha256(data).hexdigest() != image.sha256:
        raise RequestError(IMAGE_PATH, f"{image.path} changed while the request was being served (its SHA-256 differs)")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            upright = ImageOps.exif_transpose(opened)
            return upright.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise RequestError(IMAGE_PATH, f"{image.path} is refused as a decompression bomb ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RequestError(IMAGE_PATH, f"{image.path} is not an image PIL can read ({exc})") from None


def check_request_image(family: object, request: RolloutRequest) -> None:
    """Refuse a request whose image does not fit ``family``'s
    :attr:`~miles_core.family.ModelFamily.image_input`: an image for a family that takes
    none, or none for a family that requires one (a
    :class:`~miles_core.errors.RequestError` naming ``image_path``). ``family``: a family
    or its class (untyped, so that this module and :mod:`miles_core.family` do not
    import each other)."""
    mode: Any = getattr(family, "image_input", "none")
    name = family_display_name(family)
    if request.image_path and mode == "none":
        raise RequestError(IMAGE_PATH, f"the {name} family takes no conditioning image (it is text-to-image/video)")
    if not request.image_path and mode == "required":
        raise RequestError(IMAGE_PATH, f"the {name} family is image-to-video and needs a conditioning image; none given")


def family_display_name(family: object) -> str:
    """What messages call ``family`` (a family or its class): its ``family_name``
    attribute if it has one, else the name it is registered under (looked up among the
    registrations whose module is already imported, so nothing is imported), else its
    class name (a ``--train-pipeline-config-path`` class)."""
    cls = family if isinstance(family, type) else type(family)
    own = getattr(cls, "family_name", None)
    if isinstance(own, str) and own:
        return own
    from miles_core.plugin_manager import get_host

    for registration in get_host().registries["model_family"]:
        module, _, attribute = registration.spec.ref.partition(":")
        if module in sys.modules and getattr(sys.modules[module], attribute, None) is cls:
            return registration.spec.name
    return cls.__name__
