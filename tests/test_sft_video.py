"""Video SFT's data side, without a model: reading clips (every k-th frame) and WAV files,
the rows (an image or a video, an optional audio file), the checks before training and
their one-line errors that name a row and key, the frame-rate warning, the SFT flags'
rules, and the loss over several latent streams (the suite installs imageio-ffmpeg). The families' runs
on tiny pipelines are in their suites (Wan 2.2, LTX-2 with audio, Cosmos 3)."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles_core import media
from miles_core.config.reference_flags import UNAVAILABLE
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError, PromptDataError
from miles_core.family import GenerationParams
from miles_core.losses import sft
from miles_core.training.sft import SftRow, check_sft_run, load_pixels, load_sft_rows, sft_stream_loss

COLOURS = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (250, 250, 10), (10, 250, 250), (250, 10, 250), (128, 128, 128)]
"""One solid colour per frame: H.264 keeps a flat frame's colour to a few levels."""


def _clip(path: Path, count: int, size: int = 16) -> Path:
    frames = np.stack([np.full((size, size, 3), colour, dtype=np.uint8) for colour in COLOURS[:count]])
    return media.write_mp4(path, frames, fps=8)


def _colours(frames: np.ndarray) -> list[int]:
    """Which of COLOURS each frame shows (its mean pixel's nearest)."""
    means = frames.reshape(frames.shape[0], -1, 3).mean(axis=1)
    return [int(np.argmin(np.abs(np.array(COLOURS) - mean).sum(axis=1))) for mean in means]


def test_read_video_takes_every_kth_frame_from_the_first(tmp_path: Path) -> None:
    clip = _clip(tmp_path / "clip.mp4", 7)
    for stride, count, picked, read in ((1, 3, [0, 1, 2], 3), (2, 3, [0, 2, 4], 5), (3, 3, [0, 3, 6], 7), (2, 5, [0, 2, 4, 6], 7)):
        frames = media.read_video(clip, count, stride)
        assert _colours(frames.frames) == picked and frames.frames_read == read, (stride, count)
        assert frames.frames.dtype == np.uint8 and frames.frames.shape[1:] == (16, 16, 3) and frames.fps == 8.0


def _write_wav(path: Path, width: int, channels: int, samples: np.ndarray, rate: int = 8000) -> None:
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())


def test_read_wav_decodes_every_pcm_width(tmp_path: Path) -> None:
    values = np.array([[-1.0, -0.5, 0.0, 0.25], [0.5, 0.75, -0.25, 0.0]])  # [channels, samples]
    interleaved = values.T.reshape(-1)
    for width in (1, 2, 3, 4):
        scale = 2 ** (8 * width - 1)
        ints = np.round(interleaved * scale).clip(-scale, scale - 1).astype(np.int64)
        if width == 1:
            data = (ints + 128).astype(np.uint8)  # 8-bit WAV is unsigned
        elif width == 3:
            data = np.stack([(ints >> shift) & 0xFF for shift in (0, 8, 16)], axis=1).astype(np.uint8)
        else:
            data = ints.astype(f"<i{width}")
        _write_wav(tmp_path / f"{width}.wav", width, 2, data)
        samples, rate = media.read_wav(tmp_path / f"{width}.wav")
        # Exact: the integers are multiples of a power of two, rescaled by one.
        expected = (ints.reshape(-1, 2).T / scale).astype(np.float32)
        assert rate == 8000 and samples.dtype == np.float32 and np.array_equal(samples, expected), width


def _rows(tmp_path: Path, *rows: dict) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.exercises("--sft-video-key", "--sft-audio-key", "--sft-image-key")
def test_sft_rows_take_an_image_or_a_video_and_name_the_row_and_keys(tmp_path: Path) -> None:
    _clip(tmp_path / "clip.mp4", 3)
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "p.png").write_bytes(b"")
    data = _rows(tmp_path, {"input": "a", "clip": "clip.mp4", "sound": "a.wav"}, {"input": "b", "picture": "p.png"})
    rows = load_sft_rows(data, input_key="input", image_key="picture", video_key="clip", audio_key="sound")
    assert rows == [
        SftRow(
            "a",
            video=tmp_path / "clip.mp4",
            audio=tmp_path / "a.wav",
            where=f"{data}:1",
            video_key="clip",
            audio_key="sound",
            video_fps=8.0,
        ),
        SftRow("b", image=tmp_path / "p.png", where=f"{data}:2", video_key="clip", audio_key="sound"),
    ]

    def error(*rows: dict, num_frames: int = 1) -> str:
        with pytest.raises(PromptDataError) as caught:
            load_sft_rows(_rows(tmp_path, *rows), input_key="input", image_key="image", num_frames=num_frames)
        return str(caught.value)

    where = f"{tmp_path / 'sft.jsonl'}:1"
    assert (
        error({"input": "a"}) == f"{where}: SFT rows need a string 'input' and a string 'image' (an image path) or 'video' (a video path)"
    )
    assert (
        error({"input": "a", "image": "p.png", "video": "clip.mp4"})
        == f"{where}: a row gives an image ('image') or a video ('video'), not both"
    )
    assert error({"input": "a", "image": "p.png"}, num_frames=5) == (
        f"{where}: 'image' is an image (one frame) and --diffusion-output-num-frames is 5: give a video under 'video'"
    )
    assert error({"input": "a", "video": "gone.mp4"}) == f"{where}: video 'gone.mp4' not found (looked at {tmp_path / 'gone.mp4'})"
    assert error({"input": "a", "video": "clip.mp4", "audio": 3}) == f"{where}: 'audio' must be a string (a WAV file path), got int"


@pytest.mark.exercises("--sft-frame-stride", "--diffusion-output-num-frames")
def test_rows_are_checked_against_the_clip_from_the_container_when_loaded(tmp_path: Path) -> None:
    """Before any model loads: a video with fewer than (frames - 1) x stride + 1 frames, or
    one ffmpeg cannot open, is one line naming the row and key."""
    _clip(tmp_path / "clip.mp4", 7)
    (tmp_path / "bad.mp4").write_text("not a video", encoding="utf-8")

    def load(frames: int, stride: int, *videos: str) -> list[SftRow]:
        path = _rows(tmp_path, *({"input": "a", "clip": video} for video in videos))
        return load_sft_rows(path, input_key="input", image_key="image", video_key="clip", num_frames=frames, frame_stride=stride)

    # 7 frames: exactly (4 - 1) x 2 + 1; a file in several rows is read once.
    assert [row.video_fps for row in load(4, 2, "clip.mp4", "clip.mp4")] == [8.0, 8.0]
    data = tmp_path / "sft.jsonl"
    with pytest.raises(PromptDataError) as caught:
        load(3, 4, "clip.mp4")
    assert str(caught.value) == (
        f"{data}:1: video 'clip.mp4' under 'clip' has 7 frames; --diffusion-output-num-frames 3 with --sft-frame-stride 4 needs 9"
    )
    with pytest.raises(PromptDataError) as caught:
        load(1, 1, "clip.mp4", "bad.mp4")  # one frame: the video must still open
    message = str(caught.value)
    assert message.startswith(f"{data}:2: video 'bad.mp4' under 'clip' cannot be read: ") and "\n" not in message


def _wav(path: Path, seconds: float, rate: int = 8000) -> Path:
    _write_wav(path, 2, 1, np.zeros(round(seconds * rate), dtype="<i2"), rate)
    return path


class _AudioFamily:
    audio_latent_streams = ("audio_latents",)


def test_before_training_wav_headers_are_checked_and_a_frame_rate_mismatch_is_logged(tmp_path: Path, caplog) -> None:
    """check_sft_run on the driver: a family with an audio stream needs, in every row, a
    WAV file whose header says it lasts num_frames / fps seconds (here 5 frames at 8 fps:
    0.625 s, 5000 samples at 8 kHz); a video at 8 fps read every 2nd frame is 4 fps, which
    the clip's 8 fps is not: one warning for the run."""
    import logging

    _clip(tmp_path / "clip.mp4", 7)
    (tmp_path / "bad.wav").write_text("not audio", encoding="utf-8")
    files = {"long": _wav(tmp_path / "long.wav", 0.625), "short": _wav(tmp_path / "short.wav", 0.624), "bad": tmp_path / "bad.wav"}
    params = GenerationParams(height=16, width=16, num_inference_steps=2, guidance_scale=1.0, num_frames=5, fps=8.0)
    trainer = SimpleNamespace(sft_params=lambda: params)  # as Ray ranks answer the driver

    def check(stride: int, *audio: str | None) -> None:
        rows = [
            SftRow("a", video=tmp_path / "clip.mp4", audio=files.get(a), where=f"sft.jsonl:{i}", video_fps=8.0)
            for i, a in enumerate(audio, 1)
        ]
        config = SimpleNamespace(model_family="ltx", sft_frame_stride=stride)
        assert check_sft_run(trainer, config, rows, _AudioFamily) is params

    with caplog.at_level(logging.WARNING, logger="miles_core.training"):
        check(1, "long", "long")
    assert caplog.records == []
    for audio, why in (
        (None, "the ltx family denoises audio with the video: give a WAV file under 'audio' (--sft-audio-key)"),
        ("bad", "audio 'bad.wav' under 'audio' cannot be read as WAV: file does not start with RIFF id"),
        (
            "short",
            "audio 'short.wav' under 'audio' lasts 0.624 s; the clip needs 0.625 s (5 frames at 8 fps: "
            "--diffusion-output-num-frames / --diffusion-fps)",
        ),
    ):
        with pytest.raises(PromptDataError) as caught:
            check(1, "long", audio)
        assert str(caught.value) == f"sft.jsonl:2: {why}", audio
    with caplog.at_level(logging.WARNING, logger="miles_core.training"):
        check(2, "long", "long")
    assert [r.getMessage() for r in caplog.records] == [
        "sft.jsonl:1: video 'clip.mp4' under 'video' plays at 8 fps, so --sft-frame-stride 2 gives clips at 4 fps, but the run's "
        "clips are 8 fps (--diffusion-fps, or the family's default): the motion is learnt at another speed"
    ]


def test_read_wav_reads_only_the_samples_asked_for(tmp_path: Path) -> None:
    ramp = np.arange(-50, 50, dtype="<i2")
    _write_wav(tmp_path / "ramp.wav", 2, 1, ramp)
    assert media.read_wav_header(tmp_path / "ramp.wav") == (1, 8000, 100)
    whole, _ = media.read_wav(tmp_path / "ramp.wav")
    head, rate = media.read_wav(tmp_path / "ramp.wav", 30)
    assert rate == 8000 and head.shape == (1, 30) and np.array_equal(head, whole[:, :30])
    assert np.array_equal(media.read_wav(tmp_path / "ramp.wav", 1000)[0], whole)


def test_a_video_row_is_fitted_like_an_image_and_a_short_one_names_the_row(tmp_path: Path) -> None:
    from PIL import Image

    from miles_core.training.sft import fit_image

    _clip(tmp_path / "clip.mp4", 5, size=24)
    row = SftRow("a", video=tmp_path / "clip.mp4", where="sft.jsonl:3", video_key="clip")
    pixels = load_pixels(row, 3, 2, 16, 8)  # frames 0, 2, 4; covered and center-cropped
    decoded = media.read_video(tmp_path / "clip.mp4", 3, 2).frames
    assert pixels.shape == (3, 3, 16, 8) and pixels.dtype == torch.float32
    assert torch.equal(pixels, torch.stack([fit_image(Image.fromarray(f), 16, 8) for f in decoded], dim=1))
    # One frame: the video's first, as an image family takes it.
    assert torch.equal(load_pixels(row, 1, 2, 16, 8), pixels[:, 0])
    with pytest.raises(PromptDataError) as caught:
        load_pixels(row, 3, 3, 16, 8)
    assert str(caught.value) == (
        "sft.jsonl:3: video 'clip.mp4' under 'clip' has 5 frames; --diffusion-output-num-frames 3 with --sft-frame-stride 3 needs 7"
    )
    (tmp_path / "bad.mp4").write_text("not a video", encoding="utf-8")
    with pytest.raises(PromptDataError) as caught:
        load_pixels(SftRow("a", video=tmp_path / "bad.mp4", where="sft.jsonl:4"), 3, 1, 16, 8)
    # One line: ffmpeg's first and last words, not its whole stderr.
    assert str(caught.value).startswith("sft.jsonl:4: video 'bad.mp4' under 'video' cannot be read: ") and "\n" not in str(caught.value)


BASE = ["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--prompt-data", "p.jsonl", "--rollout-batch-size", "1"]


@pytest.mark.exercises("--sft-frame-stride", "--sft-video-key", "--sft-audio-key")
def test_the_sft_flags_apply_to_sft_and_keep_apart() -> None:
    assert "--sft-frame-stride" not in UNAVAILABLE
    sft_run = [*BASE, "--loss-type", "sft_loss"]
    config = resolve_config([*sft_run, "--sft-frame-stride", "2", "--sft-video-key", "clip", "--sft-audio-key", "sound"])
    assert (config.sft_frame_stride, config.sft_video_key, config.sft_audio_key) == (2, "clip", "sound")
    assert not training_errors(config)
    assert config.notes == ["--sft-frame-stride 2 has no effect with --diffusion-output-num-frames 1 (a clip of frame 0)"]
    assert resolve_config([*BASE, "--sft-video-key", "clip"]).notes == [
        "--sft-video-key clip has no effect with --loss-type policy_loss (read only by losses that train on supervised rows, e.g. sft_loss)"
    ]
    with pytest.raises(ConfigError) as caught:
        resolve_config([*sft_run, "--sft-video-key", "image", "--sft-audio-key", "input"])
    assert caught.value.messages == [
        "--sft-image-key, --sft-video-key: an SFT row keeps its prompt, image, video and audio under different keys (both are 'image')",
        "--input-key, --sft-audio-key: an SFT row keeps its prompt, image, video and audio under different keys (both are 'input')",
    ]


def test_the_sft_loss_sums_the_loss_over_every_latent_stream() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {name: {s: torch.randn(2, 3, 4, generator=generator) for s in ("latents", "audio_latents")} for name in ("v", "noise", "x0")}
    velocity = tensors["v"]
    data = {"noise": tensors["noise"], "x0": tensors["x0"]}

    def per_stream(stream: str) -> torch.Tensor:
        return sft({"v": velocity[stream], "noise": data["noise"][stream], "x0": data["x0"][stream]}, None)[0]

    loss, metrics = sft_stream_loss(sft, velocity, data, None)
    assert torch.equal(loss, per_stream("latents") + per_stream("audio_latents"))
    assert set(metrics) == {"sft_loss", "sft_loss_latents", "sft_loss_audio_latents"}
    assert torch.equal(metrics["sft_loss_audio_latents"], per_stream("audio_latents")) and torch.equal(metrics["sft_loss"], loss)
    # One stream: the loss function's own value and metrics, as image SFT had them.
    one = {"noise": {"latents": data["noise"]["latents"]}, "x0": {"latents": data["x0"]["latents"]}}
    assert sft_stream_loss(sft, velocity, one, None) == sft({"v": velocity["latents"], **{k: v["latents"] for k, v in one.items()}}, None)
