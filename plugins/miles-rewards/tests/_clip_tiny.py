"""Tiny random CLIP models and processors saved to local directories, and the helpers the
CLIP-reward tests share: no weights ship with any package and the hub is not reachable,
so the tests run the real loading code on these."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from miles_core.config.resolve import resolve_config

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
]
IMAGE_SIZE = 32


def save_tiny_clip(directory: Path, *, projection_dim: int = 64, seed: int = 0) -> Path:
    """A random CLIP model (hidden size 32, two layers) and its processor (the tiny CLIP
    tokenizer, a PIL CLIP image processor at 32x32) saved together in ``directory``."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from miles_core.tiny.tokenizers import clip_tokenizer

    tokenizer = clip_tokenizer()
    layers = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(
            **layers,
            vocab_size=len(tokenizer),
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(**layers, image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=projection_dim,
        logit_scale_init_value=3.2,  # exp: 24.5, far from 1 and from 26
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(directory)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
    return directory


def load_direct(directory: Path):
    """The saved model and processor, loaded straight with transformers."""
    from transformers import AutoProcessor, CLIPModel

    return CLIPModel.from_pretrained(directory).eval(), AutoProcessor.from_pretrained(directory, backend="pil")


def as_pil(image: torch.Tensor) -> Image.Image:
    """A ``[C, H, W]`` float image in [0, 1] as flow_grpo converts it: round(x * 255), clamped."""
    array = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))


def image_embeddings(model, processor, images: list[Image.Image]) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_image_features(**processor(images=images, return_tensors="pt"))
    embeds = out if isinstance(out, torch.Tensor) else out.pooler_output
    return embeds / embeds.norm(dim=-1, keepdim=True)


def text_embeddings(model, processor, prompts: list[str]) -> torch.Tensor:
    with torch.no_grad():
        out = model.get_text_features(**processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"))
    embeds = out if isinstance(out, torch.Tensor) else out.pooler_output
    return embeds / embeds.norm(dim=-1, keepdim=True)


def random_image(seed: int, height: int = 40, width: int = 48) -> torch.Tensor:
    return torch.rand(3, height, width, generator=torch.Generator().manual_seed(seed))


def config_for(*args: str):
    return resolve_config([*BASE, *args])


def build_reward(name: str, *args: str):
    """The registered reward, built exactly as the core builds it: ``cls(config)``."""
    from miles_core.plugin_manager import get_host

    config = config_for("--rm-type", name, *args)
    return get_host().registries.reward.get(name).load()(config)


def config_errors(*args: str) -> list[str]:
    from miles_core.errors import ConfigError

    try:
        resolve_config([*BASE, *args])
    except ConfigError as exc:
        return list(exc.messages)
    return []


def reference_clip_pixels(image: Image.Image, size: int, crop: int, mean, std) -> torch.Tensor:
    """OpenAI CLIP's preprocessing as torchvision composes it (``Resize(size, BICUBIC)``,
    ``CenterCrop(crop)``, RGB, ``ToTensor``, ``Normalize``), written out independently of
    the plugin: short side to ``size`` with the long side truncated, Pillow BICUBIC; the
    crop offset ``int(round((L - crop) / 2))`` (round half to even); normalised in float64."""
    width, height = image.size
    if width <= height:
        new = (size, int(size * height / width))
    else:
        new = (int(size * width / height), size)
    if new != (width, height):
        image = image.resize(new, Image.BICUBIC)
    array = np.asarray(image.convert("RGB"), dtype=np.float64)
    top, left = int(round((array.shape[0] - crop) / 2.0)), int(round((array.shape[1] - crop) / 2.0))
    array = array[top : top + crop, left : left + crop] / 255.0
    array = (array - np.asarray(mean, dtype=np.float64)) / np.asarray(std, dtype=np.float64)
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def save_clip_processor(directory: Path, **image_processor_kwargs) -> Path:
    """The tiny CLIP processor alone (a processor directory without a model), with
    ``image_processor_kwargs`` overriding the image processor's settings."""
    from transformers import CLIPImageProcessorPil, CLIPProcessor

    from miles_core.tiny.tokenizers import clip_tokenizer

    settings = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    CLIPProcessor(
        image_processor=CLIPImageProcessorPil(**{**settings, **image_processor_kwargs}), tokenizer=clip_tokenizer()
    ).save_pretrained(directory)
    return directory
