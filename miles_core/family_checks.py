"""Contract checks every model family's test suite runs (docs/design.md, "The family contract"), on the
family's tiny pipeline.

A family plugin's tests call these instead of re-deriving them; each check raises
:class:`AssertionError` with a message naming what failed, and returns what it measured
so a test can print it. They generalise what the SD3 tests pin:

- :func:`tiny_train_args` / :func:`run_training`: a short Flow-GRPO run with LoRA on
  the tiny pipeline, in process (``image=``: prompt rows with a conditioning image from
  :func:`write_conditioning_image`, for image-to-video families) (:func:`tiny_sft_args`: a short SFT run on random images;
  :func:`check_video_sft_fits_a_clip`: video SFT on a fixed clip against an lr-0 control).
- :func:`check_alignment_probe`: the engine and the trainer compute the same log-probs
  and model outputs, exactly (``--debug-skip-optimizer-step --diffusion-debug-mode``
  with the micro-batch tile that reproduces the engine's microgroups).
- :func:`check_multi_output_invariant`: output *i* of a request with *M* outputs equals
  the one-output request with seed ``seed + i``.
- :func:`check_training_reaches_components`: one optimizer step gives a non-zero
  gradient on every declared trainable component and every LoRA target module, and
  changes their weights (and nothing under the ``frozen`` prefixes).
- :func:`check_generate_writes`: ``miles-core generate`` writes readable files (PNG for
  images; MP4 for videos when an encoder is installed, else an animated GIF).
- :func:`check_real_configuration`: the contract at real size on a weightless real
  configuration (matched by name and content, parameters, LoRA targets counted, recipe
  resolves and fits the GPUs its header names: :func:`check_recipe_fits`), built on the
  meta device.

The family is matched from the checkpoint as the configuration does (its
``model_index.json``, else its name); pass ``family=`` only when that finds none.
Import-light: torch, diffusers and the
training code are imported inside the functions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.family import ModelFamily
    from miles_core.request import RolloutRequest

PROMPTS = ("a red cube", "a blue ball", "a green tree")
"""The prompts of :func:`tiny_train_args`' prompt file."""

PROBE_FLAGS = ("--debug-skip-optimizer-step", "--diffusion-debug-mode")


def _family_spec(checkpoint: str | Path, family: str | None) -> Any:
    """The registered spec of ``family``, or of the family matched from the checkpoint."""
    from miles_core.config.resolve import match_family
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.model_family
    if family is not None:
        assert family in registry, f"model family {family!r} is not installed (installed: {', '.join(registry.names())})"
        return registry.get(family).spec
    return match_family(checkpoint, registry).spec


def _family_flags(family: str | None) -> list[str]:
    return ["--diffusion-model-family", family] if family is not None else []


def tiny_microgroup(checkpoint: str | Path, family: str | None = None) -> int:
    """The microgroup of the tiny runs: 2, or the family's maximum when that is smaller."""
    spec = _family_spec(checkpoint, family)
    return min(2, spec.max_microgroup_size or 2)


def write_conditioning_image(path: str | Path, *, height: int, width: int, seed: int = 0) -> Path:
    """A deterministic RGB PNG of ``height`` x ``width`` pixels at ``path`` (folders
    created) for image-to-video tests: smooth seeded colour waves (a few low-frequency
    sinusoids per channel, phases and frequencies drawn from ``seed``), so the VAE sees
    structure rather than noise and two seeds give clearly different images. Returns
    ``path``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    channels = []
    for _ in range(3):
        fy, fx = rng.uniform(0.5, 2.0, size=2)
        phase = rng.uniform(0, 2 * np.pi)
        channels.append(0.5 + 0.5 * np.sin(2 * np.pi * (fy * y + fx * x) + phase))
    pixels = np.rint(np.stack(channels, axis=-1) * 255).astype(np.uint8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(out, format="PNG")  # uint8 H x W x 3: RGB
    return out


def tiny_train_args(
    checkpoint: str | Path, out_dir: str | Path, *extra: str, family: str | None = None, image: str | Path | None = None
) -> list[str]:
    """The flags of a short Flow-GRPO run on a tiny pipeline: one prompt per rollout with
    2 samples in microgroups of 2 (or the family's maximum), 3 denoising steps of which 2
    are SDE steps, the pipeline's native size, ``brightness`` reward, LoRA, 2 rollouts,
    fp32, deterministic; ``extra`` is appended (a repeated flag overrides). Writes the
    prompt file (:data:`PROMPTS`) to ``out_dir/prompts.jsonl``, every row with
    ``"image"``: ``image`` as an absolute path when it is given (an image-to-video family's
    conditioning image, see :func:`write_conditioning_image`); ``out_dir`` is the run's
    ``--output-dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    # Absolute: the run resolves a relative row path against the prompt file's folder.
    rows = [{"input": p} if image is None else {"input": p, "image": str(Path(image).absolute())} for p in PROMPTS]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return [
        "--hf-checkpoint",
        str(checkpoint),
        *_family_flags(family),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--rollout-microgroup-size",
        str(tiny_microgroup(checkpoint, family)),
        "--diffusion-num-steps",
        "3",
        "--diffusion-num-sde-steps",
        "2",
        "--rm-type",
        "brightness",
        "--use-lora",
        "--lora-rank",
        "4",
        "--num-rollout",
        "2",
        "--diffusion-forward-dtype",
        "fp32",
        "--deterministic-mode",
        "--output-dir",
        str(out),
        *extra,
    ]


def _sft_flags(checkpoint: str | Path, family: str | None, rows: Path, size: int, batch: str) -> list[str]:
    """What every tiny SFT run sets: the checkpoint, its rows, the loss, one sample per
    row, ``batch`` rows per rollout, ``size`` x ``size``."""
    return [
        "--hf-checkpoint",
        str(checkpoint),
        *_family_flags(family),
        "--prompt-data",
        str(rows),
        "--loss-type",
        "sft_loss",
        "--rollout-batch-size",
        batch,
        "--n-samples-per-prompt",
        "1",
        "--diffusion-height",
        str(size),
        "--diffusion-width",
        str(size),
    ]


def tiny_sft_args(
    checkpoint: str | Path, out_dir: str | Path, prompts: Sequence[str], *extra: str, size: int, family: str | None = None
) -> list[str]:
    """The flags of a short SFT run (``sft_loss`` with LoRA) on a tiny pipeline: one random
    RGB image per prompt (40x48 pixels, cropped to ``size`` x ``size`` by the data loader),
    all rows in one micro-batch, 2 rollouts, fp32; ``extra`` is appended. Writes the
    images and the rows (``out_dir/sft.jsonl``); the run's ``--output-dir`` is
    ``out_dir/run``."""
    import numpy as np
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, prompt in enumerate(prompts):
        pixels = np.random.default_rng(i).integers(0, 256, size=(40, 48, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out / f"image{i}.png")
        rows.append(json.dumps({"input": prompt, "image": f"image{i}.png"}) + "\n")
    (out / "sft.jsonl").write_text("".join(rows), encoding="utf-8")
    rows_per_rollout = str(len(prompts))
    return [
        *_sft_flags(checkpoint, family, out / "sft.jsonl", size, rows_per_rollout),
        "--micro-batch-size",
        rows_per_rollout,
        "--use-lora",
        "--lora-rank",
        "4",
        "--num-rollout",
        "2",
        "--diffusion-forward-dtype",
        "fp32",
        "--output-dir",
        str(out / "run"),
        *extra,
    ]


CLIP_FPS = 8.0
"""The frame rate of :func:`write_sft_clip`'s video (the runs' ``--diffusion-fps`` is this
over the stride)."""


def write_sft_clip(out_dir: str | Path, *, size: int, frames: int, audio_seconds: float | None = None) -> dict[str, str]:
    """A fixed clip for SFT tests in ``out_dir``: ``frames`` frames of ``size`` x ``size``
    pixels (a red ramp that shifts one column per frame, a blue top half, green rising
    frame by frame) as ``clip.mp4`` at :data:`CLIP_FPS`; with ``audio_seconds``, a
    22.05 kHz stereo 16-bit WAV ``clip.wav`` (a 440 Hz tone left, 660 Hz right). Returns
    the row's file entries (``{"video": ..., "audio": ...}``)."""
    import wave

    import numpy as np

    from miles_core import media

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    ramp = np.linspace(0, 255, size).astype(np.uint8)
    for i in range(frames):
        video[i, :, :, 0] = np.roll(ramp, i)[None, :]
        video[i, :, :, 1] = (40 * i) % 256
        video[i, : size // 2, :, 2] = 200
    media.write_mp4(out / "clip.mp4", video, fps=CLIP_FPS)
    entries = {"video": "clip.mp4"}
    if audio_seconds is not None:
        rate = 22050
        t = np.arange(round(audio_seconds * rate)) / rate
        tone = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)], axis=1)
        with wave.open(str(out / "clip.wav"), "wb") as writer:
            writer.setnchannels(2)
            writer.setsampwidth(2)
            writer.setframerate(rate)
            writer.writeframes((tone * 0.5 * 32767).astype("<i2").tobytes())
        entries["audio"] = "clip.wav"
    return entries


def tiny_video_sft_args(
    checkpoint: str | Path,
    out_dir: str | Path,
    *extra: str,
    size: int,
    frames: int,
    lr: float,
    stride: int = 1,
    steps: int = 8,
    audio: bool = False,
    family: str | None = None,
    video_key: str = "video",
    audio_key: str = "audio",
) -> list[str]:
    """The flags of a short video SFT run on a tiny pipeline: two rows of one fixed clip
    (:func:`write_sft_clip`, ``(frames - 1) x stride + 1`` frames, with its WAV file when
    ``audio``) under ``video_key`` (and ``audio_key``: other keys than the defaults add
    ``--sft-video-key`` / ``--sft-audio-key``), one rollout of ``steps`` optimizer steps on
    both rows, full fine-tuning at ``lr``, 2 denoising steps, fp32; ``extra`` is appended.
    The run's ``--output-dir`` is ``out_dir/run``."""
    out = Path(out_dir)
    entries = write_sft_clip(
        out, size=size, frames=(frames - 1) * stride + 1, audio_seconds=frames * stride / CLIP_FPS + 0.5 if audio else None
    )
    keys = {"video": video_key, "audio": audio_key}
    row = json.dumps({"input": "a moving ramp", **{keys[what]: file for what, file in entries.items()}}) + "\n"
    key_flags = [
        *(["--sft-video-key", video_key] if video_key != "video" else []),
        *(["--sft-audio-key", audio_key] if audio_key != "audio" else []),
    ]
    (out / "sft.jsonl").write_text(row * 2, encoding="utf-8")
    return [
        *_sft_flags(checkpoint, family, out / "sft.jsonl", size, str(2 * steps)),
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--diffusion-num-steps",
        "2",
        "--diffusion-output-num-frames",
        str(frames),
        "--diffusion-fps",
        str(CLIP_FPS / stride),  # the clip's own rate: every stride-th frame of CLIP_FPS
        "--sft-frame-stride",
        str(stride),
        *key_flags,
        "--lr",
        str(lr),
        "--num-rollout",
        "1",
        "--diffusion-forward-dtype",
        "fp32",
        "--output-dir",
        str(out / "run"),
        *extra,
    ]


def check_video_sft_fits_a_clip(checkpoint: str | Path, out_dir: str | Path, *extra: str, lr: float, **clip: Any) -> dict[str, Any]:
    """Run :func:`tiny_video_sft_args` at ``lr`` and, as the control, at lr 0 (the same
    rows, steps and noise: both runs draw from ``(--seed, optimizer step)``); the first
    step's loss must be the same in both (same weights, same draws). Returns the
    per-step losses (``trained``, ``control``), the last records and the run folders, for
    the family's test to judge the fall and the weights."""
    out = Path(out_dir)
    result: dict[str, Any] = {}
    for name, rate in (("trained", lr), ("control", 0.0)):
        records = run_training(tiny_video_sft_args(checkpoint, out / name, *extra, lr=rate, **clip))
        assert len(records) == 1, f"{name}: expected one rollout, got {len(records)}"
        result[name] = records[0]["train/loss_per_step"]
        result[f"{name}_record"] = records[0]
        result[f"{name}_run"] = out / name / "run"
    assert result["trained"][0] == result["control"][0], "the first step ran other weights or draws than the control's"
    return result


def check_real_configuration(
    checkpoint: str | Path,
    family: str,
    workdir: str | Path,
    *,
    recipe: str | Path | None = None,
    parameters: dict[str, int] | None = None,
    lora_targets: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The family contract at real size, on a weightless real configuration (a plugin's
    ``tests/data/real_checkpoints/NAME``: ``model_index.json`` and each component's
    configuration, no weights):

    - the folder is matched to ``family`` by its name, and a copy under a neutral name by
      its content (:func:`miles_core.testing.assert_matched_by_content`);
    - the pipeline is built on the meta device (:mod:`miles_core.planning.meta_pipeline`)
      and each trainable component has ``parameters[name]`` parameters when given;
    - every default LoRA target a run on it gets names modules of each trainable component
      (:func:`miles_core.testing.assert_lora_targets`), counted (and equal to
      ``lora_targets`` when given);
    - ``recipe`` resolves for training with this checkpoint (no training error) and fits
      the GPUs its header names (:func:`check_recipe_fits`).

    Returns ``{"parameters": {component: count}, "lora_targets": {component: {target: modules}}}``
    and, with a recipe, ``"plan"``: its peak, phase and host figures."""
    import torch

    from miles_core.config.resolve import resolve_config, training_errors
    from miles_core.family import pipeline_class_for
    from miles_core.family_match import match_family
    from miles_core.planning.meta_pipeline import build_pipeline_from_configs
    from miles_core.plugin_manager import get_host
    from miles_core.testing import assert_lora_targets, assert_matched_by_content

    registry = get_host().registries.model_family
    assert match_family(checkpoint, registry).name == family, f"{checkpoint}: not matched to {family}"
    assert_matched_by_content(checkpoint, family, workdir)
    entry = registry.get(family)
    family_cls = entry.load()
    pipeline = build_pipeline_from_configs(
        checkpoint, pipeline_class_for(family_cls, checkpoint), torch.bfloat16, family_cls.plan_components(checkpoint)
    )
    trainable = {name: getattr(pipeline, name) for name in entry.spec.trainable_components if getattr(pipeline, name, None) is not None}
    assert trainable, f"{checkpoint}: none of {family}'s trainable components {entry.spec.trainable_components} is in the pipeline"
    counts = {name: sum(p.numel() for p in module.parameters()) for name, module in trainable.items()}
    if parameters is not None:
        assert counts == parameters, f"{checkpoint}: parameters {counts}, expected {parameters}"
    args = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1"]
    config = resolve_config([*args, "--custom-config-path", str(recipe)] if recipe is not None else args)
    if recipe is not None:
        assert config.model_family == family, f"{recipe}: resolved as {config.model_family} with {checkpoint}"
        errors = training_errors(config)
        assert errors == [], f"{recipe} with {checkpoint}: " + "; ".join(errors)
    # The targets a run on this checkpoint gets (a family may set them per pipeline class).
    targets = list(config.lora_target_modules)
    lora: dict[str, dict[str, int]] = {}
    for name, module in trainable.items():
        wrapped = assert_lora_targets(module, targets)
        lora[name] = {target: sum(1 for w in wrapped if w == target or w.endswith("." + target)) for target in targets}
    if lora_targets is not None:
        assert lora == lora_targets, f"{checkpoint}: LoRA targets {lora}, expected {lora_targets}"
    measured: dict[str, Any] = {"parameters": counts, "lora_targets": lora}
    if recipe is not None:
        measured["plan"] = check_recipe_fits(recipe, checkpoint)
    return measured


def check_recipe_fits(recipe: str | Path, checkpoint: str | Path) -> dict[str, Any]:
    """``recipe`` planned on ``checkpoint``'s configuration for the GPUs its header names
    (:mod:`miles_core.planning.recipe_target`) fits them; on the checkpoint the header's
    command names, the header's peak, phase and host figures are the plan's."""
    from miles_core.planning.plan import gib
    from miles_core.planning.recipe_target import plan_recipe

    target, plan = plan_recipe(recipe, checkpoint)
    peak = plan.peak()
    host = sum(term.nbytes for term in plan.host)
    figures = {"peak": gib(peak.nbytes), "phase": peak.name, "host": gib(host)}
    assert plan.fits, (
        f"{recipe} on {Path(checkpoint).name} does not fit {target.gpus} x {target.gpu} ({target.gpu_gib:g} GiB): "
        f"peak {figures['peak']} at {peak.name}, largest term {peak.largest().name}"
    )
    if Path(checkpoint).name == target.checkpoint:
        written = {"peak": target.peak, "phase": target.phase, "host": target.host}
        assert written == figures, f"{recipe}: the header says {written}, miles-core plan gives {figures}"
    return figures


def real_checkpoint_cases(test_file: str | Path, rows: Sequence[tuple[str, str, str | None, dict, dict]]) -> list[Any]:
    """``pytest.param`` cases of :func:`check_real_configuration` for a plugin's test module:
    each row is ``(folder name under tests/data/real_checkpoints, family, recipe file name
    under the repository's recipes/ or None, parameters, LoRA target counts)``, the id the
    folder name."""
    import pytest

    tests = Path(test_file).resolve().parent
    recipes = tests.parents[2] / "recipes"
    return [
        pytest.param(
            tests / "data" / "real_checkpoints" / name, family, None if recipe is None else recipes / recipe, params, targets, id=name
        )
        for name, family, recipe, params, targets in rows
    ]


def recipe_flags(recipe: str | Path, keys: Sequence[str]) -> list[str]:
    """The values of ``keys`` in a recipe file (``recipes/*.yaml``) as command-line flags
    (``diffusion_noise_level: 1.2`` -> ``--diffusion-noise-level 1.2``; true: the bare
    switch; false: nothing), so a family's tests run the recipe's own settings."""
    import yaml

    values = yaml.safe_load(Path(recipe).read_text(encoding="utf-8"))
    flags: list[str] = []
    for key in keys:
        flag = "--" + key.replace("_", "-")
        value = values[key]
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def _resolve_for_training(args: Sequence[str]) -> Any:
    from miles_core.config.resolve import resolve_config, training_errors

    config = resolve_config(list(args))
    errors = training_errors(config)
    assert not errors, "the configuration cannot train:\n" + "\n".join(errors)
    return config


def run_training(args: Sequence[str]) -> list[dict[str, Any]]:
    """Resolve ``args`` as ``miles-core train`` does (its training rules included: a
    violation is an :class:`AssertionError` listing them), train in this process and
    return the run's ``metrics.jsonl`` records."""
    import torch

    from miles_core.training.run import train

    config = _resolve_for_training(args)
    # --deterministic-mode switches torch's deterministic algorithms on for the process:
    # restore the setting, so the next test runs as it would have.
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        path = asyncio.run(train(config, log=lambda line: None))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    assert records, f"the run wrote no metrics to {path / 'metrics.jsonl'}"
    return records


def check_alignment_probe(args: Sequence[str]) -> dict[str, Any]:
    """The alignment probe: ``args`` plus ``--debug-skip-optimizer-step
    --diffusion-debug-mode`` and the 2-D micro-batch tile that reproduces the engine's
    microgroups (``--micro-batch-size-sample <microgroup> --micro-batch-size-tstep 1``).
    Asserts, on every record, that the trainer's log-probs and model outputs equal the
    engine's exactly (``train/log_prob_*_abs_diff`` and ``train/model_output_*_abs_diff``
    are 0), that the ratio is exactly 1 and nothing is clipped. Returns the first record."""
    from miles_core.config.resolve import resolve_config

    microgroup = resolve_config(list(args)).rollout_microgroup_size
    probe = [*args, *PROBE_FLAGS, "--micro-batch-size-sample", str(microgroup), "--micro-batch-size-tstep", "1"]
    records = run_training(probe)
    for record in records:
        where = f"rollout {record.get('rollout_id')}"
        assert record.get("train/num_pairs", 0) > 0, f"{where}: the probe trained no pair: {record}"
        for key in (
            "train/log_prob_mean_abs_diff",
            "train/log_prob_max_abs_diff",
            "train/model_output_mean_abs_diff",
            "train/model_output_max_abs_diff",
        ):
            assert key in record, f"{where}: {key} is missing (is --diffusion-debug-mode reaching the engine?)"
            assert record[key] == 0.0, f"{where}: {key} = {record[key]!r}, expected exactly 0 (engine/trainer drift)"
        drift = {k: v for k, v in record.items() if k.startswith("train/log_prob_abs_diff_step_") and v != 0.0}
        assert not drift, f"{where}: per-step log-prob drift {drift}"
        ratio = record.get("train/ratio_mean", record.get("train/ratio_mean_per_step", [None])[0])
        assert ratio == 1.0, f"{where}: the first ratio is {ratio!r}, expected exactly 1"
        clipfrac = record.get("train/clipfrac", 0.0)
        assert clipfrac == 0.0, f"{where}: train/clipfrac = {clipfrac!r} with identical policies"
    return records[0]


def _max_diff(a: Any, b: Any, what: str) -> float:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} in the batch, {tuple(b.shape)} alone"
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).abs().max())


def check_expand_matches_repeated(family: ModelFamily, prompt: str, negative: str | None, params: Any, once: Any, count: int = 3) -> None:
    """``once`` (the family's encoding of ``prompt`` / ``negative``) expanded to ``count``
    outputs equals ``count`` separate encodings, tensor by tensor on both sides: the
    engine encodes a prompt once per request."""
    import torch

    expanded = once.expand(count)
    repeated = [family.encode(prompt, negative, params) for _ in range(count)]
    for side in ("positive", "negative"):
        if getattr(expanded, side) is None:  # no negative side without CFG: none when repeated either
            assert all(getattr(r, side) is None for r in repeated), side
            continue
        for key, value in getattr(expanded, side).items():
            assert torch.equal(value, torch.cat([getattr(r, side)[key] for r in repeated])), (side, key)


def batched_and_rows(family: ModelFamily, latents: dict[str, Any], t: Any, cond: Any, params: Any) -> dict[str, tuple[Any, Any]]:
    """Per latent stream, the prediction for a batch of rows (each its own timestep, the
    conditioning expanded) and the row-by-row predictions concatenated: the trainer mixes
    rows of different samples and steps in one micro-batch, so the two must agree."""
    import torch

    count = int(t.shape[0])
    with torch.no_grad():
        batched = family.predict(latents, t, cond.expand(count), params)
        rows = [family.predict({n: x[i : i + 1] for n, x in latents.items()}, t[i : i + 1], cond, params) for i in range(count)]
    return {name: (batched[name], torch.cat([row[name] for row in rows])) for name in family.latent_streams}


def check_multi_output_invariant(family: ModelFamily, request: RolloutRequest, *, atol: float = 1e-5) -> float:
    """Output *i* of ``request`` (``num_outputs_per_prompt`` M >= 2) equals the one-output
    request with seed ``seed + i``: pixels, log-probs, trajectory latents and extra outputs
    within ``atol``. Also asserts that the M outputs differ from one another (each has its
    own noise: a family that ignores the per-output seed fails here or above). Returns the
    largest absolute difference seen."""
    import dataclasses

    from miles_core.engine.embedded import EmbeddedEngine

    m = request.num_outputs_per_prompt
    assert m >= 2, f"the invariant needs a request with at least 2 outputs, got num_outputs_per_prompt={m}"
    engine = EmbeddedEngine(family)
    batch = engine.generate_sync(request)
    assert len(batch) == m, f"{m} outputs asked, {len(batch)} returned"
    assert [o.seed for o in batch] == [request.seed + i for i in range(m)], [o.seed for o in batch]
    worst = 0.0
    for i, output in enumerate(batch):
        (single,) = engine.generate_sync(dataclasses.replace(request, seed=request.seed + i, num_outputs_per_prompt=1))
        pairs = [("generated_output", output.generated_output, single.generated_output)]
        if output.rollout_log_probs is not None or single.rollout_log_probs is not None:
            assert output.rollout_log_probs is not None and single.rollout_log_probs is not None, (
                f"output {i}: log-probs returned in one case only"
            )
            pairs.append(("rollout_log_probs", output.rollout_log_probs, single.rollout_log_probs))
        if output.dit_trajectory is not None and single.dit_trajectory is not None:
            for stream in family.latent_streams:
                if stream in output.dit_trajectory:
                    pairs.append((f"dit_trajectory[{stream}]", output.dit_trajectory[stream], single.dit_trajectory[stream]))
        assert set(output.extra_outputs) == set(single.extra_outputs), (
            f"output {i}: extra outputs {sorted(output.extra_outputs)} in the batch, {sorted(single.extra_outputs)} alone"
        )
        pairs += [(f"extra_outputs[{k}]", output.extra_outputs[k], single.extra_outputs[k]) for k in output.extra_outputs]
        for what, a, b in pairs:
            diff = _max_diff(a, b, f"output {i} {what}")
            assert diff <= atol, (
                f"output {i} of a {m}-output request differs from the one-output request with seed "
                f"{request.seed + i} in {what}: max |diff| = {diff:.3e} > {atol:g}"
            )
            worst = max(worst, diff)
    for i in range(1, m):
        spread = _max_diff(batch[0].generated_output, batch[i].generated_output, f"outputs 0 and {i}")
        assert spread > atol, (
            f"outputs 0 and {i} of one request are identical (max |diff| = {spread:.3e}): the outputs do not get their own noise"
        )
    return worst


def check_training_reaches_components(
    checkpoint: str | Path,
    *extra: str,
    family: str | None = None,
    frozen: Sequence[str] = (),
    image: str | Path | None = None,
) -> dict[str, float]:
    """Build the trainer on the tiny pipeline with LoRA on every declared trainable
    component (``--update-weight-target-module`` = the spec's ``trainable_components``),
    generate one rollout (advantages +1/-1) and take one optimizer step. Asserts a
    non-zero gradient on every trainable component and on every LoRA target (each
    ``--lora-target-modules`` suffix, over the modules it wraps in each component), that
    each of them changed, and that no parameter whose ``component.name`` starts with one
    of ``frozen`` has a gradient or changed (each prefix must match some parameter).
    ``extra`` flags are appended; ``image``: the rollout's prompt carries this conditioning
    image (an image-to-video family's, see :func:`write_conditioning_image`). Returns the
    gradient norm of each component."""
    import torch

    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    spec = _family_spec(checkpoint, family)
    config = _resolve_for_training(
        [
            "--hf-checkpoint",
            str(checkpoint),
            *_family_flags(family),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            str(tiny_microgroup(checkpoint, family)),
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            "1e-2",
            "--num-steps-per-rollout",
            "1",
            "--diffusion-forward-dtype",
            "fp32",
            "--update-weight-target-module",
            ",".join(spec.trainable_components),
            *extra,
        ]
    )
    engine = create_engine(config)
    host = get_host()
    trainer = Trainer(
        engine.family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
    )
    components = engine.family.components()
    everything = {f"{c}.{n}": p for c, module in components.items() for n, p in module.named_parameters()}
    for prefix in frozen:
        assert any(name.startswith(prefix) for name in everything), (
            f"frozen prefix {prefix!r} matches no parameter (names look like {next(iter(everything))!r})"
        )
    watched = {n for n in everything if any(n.startswith(p) for p in frozen)}
    trainable = trainer.named_trainable()
    assert not watched & set(trainable), f"parameters under the frozen prefixes are trainable: {sorted(watched & set(trainable))[:5]}"
    before = {n: p.detach().clone() for n, p in everything.items() if n in trainable or n in watched}

    record = PromptRecord(PROMPTS[0], image=None if image is None else str(Path(image).absolute()))
    groups = asyncio.run(generate_rollout(engine, RolloutSettings.from_config(config), 0, [record], strategy_from_config(config)))
    samples = [s for group in groups for s in group]
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))])
    metrics = trainer.train_rollout(samples, advantages)
    assert trainer.optimizer_steps >= 1, f"no optimizer step was taken: {metrics}"

    def grad_norm(names: Sequence[str]) -> float:
        masters = trainer.named_masters()  # the gradients land on the master weights
        grads = [masters[n].grad for n in names if masters[n].grad is not None]
        return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads))) if grads else 0.0

    def changed(names: Sequence[str]) -> bool:
        return any(not torch.equal(before[n], everything[n].detach()) for n in names)

    norms: dict[str, float] = {}
    for component in trainer.modules:
        names = [n for n in trainable if n.startswith(component + ".")]
        assert names, f"component {component!r} has no trainable parameter"
        norms[component] = grad_norm(names)
        assert norms[component] > 0, f"component {component!r}: zero gradient after one step"
        assert changed(names), f"component {component!r}: no weight changed after the optimizer step"
    if config.use_lora:
        # Per target (a module-name suffix of --lora-target-modules), not per wrapped module: a
        # module can be structurally dead (SD3's last joint block discards the text stream, so
        # its attn.add_q_proj never receives a gradient) while the target trains elsewhere.
        reached: dict[str, list[str]] = {target: [] for target in config.lora_target_modules}
        for component, module in trainer.modules.items():
            wrapped = [name for name, sub in module.named_modules() if hasattr(sub, "lora_A")]
            assert wrapped, f"component {component!r}: no module carries a LoRA adapter"
            for target in config.lora_target_modules:
                matched = [name for name in wrapped if name == target or name.endswith("." + target)]
                if not matched:
                    continue
                names = [n for n in trainable if any(n.startswith(f"{component}.{m}.lora_") for m in matched)]
                assert names, f"LoRA target {target!r} of {component}: no trainable LoRA parameter"
                assert grad_norm(names) > 0, (
                    f"LoRA target {target!r} of {component}: zero gradient after one step on all {len(matched)} module(s) it wraps"
                )
                assert changed(names), f"LoRA target {target!r} of {component}: unchanged after the optimizer step"
                reached[target].append(component)
        missing = [target for target, where in reached.items() if not where]
        assert not missing, f"LoRA target(s) {missing} wrap no module of {', '.join(trainer.modules)}"
    leaked = sorted(n for n in watched if everything[n].grad is not None and bool(everything[n].grad.abs().sum() > 0))
    assert not leaked, f"frozen parameters received a gradient: {leaked[:5]}"
    moved = sorted(n for n in watched if not torch.equal(before[n], everything[n].detach()))
    assert not moved, f"frozen parameters changed: {moved[:5]}"
    return norms


def check_generate_writes(checkpoint: str | Path, out_dir: str | Path, *extra: str, family: str | None = None) -> list[Path]:
    """Run ``miles-core generate`` in this process (one prompt, two outputs, 2 steps;
    ``extra`` appended) and check what it wrote: one file per output, listed in the
    manifest, a PNG for an image and an MP4 (when an encoder is installed) or animated
    GIF for a video, each readable back. Returns the files."""
    from miles_core.cli import generate

    out = Path(out_dir)
    argv = [
        "--hf-checkpoint",
        str(checkpoint),
        *_family_flags(family),
        "--prompt",
        PROMPTS[0],
        "--num-outputs",
        "2",
        "--num-inference-steps",
        "2",
        "--seed",
        "0",
        "--out",
        str(out),
        *extra,
    ]
    try:
        status = generate.run(argv)
    except SystemExit as exc:  # the parser's one-line error
        raise AssertionError(f"miles-core generate {' '.join(argv)} exited with status {exc.code}") from None
    assert status == 0, f"miles-core generate exited with status {status}"
    rows = [json.loads(line) for line in (out / generate.MANIFEST).read_text(encoding="utf-8").splitlines() if line]
    assert rows, "the manifest lists no file"
    files = [out / row["file"] for row in rows]
    on_disk = sorted(p.name for p in out.iterdir() if p.name != generate.MANIFEST)
    assert on_disk == sorted(p.name for p in files), f"files {on_disk} but the manifest lists {[p.name for p in files]}"
    encoder = generate.mp4_encoder() is not None
    for path in files:
        assert path.suffix in (".png", ".mp4", ".gif"), f"{path.name}: unexpected file type"
        assert path.suffix != (".gif" if encoder else ".mp4"), (
            f"{path.name}: videos are MP4 when an encoder is installed and GIF otherwise (encoder installed: {encoder})"
        )
        try:
            frames = read_frames(path)
        except Exception as exc:
            raise AssertionError(f"{path.name}: cannot be read back ({type(exc).__name__}: {exc})") from None
        assert frames >= 1, f"{path.name}: no frame"
        if path.suffix == ".png":
            assert frames == 1
    return files


def read_frames(path: Path) -> int:
    """The number of frames of an image or video file, read back."""
    if path.suffix == ".mp4":
        import imageio.v3 as iio

        return int(iio.imread(path, plugin="FFMPEG", index=None).shape[0])
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return int(getattr(image, "n_frames", 1))


def euler_sample(family: ModelFamily, cond: Any, params: Any, latents: dict[str, Any]) -> dict[str, Any]:
    """The deterministic (ODE) loop over the family's own API: ``x += (sigma' - sigma) v``
    for every latent stream, with ``cond`` already expanded to the batch. What a family's
    test compares with its diffusers pipeline, so the loop is written once."""
    schedule = family.schedule(params)
    batch = next(iter(latents.values())).shape[0]
    x = {name: value.float() for name, value in latents.items()}
    for k in range(params.num_inference_steps):
        v = family.predict(x, schedule.timesteps[k].expand(batch), cond, params)
        dt = schedule.sigmas[k + 1] - schedule.sigmas[k]
        x = {name: x[name] + dt * v[name] for name in x}
    return x


@contextmanager
def nudged(parameter: Any, delta: float = 0.5) -> Iterator[None]:
    """Add ``delta`` to one entry of ``parameter`` inside the block, then restore it
    exactly: the control that shows a parity check sees that weight."""
    import torch

    saved = parameter.detach().clone()
    try:
        with torch.no_grad():
            parameter.view(-1)[0] += delta
        yield
    finally:
        with torch.no_grad():
            parameter.copy_(saved)
