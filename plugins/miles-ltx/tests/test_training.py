"""Training the ltx family on its tiny pipeline: a short Flow-GRPO + LoRA run, the
alignment probe with the recipe's sampling settings, training reaching the transformer
(video and audio branches), ``miles-core generate``, and the family's recipe defaults.

The tiny runs use small videos (32 x 32, 9 frames, 5 latent frames) and the sampling and
loss settings of ``recipes/ltx.yaml``: CPS with noise level 0.8 and log-probs without
constants, and guidance 1 (no CFG in rollouts, as the reference trains LTX without CFG).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import yaml

from miles_core import family_checks, testing
from miles_core.config.resolve import resolve_config
from miles_ltx.family import LtxFamily

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "ltx.yaml"
SMALL = ("--diffusion-height", "32", "--diffusion-width", "32", "--diffusion-output-num-frames", "9")
FAMILY = ("--diffusion-model-family", "ltx")

tiny_dir, pipe = testing.tiny_pipeline_fixtures(LtxFamily)


def recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text(encoding="utf-8"))


SAMPLING = ("diffusion_sde_type", "diffusion_noise_level", "diffusion_log_prob_no_const", "diffusion_guidance_scale")
"""The recipe's sampling settings, which the engine and the trainer must agree on."""


def test_recipe_matches_the_family_spec() -> None:
    spec = testing.load_plugin("ltx", "miles-ltx").registries.model_family.get("ltx").spec
    values = recipe()
    assert values["n_samples_per_prompt"] == spec.n_samples_per_prompt == 8
    assert values["rollout_microgroup_size"] == spec.rollout_microgroup_size == 1
    assert values["diffusion_sde_type"] == spec.default_sde_type == "cps"
    # supports_cfg_training is False: the recipe samples without CFG, so rollouts and
    # training-side forwards are the same computation.
    assert spec.supports_cfg_training is False and values["diffusion_guidance_scale"] == 1.0
    assert values["diffusion_clip_range"] == 1e-5 and values["diffusion_noise_level"] == 0.8


def test_family_defaults_resolve(tiny_dir) -> None:
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            *FAMILY,
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "8",
        ]
    )
    assert config.diffusion_sde_type == "cps"
    assert config.rollout_microgroup_size == 1
    assert (config.diffusion_height, config.diffusion_width) == (512, 768)
    assert list(config.lora_target_modules) == ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]


def test_lora_targets_exist_in_the_tiny_transformer(pipe) -> None:
    spec = testing.load_plugin("ltx", "miles-ltx").registries.model_family.get("ltx").spec
    wrapped = testing.assert_lora_targets(pipe.transformer, spec.lora_target_modules)
    # Both branches: video and audio self-attention, text cross-attention, the two
    # cross-modal attentions and both feed-forwards, in every block.
    for part in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
        assert f"transformer_blocks.0.{part}.to_q" in wrapped, part
    for part in ("ff", "audio_ff"):
        assert {f"transformer_blocks.1.{part}.net.0.proj", f"transformer_blocks.1.{part}.net.2"} <= set(wrapped), part


@pytest.mark.parametrize("microgroup", [1, 2], ids=["recipe-microgroup-1", "batched-microgroup-2"])
@pytest.mark.exercises("--diffusion-debug-mode", "--debug-skip-optimizer-step")
def test_alignment_probe_is_exactly_zero_with_the_recipe_settings(tiny_dir, tmp_path, microgroup: int) -> None:
    args = family_checks.tiny_train_args(
        tiny_dir,
        tmp_path / "probe",
        *SMALL,
        *family_checks.recipe_flags(RECIPE, SAMPLING),
        "--rollout-microgroup-size",
        str(microgroup),
        family="ltx",
    )
    record = family_checks.check_alignment_probe(args)
    assert record["train/num_pairs"] == 2 * 2  # 2 samples x 2 SDE steps
    print(
        f"microgroup {microgroup}: log-prob drift {record['train/log_prob_max_abs_diff']}, "
        f"model-output drift {record['train/model_output_max_abs_diff']}"
    )


def _engine_and_rollout(tiny_dir, *extra: str):
    from miles_core.engine.factory import create_engine
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_dir),
            *FAMILY,
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            *SMALL,
            *family_checks.recipe_flags(RECIPE, SAMPLING),
            "--diffusion-forward-dtype",
            "fp32",
            *extra,
        ]
    )
    engine = create_engine(config)
    (group,) = asyncio.run(
        generate_rollout(engine, RolloutSettings.from_config(config), 0, [PromptRecord("a red cube")], strategy_from_config(config))
    )
    return config, engine, group


def _trainer(config, engine):
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    host = get_host()
    return Trainer(
        engine.family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get("policy_loss").load(),
    )


@pytest.mark.exercises("--diffusion-debug-mode")
def test_alignment_probe_sees_both_streams(tiny_dir) -> None:
    """Control: the probe is not zero whatever the weights are, and the audio stream is
    part of the trained log-prob. A weight that only moves the audio output (the audio
    output projection) leaves the video model output alone and still moves the log-prob."""
    config, engine, group = _engine_and_rollout(
        tiny_dir,
        "--debug-skip-optimizer-step",
        "--diffusion-debug-mode",
        "--micro-batch-size-sample",
        "1",
        "--micro-batch-size-tstep",
        "1",
    )
    trainer = _trainer(config, engine)
    advantages = torch.tensor([1.0, -1.0])
    metrics = trainer.train_rollout(group, advantages)
    assert metrics["train/log_prob_max_abs_diff"] == 0.0 and metrics["train/model_output_max_abs_diff"] == 0.0
    assert {tuple(sorted(p.x)) for p in trainer.last_pairs} == {("audio_latents", "latents")}
    transformer = engine.family.components()["transformer"]
    for weight, video_moves in ((transformer.audio_proj_out.weight, False), (transformer.transformer_blocks[0].attn1.to_q.weight, True)):
        saved = weight.detach().clone()
        try:
            with torch.no_grad():
                weight[0, 0] += 1e-2
            metrics = trainer.train_rollout(group, advantages)
        finally:
            with torch.no_grad():
                weight.copy_(saved)
        assert metrics["train/log_prob_max_abs_diff"] > 0
        assert (metrics["train/model_output_max_abs_diff"] > 0) is video_moves


def test_training_reaches_the_audio_branch(tiny_dir) -> None:
    """The last block's audio feed-forward feeds only the audio output, so a gradient on
    its LoRA comes from the audio stream's share of the log-prob alone."""
    config, engine, group = _engine_and_rollout(
        tiny_dir,
        "--use-lora",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--num-steps-per-rollout",
        "1",
    )
    trainer = _trainer(config, engine)
    trainer.train_rollout(group, torch.tensor([1.0, -1.0]))
    named = trainer.named_trainable()
    last = engine.family.pipeline.transformer.config.num_layers - 1
    audio_only = [name for name in named if f"transformer_blocks.{last}.audio_ff.net.2.lora_B" in name]
    assert audio_only
    assert all(named[name].grad is not None and named[name].grad.abs().sum() > 0 for name in audio_only)


def test_training_reaches_every_trainable_component(tiny_dir) -> None:
    norms = family_checks.check_training_reaches_components(tiny_dir, *SMALL, *family_checks.recipe_flags(RECIPE, SAMPLING), family="ltx")
    assert set(norms) == {"transformer"}
    print(f"gradient norms after one step: {norms}")


def test_short_flow_grpo_lora_run_completes(tiny_dir, tmp_path) -> None:
    args = family_checks.tiny_train_args(
        tiny_dir,
        tmp_path / "run",
        *SMALL,
        *family_checks.recipe_flags(RECIPE, (*SAMPLING, "diffusion_clip_range")),
        "--rollout-microgroup-size",
        str(recipe()["rollout_microgroup_size"]),
        "--lr",
        "1e-2",
        family="ltx",
    )
    records = family_checks.run_training(args)
    assert len(records) == 2
    for record in records:
        assert record["train/num_pairs"] == 4
        assert torch.isfinite(torch.tensor(record["train/loss"]))
        assert record["train/grad_norm"] > 0
    # The first optimizer step of each rollout starts from the engine's policy: ratio 1.
    assert records[0]["train/ratio_mean_per_step"][0] == 1.0


@pytest.mark.exercises("--diffusion-output-num-frames", "--diffusion-fps")
def test_frames_and_fps_reach_the_engine(tiny_dir, pipe) -> None:
    """The video flags shape the rollouts: frames per video, and the frame rate that
    sets the clip's duration, hence the audio track's length."""
    lengths = {}
    for fps in (24.0, 12.0):
        _, _, group = _engine_and_rollout(tiny_dir, "--diffusion-fps", str(fps))
        for sample in group:
            output = sample.output
            assert output.generated_output.shape == (3, 9, 32, 32)
            assert output.denoising_env["image_kwargs"] == {"height": 32, "width": 32, "num_frames": 9, "fps": fps}
            assert output.dit_trajectory["latents"].shape[1:] == (5 * 4 * 4, pipe.transformer.config.in_channels)
        lengths[fps] = group[0].output.extra_outputs["audio"].shape[-1]
        rate = pipe.vocoder.config.output_sampling_rate
        assert abs(lengths[fps] / rate - 9 / fps) < 0.1
    assert lengths[12.0] > 1.8 * lengths[24.0]


def test_generate_writes_videos(tiny_dir, tmp_path) -> None:
    from PIL import Image

    files = family_checks.check_generate_writes(
        tiny_dir,
        tmp_path / "out",
        "--height",
        "32",
        "--width",
        "32",
        "--num-frames",
        "9",
        family="ltx",
    )
    assert len(files) == 2
    for path in files:
        if path.suffix == ".gif":
            with Image.open(path) as image:
                assert image.n_frames == 9 and image.size == (32, 32)


@pytest.mark.exercises("--sft-audio-key", "--sft-video-key", "--diffusion-fps")
def test_video_sft_with_audio_fits_a_fixed_clip_and_lr_0_keeps_the_weights(tiny_dir, tmp_path) -> None:
    """Rows with a video and a WAV file, under other keys than the defaults (``clip``,
    ``sound``: --sft-video-key, --sft-audio-key): both streams are encoded
    (``encode_pixels``, ``encode_audio``) and trained. Full fine-tuning lowers the loss on one clip within 8
    optimizer steps; the audio output projection, which only the audio stream's loss
    reaches, moves (no weight decay: Adam moves a weight only on a non-zero gradient). The
    control (lr 0, the same rows, steps and noise) neither lowers the loss nor moves a weight."""
    from safetensors.torch import load_file

    runs = family_checks.check_video_sft_fits_a_clip(
        tiny_dir, tmp_path, *FAMILY, lr=1e-2, size=32, frames=5, audio=True, video_key="clip", audio_key="sound"
    )
    trained, control = runs["trained"], runs["control"]
    audio = runs["trained_record"]["train/sft_loss_audio_latents_per_step"]
    print(
        f"video SFT losses: trained {[round(x, 3) for x in trained]} (audio {[round(x, 3) for x in audio]}), control {[round(x, 3) for x in control]}"
    )
    # Measured: trained 3.007 -> last two 1.582, 2.231 (0.63 of the first); control 2.718, 3.218.
    assert sum(trained[-2:]) / 2 < 0.8 * trained[0]
    assert sum(trained[-2:]) / 2 < 0.8 * sum(control[-2:]) / 2  # same draws: the fall is the training's
    assert sum(control[-2:]) / 2 > 0.9 * control[0]
    assert all(a > 0 for a in audio)  # the sum includes the audio stream's loss
    original = load_file(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    for name, moved in (("control", False), ("trained", True)):
        saved = load_file(runs[f"{name}_run"] / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
        assert torch.equal(saved["audio_proj_out.weight"], original["audio_proj_out.weight"]) != moved, name
        assert any(not torch.equal(saved[k], original[k]) for k in saved) is moved, name


def test_sft_rows_of_a_family_with_audio_need_an_audio_file(tiny_dir, pipe, tmp_path) -> None:
    """A run whose row has no WAV file stops before any step with one line naming the row
    and key (exit status 2); a file that is no WAV or too short is refused from its
    header before training too (tests/test_sft_video.py), and again, as a backstop, when
    its batch is built (here)."""
    from dataclasses import replace

    from miles_core.errors import PromptDataError
    from miles_core.training.sft import load_audio, load_sft_rows, sft_params

    args = family_checks.tiny_video_sft_args(tiny_dir, tmp_path, *FAMILY, size=32, frames=5, lr=1e-2)
    with pytest.raises(PromptDataError) as caught:
        family_checks.run_training(args)
    assert caught.value.exit_code == 2
    assert (
        str(caught.value)
        == f"{tmp_path / 'sft.jsonl'}:1: the ltx family denoises audio with the video: give a WAV file under 'audio' (--sft-audio-key)"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # The backstop: a file that is no WAV, or one shorter than the clip (5 frames at 8 fps).
    config = resolve_config(args)
    rows = load_sft_rows(tmp_path / "sft.jsonl", input_key="input", image_key="image", video_key="video", audio_key="audio", num_frames=5)
    family = LtxFamily(pipe)
    params = sft_params(family, config)
    (tmp_path / "bad.wav").write_text("not audio", encoding="utf-8")
    family_checks.write_sft_clip(tmp_path / "short", size=32, frames=1, audio_seconds=0.5)
    for audio, why in (
        (tmp_path / "bad.wav", "cannot be read as WAV: file does not start with RIFF id"),
        (tmp_path / "short" / "clip.wav", "lasts 0.500 s; the clip needs 0.625 s (5 frames at 8 fps)"),
    ):
        with pytest.raises(PromptDataError) as caught:
            load_audio(family, replace(rows[0], audio=audio), params)
        assert str(caught.value) == f"{rows[0].where}: audio {audio.name!r} under 'audio' {why}"
