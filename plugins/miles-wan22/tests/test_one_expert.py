"""Training one Wan 2.2 expert (``--update-weight-target-module transformer`` or
``transformer_2``) on the tiny two-expert pipeline: that expert trains and is synced, the
other stays frozen and keeps sampling its steps, the steps it denoises are left out of
training and counted, a rollout with nothing to train takes no step and says so, and the
configuration rules (the second guidance scale, modules the checkpoint lacks, one
data-parallel rank).

The tiny schedule of 3 steps has timesteps 999, 857 and 600 against a boundary of 875: SDE
step 0 is ``transformer``'s, SDE step 1 ``transformer_2``'s."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from miles_core import family_checks, testing
from miles_core.cli.main import main
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError
from miles_core.weights import module_checksum
from miles_wan22.family import EXPERTS, Wan22Family

OTHER = {EXPERTS[0]: EXPERTS[1], EXPERTS[1]: EXPERTS[0]}
VIDEO = ("--diffusion-height", "32", "--diffusion-width", "32", "--diffusion-output-num-frames", "5", "--diffusion-guidance-scale", "4.0")
"""A small video with CFG on (the tiny transformer's rope grid does not reach 480x832)."""
STEP_OF = {EXPERTS[0]: 0, EXPERTS[1]: 1}
"""The SDE step each expert denoises in the tiny runs (timesteps 999 and 857; boundary 875)."""


def one_expert(expert: str) -> tuple[str, ...]:
    """Train ``expert`` alone; the low-noise expert needs its own guidance scale, the
    high-noise one takes diffusers' fallback (``guidance_scale_2 = guidance_scale``)."""
    scale_2 = ("--diffusion-guidance-scale-2", "3.0") if expert == EXPERTS[1] else ()
    return (*VIDEO, "--update-weight-target-module", expert, *scale_2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Wan22Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan2.2-tiny")


def _lora_files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run / "lora")) for p in (run / "lora").rglob("*.safetensors"))


@pytest.mark.exercises("--update-weight-target-module")
@pytest.mark.parametrize("expert", EXPERTS)
def test_training_one_expert_changes_it_and_not_the_other(tiny: Path, expert: str) -> None:
    # One optimizer step on a rollout whose SDE steps reach both experts: the trained
    # one gets gradients on every LoRA target and changes; the other (its LoRA-free
    # weights) gets no gradient and is bit for bit what it was.
    norms = family_checks.check_training_reaches_components(tiny, *one_expert(expert), frozen=(f"{OTHER[expert]}.",))
    assert set(norms) == {expert} and norms[expert] > 0


@pytest.mark.exercises("--update-weight-target-module", "--diffusion-guidance-scale-2")
@pytest.mark.parametrize("expert", EXPERTS)
def test_a_short_run_probes_exactly_on_the_trained_experts_pairs_and_counts_the_others(tiny: Path, tmp_path: Path, expert: str) -> None:
    args = family_checks.tiny_train_args(tiny, tmp_path / "probe", *one_expert(expert), "--num-rollout", "1")
    record = family_checks.check_alignment_probe(args)  # every drift exactly 0, ratio exactly 1
    # 2 samples x 2 SDE steps: each sample's step of the trained expert is trained, the
    # other expert's is left out and counted.
    assert (record["train/num_pairs"], record["train/num_pairs_frozen"]) == (2, 2)
    assert [k for k in record if k.startswith("train/log_prob_abs_diff_step_")] == [f"train/log_prob_abs_diff_step_{STEP_OF[expert]}"]


@pytest.mark.exercises("--update-weight-target-module")
def test_the_frozen_experts_steps_are_left_out_and_the_probe_sees_the_trained_one(tiny: Path) -> None:
    from miles_core.engine.factory import create_engine
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    # Full fine-tuning (the nudged weights below are the trained ones), the probe's tile.
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-forward-dtype",
            "fp32",
            *one_expert("transformer"),
            *family_checks.PROBE_FLAGS,
            "--micro-batch-size-sample",
            "2",
            "--micro-batch-size-tstep",
            "1",
        ]
    )
    engine = create_engine(config)
    host = get_host()
    # The trainer first, as in a run: its requires_grad flags pick kernels the engine then samples with.
    trainer = Trainer(
        engine.family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
    )
    assert trainer.frozen_components == ["transformer_2"]
    groups = asyncio.run(
        generate_rollout(
            engine, RolloutSettings.from_config(config), 0, [PromptRecord(family_checks.PROMPTS[0])], strategy_from_config(config)
        )
    )
    samples = [s for group in groups for s in group]
    advantages = torch.tensor([1.0, -1.0])
    # Both experts sampled their steps, and the second scale fell back to the first (diffusers').
    assert samples[0].output.denoising_env["guidance"] == {"guidance_scale": 4.0, "guidance_scale_2": 4.0}
    timesteps = samples[0].output.dit_trajectory["timesteps"]
    assert [engine.family.denoiser_for(timesteps[k], None) for k in samples[0].sde_step_indices] == list(EXPERTS)

    def probe() -> dict:
        metrics = trainer.train_rollout(samples, advantages)
        assert (metrics["train/num_pairs"], metrics["train/num_pairs_frozen"]) == (2, 2)
        assert {(p.step, p.denoiser) for p in trainer.last_pairs} == {(0, "transformer")}
        return metrics

    assert probe()["train/log_prob_max_abs_diff"] == 0.0
    components = engine.family.components()
    # The frozen expert's steps are not recomputed: a change there leaves the probe at 0 ...
    with family_checks.nudged(components["transformer_2"].blocks[0].attn1.to_q.weight):
        assert probe()["train/log_prob_max_abs_diff"] == 0.0
    # ... while the same change in the trained expert is seen (the control).
    with family_checks.nudged(components["transformer"].blocks[0].attn1.to_q.weight):
        drift = probe()["train/log_prob_max_abs_diff"]
    print(f"one weight of transformer nudged by 0.5: log-prob drift {drift:.2e}")  # measured 1.8e-5
    assert drift > 0.0


@pytest.mark.exercises("--update-weight-target-module", "--diffusion-sde-window-range")
def test_a_rollout_with_no_step_of_the_trained_expert_takes_no_step_and_says_why(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    window = ("--diffusion-num-sde-steps", "1", "--num-rollout", "1", "--diffusion-sde-window-range")
    with caplog.at_level("WARNING", logger="miles_core.training"):
        (record,) = family_checks.run_training(
            family_checks.tiny_train_args(tiny, tmp_path / "late", *one_expert("transformer"), *window, "1,2")
        )
    assert (record["train/num_pairs"], record["train/num_pairs_frozen"]) == (0, 2) and "train/grad_norm" not in record
    assert [r.getMessage() for r in caplog.records if r.name == "miles_core.training"] == [
        "--update-weight-target-module transformer: no optimizer step in this rollout, no step of it is denoised by a "
        "trained component: the SDE window reached only transformer_2 (step(s) 1), which stays frozen; if every rollout "
        "says so, move the SDE window onto the steps of transformer (--diffusion-sde-window-range), or train "
        "transformer_2 too (--update-weight-target-module transformer,transformer_2)"
    ]
    # Control: a window on the trained expert's step trains, nothing left out.
    (record,) = family_checks.run_training(
        family_checks.tiny_train_args(tiny, tmp_path / "early", *one_expert("transformer"), *window, "0,1")
    )
    assert (record["train/num_pairs"], record["train/num_pairs_frozen"]) == (2, 0) and record["train/grad_norm"] > 0


@pytest.mark.exercises("--update-weight-target-module", "--loss-type")
def test_nft_trains_one_expert_on_its_own_steps(tiny: Path, tmp_path: Path) -> None:
    nft = ("--loss-type", "nft", "--diffusion-num-sde-steps", "0", "--diffusion-num-steps", "4", "--diffusion-guidance-scale", "1.0")
    run = tmp_path / "nft"
    records = family_checks.run_training(family_checks.tiny_train_args(tiny, run, *one_expert("transformer"), *nft, "--lr", "1e-2"))
    for record in records:
        # 2 samples x int(4 x 0.99) = 3 drawn steps of 4; the schedule's 4 steps are 2 per expert.
        assert record["train/num_pairs_frozen"] > 0 and record["train/grad_norm"] > 0
    assert _lora_files(run) == ["transformer/pytorch_lora_weights.safetensors"]
    # Only the first step drawn (999, transformer's) while transformer_2 trains: nothing to train.
    first_only = ("--no-diffusion-nft-shuffle-timesteps", "--diffusion-nft-timestep-fraction", "0.25", "--num-rollout", "1")
    (record,) = family_checks.run_training(
        family_checks.tiny_train_args(tiny, tmp_path / "nft2", *one_expert("transformer_2"), *nft, *first_only)
    )
    assert record["train/num_pairs_frozen"] == 2 and "train/grad_norm" not in record  # no optimizer step


def _checksum(url: str, module: str) -> str:
    request = urllib.request.Request(
        url + "/get_weights_checksum", data=json.dumps({"module_names": [module]}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())[module]


@pytest.mark.exercises("--update-weight-target-module", "--rollout-engine-urls")
def test_weight_sync_sends_only_the_trained_expert(tiny: Path, tmp_path: Path) -> None:
    from miles_core.engine.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_checkpoint(tiny, "wan2_2")
    before = {name: module_checksum(engine.component(name)) for name in EXPERTS}
    sent: list[str] = []
    update = engine.update_weights_from_tensors
    engine.update_weights_from_tensors = lambda name, tensors, **kw: sent.append(name) or update(name, tensors, **kw)
    run = tmp_path / "run"
    with testing.serve_engine_in_thread(engine) as url:
        records = family_checks.run_training(
            family_checks.tiny_train_args(
                tiny, run, *one_expert("transformer"), "--lr", "1e-2", "--rollout-engine", "http", "--rollout-engine-urls", url
            )
        )
        after = {name: _checksum(url, name) for name in EXPERTS}
    # A sync before the first rollout and one after each of the 2 rollouts, each checked by
    # checksum against what the trainer sent: transformer's merged weights, nothing else.
    assert set(sent) == {"transformer"} and len(sent) >= 3
    assert after["transformer_2"] == before["transformer_2"] == module_checksum(engine.component("transformer_2"))
    assert after["transformer"] != before["transformer"]  # control: training moved the expert it trains
    one_expert_bytes = sum(p.numel() * p.element_size() for p in engine.component("transformer").parameters())
    assert records[0]["perf/weight_sync_bytes"] == 2 * one_expert_bytes and records[1]["perf/weight_sync_bytes"] == one_expert_bytes
    assert [(r["train/num_pairs"], r["train/num_pairs_frozen"]) for r in records] == [(2, 2), (2, 2)]
    assert _lora_files(run) == ["transformer/pytorch_lora_weights.safetensors"]


@pytest.mark.exercises("--update-weight-target-module", "--diffusion-guidance-scale-2")
def test_configuration_rules_for_one_expert(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--hf-checkpoint", str(tiny), "--rollout-batch-size", "1", "--diffusion-num-sde-steps", "2", *VIDEO]
    # The high-noise expert alone: no second scale needed, and training accepts it.
    config = resolve_config([*base, "--update-weight-target-module", "transformer"])
    assert config.update_weight_target_module == "transformer" and config.diffusion_guidance_scale_2 is None
    assert training_errors(config) == []
    # The low-noise expert (alone, or both, the default): the second scale is required ...
    for targets in (["--update-weight-target-module", "transformer_2"], []):
        with pytest.raises(ConfigError) as caught:
            resolve_config([*base, *targets])
        assert [m.split(" ", 1)[0] for m in caught.value.messages] == ["--diffusion-guidance-scale-2"]
    # ... and given, it resolves (control).
    assert resolve_config([*base, "--diffusion-guidance-scale-2", "3"]).update_weight_target_module == "transformer,transformer_2"

    # A module the checkpoint does not train: one line, exit status 2, before anything loads.
    assert main(["config", *base, "--update-weight-target-module", "transformer,vae"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "miles-core config: error: --update-weight-target-module transformer,vae: vae is not a trainable module of the "
        "wan2_2 family's checkpoint (its trainable modules: transformer, transformer_2)"
    ]
    # Control: the same command with the experts only is a valid configuration.
    assert main(["config", *base, "--update-weight-target-module", "transformer"]) == 0
    capsys.readouterr()


@pytest.mark.exercises("--update-weight-target-module", "--actor-num-nodes")
def test_one_expert_needs_one_data_parallel_rank(tiny: Path, tmp_path: Path) -> None:
    def errors(*flags: str) -> list[str]:
        config = resolve_config(family_checks.tiny_train_args(tiny, tmp_path, "--actor-num-nodes", "2", *flags))
        return [e for e in training_errors(config) if e.startswith("--update-weight-target-module")]

    assert errors(*one_expert("transformer")) == [
        "--update-weight-target-module transformer: training part of the wan2_2 family's denoisers (transformer_2 "
        "frozen) runs on one data-parallel rank in this version, and the data-parallel size is 2 (the ranks' shares would "
        "hold different numbers of trainable steps, so their micro-batch plans would differ); train every denoiser, or "
        "use one data-parallel rank (sequence parallelism is fine)"
    ]
    # Controls: both experts on two ranks, and one expert on two sequence-parallel ranks (one data-parallel rank).
    assert errors("--diffusion-guidance-scale-2", "3.0") == []
    assert errors(*one_expert("transformer"), "--sequence-parallel-size", "2", "--ulysses-degree", "2") == []
