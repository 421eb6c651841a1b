"""The LAION aesthetic predictor: a linear MLP head on CLIP ViT-L/14 image embeddings.

As in flow_grpo's scorer (after christophschuhmann/improved-aesthetic-predictor): the
image embedding of the CLIP model at ``--aesthetic-clip-path``
(``openai/clip-vit-large-patch14``, ``get_image_features``, 768 numbers) is L2-normalised
and fed to the head at ``--aesthetic-head-path`` (``sac+logos+ava1-l14-linearMSE.pth``):

    Linear(768, 1024) - Dropout(0.2) - Linear(1024, 128) - Dropout(0.2) -
    Linear(128, 64) - Dropout(0.1) - Linear(64, 16) - Linear(16, 1)

with no activations (the checkpoint was trained that way) and in eval mode (the dropouts
do nothing). The output, about 1-10 (a rating), is the reward. Outputs are converted to
``uint8`` first (``round(x * 255)`` clamped). A video scores ``--aesthetic-num-frames``
frames spread evenly (unset: every frame), averaged; ``--aesthetic-batch-size`` frames per
forward.

The head's weights load from ``.safetensors``, or from a ``.pth`` / ``.pt`` / ``.bin``
state dict read with ``torch.load(weights_only=True)``: tensors only, never arbitrary
pickled objects. Key names are the reference checkpoint's, ``layers.{0,2,4,6,7}.{weight,bias}``
(the indices of the linear layers in the ``nn.Sequential`` above).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from miles_core.api import RewardError
from miles_rewards.clip_models import (
    DTYPE,
    ClipFrameReward,
    features,
    load_clip_model,
    load_clip_processor,
    on_device,
    reward_device,
)

EMBEDDING_SIZE = 768
"""CLIP ViT-L/14's projection size: the head's input width."""
HEAD_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


class AestheticHead(nn.Module):
    """The improved-aesthetic-predictor MLP, with the reference's layer layout (and so its
    state-dict key names)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(EMBEDDING_SIZE, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)


def read_head_weights(path: str | Path, flag: str = "--aesthetic-head-path") -> dict[str, torch.Tensor]:
    """The tensors of a head checkpoint; a file that is not a plain tensor dict is a
    one-line :class:`RewardError` naming ``flag`` and ``path``."""
    file = Path(path).expanduser()
    if file.suffix not in HEAD_SUFFIXES:
        raise RewardError(f"{flag} {path}: expected a {', '.join(HEAD_SUFFIXES)} file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file), device="cpu")
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RewardError(
            f"{flag} {path}: holds pickled objects other than tensors; only plain state dicts are loaded "
            "(torch.load weights_only=True), never arbitrary objects"
        ) from exc
    except Exception as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RewardError(f"{flag} {path}: cannot read the head's weights ({lines[0] if lines else type(exc).__name__})") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise RewardError(f"{flag} {path}: not a state dict of tensors (got {type(state).__name__})")
    return state


def load_head(path: str | None, device: torch.device, flag: str = "--aesthetic-head-path") -> AestheticHead:
    """The head with the weights at ``path``, float32, eval mode, on ``device``."""
    if not path:
        raise RewardError(f"{flag} is required with the aesthetic reward")
    state = read_head_weights(path, flag)
    head = AestheticHead()
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}"] if unexpected else []
        )
        raise RewardError(f"{flag} {path}: not an aesthetic head with keys layers.{{0,2,4,6,7}}.{{weight,bias}} ({'; '.join(parts)})")
    wrong = [
        f"{key} is {list(state[key].shape)}, expected {list(value.shape)}"
        for key, value in expected.items()
        if state[key].shape != value.shape
    ]
    if wrong:
        raise RewardError(f"{flag} {path}: wrong shapes for the 768-1024-128-64-16-1 head ({'; '.join(wrong[:3])})")
    head.load_state_dict({key: value.to(DTYPE) for key, value in state.items()})
    return head.eval().requires_grad_(False).to(device)


class Aesthetic(ClipFrameReward):
    """The ``aesthetic`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]`` (prompts are not used)."""

    name = "aesthetic"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.aesthetic_batch_size)
        self.num_frames = config.aesthetic_num_frames
        self.device = reward_device()
        clip_path = config.aesthetic_clip_path
        self.head = load_head(config.aesthetic_head_path, self.device)
        self.model = load_clip_model("--aesthetic-clip-path", clip_path, self.name, self.device)
        width = getattr(self.model.config, "projection_dim", None)
        if width != EMBEDDING_SIZE:
            raise RewardError(
                f"--aesthetic-clip-path {clip_path}: its image embeddings have {width} numbers; the aesthetic head "
                f"takes {EMBEDDING_SIZE} (CLIP ViT-L/14, openai/clip-vit-large-patch14)"
            )
        self.image_processor = load_clip_processor("--aesthetic-clip-path", clip_path, self.name, images_only=True)

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        inputs = on_device(self.image_processor(images=images, return_tensors="pt"), self.device)
        embeds = features(self.model.get_image_features(**inputs))
        embeds = embeds / torch.linalg.vector_norm(embeds, dim=-1, keepdim=True)
        return self.head(embeds).squeeze(-1)
