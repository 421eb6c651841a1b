"""Cosmos 3 end to end on the tiny pipeline: a Flow-GRPO + LoRA run, the alignment probe,
training reaching the generation path (and never the understanding tower), the
microgroup limit, and ``miles-core generate`` (images and videos, with a trained LoRA)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from miles_core import family_checks, testing
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError
from miles_cosmos3.family import Cosmos3Family, is_generation_parameter

IMAGE = ("--diffusion-height", "32", "--diffusion-width", "32")
VIDEO = ("--diffusion-height", "16", "--diffusion-width", "16", "--diffusion-output-num-frames", "5", "--diffusion-fps", "16")

tiny_dir, pipe = testing.tiny_pipeline_fixtures(Cosmos3Family)


def _understanding(pipe) -> list[str]:
    return [name for name, _ in pipe.transformer.named_parameters() if not is_generation_parameter(name)]


def test_the_parameter_split_covers_the_transformer(pipe) -> None:
    names = [name for name, _ in pipe.transformer.named_parameters()]
    generation = {name for name in names if is_generation_parameter(name)}
    understanding = set(_understanding(pipe))
    assert generation | understanding == set(names) and not generation & understanding
    assert {n.split(".")[0] for n in understanding} == {"embed_tokens", "layers", "norm", "lm_head"}
    layer = {n.split(".", 2)[2] for n in understanding if n.startswith("layers.0.")}
    assert layer == {
        "self_attn.to_q.weight",
        "self_attn.to_k.weight",
        "self_attn.to_v.weight",
        "self_attn.to_out.weight",
        "self_attn.norm_q.weight",
        "self_attn.norm_k.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    assert {n.split(".")[0] for n in generation} == {"layers", "norm_moe_gen", "proj_in", "proj_out", "time_embedder"}


@pytest.mark.exercises("--use-lora")
def test_flow_grpo_lora_run_completes_and_its_lora_loads(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    records = family_checks.run_training(family_checks.tiny_train_args(tiny_dir, out, *IMAGE))
    assert [r["rollout_id"] for r in records] == [0, 1]
    for record in records:
        assert record["train/num_pairs"] == 4 and math.isfinite(record["train/loss"])
        assert record["train/grad_norm"] > 0
    # The run's LoRA, saved with the transformer's adapter API, loads back (prefix=None).
    family = Cosmos3Family.from_pretrained(tiny_dir)
    assert family.load_lora(out / "lora") == 4 * family.pipeline.transformer.config.num_hidden_layers > 0


@pytest.mark.parametrize("size", [IMAGE, VIDEO], ids=["image", "video"])
def test_alignment_probe_is_exactly_zero(tiny_dir: Path, tmp_path: Path, size) -> None:
    first = family_checks.check_alignment_probe(family_checks.tiny_train_args(tiny_dir, tmp_path / "probe", *size))
    print(
        f"alignment probe {size}: log-prob drift {first['train/log_prob_max_abs_diff']}, "
        f"model-output drift {first['train/model_output_max_abs_diff']}, ratio {first['train/ratio_mean']}"
    )


def test_lora_training_reaches_the_generation_path_only(tiny_dir: Path, pipe) -> None:
    frozen = [f"transformer.{name}" for name in _understanding(pipe)]
    norms = family_checks.check_training_reaches_components(tiny_dir, *IMAGE, frozen=frozen)
    assert set(norms) == {"transformer"} and norms["transformer"] > 0
    print(f"LoRA grad norms: {norms}")


@pytest.mark.exercises("--update-weight-target-module")
def test_full_fine_tuning_trains_the_generation_path_and_freezes_the_understanding_tower(tiny_dir: Path) -> None:
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            "--lr",
            "1e-2",
            "--num-steps-per-rollout",
            "1",
            "--diffusion-forward-dtype",
            "fp32",
            "--update-weight-target-module",
            "transformer",
            *IMAGE,
        ]
    )
    assert not training_errors(config) and not config.use_lora
    engine = create_engine(config)
    host = get_host()
    trainer = Trainer(
        engine.family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
    )
    transformer = engine.family.components()["transformer"]
    params = dict(transformer.named_parameters())
    generation = {n for n in params if is_generation_parameter(n)}
    assert set(trainer.named_trainable()) == {f"transformer.{n}" for n in generation}
    before = {n: p.detach().clone() for n, p in params.items()}

    groups = asyncio.run(
        generate_rollout(
            engine, RolloutSettings.from_config(config), 0, [PromptRecord(family_checks.PROMPTS[0])], strategy_from_config(config)
        )
    )
    samples = [s for group in groups for s in group]
    trainer.train_rollout(samples, torch.tensor([1.0, -1.0]))
    assert trainer.optimizer_steps == 1

    understanding = set(params) - generation
    assert all(params[n].grad is None for n in understanding)
    unchanged = [n for n in understanding if torch.equal(before[n], params[n].detach())]
    assert sorted(unchanged) == sorted(understanding)
    # Every generation parameter that takes part in the forward received a gradient and moved.
    reached = [n for n in generation if params[n].grad is not None and params[n].grad.abs().sum() > 0]
    assert set(reached) == generation
    assert all(not torch.equal(before[n], params[n].detach()) for n in generation)


@pytest.mark.exercises("--rollout-microgroup-size")
def test_a_microgroup_larger_than_one_is_a_one_line_error(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve_config(
            ["--hf-checkpoint", str(tiny_dir), "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2"]
        )
    assert excinfo.value.messages == [
        "--rollout-microgroup-size 2: the cosmos3 family supports at most 1 output(s) per request (its forward packs one sample)"
    ]
    # Unset, it is the recipe's 1.
    config = resolve_config(["--hf-checkpoint", str(tiny_dir), "--rollout-batch-size", "1", "--n-samples-per-prompt", "4"])
    assert config.rollout_microgroup_size == 1


def test_generate_writes_images_and_videos(tiny_dir: Path, tmp_path: Path) -> None:
    images = family_checks.check_generate_writes(tiny_dir, tmp_path / "images", "--height", "32", "--width", "32")
    assert [p.suffix for p in images] == [".png", ".png"]
    videos = family_checks.check_generate_writes(
        tiny_dir, tmp_path / "videos", "--height", "16", "--width", "16", "--num-frames", "5", "--fps", "8"
    )
    assert len(videos) == 2 and all(p.suffix in (".mp4", ".gif") for p in videos)
    assert all(family_checks.read_frames(p) == 5 for p in videos)


def test_generate_loads_a_saved_lora_through_the_transformer(tiny_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    from miles_core.cli import generate

    family = Cosmos3Family.from_pretrained(tiny_dir)
    transformer = family.components()["transformer"]
    transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=2, init_lora_weights=False, target_modules=["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"])
    )
    lora = family.save_lora(tmp_path / "lora", {"transformer": transformer})
    common = [
        "--hf-checkpoint",
        str(tiny_dir),
        "--prompt",
        "a cat",
        "--num-inference-steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--seed",
        "3",
    ]
    assert generate.run([*common, "--out", str(tmp_path / "base")]) == 0
    assert generate.run([*common, "--lora", str(lora), "--out", str(tmp_path / "with")]) == 0
    import numpy as np
    from PIL import Image

    base = np.asarray(Image.open(tmp_path / "base" / "p000_s3.png"))
    with_lora = np.asarray(Image.open(tmp_path / "with" / "p000_s3.png"))
    assert base.shape == with_lora.shape == (32, 32, 3)
    assert not np.array_equal(base, with_lora)


RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "cosmos3.yaml"


def test_the_recipe_validates_and_its_settings_run_on_the_tiny_pipeline(tiny_dir: Path, tmp_path: Path) -> None:
    """recipes/cosmos3.yaml resolves for training; its sampling, loss and LoRA settings
    (10 steps, noise 0.7, CFG 6, KL to the LoRA base, 2 optimizer steps) run the alignment probe on the tiny
    pipeline at zero drift, with the CPU-sized group and video of this suite."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    assert (recipe["n_samples_per_prompt"], recipe["rollout_microgroup_size"]) == (16, 1)
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            "--prompt-data",
            str(tmp_path / "p.jsonl"),
            "--rollout-batch-size",
            "2",
            "--rm-type",
            "brightness",
            "--custom-config-path",
            str(RECIPE),
        ]
    )
    assert not training_errors(config)
    assert (config.diffusion_height, config.diffusion_width, config.diffusion_output_num_frames) == (720, 1280, 189)
    # 4 SDE steps instead of 9: family_checks reads the ratio as a float sum of per-pair
    # weights, and nine weights of 1/9 sum to 1.0000000000000002 (no drift, just rounding).
    cpu_sized = {
        k: v for k, v in recipe.items() if k not in ("n_samples_per_prompt", "diffusion_output_num_frames", "diffusion_num_sde_steps")
    }
    trimmed = tmp_path / "recipe.yaml"
    trimmed.write_text(yaml.safe_dump(cpu_sized), encoding="utf-8")
    args = family_checks.tiny_train_args(
        tiny_dir,
        tmp_path / "run",
        "--custom-config-path",
        str(trimmed),
        "--diffusion-height",
        "16",
        "--diffusion-width",
        "16",
        "--diffusion-output-num-frames",
        "5",
        "--diffusion-num-sde-steps",
        "4",
    )
    first = family_checks.check_alignment_probe(args)
    assert first["train/num_pairs"] == 2 * 4  # 2 samples x 4 SDE steps (over the recipe's 2 optimizer steps)


def test_sft_encodes_images_and_trains_the_generation_path_only(tiny_dir: Path, pipe, tmp_path: Path) -> None:
    """SFT (full fine-tuning) goes through encode_pixels, and the saved transformer keeps
    the understanding tower of the checkpoint."""
    import json

    from PIL import Image
    from safetensors.torch import load_file

    from miles_core.training.run import train

    rows = []
    (tmp_path / "images").mkdir()
    for i, (name, colour) in enumerate([("a red square", (220, 30, 30)), ("a blue square", (30, 30, 220))]):
        Image.new("RGB", (40, 40), colour).save(tmp_path / "images" / f"{i}.png")
        rows.append(json.dumps({"input": name, "image": f"images/{i}.png"}))
    (tmp_path / "sft.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            "--prompt-data",
            str(tmp_path / "sft.jsonl"),
            "--loss-type",
            "sft_loss",
            "--rollout-batch-size",
            "2",
            "--num-steps-per-rollout",
            "1",
            "--micro-batch-size",
            "2",
            "--diffusion-num-steps",
            "4",
            *IMAGE,
            "--lr",
            "3e-3",
            "--num-rollout",
            "2",
            "--output-dir",
            str(tmp_path / "sft"),
        ]
    )
    path = asyncio.run(train(config, log=lambda line: None))
    losses = [json.loads(line)["train/loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(map(math.isfinite, losses))
    saved = load_file(path / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
    original = load_file(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert saved.keys() == original.keys()
    understanding = set(_understanding(pipe))
    assert all(torch.equal(saved[n], original[n]) for n in understanding)
    assert all(not torch.equal(saved[n], original[n]) for n in saved if n not in understanding)


@pytest.mark.exercises("--sft-video-key", "--diffusion-output-num-frames")
def test_video_sft_fits_a_fixed_clip_and_lr_0_keeps_the_weights(tiny_dir: Path, tmp_path: Path) -> None:
    """Video rows through ``encode_pixels`` on ``[B, C, F, H, W]``: full fine-tuning on one
    5-frame clip lowers the loss within 8 optimizer steps; the control (lr 0, the same rows,
    steps and noise) neither lowers it nor moves a weight."""
    from safetensors.torch import load_file

    runs = family_checks.check_video_sft_fits_a_clip(tiny_dir, tmp_path, lr=2e-2, size=16, frames=5)
    trained, control = runs["trained"], runs["control"]
    print(f"video SFT losses: trained {[round(x, 3) for x in trained]}, control {[round(x, 3) for x in control]}")
    # Measured: trained 1.434 -> last two 1.135, 1.036 (0.76 of the first); control 1.627, 1.383.
    assert sum(trained[-2:]) / 2 < 0.8 * trained[0]
    assert sum(trained[-2:]) / 2 < 0.8 * sum(control[-2:]) / 2  # same draws: the fall is the training's
    assert sum(control[-2:]) / 2 > 0.9 * control[0]
    original = load_file(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    for name, moved in (("control", False), ("trained", True)):
        saved = load_file(runs[f"{name}_run"] / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
        assert any(not torch.equal(saved[k], original[k]) for k in saved) is moved, name
