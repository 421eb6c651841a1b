"""What the trainer hands a plugin's loss: the ``preference_pairs`` batch (online DPO) and
the ``batch_keys`` of an ``sde_transitions`` loss (GRPO-Guard's old means), on the tiny SD3
pipeline with a spy loss that records each batch."""

from __future__ import annotations

import asyncio

import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.factory import create_engine
from miles_core.plugin_manager import get_host
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
from miles_core.training.trainer import Trainer


def trainer_and_rollout(tiny_sd3, loss: str, *extra: str):
    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "3",
            "--rollout-microgroup-size",
            "3",
            "--diffusion-num-steps",
            "4",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            "1e-2",
            "--loss-type",
            loss,
            *extra,
        ]
    )
    engine = create_engine(config)
    host = get_host()
    real = host.registries.loss.get(loss).load()
    batches: list[dict[str, torch.Tensor]] = []

    def spy(batch, cfg):
        batches.append({k: v.detach().clone() for k, v in batch.items()})
        return real(batch, cfg)

    trainer = Trainer(engine.family, config, host.registries.sde_backend.get(config.diffusion_sde_type).load(), spy)
    prompts = [PromptRecord("a red cube"), PromptRecord("a blue ball")]
    groups = asyncio.run(generate_rollout(engine, RolloutSettings.from_config(config), 0, prompts, strategy_from_config(config)))
    return engine, trainer, [s for g in groups for s in g], batches


def test_preference_pairs_share_noise_and_start_at_the_reference(tiny_sd3):
    engine, trainer, samples, batches = trainer_and_rollout(
        tiny_sd3, "flow_dpo", "--num-steps-per-rollout", "2", "--global-batch-size", "3", "--micro-batch-size", "1"
    )
    try:
        # Group 0: sample 1 best, 2 worst; group 1: 3 best, 5 worst.
        advantages = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -2.0])
        metrics = trainer.train_preferences(samples, advantages)
        assert metrics["train/num_pairs"] == 2 and len(batches) == 2  # one pair per optimizer step
        for batch, (chosen, rejected) in zip(batches, [(1, 2), (3, 5)]):
            x0 = {i: samples[i].output.dit_trajectory["latents"][-1] for i in (chosen, rejected)}
            # Both rows re-noised with one noise: target + x0 is that noise, the same for both.
            noise_c = batch["target_chosen"][0] + x0[chosen]
            noise_r = batch["target_rejected"][0] + x0[rejected]
            assert torch.allclose(noise_c, noise_r, atol=1e-6)
            assert not torch.allclose(x0[chosen], x0[rejected], atol=1e-3)  # control: different samples
            assert batch["sigma"].shape == (1,) and 0 < float(batch["sigma"][0]) <= 1
        # The first step: LoRA's B is 0, so the policy is its reference bit for bit.
        assert torch.equal(batches[0]["v_chosen"], batches[0]["ref_v_chosen"])
        assert torch.equal(batches[0]["v_rejected"], batches[0]["ref_v_rejected"])
        # Control: after one optimizer step the policy has moved away from it.
        assert not torch.equal(batches[1]["v_chosen"], batches[1]["ref_v_chosen"])
    finally:
        asyncio.run(engine.close())


def test_old_means_are_the_rollouts_own_forward(tiny_sd3):
    steps = 2
    engine, trainer, samples, batches = trainer_and_rollout(
        tiny_sd3,
        "grpo_guard",
        "--diffusion-num-sde-steps",
        "2",
        "--num-steps-per-rollout",
        str(steps),
        "--global-batch-size",
        str(6 // steps),
        "--micro-batch-size",
        "4",
    )
    try:
        trainer.train_rollout(samples, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.2, -0.2]))
        first = batches[0]
        # Before any update the old means are the same forward's, bit for bit.
        assert torch.equal(first["mean"], first["old_mean"])
        # The transition std is s * sqrt(-dt) of Flow-GRPO's SDE at each pair's sigmas.
        sigma, sigma_next = first["sigma"].double(), first["sigma_next"].double()
        # At sigma = 1 Flow-GRPO's denominator takes the schedule's second sigma.
        sigma_max = float(samples[0].output.dit_trajectory["sigmas"][1])
        s = 0.7 * torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)))
        expected = (s * torch.sqrt(sigma - sigma_next)).reshape(-1, 1, 1, 1)
        assert torch.allclose(first["transition_std"].double(), expected, rtol=1e-5)
        assert not trainer.old_means  # released with the rollout
        # Control: the second optimizer step's policy has moved from the old one.
        assert not torch.equal(batches[-1]["mean"], batches[-1]["old_mean"])
    finally:
        asyncio.run(engine.close())
