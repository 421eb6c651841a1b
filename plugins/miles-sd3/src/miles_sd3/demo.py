"""The demo variant of the tiny SD3 pipeline: a VAE whose latents mean something, and data.

On the randomly initialised tiny pipeline of :mod:`miles_sd3.tiny` image rewards cannot
move (the random decoder dominates every image). The demo
variant keeps that pipeline but swaps in a small VAE trained, in seconds, against a fixed,
hand-designed latent space, and writes a synthetic image dataset for the supervised
flow-matching stage that follows:

1. :func:`build_demo` (meant to back ``miles-core make-tiny sd3 DIR --demo``) writes the
   pipeline to ``DIR`` and ``DIR/demo_data/sft.jsonl`` (rows ``{"input": prompt,
   "image": "images/NNNN.png"}``, paths relative to the JSONL's folder) with the PNGs.
2. SFT of the still random transformer on that data::

       miles-core train --loss-type sft_loss --hf-checkpoint DIR \\
           --prompt-data DIR/demo_data/sft.jsonl --sft-image-key image ...

3. Then RL (GRPO) on pixel rewards, which now act on a meaningful decoder.

The designed latent space (4 channels, one latent pixel per 8x8 image block): channels 0
to 2 are the mean RGB colour of the block, channel 3 a per-image exposure offset ``e``
(pixel units, ``U(-0.4, 0.4)`` in training), each channel standardised with the fixed
constants :data:`LATENT_MEAN` / :data:`LATENT_STD`. The decoder maps latents to ``image +
e`` without clipping (the pipeline clamps to [0, 1] afterwards); the encoder maps a clean
image (``e = 0``: the exposure of a single image cannot be told apart from a brighter
scene, and the data are clean images) to the mean of its latent distribution, with a
constant, low log-variance (:data:`ENCODER_LOGVAR`). ``scaling_factor`` is 1 and
``shift_factor`` 0, so the pipeline's latents *are* the designed latents.

Heavy imports (torch, diffusers, numpy, PIL): nothing imports this module at plugin load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from miles_core.api import mark_tiny
from miles_sd3 import tiny

__all__ = [
    "BLOCK",
    "COLOURS",
    "ENCODER_LOGVAR",
    "EXPOSURE_RANGE",
    "LATENT_MEAN",
    "LATENT_STD",
    "PROMPTS",
    "build_demo",
    "demo_vae",
    "designed_latents",
    "synthetic_images",
    "train_demo_vae",
]

BLOCK = 8
"""Pixels per latent pixel along each side (the VAE's 8x downsampling)."""

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.86, 0.12, 0.12),
    "orange": (0.96, 0.55, 0.10),
    "yellow": (0.95, 0.88, 0.15),
    "green": (0.15, 0.68, 0.22),
    "blue": (0.15, 0.30, 0.88),
    "purple": (0.55, 0.20, 0.75),
    "white": (0.95, 0.95, 0.95),
    "black": (0.06, 0.06, 0.06),
}
"""Named colours of backgrounds and shapes (each drawn with a small per-image jitter)."""

_SHAPES = ("square", "circle")  # drawn as rectangles and ellipses of mild aspect ratio
_COUNT_WORDS = ("one", "two", "three")  # "one" becomes "a" / "an" in prompts
COLOUR_JITTER = 0.04


def _prompt(colour: str, count: int = 0, shape: str = "") -> str:
    """``"a green background"`` (no shapes), ``"an orange square"``, ``"two blue circles"``."""
    if count == 0:
        return f"{_article(colour)} {colour} background"
    word = _article(colour) if count == 1 else _COUNT_WORDS[count - 1]
    return f"{word} {colour} {shape}{'s' if count > 1 else ''}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


PROMPTS: tuple[str, ...] = tuple(_prompt(c) for c in COLOURS) + tuple(
    _prompt(c, count, shape) for count in range(1, 4) for c in COLOURS for shape in _SHAPES
)
"""Every prompt :func:`synthetic_images` can give: ``"a red square"``, ``"two blue circles"``,
``"a green background"`` (no shapes), ..."""

EXPOSURE_RANGE = 0.4
"""Training exposure offsets are ``U(-EXPOSURE_RANGE, EXPOSURE_RANGE)`` in pixel units."""

# Standardisation of the designed latents. Channels 0-2: mean and std of the 8x8 block
# means of 4096 synthetic 64x64 images (seed 1234, see ``measure_colour_stats``), rounded;
# channel 3: the exposure U(-0.4, 0.4) has mean 0 and std 0.4 / sqrt(3).
LATENT_MEAN: tuple[float, float, float, float] = (0.552, 0.463, 0.420, 0.0)
LATENT_STD: tuple[float, float, float, float] = (0.318, 0.275, 0.304, EXPOSURE_RANGE / 3**0.5)

ENCODER_LOGVAR = -10.0
"""The encoder's log-variance, the same everywhere (std ``exp(-5)`` = 0.0067 standardised
units): sampled latents equal the mean up to a negligible noise."""


# ------------------------------------------------------------------------------------ data


def _subseed(*keys: int) -> int:
    """An independent 63-bit seed for a stream named by integer ``keys``."""
    return int(np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def _jittered(rng: np.random.Generator, name: str) -> np.ndarray:
    base = np.asarray(COLOURS[name], dtype=np.float64)
    return np.clip(base + rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, 3), 0.0, 1.0)


def synthetic_images(n: int, size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """``n`` synthetic ``size`` x ``size`` RGB images (float32 ``[n, 3, size, size]`` in [0, 1])
    and their prompts (from :data:`PROMPTS`), deterministic in ``seed``.

    Each image: a flat or linear-gradient background of a named colour, then 0 to 3
    rectangles ("squares") or ellipses ("circles") of one other named colour, which the
    prompt names with their count (``"two blue circles"``); with no shapes the prompt
    names the background (``"a green background"``). Geometry is drawn in fractions of
    the image, so a seed gives the same scenes at every size.
    """
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    centres = (np.arange(size, dtype=np.float64) + 0.5) / size
    v, u = np.meshgrid(centres, centres, indexing="ij")  # v: rows (y), u: columns (x)
    images = np.empty((n, 3, size, size), dtype=np.float64)
    prompts = []
    for i in range(n):
        bg = names[rng.integers(len(names))]
        colour = _jittered(rng, bg)
        if rng.random() < 0.5:
            image = np.broadcast_to(colour[:, None, None], (3, size, size)).copy()
        else:  # dark (0.6x) to light (35% towards white) along a random direction
            angle = rng.uniform(0.0, 2 * np.pi)
            t = (np.cos(angle) * (u - 0.5) + np.sin(angle) * (v - 0.5)) / (abs(np.cos(angle)) + abs(np.sin(angle))) + 0.5
            dark, light = 0.6 * colour, colour + 0.35 * (1.0 - colour)
            image = dark[:, None, None] * (1 - t) + light[:, None, None] * t
        count = int(rng.choice(4, p=(0.16, 0.36, 0.26, 0.22)))
        if count == 0:
            prompts.append(_prompt(bg))
        else:
            shape = _SHAPES[rng.integers(len(_SHAPES))]
            others = [c for c in names if c != bg]
            name = others[rng.integers(len(others))]
            fill = _jittered(rng, name)
            for _ in range(count):
                side = rng.uniform(0.2, 0.45)
                aspect = np.exp(rng.uniform(np.log(0.75), np.log(4 / 3)))
                half_w, half_h = side * aspect**0.5 / 2, side / aspect**0.5 / 2
                cx, cy = rng.uniform(half_w, 1 - half_w), rng.uniform(half_h, 1 - half_h)
                if shape == "square":
                    mask = (np.abs(u - cx) <= half_w) & (np.abs(v - cy) <= half_h)
                else:
                    mask = ((u - cx) / half_w) ** 2 + ((v - cy) / half_h) ** 2 <= 1.0
                image[:, mask] = fill[:, None]
            prompts.append(_prompt(name, count, shape))
        images[i] = image
    return torch.from_numpy(images.astype(np.float32)), prompts


def measure_colour_stats(n: int = 4096, size: int = 64, seed: int = 1234) -> tuple[list[float], list[float]]:
    """Mean and std of each colour channel's 8x8 block means over a synthetic sample: how
    :data:`LATENT_MEAN` / :data:`LATENT_STD` (channels 0-2) were computed."""
    images, _ = synthetic_images(n, size, seed)
    blocks = F.avg_pool2d(images.double(), BLOCK)
    return blocks.mean(dim=(0, 2, 3)).tolist(), blocks.std(dim=(0, 2, 3)).tolist()


def designed_latents(images: torch.Tensor, exposure: torch.Tensor | float = 0.0) -> torch.Tensor:
    """The designed latents of ``images`` (``[n, 3, H, W]`` in [0, 1], H and W multiples
    of 8) with exposure offsets ``exposure`` (``[n]`` or a number, pixel units):
    ``[n, 4, H/8, W/8]``, standardised. The demo decoder maps them to ``images + exposure``."""
    n = images.shape[0]
    if images.shape[-1] % BLOCK or images.shape[-2] % BLOCK:
        raise ValueError(f"image sides must be multiples of {BLOCK}, got {tuple(images.shape[-2:])}")
    colour = F.avg_pool2d(images.float(), BLOCK)
    exposure = torch.as_tensor(exposure, dtype=torch.float32).expand(n)
    exposure = exposure.view(n, 1, 1, 1).expand(n, 1, *colour.shape[-2:])
    z = torch.cat([colour, exposure], dim=1)
    mean = torch.tensor(LATENT_MEAN, dtype=torch.float32).view(1, 4, 1, 1)
    std = torch.tensor(LATENT_STD, dtype=torch.float32).view(1, 4, 1, 1)
    return (z - mean) / std


# ------------------------------------------------------------------------------------ VAE


def demo_vae(seed: int) -> AutoencoderKL:
    """The demo VAE, untrained: 8x downsampling, 4 latent channels, scaling 1, shift 0."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=tiny.LATENT_CHANNELS,
        norm_num_groups=2,
        sample_size=64,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,  # as SD3's VAE and the regular tiny one
        use_post_quant_conv=False,
    ).eval()


def _decoder_batch(seed: int, step: int, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, _ = synthetic_images(batch, size, _subseed(seed, 1, step))
    rng = np.random.default_rng(_subseed(seed, 2, step))
    exposure = torch.from_numpy(rng.uniform(-EXPOSURE_RANGE, EXPOSURE_RANGE, batch).astype(np.float32))
    return images, exposure


def _encoder_batch(seed: int, step: int, batch: int, size: int) -> torch.Tensor:
    return synthetic_images(batch, size, _subseed(seed, 3, step))[0]


def train_demo_vae(
    vae: AutoencoderKL,
    *,
    seed: int,
    steps_decoder: int = 300,
    steps_encoder: int = 100,
    size: int = 32,
    batch: int = 16,
    lr: float = 2e-3,
) -> dict[str, float]:
    """Train ``vae`` (a :func:`demo_vae`) in place against the designed latent space.

    Decoder first (``steps_decoder`` Adam steps): MSE between ``vae.decode(designed
    latents of (x, e))`` and ``2 (x + e) - 1`` (the VAE's [-1, 1] pixel range) on fresh
    synthetic ``size`` x ``size`` images ``x`` with exposures ``e``. Then the encoder
    (``steps_encoder`` steps): MSE between the mean of ``vae.encode(2 x - 1)`` and the
    designed latents of ``(x, 0)``; its log-variance half is fixed at
    :data:`ENCODER_LOGVAR` (zero weights, constant bias, never a gradient). Deterministic
    in ``seed`` (data from ``seed``; weights as initialised). Returns the final losses,
    each the mean over the last (up to) 10 steps: ``decoder_mse`` and ``encoder_mse``.
    """
    channels = vae.config.latent_channels
    with torch.no_grad():
        conv_out = vae.encoder.conv_out
        conv_out.weight[channels:].zero_()
        conv_out.bias[channels:].fill_(ENCODER_LOGVAR)
    vae.train()
    losses: dict[str, list[float]] = {"decoder_mse": [], "encoder_mse": []}

    parts = [vae.decoder] + ([vae.post_quant_conv] if vae.post_quant_conv is not None else [])
    optimizer = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=lr)
    for step in range(steps_decoder):
        images, exposure = _decoder_batch(seed, step, batch, size)
        target = 2 * (images + exposure.view(-1, 1, 1, 1)) - 1
        loss = F.mse_loss(vae.decode(designed_latents(images, exposure)).sample, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses["decoder_mse"].append(loss.item())

    parts = [vae.encoder] + ([vae.quant_conv] if vae.quant_conv is not None else [])
    optimizer = torch.optim.Adam([p for m in parts for p in m.parameters()], lr=lr)
    for step in range(steps_encoder):
        images = _encoder_batch(seed, step, batch, size)
        loss = F.mse_loss(vae.encode(2 * images - 1).latent_dist.mean, designed_latents(images))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses["encoder_mse"].append(loss.item())

    vae.eval()
    return {name: float(np.mean(values[-10:])) if values else float("nan") for name, values in losses.items()}


# ------------------------------------------------------------------------------------ build


def write_demo_data(out_dir: str | Path, *, n: int = 256, size: int = 64, seed: int = 0) -> Path:
    """``out_dir/sft.jsonl`` (``{"input": prompt, "image": "images/NNNN.png"}`` per row) and
    ``out_dir/images/NNNN.png``: ``n`` synthetic ``size`` x ``size`` images. Returns the JSONL."""
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, prompts = synthetic_images(n, size, _subseed(seed, 4))
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows = []
    for i, (array, prompt) in enumerate(zip(pixels, prompts)):
        name = f"images/{i:04d}.png"
        Image.fromarray(array, mode="RGB").save(out / name)
        rows.append(json.dumps({"input": prompt, "image": name}))
    jsonl = out / "sft.jsonl"
    jsonl.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return jsonl


def build_demo(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps_decoder: int = 300,
    steps_encoder: int = 100,
    n_images: int = 256,
    image_size: int = 64,
) -> Path:
    """Write the demo pipeline to ``out_dir`` and its SFT data to ``out_dir/demo_data``.

    The regular tiny SD3 pipeline of :func:`miles_sd3.tiny.build_pipeline` (random
    transformer and text encoders from ``seed``) with the VAE replaced by a
    :func:`demo_vae` trained by :func:`train_demo_vae`, saved with ``save_pretrained``
    (safetensors); then :func:`write_demo_data`. The same files for the same seed (same
    environment, deterministic CPU kernels: one thread). Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vae = demo_vae(seed)
    train_demo_vae(vae, seed=seed, steps_decoder=steps_decoder, steps_encoder=steps_encoder)
    tiny.build_pipeline(seed=seed, vae=vae).save_pretrained(out, safe_serialization=True)
    mark_tiny(out, family="sd3", demo=True)  # commands load it without the hub libraries' notices
    write_demo_data(out / "demo_data", n=n_images, size=image_size, seed=seed)
    return out


DEMO_VERSION = 1
"""Bumped whenever the demo recipe changes, so cached builds are not reused."""


def build_demo_pipeline(out_dir: str | Path, *, seed: int = 0, sft_steps: int = 300) -> Path:
    """The complete demo pipeline: :func:`build_demo` (VAE trained on synthetic shapes,
    SFT data), then the transformer fine-tuned on that data with miles-core's own
    ``sft_loss`` through the training loop (all weights, ``sft_steps`` AdamW steps, lr 1e-3,
    batch 16), one torch thread so the result is the same on every build. Returns
    ``out_dir``; ``out_dir/demo_data`` keeps the SFT data and ``out_dir/demo_build.json``
    records how it was built."""
    import asyncio
    import json
    import shutil
    import tempfile

    import torch

    from miles_core.api import resolve_config, train

    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_demo(out, seed=seed)
        with tempfile.TemporaryDirectory(prefix="miles-demo-sft-") as work:
            config = resolve_config(
                [
                    "--hf-checkpoint",
                    str(out),
                    "--diffusion-model-family",
                    "sd3",
                    "--loss-type",
                    "sft_loss",
                    "--prompt-data",
                    str(out / "demo_data" / "sft.jsonl"),
                    "--rollout-batch-size",
                    "16",
                    "--num-rollout",
                    str(sft_steps),
                    "--micro-batch-size",
                    "16",
                    "--lr",
                    "1e-3",
                    "--diffusion-num-steps",
                    "10",
                    "--diffusion-height",
                    "64",
                    "--diffusion-width",
                    "64",
                    "--seed",
                    str(seed),
                    "--cpu-threads",
                    "1",
                    "--output-dir",
                    str(Path(work) / "run"),
                ]
            )
            run_dir = asyncio.run(train(config, log=lambda line: None))
            losses = [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            shutil.rmtree(out / "transformer")
            shutil.copytree(run_dir / "model" / "transformer", out / "transformer")
    finally:
        torch.set_num_threads(threads)
    (out / "demo_build.json").write_text(
        json.dumps(
            {
                "version": DEMO_VERSION,
                "seed": seed,
                "sft_steps": sft_steps,
                "sft_loss_first": losses[0],
                "sft_loss_last_50_mean": sum(losses[-50:]) / len(losses[-50:]),
            },
            indent=2,
        )
        + "\n"
    )
    return out


def cache_root() -> Path:
    import os

    return Path(os.environ.get("MILES_CACHE_DIR") or Path.home() / ".cache" / "miles-core")


def cached_demo_pipeline(out_dir: str | Path, *, seed: int = 0) -> Path:
    """:func:`build_demo_pipeline`, built once per (recipe version, seed) into the cache
    and copied to ``out_dir`` afterwards. A cache entry is complete only once its
    ``demo_build.json`` exists (it is written last and the entry renamed into place)."""
    import shutil
    import tempfile

    entry = cache_root() / f"sd3-demo-v{DEMO_VERSION}-seed{seed}"
    if not (entry / "demo_build.json").is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            build_demo_pipeline(staging, seed=seed)
            shutil.rmtree(entry, ignore_errors=True)
            staging.rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(entry, out_dir, dirs_exist_ok=True)
    mark_tiny(Path(out_dir), family="sd3", demo=True)  # a cache entry built before the marker existed too
    return Path(out_dir)
