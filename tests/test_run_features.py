"""The run loop's logging and debug features on the tiny SD3 pipeline: W&B offline runs,
saved rollouts replayed with no engine, train-data dumps, progress bars, and sampling
with the EMA weights (``--ema-rollout-policy ema``)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, RunError
from miles_core.training.run import train
from tests.tiny_runs import tiny_run_args

TRAIN = ("--num-steps-per-rollout", "2", "--use-lora", "--lora-rank", "4", "--lr", "1e-2", "--deterministic-mode")


def base_args(tiny_sd3, prompts, out):
    return tiny_run_args(tiny_sd3, prompts, out)


def run(tiny_sd3, prompts, out, *extra, log=lambda line: None, engine_factory=None):
    config = resolve_config([*base_args(tiny_sd3, prompts, out), *extra])
    path = asyncio.run(train(config, log=log, engine_factory=engine_factory))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def train_metrics(records):
    return [{k: v for k, v in r.items() if k.startswith(("train/", "rollout/"))} for r in records]


# -- W&B ------------------------------------------------------------------------------------


def settled_wandb_records(path: Path, kind: str, timeout: float = 60.0) -> list:
    """:func:`wandb_records` once the log holds a record of ``kind``: W&B's service process
    may still be writing it after ``finish()`` returns on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(wandb_records(path))
        except Exception:  # a log cut mid-record while it is written
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == kind for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (a LevelDB-style log:
    7-byte file header, then 32 KiB blocks of chunks with a crc32/length/type header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind == 2 else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def items(entries):
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B's own files under tmp_path. wandb reads its environment once per process, so
    the runs also name their directory (``--wandb-dir``)."""
    for name, sub in (
        ("WANDB_DIR", "wb"),
        ("WANDB_CACHE_DIR", "wb-cache"),
        ("WANDB_CONFIG_DIR", "wb-config"),
        ("WANDB_DATA_DIR", "wb-data"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path / "wb"


@pytest.mark.exercises(
    "--use-wandb",
    "--wandb-project",
    "--wandb-group",
    "--wandb-mode",
    "--disable-wandb-random-suffix",
    "--wandb-log-num-images",
    "--wandb-log-image-interval",
)
def test_wandb_offline_run_logs_scalars_step_series_and_images(tiny_sd3, prompts, tmp_path, wandb_env):
    records = run(
        tiny_sd3,
        prompts,
        tmp_path / "run",
        "--num-rollout",
        "3",
        *TRAIN,
        "--use-wandb",
        "--wandb-mode",
        "offline",
        "--wandb-dir",
        str(wandb_env),
        "--wandb-project",
        "miles-test",
        "--wandb-group",
        "tiny",
        "--disable-wandb-random-suffix",
        "--wandb-key",
        "not-a-real-key",
        "--wandb-log-num-images",
        "2",
        "--wandb-log-image-interval",
        "2",
    )
    (run_dir,) = (wandb_env / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    history, summary, run_record = [], {}, None
    for record in settled_wandb_records(log_file, "summary"):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
        elif kind == "run":
            run_record = record.run
    assert (run_record.project, run_record.run_group, run_record.display_name) == ("miles-test", "tiny", "tiny")
    config = items(run_record.config.update)
    assert config["logging"]["wandb_key"] == "<redacted>"  # the key never leaves the machine
    assert config["data"]["rollout_batch_size"] == 2

    per_rollout = [row for row in history if "rollout_id" in row]
    assert [row["rollout_id"] for row in per_rollout] == [0, 1, 2]
    for row, record in zip(per_rollout, records):
        for key in ("rollout/reward/raw_mean", "train/loss", "train/clipfrac", "train/grad_norm"):
            assert row[key] == pytest.approx(record[key], rel=1e-12)
        assert not any(key.endswith("_per_step") for key in row)
    # Per-step lists: their own series, one row per optimizer step.
    per_step = [row for row in history if "train_step" in row]
    assert [row["train_step"] for row in per_step] == list(range(6))
    assert [row["train_step/clipfrac"] for row in per_step] == [v for r in records for v in r["train/clipfrac_per_step"]]
    # Images every second rollout (0 and 2), the first two samples, captioned with their prompt.
    assert [("rollout/images/count" in row) for row in per_rollout] == [True, False, True]
    first = per_rollout[0]
    assert first["rollout/images/count"] == 2 and first["rollout/images/width"] == first["rollout/images/height"] == 32
    captions = first["rollout/images/captions"]
    assert all(c.split(" (reward ")[0] in {"a red cube", "a blue ball", "a green tree"} for c in captions) and len(captions) == 2
    assert len(list((run_dir / "files" / "media" / "images").rglob("*.png"))) == 4
    assert summary["rollout/reward/raw_mean"] == pytest.approx(records[-1]["rollout/reward/raw_mean"], rel=1e-12)


def test_wandb_videos_are_mp4_else_pillow_gifs(tmp_path, wandb_env, monkeypatch):
    from types import SimpleNamespace

    import imageio.v3 as iio
    from PIL import Image

    from miles_core.training.metrics_logging import WandbLogger

    names = ("project", "group", "run_id", "team", "host", "key")
    config = SimpleNamespace(
        **{f"wandb_{n}": None for n in names},
        wandb_mode="offline",
        wandb_dir=str(wandb_env),
        disable_wandb_random_suffix=False,
        wandb_log_num_images=1,
        wandb_log_image_interval=1,
        diffusion_fps=4,
    )
    logger = WandbLogger(config, {"logging": {"wandb_key": None}}, tmp_path / "my-run")
    assert logger.run.name.startswith("my-run-") and len(logger.run.name) == len("my-run-") + 6
    video = torch.rand(3, 5, 16, 16)  # [C, F, H, W]
    sample = SimpleNamespace(prompt="a spinning cube", reward=0.5, pixels=video)
    logger.log({"rollout_id": 0, "rollout/reward/raw_mean": 0.5}, [sample])  # the video extra: H.264 MP4
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # without it: an animated GIF (Pillow)
    logger.log({"rollout_id": 1, "rollout/reward/raw_mean": 0.5}, [sample])
    logger.finish()
    monkeypatch.undo()  # the video extra back, to read the MP4
    media = next((wandb_env / "wandb").glob("offline-run-*/files/media/videos"))
    (mp4,), (gif,) = media.rglob("*.mp4"), media.rglob("*.gif")
    assert iio.imread(mp4, plugin="FFMPEG", index=None).shape == (5, 16, 16, 3)
    with Image.open(gif) as image:
        assert image.n_frames == 5 and image.size == (16, 16)


@pytest.mark.exercises("--use-wandb")
def test_missing_wandb_is_one_line_naming_the_flag_and_the_extra(tiny_sd3, prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    config = resolve_config([*base_args(tiny_sd3, prompts, tmp_path / "run"), "--num-rollout", "1", "--use-wandb"])
    with pytest.raises(RunError) as error:
        asyncio.run(train(config, log=lambda line: None))
    assert str(error.value) == "--use-wandb needs the wandb package: pip install miles-core[wandb]"
    assert not (tmp_path / "run").exists()  # refused before any model or directory


# -- debug data ---------------------------------------------------------------------------------


@pytest.mark.exercises(
    "--dump-details", "--load-debug-rollout-data", "--load-debug-rollout-data-subsample", "--save-debug-train-data", "--train-only"
)
def test_replayed_rollouts_reproduce_the_train_metrics(tiny_sd3, prompts, tmp_path, monkeypatch):
    from miles_core.training.debug_data import load_rollout_data, load_train_data

    original = run(tiny_sd3, prompts, tmp_path / "original", "--num-rollout", "2", *TRAIN, "--dump-details", str(tmp_path / "dump"))
    rollout_data = tmp_path / "dump" / "rollout_data"
    assert sorted(p.name for p in rollout_data.iterdir()) == ["0.msgpack", "1.msgpack"]

    def no_engine(config):
        raise AssertionError("a replay must not start an engine")

    template = str(rollout_data / "{}.msgpack")
    replay = run(
        tiny_sd3,
        prompts,
        tmp_path / "replay",
        "--num-rollout",
        "2",
        *TRAIN,
        "--train-only",
        "--load-debug-rollout-data",
        template,
        "--save-debug-train-data",
        str(tmp_path / "replay-train" / "{}.msgpack"),
        engine_factory=no_engine,
    )
    assert train_metrics(replay) == train_metrics(original)
    assert replay[0]["train/grad_norm_per_step"][0] > 0 and len(replay[1]["train/clipfrac_per_step"]) == 2

    # The train data: one entry per (sample, SDE step) pair, the engine's old log-probs, the same in both runs.
    saved = load_train_data(tmp_path / "dump" / "train_data" / "1.msgpack")
    again = load_train_data(tmp_path / "replay-train" / "1.msgpack")
    pairs = saved["pairs"]
    assert len(pairs["step"]) == original[1]["train/num_pairs"] == 16
    samples, rewards = load_rollout_data(template, 1)
    expected = torch.tensor(
        [float(samples[i].output.rollout_log_probs[k]) for i, k in zip(pairs["sample_index"].tolist(), pairs["step"].tolist())],
        dtype=torch.float64,
    )
    assert torch.equal(pairs["old_log_prob"], expected)
    assert torch.equal(saved["rewards"], rewards) and torch.equal(saved["advantages"], again["advantages"])
    assert torch.equal(pairs["old_log_prob"], again["pairs"]["old_log_prob"])
    assert saved["metrics"]["train/loss"] == original[1]["train/loss"]

    # Controls: other rollouts (the two files swapped) and a subsample give other metrics.
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(rollout_data / "0.msgpack", swapped / "1.msgpack")
    shutil.copy(rollout_data / "1.msgpack", swapped / "0.msgpack")
    other = run(
        tiny_sd3, prompts, tmp_path / "other", "--num-rollout", "2", *TRAIN, "--load-debug-rollout-data", str(swapped / "{}.msgpack")
    )
    assert other[0]["train/loss"] != original[0]["train/loss"]
    half = run(
        tiny_sd3,
        prompts,
        tmp_path / "half",
        "--num-rollout",
        "2",
        *TRAIN,
        "--train-only",
        "--load-debug-rollout-data",
        template,
        "--load-debug-rollout-data-subsample",
        "0.5",
    )
    assert [r["rollout/num_samples"] for r in half] == [4, 4] and [r["train/num_pairs"] for r in half] == [8, 8]
    assert half[0]["train/loss_per_step"] != original[0]["train/loss_per_step"]
    assert len(half[0]["train/loss_per_step"]) == 2  # the kept samples spread over the same steps
    # The subsample is deterministic.
    assert train_metrics(half) == train_metrics(
        run(
            tiny_sd3,
            prompts,
            tmp_path / "half-again",
            "--num-rollout",
            "2",
            *TRAIN,
            "--train-only",
            "--load-debug-rollout-data",
            template,
            "--load-debug-rollout-data-subsample",
            "0.5",
        )
    )


@pytest.mark.exercises("--load-debug-rollout-data")
def test_a_missing_replay_file_is_one_line_naming_the_flag_and_path(tiny_sd3, prompts, tmp_path):
    template = str(tmp_path / "nothing" / "{}.msgpack")
    with pytest.raises(RunError) as error:
        run(tiny_sd3, prompts, tmp_path / "run", "--num-rollout", "1", "--train-only", "--load-debug-rollout-data", template)
    assert str(error.value) == f"--load-debug-rollout-data {template}: {tmp_path / 'nothing' / '0.msgpack'} not found (rollout 0)"


@pytest.mark.exercises(
    "--train-only",
    "--dump-details",
    "--save-debug-rollout-data",
    "--save-debug-train-data",
    "--load-debug-rollout-data",
    "--load-debug-rollout-data-subsample",
)
def test_debug_flags_resolve_and_refuse(tiny_sd3, prompts, tmp_path):
    base = base_args(tiny_sd3, prompts, tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        resolve_config([*base, "--train-only"])
    assert error.value.messages == ["--train-only requires --load-debug-rollout-data (the saved rollouts to train on; no engine starts)"]
    config = resolve_config([*base, "--debug-train-only", "--load-debug-rollout-data", "r/{}.msgpack"])
    assert config.train_only
    config = resolve_config([*base, "--load-debug-rollout-data", "r/{rollout_id}.msgpack"])
    assert config.train_only  # a replay starts no engine, as in the reference
    config = resolve_config([*base, "--dump-details", "d", "--save-debug-train-data", "t/{}.bin"])
    assert (config.save_debug_rollout_data, config.save_debug_train_data) == ("d/rollout_data/{}.msgpack", "t/{}.bin")
    with pytest.raises(ConfigError) as error:
        resolve_config(
            [
                *base,
                "--save-debug-rollout-data",
                "r.msgpack",
                "--load-debug-rollout-data",
                "x/{}.m",
                "--load-debug-rollout-data-subsample",
                "1.5",
            ]
        )
    assert error.value.messages == [
        "--load-debug-rollout-data-subsample 1.5: must be in (0, 1]",
        "--save-debug-rollout-data r.msgpack: the template needs {} or {rollout_id} for the rollout id",
    ]


# -- progress --------------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal(tiny_sd3, prompts, tmp_path, monkeypatch, capfd):
    run(tiny_sd3, prompts, tmp_path / "plain", "--num-rollout", "1", *TRAIN)
    assert "microgroup" not in capfd.readouterr().err  # not a TTY: no bar
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    lines = []
    run(tiny_sd3, prompts, tmp_path / "tty", "--num-rollout", "1", *TRAIN, log=lines.append)
    text = terminal.getvalue()
    # 2 prompts x 2 microgroups (tqdm throttles redraws: the count shown may lag).
    assert "rollout 1/1" in text and "/4 [" in text and "microgroup" in text
    assert "train 1/1" in text and "micro-batch" in text
    # The thread plan's line, then the rollout's summary line, still there.
    assert len(lines) == 3 and lines[0].startswith("threads: ") and lines[1].startswith("rollout 1/1  reward")


# -- EMA rollout policy -----------------------------------------------------------------------------


def outputs_of(template: str, rollout_id: int) -> list[torch.Tensor]:
    from miles_core.training.debug_data import load_rollout_data

    samples, _ = load_rollout_data(template, rollout_id)
    return [s.output.generated_output for s in samples]


@pytest.mark.exercises("--use-ema", "--ema-rollout-policy")
@pytest.mark.exercises("--debug-rollout-only", "--save-debug-rollout-data")
def test_ema_rollout_policy_samples_with_the_ema_weights(tiny_sd3, prompts, tmp_path):
    """With decay 1 the EMA never leaves the initial weights, so sampling with it must
    reproduce, bit for bit, a run whose weights never train; sampling with the live
    weights must not, and neither must an EMA that moves (decay 0.5)."""

    def samples(name, *extra):
        template = str(tmp_path / name / "{}.msgpack")
        records = run(
            tiny_sd3, prompts, tmp_path / f"run-{name}", "--num-rollout", "2", *TRAIN, "--save-debug-rollout-data", template, *extra
        )
        return records, outputs_of(template, 1)

    ema_args = ("--use-ema", "--ema-rollout-policy", "ema", "--ema-decay-flat-steps", "1000")
    _, frozen = samples("frozen", "--debug-rollout-only")
    live_records, live = samples("live")
    ema_records, ema = samples("ema", *ema_args, "--ema-decay-init", "1.0")
    _, half = samples("half", *ema_args, "--ema-decay-init", "0.5")
    assert all(torch.equal(a, b) for a, b in zip(ema, frozen))
    assert not any(torch.equal(a, b) for a, b in zip(live, frozen))  # control: training moved the live policy
    assert not any(torch.equal(a, b) for a, b in zip(half, frozen)) and not any(torch.equal(a, b) for a, b in zip(half, live))
    # The trainer still trains the live weights (the swap restores them): the first rollout is the same.
    assert train_metrics(ema_records)[0] == train_metrics(live_records)[0]


def test_ema_rollout_policy_syncs_the_ema_to_a_remote_engine(tiny_sd3, prompts, tmp_path):
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.server import create_app
    from tests.test_server import ServerThread, wait_healthy
    from tests.test_weight_sync import checksum_of

    engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    thread = ServerThread(create_app(engine))
    try:
        wait_healthy(thread.url)
        before = checksum_of(thread.url)
        remote = ("--rollout-engine", "http", "--rollout-engine-urls", thread.url, "--num-rollout", "2", *TRAIN)
        records = run(
            tiny_sd3,
            prompts,
            tmp_path / "ema",
            *remote,
            "--use-ema",
            "--ema-rollout-policy",
            "ema",
            "--ema-decay-init",
            "1.0",
            "--ema-decay-flat-steps",
            "1000",
        )
        assert all(r["train/grad_norm"] > 0 for r in records) and records[1]["perf/weight_sync_bytes"] > 0
        assert checksum_of(thread.url) == before  # the EMA (still the initial weights) was synced
        run(tiny_sd3, prompts, tmp_path / "live", *remote)
        assert checksum_of(thread.url) != before  # control: the live policy moves the engine
    finally:
        thread.close()
