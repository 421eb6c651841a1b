"""Wan 2.2 TI2V-5B end to end on the tiny pipeline, through :mod:`miles_core.family_checks`:
a short Flow-GRPO + LoRA run and ``miles-core generate`` with its LoRA, the alignment probe
(exactly 0), and training reaching the transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_core import family_checks
from miles_core.config.resolve import resolve_config
from miles_wan22.ti2v import WanTI2VFamily

HEIGHT, WIDTH, FRAMES = 32, 64, 5
TI2V_FLAGS = (
    "--diffusion-height",
    str(HEIGHT),
    "--diffusion-width",
    str(WIDTH),
    "--diffusion-output-num-frames",
    str(FRAMES),
    "--diffusion-guidance-scale",
    "5.0",
)
"""What every run here adds to the tiny run: a small video (WanPipeline's default 480x832
with 81 frames would be slow) and CFG at TI2V-5B's published scale."""
GENERATE_FLAGS = ("--height", str(HEIGHT), "--width", str(WIDTH), "--num-frames", str(FRAMES))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The name matches the family's checkpoint patterns (and wan2_2's); the content decides.
    return WanTI2VFamily.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-ti2v-tiny")


@pytest.mark.exercises("--diffusion-output-num-frames", "--diffusion-fps")
def test_a_short_flow_grpo_lora_run_trains_and_generate_loads_its_lora(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    args = family_checks.tiny_train_args(tiny, run, *TI2V_FLAGS, "--diffusion-fps", "24", "--lr", "1e-2")
    config = resolve_config(args)
    assert config.model_family == "wan2_2_ti2v" and config.update_weight_target_module == "transformer"
    records = family_checks.run_training(args)
    assert [r["rollout_id"] for r in records] == [0, 1]
    for record in records:
        assert record["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(record["train/loss"]))
        assert record["train/num_pairs"] == 4  # 2 samples x 2 SDE steps
    tensors = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    assert tensors and all(key.startswith("transformer.") for key in tensors)
    # PEFT starts lora_B at zero: a non-zero one was trained.
    assert any("lora_B" in key and value.abs().max() > 0 for key, value in tensors.items())
    files = family_checks.check_generate_writes(tiny, tmp_path / "out", *GENERATE_FLAGS, "--lora", str(run / "lora"))
    assert len(files) == 2 and all(family_checks.read_frames(f) == FRAMES for f in files)
    # Control: the trained LoRA changes what generate writes.
    plain = family_checks.check_generate_writes(tiny, tmp_path / "plain", *GENERATE_FLAGS)
    assert [f.read_bytes() for f in plain] != [f.read_bytes() for f in files]


def test_alignment_probe_has_zero_drift(tiny: Path, tmp_path: Path) -> None:
    record = family_checks.check_alignment_probe(family_checks.tiny_train_args(tiny, tmp_path / "probe", *TI2V_FLAGS, "--num-rollout", "1"))
    assert record["train/num_pairs"] == 4
    print("alignment probe:", {k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("per_step")})


def test_the_probe_sees_token_timesteps_that_differ_from_the_engines(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the trainer's recomputation (not the engine's sampling) gets its per-token
    timesteps one unit off, and the probe reports the drift."""
    from miles_core.training.trainer import Trainer

    in_trainer = [False]
    recompute, expand = Trainer._log_prob, WanTI2VFamily.token_timesteps

    def trainer_log_prob(self: Trainer, data: dict) -> tuple:
        in_trainer[0] = True
        try:
            return recompute(self, data)
        finally:
            in_trainer[0] = False

    def shifted(self: WanTI2VFamily, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return expand(self, timestep + (1.0 if in_trainer[0] else 0.0), latents)

    monkeypatch.setattr(Trainer, "_log_prob", trainer_log_prob)
    monkeypatch.setattr(WanTI2VFamily, "token_timesteps", shifted)
    with pytest.raises(AssertionError, match=r"rollout 0: train/log_prob_mean_abs_diff = .*expected exactly 0"):
        family_checks.check_alignment_probe(family_checks.tiny_train_args(tiny, tmp_path / "probe", *TI2V_FLAGS, "--num-rollout", "1"))


def test_training_reaches_the_transformer(tiny: Path) -> None:
    norms = family_checks.check_training_reaches_components(tiny, *TI2V_FLAGS)
    assert set(norms) == {"transformer"}
    print("gradient norms:", norms)


@pytest.mark.exercises("--sft-frame-stride")
def test_video_sft_smoke(tiny: Path, tmp_path: Path) -> None:
    """SFT on a video row: every second frame of a 9-frame clip gives the 5 frames the
    48-channel VAE encodes to 2 latent frames; the run trains the LoRA. Control: another
    clip under the same seed (same steps and noise) gives another loss."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    from miles_core.media import write_mp4

    losses = []
    for seed in (0, 1):
        out = tmp_path / f"clip{seed}"
        out.mkdir()
        frames = np.random.default_rng(seed).integers(0, 256, size=(9, 40, 72, 3), dtype=np.uint8)
        write_mp4(out / "clip.mp4", frames, fps=8)
        (out / "sft.jsonl").write_text(json.dumps({"input": "a red cube", "video": "clip.mp4"}) + "\n", encoding="utf-8")
        records = family_checks.run_training(
            [
                "--hf-checkpoint",
                str(tiny),
                "--prompt-data",
                str(out / "sft.jsonl"),
                "--loss-type",
                "sft_loss",
                "--rollout-batch-size",
                "1",
                "--n-samples-per-prompt",
                "1",
                "--micro-batch-size",
                "1",
                *TI2V_FLAGS,
                "--sft-frame-stride",
                "2",
                "--use-lora",
                "--lora-rank",
                "4",
                "--lr",
                "1e-2",
                "--num-rollout",
                "2",
                "--diffusion-forward-dtype",
                "fp32",
                "--output-dir",
                str(out / "run"),
            ]
        )
        assert all(torch.isfinite(torch.tensor(r["train/loss"])) and r["train/grad_norm"] > 0 for r in records)
        tensors = load_file(out / "run" / "lora" / "pytorch_lora_weights.safetensors")
        assert any("lora_B" in key and value.abs().max() > 0 for key, value in tensors.items())
        losses.append(records[0]["train/loss"])
    assert losses[0] != losses[1], losses
