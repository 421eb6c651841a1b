"""Supervised flow matching (``--loss-type sft_loss``) on image and video data.

Each row of ``--prompt-data`` carries a prompt and either an image path (under
``--sft-image-key``) or a video path (under ``--sft-video-key``); a family that denoises
audio with its video (LTX-2: :attr:`~miles_core.family.ModelFamily.audio_latent_streams`)
also needs a WAV file under ``--sft-audio-key``. Paths are relative to the JSONL file's
folder. A clip is ``--diffusion-output-num-frames`` frames: frames ``0, k, 2k, ...`` of the
video with ``k = --sft-frame-stride``, each resized to cover ``--diffusion-height`` x
``--diffusion-width`` and center-cropped as an image is; with one frame a video row gives
its first frame, an image row its image.

Each optimizer step draws, per sample, a step of the family's schedule (shift applied) and
noise from a generator seeded by ``(--seed, optimizer step)``, forms ``x_t = (1 - σ)·x0 +
σ·ε`` for every latent stream the family encodes (``encode_pixels``, plus
``encode_audio``), and regresses the velocity on ``ε − x0`` through the same family
prediction the RL losses use: the loss is the loss function's value on each stream,
summed over the streams. No rollout engine is involved.

The schedule is the checkpoint scheduler's over ``--diffusion-num-steps`` steps, or, with
``--fsdp-flow-shift s``, that scheduler rebuilt with ``shift = s`` (``σ' = s·σ / (1 +
(s − 1)·σ)`` on its unshifted grid). ``--sft-encoder-checkpoint DIR`` takes the
tokenizers, text encoders and VAE from another pipeline directory than the transformer
(:func:`miles_core.model_loading.load_sft_family`).

Checks, all before any rank trains, each one line naming the row and key (or the flag):
a row is checked when it is loaded, before any model loads (:func:`load_sft_rows`: its
files exist, an image or a video, one frame for an image; every video is opened and its
frames counted from the container, without decoding: an unreadable one, or one with
fewer than ``(frames - 1) x stride + 1`` frames, stops the run); then, once the family resolved the clip's parameters
(:func:`check_sft_run`, on the driver in every mode): a frame count the VAE cannot encode
(a :class:`~miles_core.errors.ConfigError` naming ``--diffusion-output-num-frames``), and,
for a family with an audio stream, a row without a WAV file or one whose header shows it
unreadable or shorter than ``num_frames / fps`` seconds. A video whose frame rate over the
stride differs from the clip's ``fps`` is a warning. The same checks run again as a batch
is built (a file changed during the run), naming the row and key.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import ConfigError, PromptDataError, RequestError
from miles_core.family import GenerationParams
from miles_core.request import FLOW_SHIFT, RolloutRequest
from miles_core.rollout.data import jsonl_rows
from miles_core.training.run_context import RunContext

log = logging.getLogger("miles_core.training")

AUDIO_LOOKAHEAD_S = 1.0
"""Audio past the clip that SFT reads (at most) and hands to ``encode_audio``, for a
resampler's look-ahead: the clip's ``num_frames / fps`` seconds plus this much."""

REQUEST_FLAGS = {
    "num_frames": "--diffusion-output-num-frames",
    "height": "--diffusion-height",
    "width": "--diffusion-width",
    "fps": "--diffusion-fps",
}
"""The request fields SFT fills from flags: a family's refusal of one names its flag."""


@dataclass(frozen=True)
class SftRow:
    prompt: str
    image: Path | None = None
    video: Path | None = None
    audio: Path | None = None
    where: str = ""
    """``FILE:LINE`` of the row, for errors found while its batch is built."""
    video_key: str = "video"
    audio_key: str = "audio"
    video_fps: float | None = None
    """The video container's frame rate, read when the row is loaded (0: ffmpeg cannot tell)."""


def load_sft_rows(
    path: str | Path,
    *,
    input_key: str,
    image_key: str,
    video_key: str = "video",
    audio_key: str = "audio",
    num_frames: int = 1,
    frame_stride: int = 1,
) -> list[SftRow]:
    """The rows of an SFT file: a prompt under ``input_key`` and an image under
    ``image_key`` or a video under ``video_key`` (an audio file under ``audio_key`` is
    optional here; :func:`check_sft_run` requires it where the family encodes audio).
    With ``num_frames`` above 1 every row must be a video. Every video must open and hold
    the ``(num_frames - 1) x frame_stride + 1`` frames its clip spans (counted from the
    container, once per file: :func:`~miles_core.media.probe_video`)."""
    path = Path(path)
    rows = []
    probed: dict[Path, Any] = {}
    for where, row in jsonl_rows(path):
        image, video, audio = row.get(image_key), row.get(video_key), row.get(audio_key)
        if not isinstance(row.get(input_key), str) or not (isinstance(image, str) or isinstance(video, str)):
            raise PromptDataError(
                f"{where}: SFT rows need a string {input_key!r} and a string {image_key!r} (an image path) or {video_key!r} (a video path)"
            )
        if image is not None and video is not None:
            raise PromptDataError(f"{where}: a row gives an image ({image_key!r}) or a video ({video_key!r}), not both")
        if audio is not None and not isinstance(audio, str):
            raise PromptDataError(f"{where}: {audio_key!r} must be a string (a WAV file path), got {type(audio).__name__}")
        if image is not None and num_frames > 1:
            raise PromptDataError(
                f"{where}: {image_key!r} is an image (one frame) and --diffusion-output-num-frames is {num_frames}: "
                f"give a video under {video_key!r}"
            )
        files = {}
        for what, value in (("image", image), ("video", video), ("audio", audio)):
            if value is None:
                continue
            file = (path.parent / value).resolve()
            if not file.is_file():
                raise PromptDataError(f"{where}: {what} {value!r} not found (looked at {file})")
            files[what] = file
        fps = None
        if "video" in files:
            fps = _probe_video(files["video"], probed, where, video_key, num_frames, frame_stride).fps
        rows.append(SftRow(row[input_key], **files, where=where, video_key=video_key, audio_key=audio_key, video_fps=fps))
    if not rows:
        raise PromptDataError(f"{path}: no SFT rows")
    return rows


def _video_error(where: str, video: Path, key: str, exc: Exception) -> PromptDataError:
    # ffmpeg's errors carry its whole stderr: its first and last lines say why.
    lines = [line for line in str(exc).splitlines() if line.strip()]
    why = lines[0] if len(lines) < 2 else f"{lines[0]} ({lines[-1].strip()})"
    return PromptDataError(f"{where}: video {video.name!r} under {key!r} cannot be read: {why}")


def _too_short(where: str, video: Path, key: str, has: int, frames: int, stride: int) -> PromptDataError:
    return PromptDataError(
        f"{where}: video {video.name!r} under {key!r} has {has} frames; "
        f"--diffusion-output-num-frames {frames} with --sft-frame-stride {stride} needs {(frames - 1) * stride + 1}"
    )


def _probe_video(video: Path, probed: dict[Path, Any], where: str, key: str, frames: int, stride: int) -> Any:
    """The row's video opened and its frames counted (once per file), or the one line
    that says why it cannot give the clip."""
    from miles_core.media import probe_video

    need = (frames - 1) * stride + 1
    if video not in probed:
        try:
            probed[video] = probe_video(video, need)
        except ImportError:
            raise PromptDataError(f"{where}: reading videos needs imageio-ffmpeg (pip install -c constraints.txt -e '.[video]')") from None
        except (OSError, RuntimeError) as exc:
            raise _video_error(where, video, key, exc) from None
    info = probed[video]
    if info.frames < need:
        raise _too_short(where, video, key, info.frames, frames, stride)
    return info


def fit_image(image: Any, height: int, width: int) -> torch.Tensor:
    """A PIL RGB picture resized to cover ``height`` x ``width`` (bicubic), then
    center-cropped, as ``[3, height, width]`` in [0, 1]."""
    import numpy as np
    from PIL import Image

    scale = max(height / image.height, width / image.width)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))), Image.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    cropped = resized.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(cropped, dtype=np.float32) / 255.0).permute(2, 0, 1)


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """An RGB image as [3, height, width] in [0, 1]: resized to cover, then center-cropped."""
    from PIL import Image

    with Image.open(path) as image:
        return fit_image(image.convert("RGB"), height, width)


def load_video(row: SftRow, frames: int, stride: int, height: int, width: int) -> torch.Tensor:
    """``frames`` frames of the row's video, every ``stride``-th from frame 0, each fitted
    as :func:`load_image` fits an image: ``[3, frames, height, width]`` in [0, 1]. A video
    too short for the clip is a :class:`PromptDataError` naming the row and key."""
    from PIL import Image

    from miles_core.media import read_video

    assert row.video is not None
    try:
        clip = read_video(row.video, frames, stride)
    except ImportError:
        raise PromptDataError(f"{row.where}: reading videos needs imageio-ffmpeg (pip install -c constraints.txt -e '.[video]')") from None
    except (OSError, RuntimeError, StopIteration) as exc:
        raise _video_error(row.where, row.video, row.video_key, exc) from None
    if clip.frames.shape[0] < frames:  # checked when the row was loaded: the file changed since
        raise _too_short(row.where, row.video, row.video_key, clip.frames_read, frames, stride)
    return torch.stack([fit_image(Image.fromarray(frame), height, width) for frame in clip.frames], dim=1)


def load_pixels(row: SftRow, frames: int, stride: int, height: int, width: int) -> torch.Tensor:
    """A row's pixels: ``[3, H, W]`` for a one-frame clip (its image, or its video's first
    frame), else ``[3, frames, H, W]``."""
    if row.image is not None:
        return load_image(row.image, height, width)
    video = load_video(row, frames, stride, height, width)
    return video[:, 0] if frames == 1 else video


def _clip_seconds(params: GenerationParams) -> float | None:
    """How long the clip lasts (``num_frames / fps``); None without a frame rate."""
    return (params.num_frames or 1) / params.fps if params.fps else None


def _unreadable_wav(row: SftRow, exc: Exception) -> PromptDataError:
    assert row.audio is not None
    return PromptDataError(f"{row.where}: audio {row.audio.name!r} under {row.audio_key!r} cannot be read as WAV: {exc}")


def load_audio(family: Any, row: SftRow, params: GenerationParams) -> dict[str, torch.Tensor]:
    """The clean audio latents of a row (``family.encode_audio`` on the first
    ``num_frames / fps`` seconds of its WAV file plus :data:`AUDIO_LOOKAHEAD_S`, batch 1);
    an unreadable, unsuitable or short file is a :class:`PromptDataError` naming the row
    and key."""
    import wave

    from miles_core.media import read_wav, read_wav_header

    if row.audio is None:
        raise PromptDataError(
            f"{row.where}: {type(family).__name__} denoises audio with the video: give a WAV file under {row.audio_key!r}"
        )
    seconds = _clip_seconds(params)
    try:
        limit = None if seconds is None else math.ceil((seconds + AUDIO_LOOKAHEAD_S) * read_wav_header(row.audio)[1])
        samples, rate = read_wav(row.audio, limit)
    except (OSError, EOFError, wave.Error) as exc:
        raise _unreadable_wav(row, exc) from None
    try:
        return family.encode_audio(torch.from_numpy(samples).unsqueeze(0), rate, params)
    except ValueError as exc:
        raise PromptDataError(f"{row.where}: audio {row.audio.name!r} under {row.audio_key!r} {exc}") from None


def sft_params(family: Any, config: Any) -> GenerationParams:
    """The generation parameters SFT draws its steps from; ``--fsdp-flow-shift`` (no
    engine supplies scheduler metadata here) travels as the request's ``flow_shift``. A
    size, frame count or frame rate the family refuses (a frame count its VAE cannot
    encode) is a :class:`ConfigError` naming the flag."""
    try:
        return family.resolve_params(sft_request(config))
    except RequestError as exc:
        flag = REQUEST_FLAGS.get(exc.field)
        if flag is None:
            raise
        message = str(exc).removeprefix(f"{exc.field}: ")
        raise ConfigError(f"{flag} {message}") from None


def sft_request(config: Any, prompt: str = "") -> RolloutRequest:
    """The request :func:`sft_params` resolves (``prompt`` as given): SFT encodes each
    row's prompt with these parameters and no negative prompt. The frame count is always
    given (``--diffusion-output-num-frames``, 1 for images), so a video family's clip
    geometry is the data's, not its pipeline's default length."""
    shift = config.fsdp_flow_shift
    return RolloutRequest(
        prompt=prompt,
        num_inference_steps=config.diffusion_num_steps,
        guidance_scale=1.0,
        height=config.diffusion_height,
        width=config.diffusion_width,
        num_frames=config.diffusion_output_num_frames,
        fps=config.diffusion_fps,
        extra_sampling_params={FLOW_SHIFT: shift} if shift is not None else {},
    )


def check_sft_run(trainer: Any, config: Any, rows: Sequence[SftRow], family_cls: type | None = None) -> GenerationParams:
    """Before training, on the driver: the clip's parameters (:func:`sft_params`) and, for
    a family with an audio stream (``family_cls``, else the trainer's family's class), a
    WAV file in every row whose header shows it lasts the clip's ``num_frames / fps``
    seconds (the samples are not read). A video whose frame rate over the stride is not
    the clip's ``fps`` is logged once. Returns the parameters."""
    ranks_params = getattr(trainer, "sft_params", None)
    params = ranks_params() if callable(ranks_params) else sft_params(trainer.family, config)
    family_cls = family_cls or type(getattr(trainer, "family", None))
    if getattr(family_cls, "audio_latent_streams", ()):
        _check_audio_files(rows, params, config.model_family or family_cls.__name__)
    _warn_on_frame_rate(rows, params, config.sft_frame_stride)
    return params


def _check_audio_files(rows: Sequence[SftRow], params: GenerationParams, family: str) -> None:
    """Every row's WAV file exists in the row, opens, and lasts the clip (its header)."""
    import wave

    from miles_core.media import read_wav_header

    seconds = _clip_seconds(params)
    checked: set[Path] = set()
    for row in rows:
        if row.audio is None:
            raise PromptDataError(
                f"{row.where}: the {family} family denoises audio with the video: give a WAV file under {row.audio_key!r} (--sft-audio-key)"
            )
        if row.audio in checked:
            continue
        try:
            _, rate, samples = read_wav_header(row.audio)
        except (OSError, EOFError, wave.Error) as exc:
            raise _unreadable_wav(row, exc) from None
        # The rule the families apply to the samples (LTX-2: round(seconds x rate) of them).
        if seconds is not None and samples < round(seconds * rate):
            raise PromptDataError(
                f"{row.where}: audio {row.audio.name!r} under {row.audio_key!r} lasts {samples / rate:.3f} s; the clip needs "
                f"{seconds:.3f} s ({params.num_frames or 1} frames at {params.fps:g} fps: --diffusion-output-num-frames / "
                "--diffusion-fps)"
            )
        checked.add(row.audio)


def _warn_on_frame_rate(rows: Sequence[SftRow], params: GenerationParams, stride: int) -> None:
    """One warning per run when a video's frame rate over the stride is not the rate the
    family conditions on (``params.fps``): the model would learn motion at another speed."""
    if not params.fps or (params.num_frames or 1) < 2:
        return
    off = [row for row in rows if row.video_fps and not math.isclose(row.video_fps / stride, params.fps, rel_tol=0.01)]
    if off:
        row = off[0]
        assert row.video is not None and row.video_fps is not None
        others = len({r.video for r in off}) - 1
        log.warning(
            f"{row.where}: video {row.video.name!r} under {row.video_key!r} plays at {row.video_fps:g} fps, so "
            f"--sft-frame-stride {stride} gives clips at {row.video_fps / stride:g} fps, but the run's clips are "
            f"{params.fps:g} fps (--diffusion-fps, or the family's default): the motion is learnt at another speed"
            + (f" ({others} more video(s) differ too)" if others else "")
        )


def sft_batch(
    family: Any,
    rows: Sequence[SftRow],
    params: GenerationParams,
    generator: torch.Generator,
    cache: Any = None,
    *,
    frame_stride: int = 1,
) -> dict[str, Any]:
    """Everything one SFT micro-batch needs: x_t, timesteps, targets and conditioning.
    ``cache`` (a :class:`~miles_core.engine.sampler.ConditioningCache`) keeps prompt
    encodings across steps: the text encoders are frozen."""
    from miles_core.family import Conditioning

    schedule = family.schedule(params)
    frames = params.num_frames or 1
    with torch.no_grad():
        # Rows of one file (a clip repeated in the data) are read once per micro-batch.
        loaded: dict[Path | None, torch.Tensor] = {}
        for row in rows:
            if (row.image or row.video) not in loaded:
                loaded[row.image or row.video] = load_pixels(row, frames, frame_stride, params.height, params.width)
        pixels = torch.stack([loaded[row.image or row.video] for row in rows])
        x0 = dict(family.encode_pixels(pixels, params))
        audio_streams = getattr(family, "audio_latent_streams", ())
        if audio_streams:
            sounds: dict[Path | None, dict[str, torch.Tensor]] = {}
            for row in rows:
                if row.audio not in sounds:
                    sounds[row.audio] = load_audio(family, row, params)
            x0.update({name: torch.cat([sounds[row.audio][name] for row in rows]) for name in audio_streams})
        encode = family.encode if cache is None else (lambda *args: cache.encode(family, *args))
        cond = Conditioning.cat([encode(row.prompt, None, params) for row in rows])
    steps = torch.randint(0, params.num_inference_steps, (len(rows),), generator=generator)
    sigma = schedule.sigmas.cpu()[steps]
    # One draw per stream, in the family's stream order (a resumed run draws the same).
    streams = [name for name in family.latent_streams if name in x0]
    noise = {name: torch.randn(x0[name].shape, generator=generator, dtype=torch.float32) for name in streams}
    x_t = {}
    for name in streams:
        shape = (-1,) + (1,) * (x0[name].ndim - 1)
        x_t[name] = (1 - sigma.view(shape)) * x0[name].float().cpu() + sigma.view(shape) * noise[name]
    return {
        "x_t": {name: x.to(family.device, family.dtype) for name, x in x_t.items()},
        "sigma": sigma,
        "timestep": schedule.timesteps.cpu()[steps].to(family.device),
        "noise": {name: n.to(family.device) for name, n in noise.items()},
        "x0": {name: x0[name].float() for name in streams},
        "cond": cond,
    }


def sft_stream_loss(
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]], velocity: dict[str, torch.Tensor], data: dict[str, Any], config: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss function on every latent stream of the batch, summed. One stream gives
    the loss function's own value and metrics; with several, each metric is also reported
    per stream (``sft_loss_audio_latents``) and the plain name holds the sum."""

    def stream_loss(name: str) -> tuple[torch.Tensor, dict[str, Any]]:
        return loss_fn({"v": velocity[name], "noise": data["noise"][name], "x0": data["x0"][name]}, config)

    streams = list(data["x0"])
    if len(streams) == 1:
        return stream_loss(streams[0])
    total: torch.Tensor | None = None
    metrics: dict[str, Any] = {}
    for name in streams:
        loss, stream_metrics = stream_loss(name)
        total = loss if total is None else total + loss
        for key, value in stream_metrics.items():
            metrics[f"{key}_{name}"] = value
            metrics[key] = value if key not in metrics else metrics[key] + value
    assert total is not None
    return total, metrics


async def sft_rollouts(run: RunContext) -> AsyncIterator[tuple[dict[str, Any], tuple[()]]]:
    """The SFT loop: each "rollout" is ``--num-steps-per-rollout`` optimizer steps over
    ``rollout_batch_size x n_samples_per_prompt`` rows of ``run.rows``."""
    from miles_core.rollout.data import PromptSource
    from miles_core.training.metrics_logging import Progress

    config, trainer = run.config, run.trainer
    progress = run.progress or Progress(enabled=False)
    # Training ranks on Ray resolve the parameters from their family (the driver loads none).
    ranks_params = getattr(trainer, "sft_params", None)
    params = ranks_params() if callable(ranks_params) else sft_params(trainer.family, config)
    source = PromptSource(run.rows, batch_size=config.rollout_batch_size * config.n_samples_per_prompt, seed=config.rollout_seed)
    for rollout_id in range(run.start, run.total):
        began = time.perf_counter()
        metrics: dict[str, Any] = {"rollout_id": rollout_id}
        run.settled = None  # mid-step the trainer holds no rollout's end state: nothing to checkpoint
        with progress.training(trainer, f"train {rollout_id + 1}/{run.total}", "step"):
            metrics.update(trainer.train_sft(source.batch(rollout_id), params, run.schedule.lr_at))
        run.settled = rollout_id
        metrics["perf/train_time"] = metrics["perf/step_time"] = time.perf_counter() - began
        yield metrics, ()
