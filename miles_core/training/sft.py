"""Supervised flow matching (``--loss-type sft_loss``) on image data.

Rows of ``--prompt-data`` carry an image path under ``--sft-image-key``; each optimizer
step draws, per sample, a step of the family's schedule (shift applied) and noise from a
generator seeded by ``(--seed, optimizer step)``, forms ``x_t = (1 - σ)·x0 + σ·ε`` and
regresses the velocity on ``ε − x0`` through the same family prediction the RL losses
use. No rollout engine is involved.

The schedule is the checkpoint scheduler's over ``--diffusion-num-steps`` steps, or, with
``--fsdp-flow-shift s``, that scheduler rebuilt with ``shift = s`` (``σ' = s·σ / (1 +
(s − 1)·σ)`` on its unshifted grid). ``--sft-encoder-checkpoint DIR`` takes the
tokenizers, text encoders and VAE from another pipeline directory than the transformer
(:func:`load_sft_family`).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from miles_core.engine.request import FLOW_SHIFT, RolloutRequest
from miles_core.family import GenerationParams
from miles_core.rollout.data import PromptDataError, jsonl_rows


@dataclass(frozen=True)
class SftRow:
    prompt: str
    image: Path


def load_sft_rows(path: str | Path, *, input_key: str, image_key: str) -> list[SftRow]:
    path = Path(path)
    rows = []
    for where, row in jsonl_rows(path):
        if not isinstance(row.get(input_key), str) or not isinstance(row.get(image_key), str):
            raise PromptDataError(f"{where}: SFT rows need a string {input_key!r} and a string {image_key!r} (an image path)")
        image = (path.parent / row[image_key]).resolve()
        if not image.is_file():
            raise PromptDataError(f"{where}: image {row[image_key]!r} not found (looked at {image})")
        rows.append(SftRow(row[input_key], image))
    if not rows:
        raise PromptDataError(f"{path}: no SFT rows")
    return rows


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """An RGB image as [3, height, width] in [0, 1]: resized to cover, then center-cropped."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        scale = max(height / image.height, width / image.width)
        resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))), Image.BICUBIC)
        left, top = (resized.width - width) // 2, (resized.height - height) // 2
        cropped = resized.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(cropped, dtype=np.float32) / 255.0).permute(2, 0, 1)


def sft_params(family: Any, config: Any) -> GenerationParams:
    """The generation parameters SFT draws its steps from; ``--fsdp-flow-shift`` (no
    engine supplies scheduler metadata here) travels as the request's ``flow_shift``."""
    shift = config.fsdp_flow_shift
    request = RolloutRequest(
        prompt="", num_inference_steps=config.diffusion_num_steps, guidance_scale=1.0,
        height=config.diffusion_height, width=config.diffusion_width,
        extra_sampling_params={FLOW_SHIFT: shift} if shift is not None else {},
    )
    return family.resolve_params(request)


def sft_batch(
    family: Any, rows: Sequence[SftRow], params: GenerationParams, generator: torch.Generator, cache: Any = None
) -> dict[str, Any]:
    """Everything one SFT micro-batch needs: x_t, timesteps, targets and conditioning.
    ``cache`` (a :class:`~miles_core.engine.sampler.ConditioningCache`) keeps prompt
    encodings across steps: the text encoders are frozen."""
    from miles_core.family import Conditioning

    schedule = family.schedule(params)
    with torch.no_grad():
        pixels = torch.stack([load_image(row.image, params.height, params.width) for row in rows])
        x0 = family.encode_pixels(pixels, params)
        encode = family.encode if cache is None else (lambda *args: cache.encode(family, *args))
        cond = Conditioning.cat([encode(row.prompt, None, params) for row in rows])
    steps = torch.randint(0, params.num_inference_steps, (len(rows),), generator=generator)
    sigma = schedule.sigmas.cpu()[steps]
    noise = {name: torch.randn(x.shape, generator=generator, dtype=torch.float32) for name, x in x0.items()}
    shape = (-1,) + (1,) * (next(iter(x0.values())).ndim - 1)
    x_t = {name: (1 - sigma.view(shape)) * x.float().cpu() + sigma.view(shape) * noise[name] for name, x in x0.items()}
    return {
        "x_t": {name: x.to(family.device, family.dtype) for name, x in x_t.items()},
        "sigma": sigma,
        "timestep": schedule.timesteps.cpu()[steps].to(family.device),
        "noise": {name: n.to(family.device) for name, n in noise.items()},
        "x0": {name: x.float() for name, x in x0.items()},
        "cond": cond,
    }


# -- --sft-encoder-checkpoint ------------------------------------------------------------

_ENCODER_PREFIXES = ("tokenizer", "text_encoder")


def encoder_components(pipeline_cls: type) -> list[str]:
    """The pipeline's tokenizers, text encoders and VAE(s), by ``__init__`` argument name
    (SD3: ``tokenizer``..``tokenizer_3``, ``text_encoder``..``text_encoder_3``, ``vae``)."""
    names = [name for name in inspect.signature(pipeline_cls.__init__).parameters if name != "self"]
    return [n for n in names if n.startswith(_ENCODER_PREFIXES) or n == "vae" or n.endswith("_vae")]


def load_sft_family(config: Any) -> Any:
    """The model family of an SFT run: ``--hf-checkpoint``'s pipeline, whose tokenizers,
    text encoders and VAE come from ``--sft-encoder-checkpoint`` when it is set (passed
    to diffusers' ``from_pretrained`` as component overrides, so the transformer
    checkpoint's own copies are never loaded and may be absent). The encoder checkpoint
    must be a local diffusers directory listing every such component in its
    ``model_index.json`` (``[null, null]`` there means "none", e.g. SD3 without T5) with
    a folder for each listed one; otherwise a one-line error names what is missing."""
    from miles_core.model_loading import family_class, model_device, torch_dtype
    from miles_core.training.run import RunError

    dtype = torch_dtype(config.diffusion_forward_dtype)
    device = model_device()
    family_cls = family_class(config)
    if not config.sft_encoder_checkpoint:
        return family_cls.from_pretrained(config.hf_checkpoint, device=device, dtype=dtype)
    flag = f"--sft-encoder-checkpoint {config.sft_encoder_checkpoint}"
    root = Path(config.sft_encoder_checkpoint)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise RunError(f"{flag}: not a local diffusers pipeline directory (no model_index.json)")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{flag}: unreadable model_index.json ({exc})".replace("\n", " ")) from None
    pipeline_cls = family_cls.resolve_pipeline_class()
    wanted = encoder_components(pipeline_cls)
    absent = [n for n in wanted if isinstance(index.get(n), list) and index[n][:1] == [None]]
    missing = [n for n in wanted if n not in index or (n not in absent and not (root / n).is_dir())]
    if missing:
        raise RunError(
            f"{flag}: lacks {', '.join(missing)} (each of {', '.join(wanted)} needs a model_index.json entry "
            "and a folder)"
        )
    # Load only the encoders: every other component the directory lists is passed as None.
    others = [n for n in index if not n.startswith("_") and n not in wanted]
    try:
        source = family_cls.load_pipeline(root, dtype=dtype, **{n: None for n in others})
    except (OSError, ValueError, TypeError) as exc:
        raise RunError(f"{flag}: cannot load its encoders ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    encoders = {n: getattr(source, n) for n in wanted}
    pipeline = family_cls.load_pipeline(config.hf_checkpoint, dtype=dtype, **encoders)
    return family_cls(pipeline, device=device, dtype=dtype)
