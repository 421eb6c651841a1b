"""What the CLIP-based rewards (``pickscore``, ``aesthetic``) share: loading a CLIP model
and processor with transformers, turning outputs into the PIL frames the processor takes,
choosing a video's frames, batching frames through the model and averaging per output.

Imported only when one of those rewards is used (the entry-point module names it by a
string), so torch and transformers stay out of ``miles-core list-plugins``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from miles_core.api import RewardError
from miles_rewards.pixels import to_uint8_frames

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
    """``CLIPModel.from_pretrained(path)`` in float32, in eval mode, on ``device``; a
    failure is a one-line :class:`RewardError` naming ``flag`` and ``path``."""
    from transformers import CLIPModel

    source = _check_source(flag, path, reward)
    try:
        model = CLIPModel.from_pretrained(source, dtype=DTYPE)
    except Exception as exc:
        raise RewardError(f"{flag} {path}: cannot load a CLIP model ({_first_line(exc)})") from exc
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


def features(output: Any) -> torch.Tensor:
    """The projected embeddings from ``get_image_features`` / ``get_text_features``:
    a tensor in transformers 4, the ``pooler_output`` of a model output in transformers 5."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


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


def pil_frame(frame: np.ndarray) -> Image.Image:
    """A ``uint8`` ``[H, W, C]`` frame as a PIL image (1 channel: mode ``L``, which the
    CLIP image processor converts to RGB)."""
    return Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame)


class ClipFrameReward:
    """Base of the CLIP rewards: each output's chosen frames (all frames of an image) are
    converted to ``uint8`` as the reference does (``round(x * 255)`` clamped, see
    :func:`miles_rewards.pixels.to_uint8_frames`), scored in batches of ``batch_size``
    frames by :meth:`score_batch`, and an output's reward is the mean over its frames.

    The model forward runs under a lock: the core may score several microgroups from
    worker threads at once, and one model on one device gains nothing from overlapping.
    """

    name = ""
    needs_prompts = False
    batch_size = 8
    num_frames: int | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self,
        outputs: Sequence[Any],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        if prompts is None:
            if self.needs_prompts:
                raise ValueError(f"{self.name} scores an output against its prompt: pass the prompts")
            prompts = [""] * len(outputs)
        if len(prompts) != len(outputs):
            raise ValueError(f"{self.name}: {len(outputs)} outputs but {len(prompts)} prompts")
        owners: list[int] = []
        images: list[Image.Image] = []
        texts: list[str] = []
        for index, (output, prompt) in enumerate(zip(outputs, prompts)):
            frames = to_uint8_frames(output)
            for frame_index in frame_indices(len(frames), self.num_frames):
                owners.append(index)
                images.append(pil_frame(frames[frame_index]))
                texts.append(prompt)
        scores: list[float] = []
        for start in range(0, len(images), self.batch_size):
            end = start + self.batch_size
            with self._lock, torch.inference_mode():
                batch = self.score_batch(images[start:end], texts[start:end])
            scores.extend(batch.float().cpu().tolist())
        totals = np.zeros(len(outputs))
        counts = np.zeros(len(outputs))
        for owner, score in zip(owners, scores):
            totals[owner] += score
            counts[owner] += 1
        return [float(total / count) for total, count in zip(totals, counts)]


def on_device(inputs: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A processor's output as a dict of tensors on ``device``, pixel values in float32."""
    return {key: value.to(device=device, dtype=DTYPE) if key == "pixel_values" else value.to(device) for key, value in dict(inputs).items()}
