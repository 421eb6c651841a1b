"""Evaluation during a run: fixed prompts, fixed seeds, deterministic sampling.

Every evaluation of a run samples the same prompts with the same seeds through the
engine in evaluation mode (``rollout: false``: ODE steps, pixels only), so two
evaluations differ only by the policy: the gain over the first evaluation is a paired
comparison (``eval/<name>/paired_gain``), far less noisy than comparing rollout means.

The eval sets come from ``--eval-config`` (else ``--eval-prompt-data``), each with its own
settings (:class:`~miles_core.config.eval_config.EvalDataset`: keys, samples per prompt,
steps, ``rm_type``), resolved in :mod:`miles_core.config.eval_config`.

``--eval-function-path`` (else ``--rollout-function-path``) replaces the sampling of each
eval set: it is called with ``evaluation=True`` and an :class:`EvalPrompts` source, and
its samples are scored and compared like the built-in ones.

Evaluations are scored by their own :class:`~miles_core.training.rewards.RewardScorer`
(``evaluation=True``, built with the :class:`Evaluator`, when the run starts):
``--eval-rm-type`` or ``--eval-reward-weights`` when set (a held-out reward watches for
reward hacking; it scores every sample, whatever a row's ``metadata.rm_type``), else the
training reward, with ``--eval-reward-key``
(default ``--reward-key``) picking the scalar of a dict reward. Each eval set reports
``eval/<name>/reward_mean`` and ``reward_std`` over its samples whose reward did not fail,
``eval/<name>/reward/<component>_mean`` per reward component, ``eval/<name>/reward/failed``
and the paired gain over the samples valid in both evaluations.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from miles_core.config.eval_config import EvalDataset, eval_datasets, flag_dataset
from miles_core.errors import PromptDataError
from miles_core.request import RolloutRequest
from miles_core.rollout.data import PromptRecord, load_prompts, run_image_options
from miles_core.rollout.evaluation import EvalPrompts, eval_requests
from miles_core.rollout.generate import diffusion_rollout
from miles_core.rollout.hooks import check_samples, eval_hook
from miles_core.rollout.sample import Sample


@dataclass
class EvalResult:
    rewards: dict[str, torch.Tensor]
    images: dict[str, list[torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    """Each eval set's scored samples (what ``--custom-eval-rollout-log-function-path`` gets)."""
    samples_per_prompt: dict[str, int] = field(default_factory=dict)
    """Each eval set's samples per prompt (its ``n_samples_per_eval_prompt``)."""


def load_eval_records(config: Any, dataset: EvalDataset) -> list[PromptRecord]:
    """One eval set's rows, read as the run's prompt rows are but with the set's own keys
    (an image-to-video family's rows carry their image, checked by
    :func:`~miles_core.rollout.data.load_prompts`: a bad row is a one-line
    :class:`~miles_core.errors.PromptDataError`), each row's metadata with the set's
    ``metadata_overrides`` and ``rm_type`` merged in."""
    images = run_image_options(config)
    if images and dataset.image_key is not None:
        images["image_key"] = dataset.image_key
    try:
        records = load_prompts(dataset.path, input_key=dataset.input_key, metadata_key=dataset.metadata_key, **images)
    except PromptDataError as exc:
        if dataset.source is None:
            raise
        # The set's keys come from the file: its hint names the dataset's key, not the flag.
        message = str(exc).replace("(set --input-key to", "(set the dataset's input_key to")
        message = message.replace("(set --image-key to", "(set the dataset's image_key to")
        raise PromptDataError(f"{dataset.where}: {message}") from None
    if dataset.metadata_overrides or dataset.rm_type is not None:
        records = [replace(record, metadata=dataset.row_metadata(record.metadata)) for record in records]
    return records


def load_eval_datasets(config: Any) -> dict[str, list[PromptRecord]]:
    """The eval sets (``--eval-config``, else ``--eval-prompt-data``) by name, their rows
    as :func:`load_eval_records` reads them."""
    return {dataset.name: load_eval_records(config, dataset) for dataset in eval_datasets(config)}


class Evaluator:
    def __init__(self, config: Any, engine: Any, scorer: Any = None, datasets: dict[str, list[PromptRecord]] | None = None) -> None:
        """``scorer``: an evaluation scorer (``RewardScorer(config, evaluation=True)``) to
        use, or the run's training scorer, whose built reward models the evaluation scorer
        then shares. The evaluation scorer is built here, when the run starts, so an eval
        reward that cannot be built (missing weights) stops the run before its first
        rollout, not at its first evaluation. ``datasets``: the eval sets as
        :func:`load_eval_datasets` loaded them (a run loads them before its engine);
        loaded here when not given."""
        from miles_core.training.rewards import RewardScorer

        self.config = config
        self.engine = engine
        self.training_scorer = None if getattr(scorer, "evaluation", True) else scorer
        self.scorer = scorer if self.training_scorer is None else None
        if self.scorer is None:
            # A reward on a Ray worker (--use-ray) evaluates there too, with the same models.
            sibling = getattr(self.training_scorer, "evaluation_scorer", None)
            self.scorer = sibling() if sibling is not None else RewardScorer(config, evaluation=True, share=self.training_scorer)
        self.datasets: dict[str, list[PromptRecord]] = load_eval_datasets(config) if datasets is None else datasets
        self.settings: dict[str, EvalDataset] = {dataset.name: dataset for dataset in eval_datasets(config)}
        """Each eval set's own settings (keys, samples per prompt, steps)."""
        self.first: EvalResult | None = None
        self.hook = eval_hook(config)  # None: the built-in evaluation

    def dataset(self, name: str | None) -> EvalDataset:
        """Eval set ``name``'s settings; a set the run does not name (one handed in by a
        caller) gets the flags'."""
        found = self.settings.get(name) if name is not None else None
        return found if found is not None else flag_dataset(self.config, name or "")

    def requests(self, records: list[PromptRecord], name: str | None = None) -> list[RolloutRequest]:
        """The built-in evaluation's requests for eval set ``name``'s ``records``."""
        return eval_requests(self.config, records, self.dataset(name))

    def samples_per_prompt(self, name: str) -> int:
        return self.dataset(name).n_samples_per_eval_prompt

    async def sample(self, name: str, records: list[PromptRecord], rollout_id: int) -> list[Sample]:
        """One eval set's samples: the built-in evaluation, or the eval rollout function's
        (checked: the set's ``n_samples_per_eval_prompt`` samples per prompt, in prompt
        order, so paired gains compare the same prompt and seed). The source carries the
        set's settings (:attr:`EvalPrompts.dataset`)."""
        dataset = self.dataset(name)
        config, source = self.config, EvalPrompts(name, records, dataset)
        if self.hook is None:
            return await diffusion_rollout(config, rollout_id, self.engine, source, evaluation=True)
        n = dataset.n_samples_per_eval_prompt
        samples = await self.hook(config, rollout_id, self.engine, source, evaluation=True)
        return check_samples(self.hook, samples, n, size_flag=dataset.size_flag, expected=len(records) * n)

    async def evaluate(self, rollout_id: int = -1) -> EvalResult:
        """Sample and score every eval set; ``rollout_id`` is the rollout whose record
        the result goes into (passed on to an eval rollout function)."""
        result = EvalResult({}, {})
        scorer = self.scorer
        for name, records in self.datasets.items():
            samples = await self.sample(name, records, rollout_id)
            rewards = await scorer.score(samples)
            result.samples[name] = samples
            result.samples_per_prompt[name] = self.samples_per_prompt(name)
            result.rewards[name] = rewards
            result.images[name] = [s.pixels for s in samples]
            # RewardError when every sample failed; rewards of failed samples are NaN.
            reward = scorer.finish(samples, prefix=f"eval/{name}/reward/")
            result.metrics[f"eval/{name}/reward_mean"] = reward.pop(f"eval/{name}/reward/raw_mean")
            result.metrics[f"eval/{name}/reward_std"] = reward.pop(f"eval/{name}/reward/raw_std")
            for stat in ("raw_min", "raw_max"):
                reward.pop(f"eval/{name}/reward/{stat}")
            result.metrics.update(reward)
            if self.first is not None:
                gain = rewards - self.first.rewards[name]
                gain = gain[torch.isfinite(gain)]  # the samples whose reward did not fail, now and then
                if gain.numel():
                    result.metrics[f"eval/{name}/paired_gain"] = float(gain.mean())
                    result.metrics[f"eval/{name}/paired_gain_std"] = float(gain.std(unbiased=False))
        if self.first is None:
            self.first = result
        return result


# -- captioned grids --------------------------------------------------------------------------

MIN_CELL = 96
"""Cells are upscaled (nearest neighbour, an integer factor) to at least this many pixels
a side: tiny images stay visible and a cell's caption fits under it."""
LINE = 13  # the height of a line of Pillow's default font (10 px), with spacing
PAD = 4


@dataclass
class GridCaptions:
    """What a grid says about itself: a header, a label per column (``before`` /
    ``after``), a line per row (its prompt) and lines per cell (seed, reward)."""

    header: str = ""
    columns: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    cells: list[list[str]] = field(default_factory=list)


def _fit(draw: Any, text: str, width: int, font: Any) -> str:
    """``text`` cut (with an ellipsis) to ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def save_grid(images: list[torch.Tensor], path: Path, columns: int, captions: GridCaptions | None = None) -> Path:
    """Images [C, H, W] (videos: their first frame) in [0, 1] as one PNG grid, with
    ``captions`` drawn around them: the header on top, then per row its label line above
    its cells and per cell its lines below it."""
    from PIL import Image, ImageDraw, ImageFont

    from miles_core.media import rgb
    from miles_core.training.record_values import uint8_frames

    captions = captions or GridCaptions()
    frames = [img[:, 0] if img.ndim == 4 else img for img in images]
    height, width = frames[0].shape[-2:]
    scale = max(1, -(-MIN_CELL // min(height, width))) if captions != GridCaptions() else 1
    cell_w, cell_h = width * scale, height * scale
    cell_lines = max((len(lines) for lines in captions.cells), default=0)
    rows = (len(frames) + columns - 1) // columns
    top = LINE * (bool(captions.header) + bool(captions.columns)) + (PAD if captions.header or captions.columns else 0)
    row_h = LINE * bool(captions.rows) + cell_h + LINE * cell_lines + (PAD if captions.rows or cell_lines else 0)
    grid = Image.new("RGB", (columns * cell_w, top + rows * row_h), "white")
    draw, font = ImageDraw.Draw(grid), ImageFont.load_default()
    y = 0
    if captions.header:
        draw.text((PAD, y), _fit(draw, captions.header, grid.width - 2 * PAD, font), fill="black", font=font)
        y += LINE
    for column, label in enumerate(captions.columns[:columns]):
        draw.text((column * cell_w + PAD, y), _fit(draw, label, cell_w - 2 * PAD, font), fill="black", font=font)
    for i, frame in enumerate(frames):
        row, column = divmod(i, columns)
        x, y = column * cell_w, top + row * row_h
        if column == 0 and row < len(captions.rows):
            draw.text((PAD, y), _fit(draw, captions.rows[row], grid.width - 2 * PAD, font), fill="black", font=font)
        y += LINE * bool(captions.rows)
        picture = Image.fromarray(rgb(uint8_frames(frame)))
        grid.paste(picture.resize((cell_w, cell_h), Image.NEAREST) if scale > 1 else picture, (x, y))
        for k, line in enumerate(captions.cells[i] if i < len(captions.cells) else []):
            draw.text((x + PAD, y + cell_h + k * LINE), _fit(draw, line, cell_w - 2 * PAD, font), fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def _reward_text(reward: float | None) -> str:
    return "reward failed" if reward is None else f"reward {reward:.4f}"


def eval_grid_captions(eval_set: str, tag: str, rows: list[dict[str, Any]], columns: int, *, video: bool) -> GridCaptions:
    """The captions of one evaluation's grid from its manifest rows (prompt order)."""
    header = f"eval set {eval_set} · {tag}" + (" · first frame of each video" if video else "")
    prompts = [row["prompt"] for row in rows[::columns]]
    cells = [[f"seed {row['seed']}", _reward_text(row["reward"])] for row in rows]
    return GridCaptions(header, [], prompts, cells)


def before_after_captions(
    eval_set: str, before: list[dict[str, Any]], after: list[dict[str, Any]], columns: int, *, video: bool
) -> GridCaptions:
    """Before and after, side by side (``2 x columns`` cells a row): the same prompt and seed
    in each pair of columns, labelled ``before`` and ``after``."""
    header = f"eval set {eval_set} · before ({before[0]['tag']}) / after ({after[0]['tag']})"
    header += " · first frame of each video" if video else ""
    cells = [[f"seed {row['seed']}", _reward_text(row["reward"])] for pair in zip(before, after) for row in pair]
    return GridCaptions(header, ["before", "after"] * columns, [row["prompt"] for row in after[::columns]], cells)


# -- the evaluation archive --------------------------------------------------------------------

ARCHIVE = Path("samples") / "eval"
MANIFEST = ARCHIVE / "manifest.jsonl"


def _last_evaluation(manifest: Path) -> int:
    """The highest ``evaluation`` in an existing manifest (a resumed run goes on counting),
    -1 when there is none; a partial last line (a run killed mid-write) is ignored."""
    last = -1
    if manifest.exists():
        for line in manifest.read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line)["evaluation"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


class EvalArchive:
    """Every sample of every evaluation under ``RUN_DIR/samples/eval/<set>/<tag>/``
    (``p<prompt:03d>_s<sample:02d>``: an image as ``.png``; a video as ``.webm`` (VP9) and
    ``.mp4`` (H.264) with the video extra, else ``.gif``, plus a ``.png`` poster, its first
    frame), and one JSON line per sample in ``RUN_DIR/samples/eval/manifest.jsonl``,
    appended and flushed per evaluation (docs/guide.md, "The evaluation archive")."""

    def __init__(self, out: Path, columns: int, fps: float | None = None) -> None:
        self.out = out
        self.columns = columns
        self.fps = fps
        self.evaluation = _last_evaluation(out / MANIFEST) + 1
        # Each eval set's first evaluation in this process (rows, images): the "before" column.
        self.first: dict[str, tuple[list[dict[str, Any]], list[torch.Tensor]]] = {}

    def save(self, result: EvalResult, tag: str, rollout_id: int, trained_rollouts: int) -> dict[str, list[dict[str, Any]]]:
        """Write ``result``'s samples and their manifest lines; returns the lines per eval set."""
        from miles_core import media
        from miles_core.training.record_values import uint8_frames

        encoder = media.video_encoder() is not None
        written: dict[str, list[dict[str, Any]]] = {}
        for name, samples in result.samples.items():
            columns = result.samples_per_prompt.get(name, self.columns)
            folder = ARCHIVE / name / tag
            (self.out / folder).mkdir(parents=True, exist_ok=True)
            rewards = result.rewards[name]
            rows = []
            for i, sample in enumerate(samples):
                stem = folder / f"p{i // columns:03d}_s{i % columns:02d}"
                frames = uint8_frames(sample.pixels)
                video = None
                if frames.ndim == 4 and frames.shape[0] > 1:  # [F, H, W, C]
                    fps = float(self.fps or media.DEFAULT_FPS)
                    paths: dict[str, str | None] = {"webm": None, "mp4": None, "gif": None}
                    if encoder:
                        media.write_webm(self.out / f"{stem}.webm", frames, fps)
                        media.write_mp4(self.out / f"{stem}.mp4", frames, fps)
                        paths["webm"], paths["mp4"] = f"{stem.as_posix()}.webm", f"{stem.as_posix()}.mp4"
                    else:
                        media.write_gif(self.out / f"{stem}.gif", frames, fps)
                        paths["gif"] = f"{stem.as_posix()}.gif"
                    video = {**paths, "frames": int(frames.shape[0]), "fps": fps}
                    frames = frames[0]
                elif frames.ndim == 4:
                    frames = frames[0]  # a one-frame video: a picture
                media.write_png(self.out / f"{stem}.png", frames)
                reward = float(rewards[i])
                components = {key: float(v) for key, v in sample.reward_components.items() if math.isfinite(float(v))}
                rows.append(
                    {
                        "eval_set": name,
                        "tag": tag,
                        "evaluation": self.evaluation,
                        "trained_rollouts": trained_rollouts,
                        "rollout_id": rollout_id,
                        "prompt_index": i // columns,
                        "prompt": sample.prompt,
                        "sample_index": i % columns,
                        "seed": int(sample.seed),
                        "reward": reward if math.isfinite(reward) and not sample.reward_failed else None,
                        "reward_components": components,
                        "image": f"{stem.as_posix()}.png",
                        "video": video,
                    }
                )
            written[name] = rows
        with (self.out / MANIFEST).open("a", encoding="utf-8") as manifest:
            for rows in written.values():
                manifest.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            manifest.flush()
        self.evaluation += 1
        return written

    def save_grids(self, result: EvalResult, rows: dict[str, list[dict[str, Any]]], tag: str) -> list[Path]:
        """The captioned grids of one evaluation (``samples/eval_<set>_<tag>.png``) and, after
        the first, before and after side by side (``samples/eval_<set>_before_after.png``)."""
        samples_dir = self.out / "samples"
        paths = []
        for name, images in result.images.items():
            columns = result.samples_per_prompt.get(name, self.columns)
            video = any(img.ndim == 4 and img.shape[1] > 1 for img in images)
            captions = eval_grid_captions(name, tag, rows[name], columns, video=video)
            paths.append(save_grid(images, samples_dir / f"eval_{name}_{tag}.png", columns, captions))
            if name not in self.first:
                self.first[name] = (rows[name], images)
                continue
            before_rows, before = self.first[name]
            pairs = [img for pair in zip(before, images) for img in pair]
            captions = before_after_captions(name, before_rows, rows[name], columns, video=video)
            paths.append(save_grid(pairs, samples_dir / f"eval_{name}_before_after.png", 2 * columns, captions))
        return paths


@dataclass
class EvalMedia:
    """One evaluation as the trackers log it: per eval set its captioned grid, its manifest
    rows and each sample's uint8 frames (``[H, W, C]``, a video ``[F, H, W, C]``).
    ``rollout_id``: the record that holds its metrics; ``trained_rollouts``: the rollouts
    trained when it ran (two evaluations can share a record, never this)."""

    tag: str
    rollout_id: int
    trained_rollouts: int
    out: Path
    grids: dict[str, Path]
    rows: dict[str, list[dict[str, Any]]]
    frames: dict[str, list[Any]]
    fps: float | None = None

    @classmethod
    def of(
        cls,
        result: EvalResult,
        rows: dict[str, list[dict[str, Any]]],
        grids: list[Path],
        tag: str,
        rollout_id: int,
        out: Path,
        *,
        trained_rollouts: int,
    ) -> EvalMedia:
        from miles_core.training.record_values import uint8_frames

        by_set = {name: out / "samples" / f"eval_{name}_{tag}.png" for name in rows}
        frames = {name: [uint8_frames(sample.pixels) for sample in samples] for name, samples in result.samples.items()}
        fps = next((row["video"]["fps"] for set_rows in rows.values() for row in set_rows if row["video"]), None)
        kept = {name: path for name, path in by_set.items() if path in grids}
        return cls(tag, rollout_id, trained_rollouts, out, kept, rows, frames, fps)
