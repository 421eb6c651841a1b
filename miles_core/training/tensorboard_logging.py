"""``--use-tensorboard``: a run's records and evaluation media as TensorBoard event files in
``--tensorboard-dir`` (default ``RUN_DIR/tensorboard``).

* each record's scalars at step ``rollout_id``, and its per-optimizer-step lists as
  ``train_step/<name>`` at step ``train_step`` (the series W&B gets:
  :func:`~miles_core.training.metrics_logging.per_step_rows`);
* per evaluation and eval set, at step ``trained_rollouts`` (the rollouts trained when it
  ran: the evaluation before training and the one after rollout 0 share record 0, and at
  one step the second would hide the first): the captioned grid (``eval/<set>/grid``),
  each sample (``eval/<set>/p<prompt>_s<sample>``; a video's first frame) and each video
  (``eval/<set>/video/p<prompt>_s<sample>``) as an animated GIF in an image summary, which
  TensorBoard's image dashboard plays. torch's ``add_video`` needs an
  old moviepy and otherwise writes nothing, so the GIF is encoded here
  (:mod:`miles_core.media`).

Everything goes through a public ``FileWriter.add_summary``; ``tensorboard`` is imported
only when the flag is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_core.errors import LoggerError

TENSORBOARD_MISSING = "--use-tensorboard needs the tensorboard package: pip install miles-core[tensorboard]"


def require_tensorboard() -> None:
    """Fail early, before any model loads, when tensorboard is not installed."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard.writer import FileWriter  # noqa: F401  (imports tensorboard's protos)
    except ImportError:
        raise LoggerError(TENSORBOARD_MISSING) from None


def tensorboard_dir(config: Any, out: Path) -> Path:
    return Path(config.tensorboard_dir) if config.tensorboard_dir else out / "tensorboard"


def image_summary(tag: str, encoded: bytes, height: int, width: int) -> Any:
    """A ``Summary`` holding one encoded picture (PNG, or a GIF that TensorBoard animates)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    picture = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=encoded)
    return Summary(value=[Summary.Value(tag=tag, image=picture)])


class TensorBoardLogger:
    """One event file per run (a resumed run adds a new one to the same directory)."""

    def __init__(self, config: Any, out: Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard.summary import scalar
        from torch.utils.tensorboard.writer import FileWriter

        self.config = config
        self.scalar = scalar
        self.directory = tensorboard_dir(config, out)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = FileWriter(str(self.directory))

    def log(self, metrics: dict[str, Any], samples: Any = ()) -> None:
        from miles_core.training.record_values import per_step_rows, scalars

        rollout_id = int(metrics["rollout_id"])
        for step, values in per_step_rows(metrics):
            for key, value in values.items():
                self.writer.add_summary(self.scalar(key, float(value)), step)
        for key, value in scalars(metrics).items():
            self.writer.add_summary(self.scalar(key, float(value)), rollout_id)
        self.writer.flush()

    def log_eval(self, media: Any) -> None:
        """An evaluation (:class:`~miles_core.training.evaluation.EvalMedia`) at step
        ``trained_rollouts``, its own (its scalars stay in its record, at ``rollout_id``)."""
        from PIL import Image

        from miles_core import media as encode

        step = media.trained_rollouts
        for name, rows in media.rows.items():
            if name in media.grids:
                with Image.open(media.grids[name]) as grid:
                    size = grid.size
                self.writer.add_summary(image_summary(f"eval/{name}/grid", media.grids[name].read_bytes(), size[1], size[0]), step)
            for row, frames in zip(rows, media.frames[name]):
                cell = f"p{row['prompt_index']:03d}_s{row['sample_index']:02d}"
                poster = frames[0] if frames.ndim == 4 else frames
                png = (media.out / row["image"]).read_bytes()  # the archived PNG (a video's poster)
                self.writer.add_summary(image_summary(f"eval/{name}/{cell}", png, poster.shape[0], poster.shape[1]), step)
                if row["video"] is not None:
                    archived = row["video"]["gif"]  # the archive's GIF when it wrote one (no video extra)
                    gif = (media.out / archived).read_bytes() if archived else encode.gif_bytes(frames, row["video"]["fps"])
                    summary = image_summary(f"eval/{name}/video/{cell}", gif, frames.shape[1], frames.shape[2])
                    self.writer.add_summary(summary, step)
        self.writer.flush()

    def finish(self, exit_code: int = 0) -> None:
        self.writer.close()


__all__ = ["TENSORBOARD_MISSING", "TensorBoardLogger", "image_summary", "require_tensorboard", "tensorboard_dir"]
