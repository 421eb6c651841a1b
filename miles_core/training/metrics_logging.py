"""Where a run's records go besides ``metrics.jsonl``: Weights & Biases (``--use-wandb``)
and progress bars on a terminal.

W&B: one history row per rollout (its scalars, with ``rollout_id`` as the x axis), and
each per-optimizer-step list of a record (``train/clipfrac_per_step``) as its own series
``train_step/<name>`` against ``train_step`` (``rollout_id x steps + i``). Every
``--wandb-log-image-interval`` rollouts the first ``--wandb-log-num-images`` samples go
to ``rollout/images`` (``wandb.Image``) or ``rollout/videos`` (``wandb.Video`` of a GIF
that Pillow encodes: no ffmpeg or moviepy), captioned with the prompt and reward.
``wandb`` is imported only when ``--use-wandb`` is set.

Custom log functions (``--custom-rollout-log-function-path``,
``--custom-eval-rollout-log-function-path``) see a rollout's (or an evaluation's)
samples and default metrics first, and return True to skip their default logging:
see :func:`custom_log_function` and docs/customization.md.
"""

from __future__ import annotations

import math
import secrets
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import LoggerError

WANDB_MISSING = "--use-wandb needs the wandb package: pip install miles-core[wandb]"


# -- W&B -----------------------------------------------------------------------------------


def run_name(config: Any, out: Path) -> str:
    """``--wandb-group`` (or the run directory's name) with a random suffix unless
    ``--disable-wandb-random-suffix``. The suffix comes from :mod:`secrets`, so seeded
    RNGs are untouched."""
    base = config.wandb_group or out.name
    return base if config.disable_wandb_random_suffix else f"{base}-{secrets.token_hex(3)}"


def _scalar(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _uint8_frames(pixels: torch.Tensor) -> Any:
    """``[C, H, W]`` -> ``[H, W, C]`` or ``[C, F, H, W]`` -> ``[F, H, W, C]`` uint8 (numpy),
    single-channel images squeezed to ``[..., H, W]``."""
    data = (pixels.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    data = data.movedim(0, -1)
    if data.shape[-1] == 1:
        data = data[..., 0]
    return data.numpy()


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
        lists = {
            key.removeprefix("train/").removesuffix("_per_step"): value
            for key, value in metrics.items()
            if key.endswith("_per_step") and isinstance(value, list)
        }
        if lists:
            steps = max(len(v) for v in lists.values())
            for i in range(steps):
                row: dict[str, Any] = {"train_step": rollout_id * steps + i}
                for name, values in lists.items():
                    value = _scalar(values[i]) if i < len(values) else None
                    if value is not None:
                        key = f"train_step/{name}"
                        self._define(key, "train_step")
                        row[key] = value
                self.run.log(row)
        row = {"rollout_id": rollout_id}
        for key, value in metrics.items():
            value = _scalar(value)
            if key != "rollout_id" and value is not None:
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
            pixels = sample.pixels
            if pixels.dim() == 4 and pixels.shape[1] > 1:  # [C, F, H, W]
                videos.append(self.wandb.Video(self._gif(_uint8_frames(pixels), rollout_id, index), caption=caption))
            else:
                if pixels.dim() == 4:
                    pixels = pixels[:, 0]
                images.append(self.wandb.Image(_uint8_frames(pixels), caption=caption))
        self._define("rollout/images", "rollout_id")
        self._define("rollout/videos", "rollout_id")
        return {key: value for key, value in (("rollout/images", images), ("rollout/videos", videos)) if value}

    def _gif(self, frames: Any, rollout_id: int, index: int) -> str:
        from PIL import Image

        fps = self.config.diffusion_fps or 8
        path = Path(self.media_dir.name) / f"rollout_{rollout_id:05d}_{index}.gif"
        pictures = [Image.fromarray(frame) for frame in frames]
        pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=max(1, round(1000 / fps)), loop=0)
        return str(path)

    def finish(self, exit_code: int = 0) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        finally:
            self.media_dir.cleanup()


def require_wandb(config: Any) -> None:
    """Fail early, before any model loads, when ``--use-wandb`` is set without wandb."""
    if config.use_wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise LoggerError(WANDB_MISSING) from None


def metrics_logger(config: Any, document: dict[str, Any], out: Path) -> WandbLogger | None:
    """The W&B logger when ``--use-wandb`` is set, else None."""
    return WandbLogger(config, document, out) if config.use_wandb else None


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
    "WANDB_MISSING",
    "WandbLogger",
    "custom_log_function",
    "metrics_logger",
    "require_wandb",
    "run_name",
]
