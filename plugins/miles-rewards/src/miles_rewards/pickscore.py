"""PickScore: a CLIP model fine-tuned on human preferences between generated images.

As in flow_grpo's scorer: the prompt and the image are embedded by the CLIP model at
``--pickscore-model-path`` (``yuvalkirstain/PickScore_v1``) with the processor at
``--pickscore-processor-path`` (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``), each embedding
L2-normalised, and

    reward = logit_scale.exp() * cos(text_embedding, image_embedding) / 26

(the division by 26 brings PickScore's usual range to about 0-1). Outputs are converted
to ``uint8`` first (``round(x * 255)`` clamped), text is padded and truncated to 77
tokens. ``--pickscore-batch-size`` frames go through the model per forward. A video
scores ``--pickscore-num-frames`` frames spread evenly (see
:func:`miles_rewards.clip_models.frame_indices`; unset: every frame), averaged.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from miles_rewards.clip_models import (
    ClipFrameReward,
    features,
    load_clip_model,
    load_clip_processor,
    on_device,
    reward_device,
)

SCORE_SCALE = 26.0
"""flow_grpo divides PickScore's ``logit_scale * cosine`` by 26 to bring it to about [0, 1]."""
MAX_TEXT_TOKENS = 77


class PickScore(ClipFrameReward):
    """The ``pickscore`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "pickscore"
    needs_prompts = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.pickscore_batch_size)
        self.num_frames = config.pickscore_num_frames
        self.device = reward_device()
        self.model = load_clip_model("--pickscore-model-path", config.pickscore_model_path, self.name, self.device)
        self.processor = load_clip_processor("--pickscore-processor-path", config.pickscore_processor_path, self.name)

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        image_inputs = on_device(self.processor(images=images, return_tensors="pt"), self.device)
        text_inputs = on_device(
            self.processor(text=prompts, padding=True, truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt"),
            self.device,
        )
        image_embeds = features(self.model.get_image_features(**image_inputs))
        text_embeds = features(self.model.get_text_features(**text_inputs))
        image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        return self.model.logit_scale.exp() * (text_embeds * image_embeds).sum(dim=-1) / SCORE_SCALE
