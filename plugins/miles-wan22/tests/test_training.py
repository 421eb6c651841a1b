"""Wan 2.2 end to end on the tiny two-expert pipeline, through :mod:`miles_core.family_checks`:
a short Flow-GRPO + LoRA run (and DiffusionNFT), the alignment probe, training reaching
both experts, ``miles-core generate``, and the flags the family reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_core import family_checks
from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_wan22.family import EXPERTS, Wan22Family

SIZE, FRAMES = 32, 5
WAN_FLAGS = (
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
    "--update-weight-target-module",
    "transformer,transformer_2",
)
"""What every Wan run here adds to the tiny run: a small video (the tiny transformer's
rope grid does not reach the native 480x832, and 81 frames would be slow), CFG with the
low-noise expert's own scale, and both experts trained."""
GENERATE_FLAGS = ("--height", str(SIZE), "--width", str(SIZE), "--num-frames", str(FRAMES), "--guidance-scale", "1")
"""``miles-core generate`` at the same small size, CFG off (with CFG: see
test_generate_with_cfg_takes_guidance_scale_2_or_diffusers_fallback)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The name matches the family's checkpoint patterns: runs find the family themselves.
    return Wan22Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-tiny")


def _lora_files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run / "lora")) for p in (run / "lora").rglob("*.safetensors"))


def _assert_both_loras_trained(run: Path) -> None:
    from safetensors.torch import load_file

    assert _lora_files(run) == [f"{e}/pytorch_lora_weights.safetensors" for e in EXPERTS]
    for expert in EXPERTS:
        tensors = load_file(run / "lora" / expert / "pytorch_lora_weights.safetensors")
        # PEFT starts lora_B at zero: a non-zero one was trained.
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in tensors.items()), f"{expert}: untrained LoRA"


@pytest.mark.exercises("--update-weight-target-module")
def test_a_short_flow_grpo_lora_run_trains_and_saves_both_experts(tiny: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    records = family_checks.run_training(family_checks.tiny_train_args(tiny, run, *WAN_FLAGS, "--lr", "1e-2"))
    assert [r["rollout_id"] for r in records] == [0, 1]
    for record in records:
        assert record["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(record["train/loss"]))
        assert record["train/num_pairs"] == 4  # 2 samples x 2 SDE steps (one per expert: timesteps 999, 857)
    _assert_both_loras_trained(run)
    # `miles-core generate --lora` loads both experts' adapters (Wan22Family.load_lora).
    files = family_checks.check_generate_writes(tiny, tmp_path / "out", *GENERATE_FLAGS, "--lora", str(run / "lora"))
    assert len(files) == 2


def test_alignment_probe_has_zero_drift(tiny: Path, tmp_path: Path) -> None:
    record = family_checks.check_alignment_probe(family_checks.tiny_train_args(tiny, tmp_path / "probe", *WAN_FLAGS, "--num-rollout", "1"))
    assert record["train/num_pairs"] == 4
    print("alignment probe:", {k: v for k, v in record.items() if "abs_diff" in k and not k.endswith("per_step")})


def test_training_reaches_both_experts(tiny: Path) -> None:
    norms = family_checks.check_training_reaches_components(tiny, *WAN_FLAGS)
    assert set(norms) == set(EXPERTS)
    print("gradient norms:", norms)


@pytest.mark.exercises("--loss-type")
def test_nft_run_trains_both_experts(tiny: Path, tmp_path: Path) -> None:
    # DiffusionNFT: CFG-free deterministic rollout, random timesteps per sample; a flat
    # micro-batch may hold steps of both experts (predict splits it by expert).
    run = tmp_path / "nft"
    args = family_checks.tiny_train_args(
        tiny,
        run,
        *WAN_FLAGS,
        "--loss-type",
        "nft",
        "--diffusion-num-sde-steps",
        "0",
        "--diffusion-num-steps",
        "4",
        "--diffusion-guidance-scale",
        "1.0",
        "--micro-batch-size",
        "3",
        "--lr",
        "1e-2",
    )
    records = family_checks.run_training(args)
    for record in records:
        assert {"train/nft_loss", "train/positive_loss", "train/negative_loss"} <= record.keys()
        assert torch.isfinite(torch.tensor(record["train/loss"])) and record["train/grad_norm"] > 0
    _assert_both_loras_trained(run)


def test_generate_writes_videos(tiny: Path, tmp_path: Path) -> None:
    # CFG off here; with CFG, the next test.
    files = family_checks.check_generate_writes(tiny, tmp_path / "out", *GENERATE_FLAGS)
    assert len(files) == 2 and all(f.suffix in (".gif", ".mp4") for f in files)
    if files[0].suffix == ".gif":
        from PIL import Image

        with Image.open(files[0]) as image:
            assert image.n_frames == FRAMES and image.size == (SIZE, SIZE)
    else:
        import imageio.v3 as iio

        assert iio.imread(files[0], plugin="FFMPEG", index=None).shape == (FRAMES, SIZE, SIZE, 3)


def test_generate_with_cfg_takes_guidance_scale_2_or_diffusers_fallback(tiny: Path, tmp_path: Path) -> None:
    from miles_core.cli import generate

    def videos(*extra: str) -> list[bytes]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        argv = ["--hf-checkpoint", str(tiny), "--prompt", "a red cube", "--height", str(SIZE), "--width", str(SIZE)]
        argv += ["--num-frames", str(FRAMES), "--num-inference-steps", "2", "--guidance-scale", "4", "--out", str(out), *extra]
        assert generate.run(argv) == 0
        return sorted(p.read_bytes() for p in out.iterdir() if p.suffix in (".mp4", ".gif"))

    # Never required: unset, the low-noise expert samples with --guidance-scale, as in
    # WanPipeline (plugins/miles-wan22/tests/test_family_runtime.py compares the pixels).
    fallback = videos()
    assert fallback and fallback == videos("--guidance-scale-2", "4")  # the same scale, the same call
    # The second expert's own scale acts.
    assert videos("--guidance-scale-2", "3") != videos("--guidance-scale-2", "6")


@pytest.mark.exercises("--diffusion-guidance-scale-2", "--update-weight-target-module")
def test_config_requires_guidance_scale_2_when_both_experts_train(tiny: Path) -> None:
    # Unset, the family's trainable components: both experts, so the second scale is needed
    # (test_one_expert.py: one expert).
    with pytest.raises(ConfigError) as excinfo:
        resolve_config(["--hf-checkpoint", str(tiny), "--rollout-batch-size", "1"])
    assert [m.split(" ", 1)[0] for m in excinfo.value.messages] == ["--diffusion-guidance-scale-2"]
    both = resolve_config(["--hf-checkpoint", str(tiny), "--rollout-batch-size", "1", "--diffusion-guidance-scale-2", "3"])
    assert both.update_weight_target_module == "transformer,transformer_2"
    config = resolve_config(["--hf-checkpoint", str(tiny), "--rollout-batch-size", "1", *WAN_FLAGS])
    assert config.model_family == "wan2_2" and config.diffusion_guidance_scale_2 == 3.0
    assert (config.n_samples_per_prompt, config.rollout_microgroup_size) == (1, 1)  # capped at n
    assert list(config.lora_target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.mark.exercises("--diffusion-output-num-frames", "--diffusion-fps", "--diffusion-guidance-scale-2")
def test_frames_fps_and_guidance_scale_2_reach_the_engine(tiny: Path) -> None:
    from miles_core.engine.factory import create_engine
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "2",
            *WAN_FLAGS,
            "--diffusion-output-num-frames",
            "9",
            "--diffusion-fps",
            "12",
            "--diffusion-guidance-scale-2",
            "2.5",
        ]
    )
    request = RolloutSettings.from_config(config).request(
        "a red cube", Microgroup(group_index=0, offset=0, size=2, seed=3), (0,), (0, 1, 2)
    )
    assert (request.num_frames, request.fps, dict(request.extra_sampling_params)) == (9, 12.0, {"guidance_scale_2": 2.5})
    outputs = create_engine(config).generate_sync(request)
    assert [o.generated_output.shape for o in outputs] == [(3, 9, SIZE, SIZE)] * 2
    env = outputs[0].denoising_env
    assert env["image_kwargs"] == {"height": SIZE, "width": SIZE, "num_frames": 9, "fps": 12.0}
    assert env["guidance"] == {"guidance_scale": 4.0, "guidance_scale_2": 2.5}


@pytest.mark.exercises("--sft-frame-stride", "--sft-video-key")
def test_video_sft_fits_a_fixed_clip_and_lr_0_keeps_the_weights(tiny: Path, tmp_path: Path) -> None:
    """Video rows, every 2nd frame of the clip (--sft-frame-stride 2), encoded by the A14B
    VAE as ``[B, C, F, H, W]``; full fine-tuning of both experts lowers the loss within 8
    optimizer steps, the control (lr 0, the same rows, steps and noise) neither lowers it
    nor moves a weight."""
    from safetensors.torch import load_file

    runs = family_checks.check_video_sft_fits_a_clip(tiny, tmp_path, lr=2e-2, size=16, frames=5, stride=2)
    trained, control = runs["trained"], runs["control"]
    print(f"video SFT losses: trained {[round(x, 3) for x in trained]}, control {[round(x, 3) for x in control]}")
    # Measured: trained 1.521 -> last two 1.155, 1.184 (0.77 of the first); control 1.537, 1.616.
    assert sum(trained[-2:]) / 2 < 0.8 * trained[0]
    assert sum(trained[-2:]) / 2 < 0.8 * sum(control[-2:]) / 2  # same draws: the fall is the training's
    assert sum(control[-2:]) / 2 > 0.9 * control[0]
    for expert in EXPERTS:
        original = load_file(tiny / expert / "diffusion_pytorch_model.safetensors")
        for name, moved in (("control", False), ("trained", True)):
            saved = load_file(runs[f"{name}_run"] / "model" / expert / "diffusion_pytorch_model.safetensors")
            assert any(not torch.equal(saved[k], original[k]) for k in saved) is moved, (expert, name)


@pytest.mark.exercises("--diffusion-output-num-frames")
def test_video_sft_stops_before_training_on_a_frame_count_the_vae_cannot_encode(tiny: Path, tmp_path: Path) -> None:
    """One line naming the flag and the VAE's rule, exit status 2, before any step."""
    args = family_checks.tiny_video_sft_args(tiny, tmp_path, size=16, frames=6, lr=1e-2)
    with pytest.raises(ConfigError) as caught:
        family_checks.run_training(args)
    assert caught.value.exit_code == 2
    assert caught.value.messages == [
        "--diffusion-output-num-frames 6: Wan needs num_frames - 1 divisible by 4 (the VAE's temporal factor), e.g. 5"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.exercises("--sft-frame-stride")
def test_video_sft_checks_the_clip_the_stride_spans_before_any_model_loads(tiny: Path, tmp_path: Path) -> None:
    """The control of the stride-2 run above: the same 9-frame clip read every 3rd frame
    spans (5 - 1) x 3 + 1 = 13 frames, so the run stops with one line naming the row and
    key (exit status 2) when its rows are loaded."""
    from miles_core.errors import PromptDataError

    args = family_checks.tiny_video_sft_args(tiny, tmp_path, size=16, frames=5, lr=1e-2, stride=2)
    args[args.index("--sft-frame-stride") + 1] = "3"
    with pytest.raises(PromptDataError) as caught:
        family_checks.run_training(args)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"{tmp_path / 'sft.jsonl'}:1: video 'clip.mp4' under 'video' has 9 frames; "
        "--diffusion-output-num-frames 5 with --sft-frame-stride 3 needs 13"
    )
    assert not (tmp_path / "run").exists()
