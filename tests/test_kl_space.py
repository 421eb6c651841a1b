"""The KL term's two spaces (``--kl-space``) and DiffusionNFT's KL (``--diffusion-kl-beta``
with nft): the formulas, and runs on the tiny SD3 pipeline where the policy starts as its
reference (LoRA's B = 0), so the first step's KL is exactly 0 and a trained one is not."""

from __future__ import annotations

import pytest
import torch

from miles_core.losses import flow_grpo_loss, kl_penalty, nft, policy_loss, velocity_kl
from tests.tiny_runs import run_metrics, tiny_run_args


class Flags:
    diffusion_clip_range = 0.2
    diffusion_adv_clip_max = 5.0
    diffusion_kl_beta = 0.5
    diffusion_nft_beta = 1.0
    no_diffusion_nft_adaptive_weight = False


def test_velocity_kl_is_the_mean_squared_velocity_difference():
    g = torch.Generator().manual_seed(0)
    v, ref = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    expected = ((v.double() - ref.double()) ** 2).flatten(1).mean(1)
    assert torch.allclose(velocity_kl(v, ref).double(), expected, rtol=1e-6)
    assert torch.equal(velocity_kl(v, v), torch.zeros(3))


def test_policy_loss_takes_its_kl_term_in_the_space_the_batch_carries():
    g = torch.Generator().manual_seed(1)
    base = {"log_prob": torch.randn(4, generator=g), "old_log_prob": torch.randn(4, generator=g), "advantages": torch.randn(4, generator=g)}
    v, v_ref = torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, 2, 3, 3, generator=g)
    loss, metrics = policy_loss({**base, "velocity": v, "ref_velocity": v_ref}, Flags())
    plain, _ = flow_grpo_loss(base["log_prob"], base["old_log_prob"], base["advantages"], clip_range=0.2, adv_clip_max=5.0)
    kl = ((v.double() - v_ref.double()) ** 2).flatten(1).mean(1).mean()
    assert torch.allclose(loss.double(), plain.double() + 0.5 * kl, rtol=1e-6)
    assert torch.allclose(metrics["kl_loss"].double(), kl, rtol=1e-6)
    # Latent space: mean((mu - mu_ref)^2) / (2 s^2), as before.
    mean, ref_mean, s = v, v_ref, torch.full((4,), 0.3)
    latent, _ = policy_loss({**base, "mean": mean, "ref_mean": ref_mean, "std": s}, Flags())
    expected = ((mean.double() - ref_mean.double()) ** 2 / (2 * 0.3**2)).flatten(1).mean(1).mean()
    assert torch.allclose(latent.double(), plain.double() + 0.5 * expected, rtol=1e-6)
    assert torch.equal(kl_penalty({"velocity": v, "ref_velocity": v}), torch.zeros(4))
    with pytest.raises(KeyError, match=r"policy_loss loss needs batch key 'ref_mean'"):
        policy_loss({**base, "mean": mean, "std": s}, Flags())


def test_nft_adds_diffusion_nft_kl_against_the_base_model():
    g = torch.Generator().manual_seed(2)
    batch = {k: torch.randn(3, 2, 4, 4, generator=g) for k in ("v_new", "v_old", "x_t", "x0", "v_ref")}
    batch.update(sigma=torch.tensor([0.2, 0.5, 0.9]), advantages=torch.tensor([1.0, -0.5, 0.0]))
    flags = Flags()
    with_kl, metrics = nft(batch, flags)
    flags.diffusion_kl_beta = 0.0
    without, _ = nft(batch, flags)
    kl = ((batch["v_new"].double() - batch["v_ref"].double()) ** 2).flatten(1).mean(1).mean()
    assert torch.allclose((with_kl - without).double(), 0.5 * kl, rtol=1e-5)
    assert torch.allclose(metrics["kl_loss"].double(), kl, rtol=1e-6)
    flags.diffusion_kl_beta = 0.5
    with pytest.raises(KeyError, match=r"nft loss needs batch key 'v_ref'"):
        nft({k: v for k, v in batch.items() if k != "v_ref"}, flags)


def _kl_per_step(records):
    return [r["train/kl_loss_per_step"] for r in records if "train/kl_loss_per_step" in r]


@pytest.mark.exercises("--kl-space")
@pytest.mark.parametrize("loss", ["policy_loss", "nft"])
def test_a_lora_run_starts_at_its_reference_and_leaves_it(tiny_sd3, prompts, tmp_path, loss):
    """LoRA's B starts at 0, so the first optimizer step's KL to the base model is exactly 0
    (the policy is the reference); after steps it is above 0 (the control: the term measures
    something)."""
    args = tiny_run_args(tiny_sd3, prompts, tmp_path / "run", batch=1, n=4, steps=3, sde_steps=1)
    args += ["--num-rollout", "2", "--num-steps-per-rollout", "2", "--global-batch-size", "2", "--use-lora", "--lora-rank", "4"]
    args += ["--lr", "3e-3", "--diffusion-kl-beta", "0.1", "--loss-type", loss, "--no-guard"]
    if loss == "policy_loss":
        args += ["--kl-space", "velocity"]
    steps = [value for per_rollout in _kl_per_step(run_metrics(args)) for value in per_rollout]
    assert len(steps) == 4
    assert steps[0] == 0.0
    assert steps[-1] > 0.0
