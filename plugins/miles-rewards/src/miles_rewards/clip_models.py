"""What the CLIP-based rewards (``pickscore``, ``aesthetic``, ``clipscore``,
``temporal_consistency``) share: loading a CLIP model and processor with transformers,
OpenAI CLIP's own image preprocessing, turning outputs into the PIL frames the models
take, choosing a video's frames, batching frames through the model and aggregating an
output's frame scores (``--reward-frame-aggregation``).

Imported only when one of those rewards is used (the entry-point module names it by a
string), so torch and transformers stay out of ``miles-core list-plugins``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from miles_core.api import RewardError
from miles_rewards.pixels import to_uint8_frames
from miles_rewards.plugin import FRAME_AGGREGATIONS

DTYPE = torch.float32
"""The reference scores in float32 (flow_grpo's PickScore and aesthetic scorers); so do we,
on the GPU and on the CPU."""


def reward_device() -> torch.device:
    """The first visible GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _check_source(flag: str, path: str | None, reward: str) -> str:
    if not path:
        raise RewardError(f"{flag} is required with the {reward} reward")
    if Path(path).expanduser().exists() and not Path(path).expanduser().is_dir():
        raise RewardError(f"{flag} {path}: not a directory (a saved model directory or a hub id is expected)")
    return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path


def load_clip_model(flag: str, path: str | None, reward: str, device: torch.device) -> Any:
    """``CLIPModel.from_pretrained(path)`` in float32, in eval mode, on ``device``.

    A path that holds no model, a model of another architecture (its ``config.json`` is
    not ``model_type: clip``: transformers would otherwise build a random CLIP from it
    with a warning) or weights that lack some of the CLIP model's tensors (which
    transformers would leave random) is a one-line :class:`RewardError` naming ``flag``
    and ``path``."""
    from transformers import AutoConfig, CLIPModel

    source = _check_source(flag, path, reward)
    try:
        model_type = AutoConfig.from_pretrained(source).model_type
        if model_type != "clip":
            raise RewardError(
                f"{flag} {path}: not a CLIP model (its config.json has model_type {model_type!r}; "
                f"the {reward} reward needs a transformers CLIPModel, model_type 'clip')"
            )
        model, info = CLIPModel.from_pretrained(source, dtype=DTYPE, output_loading_info=True)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"{flag} {path}: cannot load a CLIP model ({_first_line(exc)})") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise RewardError(
            f"{flag} {path}: not a complete CLIP checkpoint ({len(missing)} of the CLIP model's tensors are missing, e.g. {missing[0]})"
        )
    return model.eval().requires_grad_(False).to(device)


def load_clip_processor(flag: str, path: str | None, reward: str, *, images_only: bool = False) -> Any:
    """The CLIP processor (tokenizer and image processor) at ``path``, or only its image
    processor with ``images_only``. The PIL image backend is asked for explicitly: it is
    what the reference used (transformers 4's ``CLIPImageProcessor``), and the
    torchvision backend resizes slightly differently."""
    from transformers import AutoImageProcessor, AutoProcessor

    source = _check_source(flag, path, reward)
    loader = AutoImageProcessor if images_only else AutoProcessor
    try:
        processor = loader.from_pretrained(source, backend="pil")
    except Exception as exc:
        what = "an image processor" if images_only else "a CLIP processor"
        raise RewardError(f"{flag} {path}: cannot load {what} ({_first_line(exc)})") from exc
    if not images_only and (getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None):
        raise RewardError(
            f"{flag} {path}: not a CLIP processor (it needs both a tokenizer and an image processor, got {type(processor).__name__})"
        )
    return processor


@dataclass(frozen=True)
class OpenAIClipTransform:
    """OpenAI CLIP's own image preprocessing, the transform of ``clip.load`` that
    CLIPScore's reference uses (jmhessel/clipscore@1036465 ``clipscore.py``,
    ``_transform_test``), on PIL images:

        Resize(size, BICUBIC) -> CenterCrop(crop) -> convert("RGB") -> ToTensor() -> Normalize(mean, std)

    written out here without torchvision (which cannot be installed beside the CPU torch):

    - **resize** (torchvision ``Resize(int)`` on a PIL image): the short side becomes
      ``size``, the long side ``int(size * long / short)`` (truncated), with Pillow's
      BICUBIC; an image already of that size is left as it is;
    - **centre crop** (torchvision ``CenterCrop``): top ``int(round((H - crop_h) / 2))``,
      left ``int(round((W - crop_w) / 2))``, Python's round (half to even). transformers'
      ``CLIPImageProcessor`` floors instead, so the two crops differ by one pixel when
      ``H - crop_h`` (or ``W - crop_w``) is 3 modulo 4;
    - **to tensor**: ``uint8 / 255`` in float32, then ``(x - mean) / std`` per channel.

    ``size``, ``crop`` and the mean and std are read from the model's image processor
    (OpenAI CLIP: 224, 224x224 and the OpenAI mean and std), so a smaller model works too.
    """

    size: int
    crop_height: int
    crop_width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_image_processor(cls, image_processor: Any, flag: str, path: str) -> OpenAIClipTransform:
        """The transform with the sizes, mean and std of a transformers CLIP image
        processor; one it cannot describe is a one-line :class:`RewardError`."""
        size = dict(getattr(image_processor, "size", None) or {})
        crop = dict(getattr(image_processor, "crop_size", None) or {})
        mean, std = getattr(image_processor, "image_mean", None), getattr(image_processor, "image_std", None)
        if "shortest_edge" not in size or not {"height", "width"} <= set(crop) or mean is None or std is None:
            raise RewardError(
                f"{flag} {path}: not a CLIP image processor (it needs size.shortest_edge, crop_size and "
                f"image_mean/image_std; got size {size}, crop_size {crop})"
            )
        if crop["height"] > size["shortest_edge"] or crop["width"] > size["shortest_edge"]:
            raise RewardError(f"{flag} {path}: crop_size {crop} is larger than size.shortest_edge {size['shortest_edge']}")
        return cls(int(size["shortest_edge"]), int(crop["height"]), int(crop["width"]), tuple(mean), tuple(std))

    def resize(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        new_width, new_height = (new_short, new_long) if width <= height else (new_long, new_short)
        if (new_width, new_height) == (width, height):
            return image
        return image.resize((new_width, new_height), Image.Resampling.BICUBIC)

    def crop(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        top = int(round((height - self.crop_height) / 2.0))
        left = int(round((width - self.crop_width) / 2.0))
        return image.crop((left, top, left + self.crop_width, top + self.crop_height))

    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """``[B, 3, crop_h, crop_w]`` float32 pixel values."""
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        tensors = []
        for image in images:
            rgb = self.crop(self.resize(image)).convert("RGB")
            pixels = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).to(torch.float32).div(255)
            tensors.append((pixels - mean) / std)
        return torch.stack(tensors)


def features(output: Any) -> torch.Tensor:
    """The projected embeddings from ``get_image_features`` / ``get_text_features``:
    a tensor in transformers 4, the ``pooler_output`` of a model output in transformers 5."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def normalized(embeddings: torch.Tensor) -> torch.Tensor:
    """``embeddings`` divided by their L2 norms (last dimension)."""
    return embeddings / torch.linalg.vector_norm(embeddings, dim=-1, keepdim=True)


def frame_indices(count: int, wanted: int | None) -> list[int]:
    """Which of a video's ``count`` frames to score: ``wanted`` frames spread evenly,
    ``np.linspace(0, count - 1, wanted)`` rounded down (computed exactly in integers, as
    ``i * (count - 1) // (wanted - 1)``), so the first and last frames are always in;
    one wanted frame is the first. ``None``, or ``wanted >= count``, is every frame."""
    if wanted is None or wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [0]
    return [i * (count - 1) // (wanted - 1) for i in range(wanted)]


def scored_frames(count: int, wanted: int | None, aggregation: str) -> list[int]:
    """The frames an output's reward needs: :func:`frame_indices` for ``mean`` and
    ``min``; for ``first`` and ``last`` only that one of them, which is always the
    video's first (last) frame, whatever ``wanted`` is."""
    if aggregation == "first":
        return [0]
    if aggregation == "last":
        return [count - 1]
    return frame_indices(count, wanted)


def aggregate_frames(scores: Sequence[float], aggregation: str) -> float:
    """An output's reward from the scores of its :func:`scored_frames`, in order: their
    mean, their minimum, or (``first``/``last``) the one frame's score."""
    if aggregation == "mean":
        # Added one by one in order, then divided: the sum the rewards always took (np.mean's
        # pairwise summation could round differently).
        total = 0.0
        for score in scores:
            total += float(score)
        return total / len(scores)
    if aggregation == "min":
        return float(min(scores))
    if aggregation in ("first", "last") and len(scores) == 1:
        return float(scores[0])
    raise ValueError(f"--reward-frame-aggregation {aggregation}: expected one of {', '.join(FRAME_AGGREGATIONS)}")


def pil_frame(frame: np.ndarray) -> Image.Image:
    """A ``uint8`` ``[H, W, C]`` frame as a PIL image (1 channel: mode ``L``, which the
    CLIP image processor converts to RGB)."""
    return Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame)


class ClipFrameReward:
    """Base of the CLIP rewards: each output's frames (one for an image; for a video the
    frames :func:`scored_frames` picks) are converted to ``uint8`` as the reference does
    (``round(x * 255)`` clamped, see :func:`miles_rewards.pixels.to_uint8_frames`),
    scored in batches of ``batch_size`` frames by :meth:`score_batch`, and an output's
    reward is its frames' scores aggregated by ``--reward-frame-aggregation``
    (:func:`aggregate_frames`; default the mean).

    The model forward runs under a lock: the core may score several microgroups from
    worker threads at once, and one model on one device gains nothing from overlapping.
    """

    name = ""
    needs_prompts = False
    batch_size = 8
    num_frames: int | None = None

    def __init__(self, config: Any = None) -> None:
        self._lock = threading.Lock()
        aggregation = (config.get("reward_frame_aggregation") if config is not None else None) or "mean"
        if aggregation not in FRAME_AGGREGATIONS:
            raise RewardError(f"--reward-frame-aggregation {aggregation}: expected one of {', '.join(FRAME_AGGREGATIONS)}")
        self.aggregation: str = aggregation

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """One forward: a tensor whose first dimension runs over ``images``."""
        raise NotImplementedError

    def check_prompts(self, outputs: Sequence[Any], prompts: Sequence[str] | None) -> Sequence[str]:
        """``prompts``, or empty ones for a reward that does not read them."""
        if prompts is None:
            if self.needs_prompts:
                raise ValueError(f"{self.name} scores an output against its prompt: pass the prompts")
            prompts = [""] * len(outputs)
        if len(prompts) != len(outputs):
            raise ValueError(f"{self.name}: {len(outputs)} outputs but {len(prompts)} prompts")
        return prompts

    def forward_in_batches(self, images: list[Image.Image], texts: list[str]) -> torch.Tensor:
        """:meth:`score_batch` over ``batch_size`` frames at a time, concatenated on the
        CPU in float32."""
        parts = []
        for start in range(0, len(images), self.batch_size):
            end = start + self.batch_size
            with self._lock, torch.inference_mode():
                parts.append(self.score_batch(images[start:end], texts[start:end]).float().cpu())
        return torch.cat(parts) if parts else torch.empty(0)

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        prompts = self.check_prompts(outputs, prompts)
        owners: list[int] = []
        images: list[Image.Image] = []
        texts: list[str] = []
        for index, (output, prompt) in enumerate(zip(outputs, prompts)):
            frames = to_uint8_frames(output)
            for frame_index in scored_frames(len(frames), self.num_frames, self.aggregation):
                owners.append(index)
                images.append(pil_frame(frames[frame_index]))
                texts.append(prompt)
        per_output: list[list[float]] = [[] for _ in outputs]
        for owner, score in zip(owners, self.forward_in_batches(images, texts).tolist()):
            per_output[owner].append(score)
        return [aggregate_frames(scores, self.aggregation) for scores in per_output]


def on_device(inputs: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A processor's output as a dict of tensors on ``device``, pixel values in float32."""
    return {key: value.to(device=device, dtype=DTYPE) if key == "pixel_values" else value.to(device) for key, value in dict(inputs).items()}
