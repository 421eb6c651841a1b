"""FLUX end to end on the tiny pipelines, through miles_core.family_checks: for FLUX.1 [dev]
the multi-output invariant, a Flow-GRPO + LoRA run and ``miles-core generate`` with its
LoRA, SFT (encode_pixels), the alignment probe with the recipe's settings (guidance 3.5
embedded in the transformer) and with true CFG at zero drift, training reaching the
transformer and every LoRA target; for FLUX.2 [klein] the same probe (the base model with
real CFG, the step-distilled model without), a run with generate, and training reaching
every target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from miles_core import family_checks, testing
from miles_core.request import RolloutRequest
from miles_flux.family import FluxFamily

FAMILY = "flux"  # the tiny directories' names match no checkpoint pattern
SIZE = 32
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "flux.yaml"
RECIPE_KEYS = (
    "diffusion_guidance_scale",
    "diffusion_sde_type",
    "diffusion_noise_level",
    "diffusion_clip_range",
    "diffusion_adv_clip_max",
    "diffusion_kl_beta",
    "lora_init_weights",
    "lr",
    "weight_decay",
    "clip_grad",
)

tiny_dir, pipe = testing.tiny_pipeline_fixtures(FluxFamily)


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FluxFamily.build_tiny_pipeline(tmp_path_factory.mktemp("klein") / "tiny", variant="klein")


@pytest.fixture(scope="module")
def klein_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FluxFamily.build_tiny_pipeline(tmp_path_factory.mktemp("klein-base") / "tiny", variant="klein-base")


def _args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    # The tiny pipelines' native size is larger than needed: train at 32x32.
    return family_checks.tiny_train_args(
        checkpoint, out, "--diffusion-height", str(SIZE), "--diffusion-width", str(SIZE), *extra, family=FAMILY
    )


@pytest.mark.parametrize("true_cfg", [None, 4.0], ids=["guidance-embedded", "true-cfg"])
def test_multi_output_invariant(pipe, true_cfg) -> None:
    request = RolloutRequest(
        prompt="a red cube",
        seed=5,
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        num_outputs_per_prompt=3,
        guidance_scale=3.5,
        true_cfg_scale=true_cfg,
        rollout_return_dit_trajectory=True,
    )
    worst = family_checks.check_multi_output_invariant(FluxFamily(pipe), request)
    print(f"true_cfg {true_cfg}: multi-output invariant max |diff| = {worst:.3e}")


def test_flow_grpo_lora_run_and_generate_with_its_lora(tiny_dir: Path, tmp_path: Path) -> None:
    records = family_checks.run_training(_args(tiny_dir, tmp_path / "run"))
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(math.isfinite(r["train/loss"]) and r["train/num_pairs"] == 4 for r in records)
    lora = tmp_path / "run" / "lora"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()
    # The LoRA the run saved loads into FluxPipeline (generate --lora uses load_lora_weights).
    files = family_checks.check_generate_writes(
        tiny_dir, tmp_path / "gen", "--lora", str(lora), "--height", str(SIZE), "--width", str(SIZE), family=FAMILY
    )
    assert [f.name for f in files] == ["p000_s0.png", "p000_s1.png"]


def test_sft_run_on_images(tiny_dir: Path, tmp_path: Path) -> None:
    """SFT encodes images with encode_pixels (FLUX.1's scaling and shift factors)."""
    records = family_checks.run_training(
        family_checks.tiny_sft_args(
            tiny_dir, tmp_path, ("a red cube", "a very small green frog on a large wet leaf"), size=SIZE, family=FAMILY
        )
    )
    assert len(records) == 2
    assert all(math.isfinite(r["train/sft_loss"]) and r["train/grad_norm"] > 0 for r in records)


def test_alignment_probe_with_the_recipe_has_zero_drift(tiny_dir: Path, tmp_path: Path) -> None:
    """The recipe's settings (guidance 3.5 as the transformer's input, its noise level, ...)
    on the tiny FLUX.1 pipeline: the trainer recomputes the engine's log-probs and model
    outputs exactly."""
    flags = family_checks.recipe_flags(RECIPE, RECIPE_KEYS)
    assert flags[flags.index("--diffusion-guidance-scale") + 1] == "3.5"
    record = family_checks.check_alignment_probe(_args(tiny_dir, tmp_path, "--diffusion-num-steps", "4", *flags))
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


@pytest.mark.exercises("--diffusion-true-cfg-scale")
def test_alignment_probe_with_true_cfg_and_two_prompts_per_micro_batch(tiny_dir: Path, tmp_path: Path) -> None:
    """True CFG (two transformer calls per step) with micro-batches that mix two prompts:
    the drift is still exactly 0 (FLUX's text is padded to the same length for every prompt)."""
    record = family_checks.check_alignment_probe(
        _args(tiny_dir, tmp_path, "--diffusion-true-cfg-scale", "4.0", "--rollout-batch-size", "2", "--num-rollout", "1")
    )
    assert record["train/num_pairs"] == 8
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


def test_training_reaches_the_transformer(tiny_dir: Path) -> None:
    norms = family_checks.check_training_reaches_components(
        tiny_dir, "--diffusion-height", str(SIZE), "--diffusion-width", str(SIZE), family=FAMILY
    )
    assert set(norms) == {"transformer"}
    print(norms)


@pytest.mark.exercises("--diffusion-guidance-scale")
def test_klein_base_alignment_probe_with_cfg_has_zero_drift(klein_base_dir: Path, tmp_path: Path) -> None:
    """FLUX.2 [klein] base samples with real CFG (guidance 4 > 1: conditional and
    unconditional calls); the trainer reproduces it exactly."""
    record = family_checks.check_alignment_probe(_args(klein_base_dir, tmp_path, "--diffusion-guidance-scale", "4.0"))
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


def test_klein_alignment_probe_has_zero_drift(klein_dir: Path, tmp_path: Path) -> None:
    """The step-distilled klein (guidance ignored, one call per step): zero drift too."""
    record = family_checks.check_alignment_probe(_args(klein_dir, tmp_path, "--num-rollout", "1"))
    print({k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("_per_step")})


def test_klein_run_generate_and_training_reaches_every_target(klein_dir: Path, tmp_path: Path) -> None:
    """The step-distilled klein: a short run, its LoRA loaded by generate, and one step that
    reaches the transformer and every LoRA target."""
    records = family_checks.run_training(_args(klein_dir, tmp_path / "run", "--num-rollout", "1"))
    assert len(records) == 1 and math.isfinite(records[0]["train/loss"])
    # The default targets reach each single-stream block's attention output by its
    # block-qualified name (the tiny klein has two such blocks), in the saved LoRA too.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"), "pt") as saved:
        outputs = {key.split(".attn.")[0] for key in saved.keys() if ".attn.to_out.lora_" in key and "single_transformer_blocks" in key}
    assert outputs == {"transformer.single_transformer_blocks.0", "transformer.single_transformer_blocks.1"}, outputs
    files = family_checks.check_generate_writes(
        klein_dir,
        tmp_path / "gen",
        "--lora",
        str(tmp_path / "run" / "lora"),
        "--height",
        str(SIZE),
        "--width",
        str(SIZE),
        family=FAMILY,
    )
    assert len(files) == 2
    norms = family_checks.check_training_reaches_components(
        klein_dir, "--diffusion-height", str(SIZE), "--diffusion-width", str(SIZE), family=FAMILY
    )
    assert set(norms) == {"transformer"}
