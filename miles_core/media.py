"""Encoders for images and videos: one place for each format, used by ``miles-core
generate``, the evaluation archive and the trackers; and the readers SFT takes its clips
with (:func:`probe_video`, :func:`read_video`, :func:`read_wav`).

Frames are uint8 numpy arrays, ``[H, W, 3]`` (or ``[H, W]`` grey) for one picture and
``[F, H, W, 3]`` for a video; callers convert tensors themselves, so this module needs
only numpy and Pillow. PNG and animated GIF go through Pillow; MP4 (H.264) and WebM (VP9,
which Chromium plays) through the ffmpeg that imageio-ffmpeg bundles (the ``video`` extra:
``pip install -c constraints.txt -e '.[video]'``), imported only when a video is encoded
or read. WAV files are read with the standard library's ``wave`` module.
"""

from __future__ import annotations

import io
import re
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_FPS = 16.0

# VP9 at a constant quality (``-b:v 0 -crf 32``), tuned for speed: evaluation clips are
# small and encoded during the run, so the fastest realtime preset is plenty.
WEBM_OPTIONS = ["-b:v", "0", "-crf", "32", "-deadline", "realtime", "-cpu-used", "8", "-row-mt", "1"]


def video_encoder() -> str | None:
    """The path of the bundled ffmpeg when imageio and imageio-ffmpeg are installed (MP4
    and WebM can be written), else None: videos then fall back to animated GIFs."""
    try:
        import imageio  # noqa: F401  (the video extra installs both; either missing: no encoder)
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError, OSError):
        return None


def rgb(frames: np.ndarray) -> np.ndarray:
    """uint8 frames with the channels last, ``[..., H, W, 1 or 3]``, as RGB ``[..., H, W, 3]``."""
    if frames.dtype != np.uint8:
        raise TypeError(f"frames must be uint8, got {frames.dtype}")
    if frames.shape[-1] not in (1, 3):
        raise ValueError(f"frames must have 1 or 3 channels last, got shape {tuple(frames.shape)}")
    return np.repeat(frames, 3, axis=-1) if frames.shape[-1] == 1 else frames


def _picture(frame: np.ndarray) -> Any:
    """``[H, W, 3]`` as an RGB picture; ``[H, W, 1]`` or ``[H, W]`` as a grey one."""
    from PIL import Image

    if frame.dtype != np.uint8:
        raise TypeError(f"frames must be uint8, got {frame.dtype}")
    if frame.ndim == 3 and frame.shape[-1] == 1:
        frame = frame[..., 0]
    return Image.fromarray(frame)


def write_png(path: Path, frame: np.ndarray, *, exclusive: bool = False) -> Path:
    """One ``[H, W, 3]`` frame as a PNG. ``exclusive``: raise FileExistsError rather than
    overwrite."""
    with Path(path).open("xb" if exclusive else "wb") as handle:
        _picture(frame).save(handle, format="PNG")
    return Path(path)


def png_bytes(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    _picture(frame).save(buffer, format="PNG")
    return buffer.getvalue()


def gif_bytes(frames: np.ndarray, fps: float | None = None) -> bytes:
    """``[F, H, W, 3]`` as an animated GIF that loops (Pillow; no ffmpeg needed). GIF
    stores the frame duration in hundredths of a second, so the fps is approximate."""
    pictures = [_picture(frame) for frame in rgb(frames)]
    buffer = io.BytesIO()
    duration = max(1, round(1000 / (fps or DEFAULT_FPS)))
    pictures[0].save(buffer, format="GIF", save_all=True, append_images=pictures[1:], duration=duration, loop=0)
    return buffer.getvalue()


def write_gif(path: Path, frames: np.ndarray, fps: float | None = None, *, exclusive: bool = False) -> Path:
    data = gif_bytes(frames, fps)
    with Path(path).open("xb" if exclusive else "wb") as handle:
        handle.write(data)
    return Path(path)


def even_size(frames: np.ndarray) -> np.ndarray:
    """yuv420p stores colour at half resolution, so H.264 and VP9 in yuv420p need an even
    width and height: an odd size is padded by repeating its last row or column (the
    picture keeps its pixels; players show one extra line)."""
    height, width = frames.shape[-3:-1]
    pad = [(0, 0)] * frames.ndim
    pad[-3], pad[-2] = (0, height % 2), (0, width % 2)
    return np.pad(frames, pad, mode="edge") if height % 2 or width % 2 else frames


def _ffmpeg_video(path: Path, frames: np.ndarray, fps: float | None, codec: str, options: list[str], exclusive: bool) -> Path:
    import imageio_ffmpeg

    path = Path(path)
    frames = np.ascontiguousarray(even_size(rgb(frames)))
    # ffmpeg overwrites its output: reserving the name first keeps ``exclusive`` race-free.
    path.open("xb" if exclusive else "wb").close()
    try:
        writer = imageio_ffmpeg.write_frames(
            str(path),
            (int(frames.shape[2]), int(frames.shape[1])),
            fps=float(fps or DEFAULT_FPS),
            codec=codec,
            pix_fmt_out="yuv420p",
            macro_block_size=1,  # the size is even already: no rescaling
            quality=None if options else 5,
            output_params=options,
            ffmpeg_log_level="error",
        )
        writer.send(None)
        for frame in frames:
            writer.send(frame)
        writer.close()
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def write_mp4(path: Path, frames: np.ndarray, fps: float | None = None, *, exclusive: bool = False) -> Path:
    """``[F, H, W, 3]`` as H.264 (yuv420p) MP4 through the bundled ffmpeg."""
    return _ffmpeg_video(path, frames, fps, "libx264", [], exclusive)


def write_webm(path: Path, frames: np.ndarray, fps: float | None = None, *, exclusive: bool = False) -> Path:
    """``[F, H, W, 3]`` as VP9 (yuv420p) WebM through the bundled ffmpeg: what Chromium plays."""
    return _ffmpeg_video(path, frames, fps, "libvpx-vp9", WEBM_OPTIONS, exclusive)


@dataclass(frozen=True)
class VideoFrames:
    """Frames read from a video file (:func:`read_video`)."""

    frames: np.ndarray
    """The picked frames, uint8 ``[F, H, W, 3]``."""
    frames_read: int
    """How many frames were decoded: the whole video when it ended before the last pick."""
    fps: float
    """The container's frame rate (0 when ffmpeg cannot tell)."""


def read_video(path: Path, count: int, stride: int = 1) -> VideoFrames:
    """Frames ``0, stride, 2·stride, ...`` of a video file, at most ``count`` of them,
    decoded as RGB by the bundled ffmpeg; decoding stops at the last pick. A video that
    ends first gives fewer frames (``frames_read`` then counts all of its frames)."""
    if count < 1 or stride < 1:
        raise ValueError(f"count and stride must be >= 1, got {count} and {stride}")
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    try:
        meta = next(reader)
        width, height = meta["size"]
        picked: list[np.ndarray] = []
        read = 0
        for read, raw in enumerate(reader, start=1):
            if (read - 1) % stride == 0:
                picked.append(np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3))
                if len(picked) == count:
                    break
    finally:
        reader.close()
    frames = np.stack(picked) if picked else np.zeros((0, height, width, 3), dtype=np.uint8)
    return VideoFrames(frames=frames, frames_read=read, fps=float(meta.get("fps") or 0.0))


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` finds without decoding."""

    frames: int
    """The video stream's frames (packets), counted up to the probe's limit."""
    fps: float
    """The container's frame rate (0 when ffmpeg cannot tell)."""


_STREAM_RATE = re.compile(r"Stream #\d+:\d+.*?: Video: .*?(\d+(?:\.\d+)?)(k?) (fps|tbr)\b")
_FRAME_COUNT = re.compile(r"frame=\s*(\d+)")


def probe_video(path: Path, up_to: int) -> VideoInfo:
    """The frame count of a video file's first video stream, counted up to ``up_to``, and
    its frame rate, by the bundled ffmpeg copying packets to nowhere: the container is
    demuxed but nothing is decoded, and ffmpeg stops at ``up_to``. A file ffmpeg cannot
    open, or one without a video stream, raises ``RuntimeError`` with ffmpeg's last line."""
    import subprocess

    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(path), "-map", "0:v:0"]
    command += ["-c", "copy", "-frames:v", str(max(1, up_to)), "-f", "null", "-"]
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False)
    lines = [line.strip() for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    counts = [int(m.group(1)) for line in lines if line.startswith("frame=") for m in [_FRAME_COUNT.match(line)] if m]
    if done.returncode != 0 or not counts:
        raise RuntimeError(lines[-1] if lines else f"ffmpeg exited with status {done.returncode}")
    rate = next((m for m in map(_STREAM_RATE.search, lines) if m), None)
    fps = float(rate.group(1)) * (1000 if rate.group(2) else 1) if rate else 0.0
    return VideoInfo(frames=counts[-1], fps=fps)


def read_wav_header(path: Path) -> tuple[int, int, int]:
    """A WAV file's ``(channels, sample rate, samples per channel)`` from its header,
    without reading the samples; ``wave.Error`` or ``EOFError`` when it is no PCM WAV."""
    with wave.open(str(path), "rb") as reader:
        return reader.getnchannels(), reader.getframerate(), reader.getnframes()


def read_wav(path: Path, max_samples: int | None = None) -> tuple[np.ndarray, int]:
    """A PCM WAV file as float32 ``[channels, samples]`` in [-1, 1] and its sample rate;
    with ``max_samples``, only the first that many samples per channel are read.
    8-bit samples are unsigned (offset 128), 16-, 24- and 32-bit ones signed little-endian;
    ``wave`` refuses other encodings (IEEE float, compressed) with ``wave.Error``."""
    with wave.open(str(path), "rb") as reader:
        channels, width, rate = reader.getnchannels(), reader.getsampwidth(), reader.getframerate()
        count = reader.getnframes() if max_samples is None else min(reader.getnframes(), max_samples)
        data = reader.readframes(count)
    if width == 1:
        samples = (np.frombuffer(data, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        samples = np.frombuffer(data, dtype=f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:
        # Three little-endian bytes per sample: placed in the top of an int32, sign kept.
        raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        samples = ((raw[:, 0] << 8 | raw[:, 1] << 16 | raw[:, 2] << 24) >> 8).astype(np.float32) / float(2**23)
    else:
        raise wave.Error(f"unsupported sample width: {width} bytes")
    return np.ascontiguousarray(samples.reshape(-1, channels).T), rate


__all__ = [
    "DEFAULT_FPS",
    "VideoFrames",
    "VideoInfo",
    "even_size",
    "gif_bytes",
    "png_bytes",
    "probe_video",
    "read_video",
    "read_wav",
    "read_wav_header",
    "rgb",
    "video_encoder",
    "write_gif",
    "write_mp4",
    "write_png",
    "write_webm",
]
