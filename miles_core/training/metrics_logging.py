"""Where a run's records go besides ``metrics.jsonl``: the trackers (Weights & Biases with
``--use-wandb``, TensorBoard with ``--use-tensorboard``: :class:`Trackers` fans each record
out to every one enabled) and progress bars on a terminal.

W&B: one history row per rollout (its scalars, with ``rollout_id`` as the x axis), and
each per-optimizer-step list of a record (``train/clipfrac_per_step``) as its own series
``train_step/<name>`` against ``train_step`` (``rollout_id x steps + i``,
:func:`~miles_core.training.record_values.per_step_rows`, shared with TensorBoard). Every ``--wandb-log-image-interval``
rollouts the first ``--wandb-log-num-images`` samples go to ``rollout/images``
(``wandb.Image``) or ``rollout/videos`` (``wandb.Video`` of an MP4 with the video extra,
else of an animated GIF), captioned with the prompt and reward. Each evaluation's
captioned grid goes to ``eval/<set>/samples`` and its videos to ``eval/<set>/videos``.
``wandb`` is imported only when ``--use-wandb`` is set.

Custom log functions (``--custom-rollout-log-function-path``,
``--custom-eval-rollout-log-function-path``) see a rollout's (or an evaluation's)
samples and default metrics first, and return True to skip their default logging:
see :func:`custom_log_function` and docs/customization.md.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles_core.errors import LoggerError
from miles_core.training.record_values import per_step_rows, scalars, uint8_frames

WANDB_MISSING = "--use-wandb needs the wandb package: pip install miles-core[wandb]"


# -- W&B -----------------------------------------------------------------------------------


def run_name(config: Any, out: Path) -> str:
    """``--wandb-group`` (or the run directory's name) with a random suffix unless
    ``--disable-wandb-random-suffix``. The suffix comes from :mod:`secrets`, so seeded
    RNGs are untouched."""
    base = config.wandb_group or out.name
    return base if config.disable_wandb_random_suffix else f"{base}-{secrets.token_hex(3)}"


class WandbLogger:
    """One W&B run for a training run; :meth:`log` per rollout, :meth:`finish` at the end."""

    def __init__(self, config: Any, document: dict[str, Any], out: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise LoggerError(WANDB_MISSING) from None
        self.wandb = wandb
        self.config = config
        # config_document already hides --wandb-key: the key itself is never uploaded.
        settings = {}
        if config.wandb_host:
            settings["base_url"] = config.wandb_host
        if config.wandb_key:
            settings["api_key"] = config.wandb_key
        if config.wandb_dir:
            Path(config.wandb_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.wandb_project,
            group=config.wandb_group,
            entity=config.wandb_team,
            id=config.wandb_run_id,
            resume="allow" if config.wandb_run_id else None,
            name=run_name(config, out),
            dir=config.wandb_dir,
            mode=config.wandb_mode,  # None: WANDB_MODE, else wandb's default
            config=document,
            settings=wandb.Settings(**settings) if settings else None,
        )
        self.defined: set[str] = set()
        self.media_dir = tempfile.TemporaryDirectory(prefix="miles-wandb-media-")
        self.run.define_metric("rollout_id")
        self.run.define_metric("train_step")

    def _define(self, key: str, step_metric: str) -> None:
        if key not in self.defined:
            self.run.define_metric(key, step_metric=step_metric)
            self.defined.add(key)

    def log(self, metrics: dict[str, Any], samples: Sequence[Any] = ()) -> None:
        rollout_id = int(metrics["rollout_id"])
        # Per-step lists: one row per optimizer step on their own x axis.
        for step, values in per_step_rows(metrics):
            for key in values:
                self._define(key, "train_step")
            self.run.log({"train_step": step, **values})
        row: dict[str, Any] = {"rollout_id": rollout_id}
        for key, value in scalars(metrics).items():
            self._define(key, "rollout_id")
            row[key] = value
        row.update(self._media(rollout_id, samples))
        self.run.log(row)

    def _media(self, rollout_id: int, samples: Sequence[Any]) -> dict[str, Any]:
        count = self.config.wandb_log_num_images
        interval = max(1, self.config.wandb_log_image_interval or 1)
        if count <= 0 or not samples or rollout_id % interval:
            return {}
        images, videos = [], []
        for index, sample in enumerate(samples[:count]):
            caption = sample.prompt if sample.reward is None else f"{sample.prompt} (reward {sample.reward:.4f})"
            frames = uint8_frames(sample.pixels)
            if frames.ndim == 4 and frames.shape[0] > 1:  # [F, H, W, C]
                videos.append(self._video(frames, f"rollout_{rollout_id:05d}_{index}", caption))
            else:
                images.append(self._image(frames[0] if frames.ndim == 4 else frames, caption))
        self._define("rollout/images", "rollout_id")
        self._define("rollout/videos", "rollout_id")
        return {key: value for key, value in (("rollout/images", images), ("rollout/videos", videos)) if value}

    def _image(self, frame: Any, caption: str) -> Any:
        return self.wandb.Image(frame[..., 0] if frame.shape[-1] == 1 else frame, caption=caption)

    def _video(self, frames: Any, stem: str, caption: str) -> Any:
        """A ``wandb.Video`` of an MP4 (H.264) when the video extra is installed, else of an
        animated GIF (Pillow): wandb's own encoding of arrays needs moviepy."""
        from miles_core import media

        fps = self.config.diffusion_fps or 8
        if media.video_encoder() is not None:
            path = media.write_mp4(Path(self.media_dir.name) / f"{stem}.mp4", frames, fps)
            return self.wandb.Video(str(path), caption=caption, format="mp4")
        path = media.write_gif(Path(self.media_dir.name) / f"{stem}.gif", frames, fps)
        return self.wandb.Video(str(path), caption=caption, format="gif")

    def log_eval(self, media: Any) -> None:
        """An evaluation (:class:`~miles_core.training.evaluation.EvalMedia`): per eval set
        its captioned grid (``eval/<set>/samples``) and its videos (``eval/<set>/videos``,
        each captioned with its prompt, seed and reward), at the evaluation's rollout."""
        row: dict[str, Any] = {"rollout_id": media.rollout_id}
        for name, rows in media.rows.items():
            if name in media.grids:
                key = f"eval/{name}/samples"
                self._define(key, "rollout_id")
                row[key] = [self.wandb.Image(str(media.grids[name]), caption=f"{name} {media.tag}")]
            # The archive's own files (samples/eval/): MP4 with the video extra, else GIF.
            videos = [
                self.wandb.Video(str(media.out / archived), caption=eval_caption(r), format=Path(archived).suffix[1:])
                for r in rows
                if r["video"] is not None and (archived := r["video"]["mp4"] or r["video"]["gif"])
            ]
            if videos:
                self._define(f"eval/{name}/videos", "rollout_id")
                row[f"eval/{name}/videos"] = videos
        self.run.log(row)

    def finish(self, exit_code: int = 0) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        finally:
            self.media_dir.cleanup()


def eval_caption(row: dict[str, Any]) -> str:
    """An evaluation sample's caption from its manifest row."""
    reward = "failed" if row["reward"] is None else f"{row['reward']:.4f}"
    return f"{row['prompt']} (seed {row['seed']}, reward {reward})"


class Trackers:
    """Every tracker the run enabled (W&B, TensorBoard), one interface: :meth:`log` per
    record, :meth:`log_eval` per evaluation, :meth:`finish` at the end."""

    def __init__(self, loggers: Sequence[Any]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: dict[str, Any], samples: Sequence[Any] = ()) -> None:
        for logger in self.loggers:
            logger.log(metrics, samples)

    def log_eval(self, media: Any) -> None:
        for logger in self.loggers:
            logger.log_eval(media)

    def finish(self, exit_code: int = 0) -> None:
        errors = []
        for logger in self.loggers:  # every tracker gets to close its files, even after one failed
            try:
                logger.finish(exit_code=exit_code)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def require_wandb(config: Any) -> None:
    """Fail early, before any model loads, when ``--use-wandb`` is set without wandb."""
    if config.use_wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise LoggerError(WANDB_MISSING) from None


def require_trackers(config: Any) -> None:
    """Fail early, before any model loads, when a tracker is enabled without its package
    (``--use-wandb``: wandb; ``--use-tensorboard``: tensorboard)."""
    require_wandb(config)
    if config.use_tensorboard:
        from miles_core.training.tensorboard_logging import require_tensorboard

        require_tensorboard()


def metrics_logger(config: Any, document: dict[str, Any], out: Path) -> Trackers | None:
    """The trackers the run enabled (``--use-wandb``, ``--use-tensorboard``), else None."""
    loggers: list[Any] = []
    try:
        if config.use_wandb:
            loggers.append(WandbLogger(config, document, out))
        if config.use_tensorboard:
            from miles_core.training.tensorboard_logging import TensorBoardLogger

            loggers.append(TensorBoardLogger(config, out))
    except BaseException:
        for logger in loggers:
            logger.finish(exit_code=1)
        raise
    return Trackers(loggers) if loggers else None


# -- custom log functions ----------------------------------------------------------------

ROLLOUT_LOG_FLAG = "--custom-rollout-log-function-path"
EVAL_LOG_FLAG = "--custom-eval-rollout-log-function-path"

CustomLog = Callable[[int, Any, dict[str, Any]], Awaitable[bool]]
"""``await log(rollout_id, samples, metrics) -> skip the default logging``."""


def custom_log_function(config: Any, *, evaluation: bool = False) -> CustomLog:
    """The user's log function, called as ``fn(rollout_id, config, samples, metrics)``
    (sync or async) where

    * for a rollout: ``samples`` is the scored ``list[Sample]`` and ``metrics`` its
      default ``rollout/*`` metrics;
    * for an evaluation: ``samples`` is ``{eval set name: list[Sample]}`` and ``metrics``
      the ``eval/<name>/*`` metrics.

    It may change ``metrics`` in place: unless it returns True, the dict as it left it is
    logged. True skips that default logging (those keys in ``metrics.jsonl`` and W&B, and
    the rollout's W&B images or the evaluation's sample grids). Without the flag the
    returned function logs nothing and never skips."""
    from miles_core.errors import HookError
    from miles_core.rollout.hooks import load_hook

    flag = EVAL_LOG_FLAG if evaluation else ROLLOUT_LOG_FLAG
    path = config.custom_eval_rollout_log_function_path if evaluation else config.custom_rollout_log_function_path
    hook = load_hook(flag, path, "log_function")

    async def log(rollout_id: int, samples: Any, metrics: dict[str, Any]) -> bool:
        if hook is None:
            return False
        skip = await hook(rollout_id, config, samples, metrics)
        if skip is not None and not isinstance(skip, bool):
            raise HookError(f"{hook.where}: must return True (skip the default logging), False or None, got {type(skip).__name__}")
        return bool(skip)

    return log


# -- progress bars ---------------------------------------------------------------------------


class _NoBar:
    total = 0
    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def reset(self, total: int | None = None) -> None:
        pass

    def refresh(self) -> None:
        pass


class Progress:
    """Progress bars per phase of a rollout, with tqdm on stderr, only when stderr is a
    terminal: logs, CI and tests get the one-line summary per rollout and nothing else."""

    def __init__(self, stream: Any = None, *, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled

    @contextmanager
    def phase(self, description: str, total: int, unit: str) -> Iterator[Any]:
        if not self.enabled:
            yield _NoBar()
            return
        from tqdm import tqdm

        bar = tqdm(total=total, desc=description, unit=unit, file=self.stream, leave=False, dynamic_ncols=True)
        try:
            yield bar
        finally:
            bar.close()

    @contextmanager
    def training(self, trainer: Any, description: str, unit: str) -> Iterator[None]:
        """A bar fed by the trainer's ``on_progress`` hook (its total is known only once
        the trainer has cut the rollout into micro-batches)."""
        if not self.enabled:
            yield
            return
        with self.phase(description, 0, unit) as bar:

            def advance(done: int, total: int) -> None:
                bar.total, bar.n = total, done
                bar.refresh()

            trainer.on_progress = advance
            try:
                yield
            finally:
                trainer.on_progress = None


__all__ = [
    "LoggerError",
    "Progress",
    "Trackers",
    "WANDB_MISSING",
    "WandbLogger",
    "eval_caption",
    "custom_log_function",
    "metrics_logger",
    "require_trackers",
    "require_wandb",
    "run_name",
]
