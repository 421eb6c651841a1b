"""CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image
Captioning", arXiv:2104.08718, eq. 1), as its reference implementation computes it
(jmhessel/clipscore@1036465 ``clipscore.py``, ``get_clip_score``):

    reward = 2.5 * max(cos(E_image, E_text), 0)

with ``E_image`` and ``E_text`` the CLIP model's projected image and text embeddings
(``get_image_features``, ``get_text_features``), L2-normalised, and the text
``"A photo depicts " + prompt`` (the reference hard-codes that prefix). The reward lies
in [0, 2.5]. The model is the paper's OpenAI CLIP ViT-B/32 (``openai/clip-vit-base-patch32``)
at ``--clipscore-model-path``; the tokenizer and the preprocessing constants come from
``--clipscore-processor-path`` (unset: the model's directory). Images are preprocessed
exactly as the reference does (:class:`miles_rewards.clip_models.OpenAIClipTransform`:
torchvision's resize and centre-crop rounding, not transformers'), text is truncated to
77 tokens. Outputs are converted to ``uint8`` first (``round(x * 255)`` clamped); a video
scores ``--clipscore-num-frames`` frames spread evenly, aggregated by
``--reward-frame-aggregation``; ``--clipscore-batch-size`` frames per forward.

Where torchmetrics' ``CLIPScore`` differs (Lightning-AI/torchmetrics@01bc8bc
``functional/multimodal/clip_score.py``): it multiplies by 100 instead of 2.5, adds no
prefix, clamps the batch mean at 0 rather than each score, defaults to ViT-L/14 and
uses transformers' processor (floor centre crop). Its numbers are not ours.

The reference computes on GPU in float16 and tokenises with ``clip.tokenize``, which
also runs ``ftfy.fix_text`` and ``html.unescape`` on the text; here the model runs in
float32 and the transformers CLIP tokenizer does neither (the token ids are the same
for plain prompts without HTML entities or mis-encoded characters).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from miles_rewards.clip_models import (
    ClipFrameReward,
    OpenAIClipTransform,
    features,
    load_clip_model,
    load_clip_processor,
    normalized,
    on_device,
    reward_device,
)

WEIGHT = 2.5
"""The paper's w in eq. 1, the reference's default (``get_clip_score(..., w=2.5)``)."""
PREFIX = "A photo depicts "
"""The reference's text prefix (``CLIPCapDataset(prefix='A photo depicts')`` plus a space)."""
MAX_TEXT_TOKENS = 77


def processor_source(config: Any) -> tuple[str, str | None]:
    """The flag and path the CLIPScore processor is read from: ``--clipscore-processor-path``,
    or the model's directory when it is unset."""
    if config.get("clipscore_processor_path"):
        return "--clipscore-processor-path", config.clipscore_processor_path
    return "--clipscore-model-path", config.get("clipscore_model_path")


class ClipScore(ClipFrameReward):
    """The ``clipscore`` reward: built with the run's configuration, called as
    ``reward(outputs, prompts, metadata) -> list[float]``."""

    name = "clipscore"
    needs_prompts = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batch_size = int(config.clipscore_batch_size)
        self.num_frames = config.clipscore_num_frames
        self.device = reward_device()
        self.model = load_clip_model("--clipscore-model-path", config.clipscore_model_path, self.name, self.device)
        flag, path = processor_source(config)
        self.processor = load_clip_processor(flag, path, self.name)
        self.transform = OpenAIClipTransform.from_image_processor(self.processor.image_processor, flag, str(path))

    def score_batch(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        pixels = self.transform(images).to(self.device)
        text_inputs = on_device(
            self.processor(
                text=[PREFIX + prompt for prompt in prompts], padding=True, truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt"
            ),
            self.device,
        )
        image_embeds = normalized(features(self.model.get_image_features(pixel_values=pixels)))
        text_embeds = normalized(features(self.model.get_text_features(**text_inputs)))
        return WEIGHT * (image_embeds * text_embeds).sum(dim=-1).clamp(min=0.0)
