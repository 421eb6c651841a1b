"""Algorithm, reward, LoRA and EMA flags checked where no older test pinned them: each
test resolves a real command line and observes the flag's effect (a loss value, the
steps a trainer trains on, the reference policy it compares to, the reward a sample
gets, the adapter PEFT builds) with a control that shows the effect is the flag's.

Trainer tests use one tiny rollout of the tiny SD3 pipeline (1 prompt x 2 samples,
4 steps, 32x32) and ``--debug-skip-optimizer-step`` where no update is needed."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_core.losses import nft, policy_loss
from tests.test_losses import nft_inputs, nft_reference

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1"]
ADVANTAGES = torch.tensor([1.0, -1.0])


def resolve(*argv):
    return resolve_config([*SD35, *argv])


def tiny_config(tiny_sd3, *extra):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            "4",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            *extra,
        ]
    )


def rollout_and_trainer(config, loss_fn=None):
    """A fresh embedded engine (the trainer adds adapters to its modules), one rollout
    of one prompt, and a trainer on the engine's modules with the configured loss."""
    from miles_core.engine.factory import create_engine, sde_backend
    from miles_core.plugin_manager import get_host
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
    from miles_core.training.trainer import Trainer

    engine = create_engine(config)
    (group,) = asyncio.run(
        generate_rollout(engine, RolloutSettings.from_config(config), 0, [PromptRecord("a red cube")], strategy_from_config(config))
    )
    loss_fn = loss_fn or get_host().registries.loss.get(config.loss_type).load()
    return group, Trainer(engine.family, config, sde_backend(config), loss_fn)


# ------------------------------------------------------------------ advantage estimator
@pytest.mark.exercises("--advantage-estimator")
def test_advantage_estimator_accepts_only_grpo(capsys):
    assert resolve("--advantage-estimator", "grpo").advantage_estimator == "grpo"
    with pytest.raises(SystemExit) as caught:
        resolve("--advantage-estimator", "reinforce_plus_plus")
    assert caught.value.code == 2
    assert "--advantage-estimator: invalid choice: 'reinforce_plus_plus' (choose from 'grpo')" in capsys.readouterr().err


# ------------------------------------------------------------------------- loss flags
@pytest.mark.exercises("--diffusion-adv-clip-max")
def test_adv_clip_max_clamps_policy_loss_advantages_and_sets_the_nft_slope():
    # Identical log-probs (ratio 1): the policy loss is -mean(clamp(A, +-C)).
    logp = torch.tensor([-1.0, 0.5, 2.0])
    batch = {"log_prob": logp, "old_log_prob": logp.clone(), "advantages": torch.tensor([10.0, -10.0, 1.0])}
    loss, _ = policy_loss(batch, resolve("--diffusion-adv-clip-max", "2"))
    assert loss.item() == pytest.approx(-(2.0 - 2.0 + 1.0) / 3)
    loss, _ = policy_loss(batch, resolve())  # control: the default C = 5
    assert loss.item() == pytest.approx(-(5.0 - 5.0 + 1.0) / 3)
    # Under nft, C is both the clamp and the advantage-to-r slope: r = clamp(A, +-C) / 2C + 1/2.
    v_new, v_old, x_t, x0, sigma, adv = nft_inputs()
    nft_batch = dict(v_new=v_new, v_old=v_old, x_t=x_t, x0=x0, sigma=sigma, advantages=adv)
    loss, _ = nft(nft_batch, resolve("--loss-type", "nft", "--diffusion-adv-clip-max", "0.5"))
    expected = nft_reference(v_new, v_old, x_t, x0, sigma, adv, 1.0, 0.5, True)[0]
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(nft_reference(v_new, v_old, x_t, x0, sigma, adv, 1.0, 5.0, True)[0], rel=1e-3)
    with pytest.raises(ConfigError, match="--diffusion-adv-clip-max 0.0: must be positive"):
        resolve("--diffusion-adv-clip-max", "0")


@pytest.mark.exercises("--diffusion-nft-timestep-fraction")
def test_nft_timestep_fraction_sets_the_steps_each_sample_trains_on(tiny_sd3):
    # int(T x fraction) of the T = 4 schedule steps per sample, at least 1.
    for fraction, per_sample in (("0.5", 2), ("1.0", 4), ("0.2", 1)):
        sigmas: list[float] = []

        def recording(batch, config):
            sigmas.extend(batch["sigma"].tolist())
            return nft(batch, config)

        config = tiny_config(
            tiny_sd3,
            "--loss-type",
            "nft",
            "--diffusion-nft-timestep-fraction",
            fraction,
            "--micro-batch-size",
            "16",
            "--debug-skip-optimizer-step",
        )
        group, trainer = rollout_and_trainer(config, recording)
        trainer.train_nft(group, ADVANTAGES)
        assert len(sigmas) == 2 * per_sample, fraction
    with pytest.raises(ConfigError, match=r"--diffusion-nft-timestep-fraction 0.0: must be in \(0, 1\]"):
        resolve("--diffusion-nft-timestep-fraction", "0")


@pytest.mark.exercises("--no-diffusion-nft-shuffle-timesteps")
def test_nft_timesteps_are_shuffled_unless_turned_off(tiny_sd3):
    def trained_sigmas(*extra):
        seen: list[list[float]] = []

        def recording(batch, config):
            seen.append(batch["sigma"].tolist())
            return nft(batch, config)

        config = tiny_config(tiny_sd3, "--loss-type", "nft", "--micro-batch-size", "1", "--debug-skip-optimizer-step", *extra)
        group, trainer = rollout_and_trainer(config, recording)
        trainer.train_nft(group, ADVANTAGES)
        schedule = [float(s) for s in group[0].output.dit_trajectory["sigmas"][:4].float()]
        per_sample = len(seen) // 2
        return [sum(seen[i * per_sample : (i + 1) * per_sample], []) for i in range(2)], schedule

    # In order: the first int(4 x 0.5) = 2 schedule steps (the noisiest), for every sample.
    ordered, schedule = trained_sigmas("--no-diffusion-nft-shuffle-timesteps", "--diffusion-nft-timestep-fraction", "0.5")
    assert ordered == [schedule[:2], schedule[:2]]
    ordered, _ = trained_sigmas("--no-diffusion-nft-shuffle-timesteps", "--diffusion-nft-timestep-fraction", "1.0")
    assert ordered == [schedule, schedule]
    # Shuffled (the default, same seed): each sample a permutation of the schedule, not all in order.
    shuffled, _ = trained_sigmas("--diffusion-nft-timestep-fraction", "1.0")
    assert all(sorted(s, reverse=True) == schedule for s in shuffled)
    assert shuffled != ordered


@pytest.mark.exercises("--diffusion-recompute-old-log-prob")
def test_recompute_old_log_prob_replaces_the_engine_log_probs(tiny_sd3):
    def metrics(*extra):
        config = tiny_config(tiny_sd3, "--diffusion-num-sde-steps", "2", "--debug-skip-optimizer-step", *extra)
        group, trainer = rollout_and_trainer(config)
        for sample in group:  # the engine's log-probs, off by 0.5: only a recomputation ignores them
            sample.output.rollout_log_probs = sample.output.rollout_log_probs + 0.5
        return trainer.train_rollout(group, ADVANTAGES)

    recomputed = metrics("--diffusion-recompute-old-log-prob")
    assert recomputed["train/log_prob_max_abs_diff"] == 0.0 and recomputed["train/ratio_mean"] == 1.0
    engine = metrics()  # control: the shifted engine log-probs are the old policy
    assert engine["train/log_prob_mean_abs_diff"] == pytest.approx(0.5, abs=1e-3)
    assert engine["train/ratio_mean"] == pytest.approx(math.exp(-0.5), rel=1e-3)  # exp(new - old)
    with pytest.raises(ConfigError, match="--diffusion-recompute-old-log-prob applies to --loss-type policy_loss only"):
        resolve("--loss-type", "nft", "--diffusion-recompute-old-log-prob")


@pytest.mark.exercises("--ref-mode")
def test_ref_mode_chooses_the_policy_the_kl_term_compares_to(tiny_sd3):
    """The live LoRA moved away from the base and the EMA set to it (decay 0): the KL to
    the EMA (``--ref-mode ema``) is zero, the KL to the LoRA-disabled model
    (``--ref-mode lora_base``) is not."""

    def kl(mode, *extra):
        config = tiny_config(
            tiny_sd3,
            "--diffusion-num-sde-steps",
            "2",
            "--debug-skip-optimizer-step",
            "--use-lora",
            "--lora-rank",
            "2",
            "--diffusion-kl-beta",
            "0.04",
            "--ref-mode",
            mode,
            *extra,
        )
        group, trainer = rollout_and_trainer(config)
        assert trainer.reference_mode() == mode
        live = trainer.named_trainable()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in live.items():
                if "lora_B" in name:
                    parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        if trainer.ema is not None:
            assert trainer.ema.update(live, 0) == 0.0  # the EMA is now the live weights
        return trainer.train_rollout(group, ADVANTAGES)["train/kl_loss"]

    assert kl("ema", "--use-ema", "--ema-decay-init", "0") == 0.0
    assert kl("lora_base") > 1e-8


@pytest.mark.exercises("--loss-type", "--custom-loss-function-path")
def test_custom_loss_function_path_is_the_trainers_loss(tiny_sd3):
    calls.clear()
    config = tiny_config(
        tiny_sd3,
        "--diffusion-num-sde-steps",
        "2",
        "--debug-skip-optimizer-step",
        "--loss-type",
        "custom_loss",
        "--custom-loss-function-path",
        f"{__name__}.scaled_policy_loss",
    )
    group, trainer = rollout_and_trainer(config)  # the loss the run loads for --loss-type
    metrics = trainer.train_rollout(group, ADVANTAGES)
    assert calls and all(cfg is config for cfg in calls)
    assert metrics["train/custom_scale"] == 3.0
    # ratio 1 (no update, the engine's log-probs): the policy loss is -mean(A) = 0, tripled.
    assert metrics["train/loss"] == pytest.approx(0.0, abs=1e-6)


calls: list = []


def scaled_policy_loss(batch, config):
    calls.append(config)
    loss, metrics = policy_loss(batch, config)
    return 3.0 * loss, {**metrics, "custom_scale": torch.tensor(3.0)}


# ---------------------------------------------------------------------------- rewards
def _samples():
    # One image: R = 1, G = 0.5, B = 0 everywhere.
    pixels = torch.stack([torch.ones(8, 8), torch.full((8, 8), 0.5), torch.zeros(8, 8)])
    return [
        SimpleNamespace(pixels=pixels, prompt="a red cube", metadata={}, reward=None),
        SimpleNamespace(pixels=torch.zeros(3, 8, 8), prompt="night", metadata={}, reward=None),
    ]


@pytest.mark.exercises("--rm-type")
def test_rm_type_selects_the_reward_samples_get():
    from miles_core.errors import RewardError
    from miles_core.training.rewards import RewardScorer

    samples = _samples()
    rewards = asyncio.run(RewardScorer(resolve("--rm-type", "brightness")).score(samples))
    assert rewards.tolist() == pytest.approx([0.5, 0.0]) and samples[0].reward == pytest.approx(0.5)
    rewards = asyncio.run(RewardScorer(resolve("--rm-type", "redness")).score(_samples()))
    assert rewards.tolist() == pytest.approx([1.0 - 0.25, 0.0])  # mean(R - (G + B) / 2)
    with pytest.raises(RewardError, match="no reward: set --rm-type"):
        RewardScorer(resolve())


async def prompt_length_rm(args, samples):
    return [float(len(s.prompt)) + args.lr for s in samples]


@pytest.mark.exercises("--custom-rm-path")
def test_custom_rm_path_scores_the_samples():
    from miles_core.training.rewards import RewardScorer

    samples = _samples()
    config = resolve("--custom-rm-path", f"{__name__}.prompt_length_rm", "--lr", "0.5")
    rewards = asyncio.run(RewardScorer(config).score(samples))
    assert rewards.tolist() == [10.5, 5.5] and [s.reward for s in samples] == [10.5, 5.5]


# ------------------------------------------------------------------------------- LoRA
@pytest.mark.exercises("--use-lora", "--lora-rank", "--lora-alpha", "--lora-target-modules", "--lora-init-weights")
def test_lora_flags_shape_and_initialise_the_adapter(tiny_sd3):
    from peft.tuners.lora import LoraLayer

    def adapter(*extra):
        config = tiny_config(tiny_sd3, "--diffusion-num-sde-steps", "2", *extra)
        _, trainer = rollout_and_trainer(config)
        module = trainer.modules["transformer"]
        layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
        return trainer, module, layers

    trainer, module, layers = adapter(
        "--use-lora",
        "--lora-rank",
        "3",
        "--lora-alpha",
        "12",
        "--lora-target-modules",
        "attn.to_q",
        "attn.to_v",
        "--lora-init-weights",
        "kaiming-uniform",
    )
    peft = module.peft_config["default"]
    assert (peft.r, peft.lora_alpha, set(peft.target_modules)) == (3, 12, {"attn.to_q", "attn.to_v"})
    assert layers and {name.rsplit(".", 1)[1] for name in layers} == {"to_q", "to_v"}
    assert all(".attn." in f".{name}" for name in layers)
    for layer in layers.values():
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        assert a.shape[0] == 3 and b.shape[1] == 3 and layer.scaling["default"] == 12 / 3
        # kaiming-uniform (PEFT's True): A ~ U(+-1/sqrt(fan_in)), B = 0.
        assert float(a.abs().max()) <= 1 / math.sqrt(a.shape[1]) and not b.any()
    assert all("lora_" in name for name in trainer.named_trainable())  # only the adapter trains

    _, _, gaussian = adapter("--use-lora", "--lora-rank", "3", "--lora-target-modules", "attn.to_q", "attn.to_v")
    a = torch.cat([layer.lora_A["default"].weight.detach().flatten() for layer in gaussian.values()])
    fan_in = next(iter(gaussian.values())).lora_A["default"].weight.shape[1]
    # The default, gaussian: A ~ N(0, (1/r)^2), which exceeds the kaiming bound.
    assert float(a.std()) == pytest.approx(1 / 3, rel=0.2) and float(a.abs().max()) > 1 / math.sqrt(fan_in)

    full, module, layers = adapter()  # control: without --use-lora the whole transformer trains, no adapter
    assert not layers and not getattr(module, "peft_config", None)
    assert len(full.named_trainable()) == len(list(module.parameters()))
