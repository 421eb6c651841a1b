"""The reusable family contract checks (:mod:`miles_core.family_checks`) on the tiny SD3
pipeline, each with a control that makes it fail: the checks can see what they check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_core import family_checks
from miles_core.request import RolloutRequest
from miles_sd3.family import SD3Family


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The name matches the sd3 family's patterns: the checks find the family themselves.
    return SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "stable-diffusion-3-tiny")


def test_tiny_train_args_are_a_short_flow_grpo_run(tiny: Path, tmp_path: Path) -> None:
    from miles_core.config.resolve import resolve_config

    args = family_checks.tiny_train_args(tiny, tmp_path / "run", "--lora-rank", "2")
    config = resolve_config(args)
    assert config.model_family == "sd3" and (config.diffusion_height, config.diffusion_width) == (64, 64)
    assert (config.rollout_batch_size, config.n_samples_per_prompt, config.rollout_microgroup_size) == (1, 2, 2)
    assert (config.diffusion_num_steps, config.diffusion_num_sde_steps, config.num_rollout) == (3, 2, 2)
    assert config.use_lora and config.lora_rank == 2  # extra flags override
    assert (tmp_path / "run" / "prompts.jsonl").read_text().count("\n") == len(family_checks.PROMPTS)


def test_a_short_run_and_the_alignment_probe(tiny: Path, tmp_path: Path) -> None:
    records = family_checks.run_training(family_checks.tiny_train_args(tiny, tmp_path / "run"))
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    record = family_checks.check_alignment_probe(
        family_checks.tiny_train_args(tiny, tmp_path / "probe", "--num-rollout", "1", "--diffusion-guidance-scale", "4.5")
    )
    assert record["train/num_pairs"] == 4  # 2 samples x 2 SDE steps


def test_the_probe_sees_a_perturbed_trainer_weight(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the trainer's forward runs on a weight the engine did not sample with."""
    from miles_core.training.trainer import Trainer

    original = Trainer._log_prob

    def perturbed(self, data):
        weight = self.family.components()["transformer"].transformer_blocks[0].attn.to_q.base_layer.weight
        with torch.no_grad():
            weight[0, 0] += 1e-2
        return original(self, data)

    monkeypatch.setattr(Trainer, "_log_prob", perturbed)
    with pytest.raises(AssertionError, match=r"rollout 0: train/log_prob_mean_abs_diff = .*expected exactly 0"):
        family_checks.check_alignment_probe(family_checks.tiny_train_args(tiny, tmp_path / "probe", "--num-rollout", "1"))


def request(**overrides) -> RolloutRequest:
    fields = dict(
        prompt="a red cube",
        seed=11,
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=4.5,
        num_outputs_per_prompt=3,
        rollout_return_dit_trajectory=True,
    )
    return RolloutRequest(**{**fields, **overrides})


class OneNoiseSD3(SD3Family):
    """A broken family: every output of a request starts from output 0's noise."""

    def initial_latents(self, params, generators):
        seed = generators[0].initial_seed()
        return super().initial_latents(params, [torch.Generator().manual_seed(seed) for _ in generators])


class SeedlessSD3(SD3Family):
    """A broken family: the noise ignores the seeds altogether."""

    def initial_latents(self, params, generators):
        return super().initial_latents(params, [torch.Generator().manual_seed(0) for _ in generators])


def test_multi_output_invariant(tiny: Path) -> None:
    family = SD3Family.from_pretrained(tiny)
    worst = family_checks.check_multi_output_invariant(family, request())
    print(f"max |batch of 3 - single| = {worst:.3e}")
    assert worst <= 1e-5
    assert family_checks.check_multi_output_invariant(family, request(rollout=False, guidance_scale=1.0)) <= 1e-5
    # Controls: noise not drawn per output seed; noise that ignores the seed.
    pipeline = family.pipeline
    with pytest.raises(AssertionError, match=r"output 1 of a 3-output request differs .* seed 12 in generated_output"):
        family_checks.check_multi_output_invariant(OneNoiseSD3(pipeline), request())
    with pytest.raises(AssertionError, match="outputs 0 and 1 of one request are identical"):
        # An evaluation request samples with the ODE: the initial noise is the only randomness.
        family_checks.check_multi_output_invariant(SeedlessSD3(pipeline), request(rollout=False))
    with pytest.raises(AssertionError, match="at least 2 outputs"):
        family_checks.check_multi_output_invariant(family, request(num_outputs_per_prompt=1))


def test_training_reaches_every_component_and_lora_target(tiny: Path) -> None:
    norms = family_checks.check_training_reaches_components(tiny, frozen=["transformer.pos_embed"])
    print(f"gradient norms: {norms}")
    assert set(norms) == {"transformer"} and norms["transformer"] > 0


def test_training_check_sees_an_unreached_lora_target(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the outputs of every module of one LoRA target are cut from the graph, so training
    never reaches that target."""
    from miles_core.training.trainer import Trainer

    original = Trainer.__init__

    def cut(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name, module in self.modules["transformer"].named_modules():
            if name.endswith("attn.to_q"):
                module.register_forward_hook(lambda mod, inputs, output: output.detach())

    monkeypatch.setattr(Trainer, "__init__", cut)
    with pytest.raises(AssertionError, match=r"LoRA target 'attn.to_q' of transformer: zero gradient"):
        family_checks.check_training_reaches_components(tiny)


def test_training_check_sees_a_trainable_frozen_prefix(tiny: Path) -> None:
    """Control: a prefix meant to stay frozen that training does update."""
    with pytest.raises(AssertionError, match="parameters under the frozen prefixes are trainable"):
        family_checks.check_training_reaches_components(tiny, frozen=["transformer.transformer_blocks.0.attn.to_q"])
    with pytest.raises(AssertionError, match="frozen prefix 'transformer.no_such_tower' matches no parameter"):
        family_checks.check_training_reaches_components(tiny, frozen=["transformer.no_such_tower"])


def test_generate_writes_pngs(tiny: Path, tmp_path: Path) -> None:
    files = family_checks.check_generate_writes(tiny, tmp_path / "out", "--height", "32", "--width", "32")
    assert [p.name for p in files] == ["p000_s0.png", "p000_s1.png"]


def test_generate_check_sees_a_broken_file(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a writer that leaves a file nothing can read."""
    from miles_core.cli import generate

    original = generate.write_output

    def broken(out, *args, **kwargs):
        name = original(out, *args, **kwargs)
        (out / name).write_bytes(b"not an image")
        return name

    monkeypatch.setattr(generate, "write_output", broken)
    with pytest.raises(AssertionError, match="p000_s0.png: cannot be read back"):
        family_checks.check_generate_writes(tiny, tmp_path / "out", "--height", "32", "--width", "32")


def test_generate_check_reads_videos_back(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The video path of the check, on SD3 images made 3-frame videos: MP4, or GIF when no
    encoder is installed."""
    import sys

    from miles_core.engine.embedded import EmbeddedEngine

    original = EmbeddedEngine.generate_sync

    def as_video(self, request):
        outputs = original(self, request)
        for output in outputs:
            fade = torch.linspace(1.0, 0.5, 3).reshape(1, 3, 1, 1)
            output.generated_output = output.generated_output.unsqueeze(1) * fade
        return outputs

    monkeypatch.setattr(EmbeddedEngine, "generate_sync", as_video)
    size = ("--height", "32", "--width", "32")
    assert [p.name for p in family_checks.check_generate_writes(tiny, tmp_path / "mp4", *size)] == [
        "p000_s0.mp4",
        "p000_s1.mp4",
    ]
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    assert [p.name for p in family_checks.check_generate_writes(tiny, tmp_path / "gif", *size)] == [
        "p000_s0.gif",
        "p000_s1.gif",
    ]
