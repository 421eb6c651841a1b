"""Encoders for images and videos: one place for each format, used by ``miles-core
generate``, the evaluation archive and the trackers.

Frames are uint8 numpy arrays, ``[H, W, 3]`` (or ``[H, W]`` grey) for one picture and
``[F, H, W, 3]`` for a video; callers convert tensors themselves, so this module needs
only numpy and Pillow. PNG and animated GIF go through Pillow; MP4 (H.264) and WebM (VP9,
which Chromium plays) through the ffmpeg that imageio-ffmpeg bundles (the ``video`` extra:
``pip install -c constraints.txt -e '.[video]'``), imported only when a video is encoded.
"""

from __future__ import annotations

import io
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


__all__ = [
    "DEFAULT_FPS",
    "even_size",
    "gif_bytes",
    "png_bytes",
    "rgb",
    "video_encoder",
    "write_gif",
    "write_mp4",
    "write_png",
    "write_webm",
]
