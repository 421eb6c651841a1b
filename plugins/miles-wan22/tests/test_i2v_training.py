"""Wan 2.2 I2V-A14B end to end on the tiny pipeline, through :mod:`miles_core.family_checks`:
a short Flow-GRPO + LoRA run on prompt rows with an image (both experts trained and
saved), the alignment probe (the trainer conditions on the engine's image latents; a
shifted condition in the trainer alone is caught),
``miles-core generate --image`` (with the trained LoRA), and the bad inputs: a row without
its image, a module the checkpoint lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_core import family_checks
from miles_core.cli.main import main
from miles_core.errors import PromptDataError
from miles_wan22.family import EXPERTS
from miles_wan22.i2v import WanI2VFamily

from .image_probe import check_probe_catches_a_trainer_side_image_shift

SIZE, FRAMES = 32, 5
I2V_FLAGS = (
    "--diffusion-height",
    str(SIZE),
    "--diffusion-width",
    str(SIZE),
    "--diffusion-output-num-frames",
    str(FRAMES),
    "--diffusion-guidance-scale",
    "4.0",
    "--diffusion-guidance-scale-2",
    "3.0",
)
"""A small video with CFG on (the tiny experts' rope grid does not reach 480x832), the
low-noise expert's own scale; both experts train (the family's default)."""
GENERATE_FLAGS = ("--height", str(SIZE), "--width", str(SIZE), "--num-frames", str(FRAMES), "--guidance-scale", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The name matches the family's checkpoint patterns, and the content claims it too.
    return WanI2VFamily.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-i2v-tiny")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_checks.write_conditioning_image(tmp_path_factory.mktemp("images") / "first.png", height=SIZE, width=SIZE)


@pytest.mark.exercises("--update-weight-target-module")
def test_a_short_flow_grpo_lora_run_on_image_rows_trains_both_experts(tiny: Path, image: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    records = family_checks.run_training(family_checks.tiny_train_args(tiny, run, *I2V_FLAGS, "--lr", "1e-2", image=image))
    assert [r["rollout_id"] for r in records] == [0, 1]
    for record in records:
        assert record["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(record["train/loss"]))
        assert record["train/num_pairs"] == 4  # 2 samples x 2 SDE steps (timesteps 999 and 857: one per expert)
    for expert in EXPERTS:
        tensors = load_file(run / "lora" / expert / "pytorch_lora_weights.safetensors")
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in tensors.items()), f"{expert}: untrained LoRA"
    # `miles-core generate --image --lora` loads both experts' adapters.
    files = family_checks.check_generate_writes(tiny, tmp_path / "out", *GENERATE_FLAGS, "--image", str(image), "--lora", str(run / "lora"))
    assert len(files) == 2 and all(f.suffix in (".gif", ".mp4") for f in files)


def test_alignment_probe_has_zero_drift(tiny: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = family_checks.tiny_train_args(tiny, tmp_path / "probe", *I2V_FLAGS, "--num-rollout", "1", image=image)
    record = family_checks.check_alignment_probe(args)
    assert record["train/num_pairs"] == 4

    # Control: the trainer alone conditions on a shifted image latent; the probe reports it.
    args = family_checks.tiny_train_args(tiny, tmp_path / "control", *I2V_FLAGS, "--num-rollout", "1", image=image)
    check_probe_catches_a_trainer_side_image_shift(WanI2VFamily, args, monkeypatch)


def test_generate_conditions_on_the_image(tiny: Path, image: Path, tmp_path: Path) -> None:
    def videos(picture: Path) -> list[bytes]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        family_checks.check_generate_writes(tiny, out, *GENERATE_FLAGS, "--image", str(picture))
        return sorted(p.read_bytes() for p in out.iterdir() if p.suffix in (".mp4", ".gif"))

    first = videos(image)
    assert first == videos(image)  # deterministic
    other = family_checks.write_conditioning_image(tmp_path / "other.png", height=SIZE, width=SIZE, seed=1)
    assert videos(other) != first  # control: the image reaches the video


def test_a_row_without_its_image_stops_the_run_naming_the_row(tiny: Path, image: Path, tmp_path: Path) -> None:
    args = family_checks.tiny_train_args(tiny, tmp_path / "run", *I2V_FLAGS, image=image)
    prompts = tmp_path / "run" / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()]
    del rows[1]["image"]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(PromptDataError) as caught:
        family_checks.run_training(args)
    assert caught.value.exit_code == 2
    message = str(caught.value)
    assert message.startswith(f"{prompts}:2: no 'image' key") and "wan2_2_i2v" in message and "\n" not in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.exercises("--update-weight-target-module")
def test_a_module_the_checkpoint_lacks_is_refused(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["config", "--hf-checkpoint", str(tiny), "--rollout-batch-size", "1", *I2V_FLAGS]
    assert main([*base, "--update-weight-target-module", "transformer,image_encoder"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "miles-core config: error: --update-weight-target-module transformer,image_encoder: image_encoder is not a "
        "trainable module of the wan2_2_i2v family's checkpoint (its trainable modules: transformer, transformer_2)"
    ]
    assert main([*base, "--update-weight-target-module", "transformer_2"]) == 0  # control
    capsys.readouterr()
