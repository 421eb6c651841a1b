"""The trackers (TensorBoard and W&B) and the evaluation archive, on a real tiny SD3 run:
what the event files and the offline W&B run hold is read back and compared with
``metrics.jsonl`` and the archive's manifest."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.config.resolve import resolve_config
from miles_core.errors import LoggerError
from miles_core.launch import train
from tests.tiny_runs import tiny_run_args

COLUMNS = 2  # --n-samples-per-eval-prompt


@pytest.fixture(scope="module")
def run_dir(tiny_sd3, prompts, tmp_path_factory) -> Path:
    """2 rollouts, evaluated before training and after the last, with TensorBoard and W&B
    (offline) on."""
    import os

    root = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_DIR": root / "wb", "WANDB_CACHE_DIR": root / "wb-cache", "WANDB_CONFIG_DIR": root / "wb-config"}
    saved = {name: os.environ.get(name) for name in (*env, "WANDB_SILENT", "WANDB_MODE")}
    for name, path in env.items():
        path.mkdir()
        os.environ[name] = str(path)
    os.environ["WANDB_SILENT"] = "true"
    os.environ.pop("WANDB_MODE", None)
    args = [
        *tiny_run_args(tiny_sd3, prompts, root / "run", steps=2, sde_steps=1),
        *("--num-rollout", "2", "--eval-interval", "2", "--eval-prompt-data", "shapes", str(prompts)),
        *("--n-samples-per-eval-prompt", str(COLUMNS), "--use-tensorboard"),
        *("--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(root / "wb")),
    ]
    try:
        return asyncio.run(train(resolve_config(args), log=lambda line: None))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def manifest(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / "eval" / "manifest.jsonl").read_text().splitlines()]


def events(run_dir: Path, folder: str = "tensorboard") -> object:
    """The event files read back (every scalar and image kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / folder), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.exercises("--use-tensorboard")
def test_tensorboard_scalars_and_eval_images_read_back(run_dir):
    tb = events(run_dir)
    rows = records(run_dir)
    tags = tb.Tags()
    # Every finite scalar of every record at step rollout_id, exactly (float32 in the event file).
    for row in rows:
        for key, value in row.items():
            if key == "rollout_id" or isinstance(value, (list, dict, str)) or value is None:
                continue
            (point,) = [e for e in tb.Scalars(key) if e.step == row["rollout_id"]]
            assert point.value == np.float32(value), key
    assert [e.step for e in tb.Scalars("rollout/reward/raw_mean")] == [0, 1]
    # The per-step lists against the optimizer step, as W&B gets them.
    per_step = [(key, value) for key, value in rows[1].items() if key.endswith("_per_step")]
    assert per_step
    key, values = per_step[0]
    name = "train_step/" + key.removeprefix("train/").removesuffix("_per_step")
    assert [e.value for e in tb.Scalars(name)][-len(values) :] == [np.float32(v) for v in values]
    # The evaluations' grids (at step trained_rollouts: 0 before training, 2 after the last
    # rollout, whose record is 1) decode to the grid's size.
    grids = tb.Images("eval/shapes/grid")
    assert [g.step for g in grids] == [0, 2]
    for event, tag in zip(grids, ("00000_before", "00002")):
        png = Image.open(io.BytesIO(event.encoded_image_string))
        with Image.open(run_dir / "samples" / f"eval_shapes_{tag}.png") as grid:
            assert png.size == grid.size == (event.width, event.height)
    # Each sample, as archived.
    sample = tb.Images("eval/shapes/p001_s01")[-1]
    archived = Image.open(run_dir / "samples" / "eval" / "shapes" / "00002" / "p001_s01.png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample.encoded_image_string))), np.asarray(archived))
    assert not any(tag.startswith("eval/shapes/video/") for tag in tags["images"])  # an image run has no videos


def test_the_archive_and_its_manifest(run_dir):
    rows = manifest(run_dir)
    assert [(r["evaluation"], r["tag"], r["trained_rollouts"], r["rollout_id"]) for r in rows[:: len(rows) // 2]] == [
        (0, "00000_before", 0, 0),
        (1, "00002", 2, 1),
    ]
    first = [r for r in rows if r["evaluation"] == 0]
    assert [(r["prompt_index"], r["sample_index"]) for r in first] == [(p, s) for p in range(len(first) // COLUMNS) for s in range(COLUMNS)]
    # The same prompts and seeds at every evaluation.
    later = [r for r in rows if r["evaluation"] == 1]
    assert [(r["prompt"], r["seed"]) for r in first] == [(r["prompt"], r["seed"]) for r in later]
    for r in rows:
        assert r["image"] == f"samples/eval/shapes/{r['tag']}/p{r['prompt_index']:03d}_s{r['sample_index']:02d}.png"
        assert (run_dir / r["image"]).is_file() and r["video"] is None
    # The record's eval reward is the mean of the archived rewards (float32 rewards averaged
    # in float32 by the scorer and in float64 here: within 1e-6).
    record = records(run_dir)[1]
    assert record["eval/shapes/reward_mean"] == pytest.approx(np.mean([r["reward"] for r in later]), abs=1e-6)
    assert record["eval/shapes/paired_gain"] == pytest.approx(np.mean([b["reward"] - a["reward"] for a, b in zip(first, later)]), abs=1e-6)


def test_the_grids_are_captioned_and_hold_the_archived_samples(run_dir):
    from miles_core.training.evaluation import MIN_CELL

    rows = [r for r in manifest(run_dir) if r["evaluation"] == 1]
    with Image.open(run_dir / "samples" / "eval_shapes_before_after.png") as grid:
        pixels = np.asarray(grid.convert("RGB"))
    with Image.open(run_dir / rows[0]["image"]) as first:
        size = first.size[0]
    scale = -(-MIN_CELL // size)
    cell = size * scale
    assert pixels.shape[1] == 2 * COLUMNS * cell  # before/after pairs side by side

    # Find each archived sample, upscaled (nearest), in its "after" column: every cell is the archive's picture.
    def cell_matches(row: dict, column: int) -> bool:
        picture = np.asarray(Image.open(run_dir / row["image"]).convert("RGB"))
        big = picture.repeat(scale, axis=0).repeat(scale, axis=1)
        x = column * cell
        for y in range(pixels.shape[0] - cell + 1):
            if np.array_equal(pixels[y : y + cell, x : x + cell], big):
                return True
        return False

    assert cell_matches(rows[0], 1) and cell_matches(rows[1], 3)
    assert not cell_matches(rows[1], 1)  # control: another sample is not in that column
    # Captions: text (dark pixels) above the first row of cells, none in a blank header cell.
    assert (pixels[:12].min(axis=2) < 128).any()


@pytest.mark.exercises("--use-wandb")
def test_wandb_gets_the_evaluation_grids(run_dir):
    (offline,) = (run_dir.parent / "wb" / "wandb").glob("offline-run-*")
    media = offline / "files" / "media" / "images" / "eval" / "shapes"
    assert len(list(media.rglob("samples_*.png"))) == 2  # the grid of each evaluation


def video_media(tmp_path: Path, frames: int = 5) -> object:
    """An evaluation of one video sample (``[C, F, H, W]``, odd size), archived."""
    from miles_core.rollout.sample import Sample
    from miles_core.training.evaluation import EvalArchive, EvalMedia, EvalResult

    pixels = torch.rand(3, frames, 15, 17)
    sample = SimpleNamespace(prompt="a spinning cube", seed=7, pixels=pixels, reward_components={"clip": 0.25}, reward_failed=False)
    assert set(vars(sample)) <= set(Sample.__dataclass_fields__) | {"pixels"}  # the fields the archive reads
    result = EvalResult({"clips": torch.tensor([0.5])}, {"clips": [pixels]}, samples={"clips": [sample]})
    archive = EvalArchive(tmp_path, 1, fps=6)
    rows = archive.save(result, "00003", 2, 3)
    grids = archive.save_grids(result, rows, "00003")
    return EvalMedia.of(result, rows, grids, "00003", 2, tmp_path, trained_rollouts=3)


def test_a_video_evaluation_is_archived_playable(tmp_path, monkeypatch):
    import imageio.v3 as iio

    media = video_media(tmp_path)
    (row,) = media.rows["clips"]
    assert row["video"] == {
        "webm": "samples/eval/clips/00003/p000_s00.webm",
        "mp4": "samples/eval/clips/00003/p000_s00.mp4",
        "gif": None,
        "frames": 5,
        "fps": 6.0,
    }
    assert row["reward"] == 0.5 and row["reward_components"] == {"clip": 0.25}
    # yuv420p needs even sizes: 15x17 is padded to 16x18.
    for kind in ("webm", "mp4"):
        decoded = iio.imread(tmp_path / row["video"][kind], plugin="FFMPEG", index=None)
        assert decoded.shape == (5, 16, 18, 3), kind
    assert iio.immeta(tmp_path / row["video"]["mp4"], plugin="FFMPEG")["fps"] == 6.0
    with Image.open(tmp_path / row["image"]) as poster:
        assert poster.size == (17, 15)
    # Without the video extra: an animated GIF.
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    (row,) = video_media(tmp_path / "no-extra").rows["clips"]
    assert (row["video"]["webm"], row["video"]["mp4"], row["video"]["gif"]) == (None, None, "samples/eval/clips/00003/p000_s00.gif")
    with Image.open(tmp_path / "no-extra" / row["video"]["gif"]) as gif:
        assert gif.n_frames == 5


@pytest.mark.exercises("--use-tensorboard", "--tensorboard-dir")
def test_tensorboard_plays_evaluation_videos_as_gifs(tmp_path):
    from miles_core.training.tensorboard_logging import TensorBoardLogger

    media = video_media(tmp_path, frames=4)
    logger = TensorBoardLogger(SimpleNamespace(tensorboard_dir=str(tmp_path / "tb")), tmp_path)
    logger.log_eval(media)
    logger.finish()
    tb = events(tmp_path, "tb")
    (video,) = tb.Images("eval/clips/video/p000_s00")
    assert video.step == 3  # trained_rollouts, not the record's rollout_id (2)
    with Image.open(io.BytesIO(video.encoded_image_string)) as gif:
        assert gif.format == "GIF" and gif.n_frames == 4 and gif.size == (17, 15)
    (grid,) = tb.Images("eval/clips/grid")
    assert Image.open(io.BytesIO(grid.encoded_image_string)).size == (grid.width, grid.height)


@pytest.mark.exercises("--use-tensorboard")
def test_two_evaluations_of_one_record_keep_their_own_tensorboard_step(tmp_path):
    """With --eval-interval 1 the evaluation before training and the one after rollout 0
    both belong to record 0: their media go to steps 0 and 1 (the rollouts trained), so
    neither hides the other."""
    from miles_core.training.evaluation import EvalArchive, EvalMedia, EvalResult
    from miles_core.training.tensorboard_logging import TensorBoardLogger

    archive = EvalArchive(tmp_path, 1)
    logger = TensorBoardLogger(SimpleNamespace(tensorboard_dir=None), tmp_path)
    for tag, trained in (("00000_before", 0), ("00001", 1)):
        pixels = torch.rand(3, 15, 17)
        sample = SimpleNamespace(prompt="a red cube", seed=3, pixels=pixels, reward_components={}, reward_failed=False)
        result = EvalResult({"shapes": torch.tensor([0.5])}, {"shapes": [pixels]}, samples={"shapes": [sample]})
        rows = archive.save(result, tag, 0, trained)
        grids = archive.save_grids(result, rows, tag)
        logger.log_eval(EvalMedia.of(result, rows, grids, tag, 0, tmp_path, trained_rollouts=trained))
    logger.finish()
    tb = events(tmp_path)
    for name in ("eval/shapes/grid", "eval/shapes/p000_s00"):
        assert [event.step for event in tb.Images(name)] == [0, 1], name
    # Each step holds its own evaluation's sample (two different random pictures).
    decoded = [np.asarray(Image.open(io.BytesIO(event.encoded_image_string))) for event in tb.Images("eval/shapes/p000_s00")]
    for picture, tag in zip(decoded, ("00000_before", "00001")):
        assert np.array_equal(picture, np.asarray(Image.open(tmp_path / "samples" / "eval" / "shapes" / tag / "p000_s00.png")))
    assert not np.array_equal(decoded[0], decoded[1])


def test_wandb_gets_evaluation_videos_as_mp4(tmp_path, monkeypatch):
    from miles_core.training.metrics_logging import WandbLogger

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    media = video_media(tmp_path / "run")
    names = ("project", "group", "run_id", "team", "host", "key")
    config = SimpleNamespace(
        **{f"wandb_{n}": None for n in names},
        wandb_mode="offline",
        wandb_dir=str(tmp_path / "wb"),
        disable_wandb_random_suffix=True,
        wandb_log_num_images=0,
        wandb_log_image_interval=1,
        diffusion_fps=6,
    )
    logger = WandbLogger(config, {}, tmp_path / "run")
    logger.log_eval(media)
    logger.finish()
    (offline,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    assert len(list((offline / "files" / "media" / "videos" / "eval" / "clips").rglob("*.mp4"))) == 1
    assert len(list((offline / "files" / "media" / "images" / "eval" / "clips").rglob("*.png"))) == 1


@pytest.mark.exercises("--use-tensorboard")
def test_missing_tensorboard_is_one_line_before_any_model_loads(tiny_sd3, prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    config = resolve_config([*tiny_run_args(tiny_sd3, prompts, tmp_path / "run"), "--num-rollout", "1", "--use-tensorboard"])
    with pytest.raises(LoggerError) as error:
        asyncio.run(train(config, log=lambda line: None))
    assert str(error.value) == "--use-tensorboard needs the tensorboard package: pip install miles-core[tensorboard]"
    assert not (tmp_path / "run").exists()
