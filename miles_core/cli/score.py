"""``miles-core score``: score image files with a run's reward, before spending a run.

Give the reward as a training run would (``--rm-type``, ``--reward-weights``,
``--custom-rm-path``, ``--reward-key``, ``--group-rm``, the rewards' own flags, or
``--custom-config-path``), then either ``--prompt TEXT IMAGE [IMAGE ...]`` or
``--prompt-data FILE.jsonl`` whose rows name a prompt (``--input-key``) and an image
(``--image-key``; a path relative to the file). Prints one line per image with its
reward and, for a mixture or a dict-valued reward, each component; then the mean.
Scoring goes through the same code as training (``RewardScorer``): images with
the same prompt form one group (what ``--group-rm`` scores together), and a sample
whose reward fails is shown as failed. An animated GIF is scored as a video.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.config.parser import OneLineParser
from miles_core.errors import UsageError


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    image: Path
    metadata: dict[str, Any]


SCORE_DESTS = ("score_prompt", "score_images", "score_json")


def add_score_arguments(parser: OneLineParser) -> list[str]:
    """The command's own arguments, added to the training flags' parser (which already
    has ``--prompt-data``, ``--input-key``, ``--image-key`` and ``--metadata-key``)."""
    parser.description = __doc__.replace("``", "")
    group = parser.add_argument_group("Scoring")
    group.add_argument("--prompt", dest="score_prompt", metavar="TEXT", help="the prompt the IMAGE files were generated for")
    group.add_argument("score_images", nargs="*", metavar="IMAGE", help="image files to score (with --prompt)")
    group.add_argument("--json", dest="score_json", action="store_true", help="print one JSON object per image instead of a table")
    return list(SCORE_DESTS)


def items_from_config(config: Any) -> list[ScoreItem]:
    own = config.command_arguments
    prompt, images = own.get("score_prompt"), own.get("score_images") or []
    if prompt is not None:
        if config.prompt_data:
            raise UsageError("give either --prompt with IMAGE files or --prompt-data, not both")
        if not images:
            raise UsageError("--prompt needs at least one IMAGE file to score")
        return [ScoreItem(prompt, Path(image), {}) for image in images]
    if not config.prompt_data:
        raise UsageError("give --prompt TEXT IMAGE [IMAGE ...] or --prompt-data FILE.jsonl")
    if images:
        raise UsageError("IMAGE arguments go with --prompt; with --prompt-data the rows name the images")
    image_key = config.image_key  # the training flag: the same rows, the same key
    path = Path(config.prompt_data)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompt-data {path}: cannot read ({exc})") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--prompt-data {path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise UsageError(f"--prompt-data {path}:{number}: a row must be a JSON object")
        for key in (config.input_key, image_key):
            if not isinstance(row.get(key), str):
                raise UsageError(f"--prompt-data {path}:{number}: needs a string under {key!r}")
        metadata = row.get(config.metadata_key) or {}
        if not isinstance(metadata, dict):
            raise UsageError(f"--prompt-data {path}:{number}: {config.metadata_key!r} must be a JSON object")
        image = Path(row[image_key])
        items.append(ScoreItem(row[config.input_key], image if image.is_absolute() else path.parent / image, metadata))
    if not items:
        raise UsageError(f"--prompt-data {path}: no rows")
    return items


def load_pixels(path: Path) -> Any:
    """An image as ``[C, H, W]`` floats in [0, 1] (what the engine returns); an animated
    GIF as a video ``[C, F, H, W]``."""
    import numpy as np
    import torch
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]
    except FileNotFoundError:
        raise UsageError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise UsageError(f"{path}: not an image Pillow can read ({exc})") from None
    array = torch.from_numpy(np.stack(frames)).float().div(255.0)  # [F, H, W, C]
    if len(frames) == 1:
        return array[0].permute(2, 0, 1).contiguous()
    return array.permute(3, 0, 1, 2).contiguous()


def build_samples(items: Sequence[ScoreItem]) -> list[Any]:
    """Samples the reward code scores, grouped by prompt in first-seen order."""
    from miles_core.request import RolloutOutput
    from miles_core.rollout.sample import Sample

    groups: dict[str, list[ScoreItem]] = {}
    for item in items:
        groups.setdefault(item.prompt, []).append(item)
    samples = []
    for group_index, (prompt, members) in enumerate(groups.items()):
        for index, item in enumerate(members):
            output = RolloutOutput(request_id=f"score-{group_index}", prompt=prompt, seed=index, generated_output=load_pixels(item.image))
            sample = Sample(
                prompt=prompt,
                metadata=dict(item.metadata),
                rollout_id=0,
                group_index=group_index,
                index_in_group=index,
                seed=index,
                sde_step_indices=(),
                output=output,
            )
            sample.source_path = item.image  # type: ignore[attr-defined]  # for the report only
            samples.append(sample)
    return samples


async def score_samples(config: Any, samples: list[Any], warn: Any = None) -> dict[str, float]:
    """Score like a rollout. A reward that failed on every image it scored stops a run;
    here its images are shown as failed and ``warn`` gets the reason."""
    from miles_core.errors import RewardError
    from miles_core.training.rewards import RewardScorer

    scorer = RewardScorer(config)
    if scorer.needs_whole_groups:
        by_group: dict[int, list[Any]] = {}
        for sample in samples:
            by_group.setdefault(sample.group_index, []).append(sample)
        await asyncio.gather(*(scorer.score(group) for group in by_group.values()))
    else:
        await scorer.score(samples)
    try:
        return scorer.finish(samples)
    except RewardError as exc:
        if warn is not None:
            warn(str(exc))
        return {}


def report(samples: Sequence[Any], as_json: bool) -> list[str]:
    lines = []
    for sample in samples:
        failed = bool(getattr(sample, "reward_failed", False))
        record = {
            "image": str(sample.source_path),
            "prompt": sample.prompt,
            "reward": None if failed else sample.reward,
            "components": dict(sample.reward_components),
        }
        if as_json:
            lines.append(json.dumps(record))
            continue
        value = "failed" if failed else f"{sample.reward:.6f}"
        parts = "".join(f"  {name} {v:.6f}" for name, v in record["components"].items())
        lines.append(f"{sample.source_path}  {value}{parts}")
    if not as_json:
        good = [s.reward for s in samples if not getattr(s, "reward_failed", False) and math.isfinite(s.reward)]
        if good:
            lines.append(f"mean  {sum(good) / len(good):.6f}  ({len(good)} of {len(samples)} image(s) scored)")
    return lines


def build_parser(prog: str = "miles-core score") -> OneLineParser:
    """The full parser (training flags plus the scoring arguments), for ``--help`` and docs."""
    from miles_core.config.parser import build_parser as training_parser
    from miles_core.config.parser import flag_entries
    from miles_core.plugin_manager import get_host

    host = get_host()
    parser = training_parser(flag_entries(host.flags), host.registries, prog)
    add_score_arguments(parser)
    return parser


def run(argv: Sequence[str], prog: str = "miles-core score") -> int:
    from miles_core.config.resolve import resolve_config

    config = resolve_config(list(argv), prog=prog, scope="reward", extend=add_score_arguments)
    for note in config.notes:
        print(f"{prog}: warning: {note}", file=sys.stderr)
    from miles_core.quiet import show_hub_libraries

    show_hub_libraries(config.get("log_level") or "info")  # reward models may come from the hub: their progress shows
    samples = build_samples(items_from_config(config))
    asyncio.run(score_samples(config, samples, warn=lambda line: print(f"{prog}: warning: {line}", file=sys.stderr)))
    for line in report(samples, bool(config.command_arguments.get("score_json"))):
        print(line)
    return 0
