"""Qwen-Image end to end on the tiny pipeline, through miles_core.family_checks: the
multi-output invariant, a Flow-GRPO + LoRA run and ``miles-core generate`` with its LoRA,
DiffusionNFT, SFT (encode_pixels), the alignment probe with the recipe's settings (true
CFG on) at zero drift, micro-batches that mix prompts of different lengths, training
reaching the transformer and every LoRA target, and the true-CFG flag."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from miles_core import family_checks, testing
from miles_core.request import RolloutRequest
from miles_qwen_image.family import QwenImageFamily

FAMILY = "qwen_image"  # the tiny directory's name matches no checkpoint pattern
SIZE = 32
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "qwen_image.yaml"
RECIPE_KEYS = (
    "diffusion_true_cfg_scale",
    "diffusion_sde_type",
    "diffusion_noise_level",
    "diffusion_num_sde_steps",
    "diffusion_sde_window_range",
    "globalize_reward_std",
    "diffusion_clip_range",
    "diffusion_adv_clip_max",
    "diffusion_kl_beta",
    "lora_init_weights",
    "lr",
    "weight_decay",
    "clip_grad",
    "gradient_checkpointing",
)
LONG_PROMPT = "a very small green frog sitting on a large wet leaf next to a pond under the rain at night"

tiny_dir, pipe = testing.tiny_pipeline_fixtures(QwenImageFamily)


@pytest.fixture(scope="module")
def family(pipe) -> QwenImageFamily:
    return QwenImageFamily(pipe)


def _args(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    # The tiny pipeline's native size is 512: train at 32x32.
    return family_checks.tiny_train_args(
        tiny_dir, out, "--diffusion-height", str(SIZE), "--diffusion-width", str(SIZE), *extra, family=FAMILY
    )


@pytest.mark.parametrize("true_cfg", [4.0, None], ids=["true-cfg", "no-cfg"])
def test_multi_output_invariant(family: QwenImageFamily, true_cfg) -> None:
    request = RolloutRequest(
        prompt="a red cube",
        seed=5,
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        num_outputs_per_prompt=3,
        true_cfg_scale=true_cfg,
        rollout_return_dit_trajectory=True,
    )
    worst = family_checks.check_multi_output_invariant(family, request)
    print(f"true_cfg {true_cfg}: multi-output invariant max |diff| = {worst:.3e}")


def test_flow_grpo_lora_run_and_generate_with_its_lora(tiny_dir: Path, tmp_path: Path) -> None:
    records = family_checks.run_training(_args(tiny_dir, tmp_path / "run"))
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(math.isfinite(r["train/loss"]) and r["train/num_pairs"] == 4 for r in records)
    lora = tmp_path / "run" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()
    # The LoRA the run saved loads into QwenImagePipeline (generate --lora uses load_lora_weights).
    files = family_checks.check_generate_writes(
        tiny_dir, tmp_path / "gen", "--lora", str(lora), "--height", str(SIZE), "--width", str(SIZE), family=FAMILY
    )
    assert [f.name for f in files] == ["p000_s0.png", "p000_s1.png"]


def test_nft_lora_run_completes(tiny_dir: Path, tmp_path: Path) -> None:
    """DiffusionNFT (CFG-free deterministic rollouts) runs too; the reference's Qwen-Image
    recipe is Flow-GRPO, so this is a smoke test only."""
    records = family_checks.run_training(
        _args(
            tiny_dir,
            tmp_path,
            "--loss-type",
            "nft",
            "--diffusion-num-sde-steps",
            "0",
            "--diffusion-sde-type",
            "ode",
        )
    )
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(math.isfinite(r["train/nft_loss"]) and r["train/grad_norm"] > 0 for r in records)


def test_sft_run_on_images_with_prompts_of_different_lengths(tiny_dir: Path, tmp_path: Path) -> None:
    """SFT encodes images with encode_pixels and batches two prompts of different lengths."""
    records = family_checks.run_training(
        family_checks.tiny_sft_args(tiny_dir, tmp_path, ("a red cube", LONG_PROMPT), size=SIZE, family=FAMILY)
    )
    assert len(records) == 2
    assert all(math.isfinite(r["train/sft_loss"]) and r["train/grad_norm"] > 0 for r in records)


@pytest.mark.exercises("--diffusion-true-cfg-scale")
def test_alignment_probe_with_the_recipe_has_zero_drift(tiny_dir: Path, tmp_path: Path) -> None:
    """The recipe's settings (true CFG 4, noise level 1.2, a 2-step SDE window in [0, 5),
    gradient checkpointing, ...) on the tiny pipeline: the trainer recomputes the engine's
    log-probs and model outputs exactly."""
    flags = family_checks.recipe_flags(RECIPE, RECIPE_KEYS)
    assert flags[flags.index("--diffusion-true-cfg-scale") + 1] == "4.0"
    record = family_checks.check_alignment_probe(_args(tiny_dir, tmp_path, "--diffusion-num-steps", "6", *flags))
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


def test_alignment_probe_in_bf16_has_zero_drift(tiny_dir: Path, tmp_path: Path) -> None:
    """bf16 forwards (what a GPU run picks): the conditioning crosses the engine/trainer
    boundary as fp32 and back, the mask as floats; the drift is still exactly 0."""
    record = family_checks.check_alignment_probe(
        _args(
            tiny_dir,
            tmp_path,
            "--diffusion-true-cfg-scale",
            "4.0",
            "--diffusion-forward-dtype",
            "bf16",
        )
    )
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


def test_micro_batches_mixing_prompts_of_different_lengths(tiny_dir: Path, tmp_path: Path) -> None:
    """A flat micro-batch of both prompts' pairs: the short prompt's text is padded and
    masked in the trainer, where the engine ran it unpadded; the drift stays at float noise."""
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps({"input": p}) + "\n" for p in ("a red cube", LONG_PROMPT)), encoding="utf-8")
    (record,) = family_checks.run_training(
        _args(
            tiny_dir,
            tmp_path,
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "2",
            "--micro-batch-size",
            "8",
            "--diffusion-true-cfg-scale",
            "4.0",
            "--num-rollout",
            "1",
            *family_checks.PROBE_FLAGS,
        )
    )
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})
    assert record["train/num_pairs"] == 8
    assert record["train/model_output_max_abs_diff"] <= 1e-5
    assert record["train/log_prob_max_abs_diff"] <= 1e-4
    assert abs(record["train/ratio_mean"] - 1) <= 1e-5


def test_training_reaches_the_transformer(tiny_dir: Path) -> None:
    norms = family_checks.check_training_reaches_components(
        tiny_dir,
        "--diffusion-height",
        str(SIZE),
        "--diffusion-width",
        str(SIZE),
        "--diffusion-true-cfg-scale",
        "4.0",
        family=FAMILY,
    )
    assert set(norms) == {"transformer"}
    print(norms)


@pytest.mark.exercises("--diffusion-true-cfg-scale")
def test_true_cfg_flag_reaches_the_family(family: QwenImageFamily) -> None:
    """``--diffusion-true-cfg-scale`` turns true CFG on in the family (a negative prompt is
    encoded and the sample changes); 1.0 is off, as unset."""
    from miles_core.config.resolve import resolve_config
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    engine = EmbeddedEngine(family)

    def sample(*flags: str) -> torch.Tensor:
        config = resolve_config(
            [
                "--hf-checkpoint",
                "Qwen/Qwen-Image",
                "--diffusion-height",
                str(SIZE),
                "--diffusion-width",
                str(SIZE),
                "--diffusion-num-steps",
                "2",
                "--rollout-batch-size",
                "1",
                *flags,
            ]
        )
        request = RolloutSettings.from_config(config).request(
            "a red cube", Microgroup(group_index=0, offset=0, size=1, seed=3), (0,), (0, 1, 2)
        )
        return engine.generate_sync(request)[0].generated_output

    unset, off, on = sample(), sample("--diffusion-true-cfg-scale", "1.0"), sample("--diffusion-true-cfg-scale", "4.0")
    assert torch.equal(unset, off)
    assert (on - unset).abs().max().item() > 1e-4
