"""Trainer-side hooks and options on the tiny SD3 pipeline: denoiser (expert) grouping of
micro-batches, the data-parallel split, the sample-to-pair and batch-preparation hooks,
gradient checkpointing and the attention backend."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.family import GenerationParams
from miles_core.plugin_manager import get_host
from miles_core.training.advantages import advantages_from_config
from miles_core.training.data_parallel import shard_for_rank
from miles_core.training.pairs import TrainPair, build_pairs, collate, micro_batches, on_device
from miles_core.training.trainer import Trainer
from miles_sd3.family import SD3Family

PROBE = ("--debug-skip-optimizer-step", "--diffusion-debug-mode")
TILE = ("--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "1")
"""One step of one microgroup per micro-batch: the engine's own batches."""


def make_config(checkpoint, *extra: str, family: tuple[str, ...] = ("--diffusion-model-family", "sd3")) -> Any:
    return resolve_config(
        [
            "--hf-checkpoint",
            str(checkpoint),
            *family,
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            "4",
            "--diffusion-num-sde-steps",
            "3",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            *extra,
        ]
    )


def make_trainer(family, config, **kwargs) -> Trainer:
    host = get_host()
    return Trainer(
        family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
        **kwargs,
    )


def generate(family, checkpoint) -> tuple[list, torch.Tensor]:
    """One rollout (2 prompts x 4 samples, microgroups of 2, SDE steps 0-2 of 4) with
    engine debug tensors; rewards set to the sample index."""
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config

    config = make_config(checkpoint, "--diffusion-debug-mode")
    groups = asyncio.run(
        generate_rollout(
            EmbeddedEngine(family),
            RolloutSettings.from_config(config),
            0,
            [PromptRecord("a red cube"), PromptRecord("a blue ball")],
            strategy_from_config(config),
        )
    )
    samples = [s for group in groups for s in group]
    for i, sample in enumerate(samples):
        sample.reward = float(i % 3)
    rewards = torch.tensor([s.reward for s in samples])
    return samples, advantages_from_config(rewards, config, samples)


@pytest.fixture(scope="module")
def rollout(tiny_sd3):
    return generate(SD3Family.from_pretrained(tiny_sd3), tiny_sd3)


# -- two experts ---------------------------------------------------------------------

BOUNDARY = 700.0
"""The tiny schedule's timesteps are 1000, 857.7, 602.2, 8.9: SDE steps 0 and 1 go to
``transformer``, step 2 to ``transformer_2``."""


class _PipelineWith:
    """The pipeline with another module as its transformer (no shared state is swapped,
    so concurrent requests stay safe)."""

    def __init__(self, base: Any, transformer: torch.nn.Module) -> None:
        self._base = base
        self.transformer = transformer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


TWO_EXPERTS = {"family": ("--train-pipeline-config-path", f"{__name__}.TwoExpertSD3")}
"""make_config's family for :class:`TwoExpertSD3`: a class of one's own names its own
components, so ``--update-weight-target-module transformer,transformer_2`` resolves."""
BOTH = ("--update-weight-target-module", "transformer,transformer_2")


class TwoExpertSD3(SD3Family):
    """SD3 laid out like Wan 2.2: a second, different transformer denoises the timesteps
    below a boundary. Its predict refuses a batch that mixes the two experts."""

    def __init__(self, pipeline: Any, **kwargs: Any) -> None:
        super().__init__(pipeline, **kwargs)
        self.transformer_2 = copy.deepcopy(pipeline.transformer)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for parameter in self.transformer_2.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))

    def components(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.pipeline.transformer, "transformer_2": self.transformer_2}

    def denoiser_for(self, timestep: torch.Tensor | float, params: GenerationParams) -> str:
        return "transformer" if float(timestep) >= BOUNDARY else "transformer_2"

    def predict(self, latents, timestep, cond, params):
        names = {self.denoiser_for(t, params) for t in torch.as_tensor(timestep).reshape(-1).tolist()}
        if len(names) != 1:
            raise AssertionError(f"one forward mixes the experts {sorted(names)}")
        view = copy.copy(self)
        view.pipeline = _PipelineWith(self.pipeline, self.components()[names.pop()])
        return SD3Family.predict(view, latents, timestep, cond, params)


@pytest.fixture(scope="module")
def expert_rollout(tiny_sd3):
    """The family, the alignment probe's trainer on it (both experts) and a rollout. The
    trainer comes first, as in a run: it sets which parameters require a gradient, and
    that flag picks some of torch's kernels even without autograd (a strided batch times a
    weight that requires a gradient is folded into one GEMM, else run as a batched GEMM),
    so the engine must sample with it."""
    family = TwoExpertSD3.from_pretrained(tiny_sd3)
    probe = make_trainer(family, make_config(tiny_sd3, *PROBE, *TILE, *BOTH, **TWO_EXPERTS))
    return family, probe, *generate(family, tiny_sd3)


def test_the_default_denoiser_is_the_first_trainable_component(tiny_sd3, rollout):
    family = SD3Family.from_pretrained(tiny_sd3)
    samples, advantages = rollout
    assert family.denoiser_for(torch.tensor(1000.0), None) == "transformer"
    pairs = build_pairs(None, samples, advantages, family)
    assert {p.denoiser for p in pairs} == {"transformer"}


def _pair(sample: int, step: int, denoiser: str) -> TrainPair:
    params = GenerationParams(height=32, width=32, num_inference_steps=4, guidance_scale=1.0)
    x = {"latents": torch.zeros(1)}
    return TrainPair(sample, step, x, x, torch.tensor(0.0), 0.5, 0.4, 0.9, 0.0, 0.0, None, params, denoiser=denoiser)


@pytest.mark.exercises("--micro-batch-size", "--micro-batch-size-sample", "--micro-batch-size-tstep")
def test_micro_batches_never_mix_denoisers():
    expert = {0: "transformer", 1: "transformer", 2: "transformer_2"}
    pairs = [_pair(s, k, expert[k]) for s in range(4) for k in range(3)]
    flat = SimpleNamespace(micro_batch_size=4, micro_batch_size_sample=None)
    batches = micro_batches(pairs, flat)
    assert [[(p.sample_index, p.step) for p in b] for b in batches][:3] == [[(0, 0), (0, 1)], [(0, 2)], [(1, 0), (1, 1)]]
    assert sum(len(b) for b in batches) == len(pairs)
    tile = SimpleNamespace(micro_batch_size_sample=2, micro_batch_size_tstep=3, diffusion_train_iter_order="sample_major")
    batches = micro_batches(pairs, tile)
    # A 2-sample x 3-step tile across the boundary: its two experts' rows, in tile order.
    assert [[(p.sample_index, p.step) for p in b] for b in batches][:2] == [
        [(0, 0), (1, 0), (0, 1), (1, 1)],
        [(0, 2), (1, 2)],
    ]
    for batch in batches:
        assert len({p.denoiser for p in batch}) == 1
    # Control: the same pairs with one denoiser make whole tiles.
    same = [_pair(s, k, "transformer") for s in range(4) for k in range(3)]
    assert [len(b) for b in micro_batches(same, tile)] == [6, 6]


@pytest.mark.exercises("--micro-batch-size", "--update-weight-target-module", "--use-lora", "--use-ema")
def test_two_experts_align_exactly_and_both_train(tiny_sd3, expert_rollout):
    family, probe, samples, advantages = expert_rollout
    # Control: the test family does refuse a batch across the boundary.
    pair_rows = build_pairs(None, samples[:1], advantages[:1], family)
    assert [p.denoiser for p in pair_rows] == ["transformer", "transformer", "transformer_2"]
    data = collate(pair_rows)
    with pytest.raises(AssertionError, match="mixes the experts"):
        family.predict(data["x"], data["timestep"], data["cond"], data["params"])

    # The alignment probe through the engine's own family: exact with each expert.
    metrics = probe.train_rollout(samples, advantages)
    assert metrics["train/log_prob_max_abs_diff"] == 0.0 and metrics["train/model_output_max_abs_diff"] == 0.0
    # Flat micro-batches of 3 consecutive pairs would span the boundary: they are cut there.
    flat = make_trainer(family, make_config(tiny_sd3, *PROBE, "--micro-batch-size", "3", *BOTH, **TWO_EXPERTS))
    assert flat.train_rollout(samples, advantages)["train/num_pairs"] == 24
    batches = micro_batches(flat.last_pairs, flat.config)
    assert all(len({p.denoiser for p in b}) == 1 for b in batches)
    assert {p.denoiser for p in flat.last_pairs} == {"transformer", "transformer_2"}
    # One expert trained (sd3's default target): the other's steps are left out and counted.
    one = make_trainer(family, make_config(tiny_sd3, *PROBE, *TILE))
    metrics = one.train_rollout(samples, advantages)
    assert (metrics["train/num_pairs"], metrics["train/num_pairs_frozen"]) == (16, 8)
    assert {p.denoiser for p in one.last_pairs} == {"transformer"} and metrics["train/log_prob_max_abs_diff"] == 0.0

    # Training LoRA on both experts (a fresh family: the probe's shares the engine's modules).
    fresh = TwoExpertSD3.from_pretrained(tiny_sd3)
    trainer = make_trainer(
        fresh,
        make_config(
            tiny_sd3,
            "--micro-batch-size",
            "3",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            "1e-2",
            "--use-ema",
            "--ema-rollout-policy",
            "ema",
            *BOTH,
            **TWO_EXPERTS,
        ),
    )
    before = {k: v.detach().clone() for k, v in trainer.named_trainable().items()}
    assert {k.split(".")[0] for k in before} == {"transformer", "transformer_2"}
    metrics = trainer.train_rollout(samples, advantages)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    after = trainer.named_trainable()
    for component in ("transformer", "transformer_2"):
        changed = [k for k in before if k.startswith(component + ".") and not torch.equal(before[k], after[k])]
        assert changed, f"{component} did not train"
    assert set(trainer.ema.shadow) == set(before)
    assert set(trainer.trainable_state()) == {"transformer", "transformer_2"}


# -- data-parallel split ---------------------------------------------------------------


@pytest.mark.exercises("--train-dp-split-mode")
@pytest.mark.parametrize("world", [2, 4])
def test_dp_split_modes(world):
    items = list(range(8))  # microgroups of 2: (0, 1), (2, 3), ...
    contiguous = [shard_for_rank(items, r, world, "contiguous") for r in range(world)]
    stride = [shard_for_rank(items, r, world, "stride") for r in range(world)]
    for shares in (contiguous, stride):
        assert sorted(x for share in shares for x in share) == items
        assert all(len(share) == 8 // world for share in shares)
    assert contiguous[1] == list(range(8 // world, 2 * (8 // world)))
    assert stride[1] == list(range(1, 8, world))
    rank_of = {x: r for r, share in enumerate(contiguous) for x in share}
    assert all(rank_of[2 * g] == rank_of[2 * g + 1] for g in range(4))  # microgroups stay whole
    rank_of = {x: r for r, share in enumerate(stride) for x in share}
    assert all(rank_of[2 * g] != rank_of[2 * g + 1] for g in range(4))  # dealt round-robin


@pytest.mark.exercises("--train-dp-split-mode")
def test_dp_split_rejects_uneven_counts_and_bad_ranks():
    with pytest.raises(ValueError) as error:
        shard_for_rank(list(range(6)), 0, 4, "stride")
    assert str(error.value) == (
        "--train-dp-split-mode stride: 6 samples do not split evenly over 4 data-parallel ranks (6 % 4 = 2); "
        "--global-batch-size must be a multiple of the data-parallel size"
    )
    with pytest.raises(ValueError, match=r"^--train-dp-split-mode contiguous: data-parallel rank 2 is not in \[0, 2\)"):
        shard_for_rank(list(range(4)), 2, 2, "contiguous")
    with pytest.raises(ValueError, match="^--train-dp-split-mode random: must be one of contiguous, stride$"):
        shard_for_rank(list(range(4)), 0, 2, "random")


@pytest.mark.exercises("--train-dp-split-mode", "--num-steps-per-rollout")
@pytest.mark.parametrize("mode, expected", [("contiguous", [2, 3, 6, 7]), ("stride", [1, 3, 5, 7])])
def test_the_trainer_trains_its_ranks_share(tiny_sd3, rollout, mode, expected):
    samples, advantages = rollout
    config = make_config(tiny_sd3, *PROBE, *TILE, "--num-steps-per-rollout", "2", "--train-dp-split-mode", mode)
    config.data_parallel_size = 2  # what a two-rank run resolves; this process plays rank 1
    trainer = make_trainer(SD3Family.from_pretrained(tiny_sd3), config, dp_rank=1)
    metrics = trainer.train_rollout(samples, advantages)
    assert sorted({p.sample_index for p in trainer.last_pairs}) == expected
    assert metrics["train/num_pairs"] == 12
    if mode == "contiguous":
        # Whole microgroups on the rank: its tiles are the engine's batches, bit for bit.
        assert metrics["train/log_prob_max_abs_diff"] == 0.0


# -- sample-to-pair hooks ------------------------------------------------------------------


def expand_first_step_flipped(config, samples, advantages, family):
    """Only SDE step 0 of each sample, with the advantage's sign flipped."""
    return [p for p in build_pairs(config, samples, -advantages, family) if p.step == 0]


def expand_without_denoiser(config, samples, advantages, family):
    pairs = build_pairs(config, samples, advantages, family)
    for pair in pairs:
        pair.denoiser = None
    return pairs


def expand_dict(config, samples, advantages, family):
    return {"train_data": []}


def expand_out_of_range(config, samples, advantages, family):
    pairs = build_pairs(config, samples, advantages, family)
    pairs[0].sample_index = len(samples)
    return pairs


def expand_duplicate(config, samples, advantages, family):
    pairs = build_pairs(config, samples, advantages, family)
    return pairs + pairs[:1]


def expand_unknown_denoiser(config, samples, advantages, family):
    pairs = build_pairs(config, samples, advantages, family)
    pairs[0].denoiser = "transformer_9"
    return pairs


def convert_rank_advantages(config, samples, family):
    """Advantages from the reward's rank in the whole rollout, not GRPO."""
    rewards = torch.tensor([s.reward + 0.01 * i for i, s in enumerate(samples)])
    ranks = rewards.argsort().argsort().to(torch.float32)
    return build_pairs(config, samples, ranks - ranks.mean(), family)


HERE = __name__


@pytest.mark.exercises("--custom-expand-samples-to-train-pairs-path")
def test_expand_hook_replaces_the_pair_expansion(tiny_sd3, rollout):
    samples, advantages = rollout
    config = make_config(tiny_sd3, *PROBE, "--custom-expand-samples-to-train-pairs-path", f"{HERE}.expand_first_step_flipped")
    trainer = make_trainer(SD3Family.from_pretrained(tiny_sd3), config)
    assert trainer.train_rollout(samples, advantages)["train/num_pairs"] == 8
    assert {p.step for p in trainer.last_pairs} == {0}
    assert [p.advantage for p in trainer.last_pairs] == pytest.approx((-advantages).tolist())
    # A pair left without a denoiser gets the family's.
    config = make_config(tiny_sd3, *PROBE, "--custom-expand-samples-to-train-pairs-path", f"{HERE}.expand_without_denoiser")
    trainer = make_trainer(SD3Family.from_pretrained(tiny_sd3), config)
    assert trainer.train_rollout(samples, advantages)["train/num_pairs"] == 24
    assert {p.denoiser for p in trainer.last_pairs} == {"transformer"}


@pytest.mark.exercises("--custom-expand-samples-to-train-pairs-path")
@pytest.mark.parametrize(
    "hook, message",
    [
        ("expand_dict", "must return a list of TrainPair, got dict"),
        ("expand_out_of_range", "pair 0 has sample_index 8, not in [0, 8)"),
        ("expand_duplicate", "pair 24 repeats (sample 0, step 0); a pair is one transition"),
        ("expand_unknown_denoiser", "pair 0.denoiser 'transformer_9' is not a component of the family (transformer)"),
    ],
)
def test_expand_hook_results_are_checked(tiny_sd3, rollout, hook, message):
    samples, advantages = rollout
    path = f"{HERE}.{hook}"
    trainer = make_trainer(
        SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, *PROBE, "--custom-expand-samples-to-train-pairs-path", path)
    )
    with pytest.raises(ValueError) as error:
        trainer.train_rollout(samples, advantages)
    assert str(error.value) == f"--custom-expand-samples-to-train-pairs-path {path}: {message}"


@pytest.mark.exercises("--custom-convert-samples-to-train-data-path")
def test_convert_hook_replaces_advantages_and_expansion(tiny_sd3, rollout):
    samples, _ = rollout
    config = make_config(tiny_sd3, *PROBE, "--custom-convert-samples-to-train-data-path", f"{HERE}.convert_rank_advantages")
    trainer = make_trainer(SD3Family.from_pretrained(tiny_sd3), config)
    # The run's advantages (here all zero) are not used: the hook computes its own.
    trainer.train_rollout(samples, torch.zeros(len(samples)))
    expected = [a for a in convert_rank_advantages(config, samples, trainer.family)]
    assert [p.advantage for p in trainer.last_pairs] == [p.advantage for p in expected]
    assert any(p.advantage != 0 for p in trainer.last_pairs)


@pytest.mark.exercises("--custom-convert-samples-to-train-data-path", "--custom-expand-samples-to-train-pairs-path")
def test_convert_and_expand_hooks_exclude_each_other(tiny_sd3):
    config = make_config(
        tiny_sd3,
        "--custom-convert-samples-to-train-data-path",
        f"{HERE}.convert_rank_advantages",
        "--custom-expand-samples-to-train-pairs-path",
        f"{HERE}.expand_dict",
    )
    with pytest.raises(ValueError) as error:
        make_trainer(SD3Family.from_pretrained(tiny_sd3), config)
    assert str(error.value) == (
        f"--custom-convert-samples-to-train-data-path {HERE}.convert_rank_advantages: replaces the whole conversion, "
        f"pair expansion included; it cannot be combined with --custom-expand-samples-to-train-pairs-path {HERE}.expand_dict"
    )


@pytest.mark.exercises("--custom-expand-samples-to-train-pairs-path")
def test_pair_hooks_are_refused_under_nft(tiny_sd3):
    from miles_core.training.train_hooks import pair_source

    path = f"{HERE}.expand_first_step_flipped"
    config = make_config(tiny_sd3, "--loss-type", "nft", "--custom-expand-samples-to-train-pairs-path", path)
    with pytest.raises(ValueError) as error:
        pair_source(config, SD3Family.from_pretrained(tiny_sd3))
    assert str(error.value) == (
        f"--custom-expand-samples-to-train-pairs-path {path}: --loss-type nft does not train on (sample, SDE step) "
        "pairs; the hook applies to pair losses (policy_loss, custom_loss)"
    )


# -- batch preparation hook ---------------------------------------------------------------

PREPARED: list[int] = []


def prepare_shifted(batch, config):
    """collate, with every old log-prob raised by 1."""
    PREPARED.append(len(batch))
    data = collate(batch)
    data["old_log_prob"] = data["old_log_prob"] + 1.0
    return data


def prepare_without_cond(batch, config):
    data = collate(batch)
    del data["cond"], data["engine_velocity"]
    return data


def prepare_short_rows(batch, config):
    data = collate(batch)
    data["advantages"] = data["advantages"][:1]
    return data


@pytest.mark.exercises("--custom-prepare-train-batch-path")
def test_prepare_hook_builds_the_model_inputs(tiny_sd3, rollout):
    samples, advantages = rollout
    PREPARED.clear()
    config = make_config(tiny_sd3, *PROBE, *TILE, "--custom-prepare-train-batch-path", f"{HERE}.prepare_shifted")
    metrics = make_trainer(SD3Family.from_pretrained(tiny_sd3), config).train_rollout(samples, advantages)
    assert PREPARED == [2] * 12
    # The probe is exactly 0 with collate (test_training); the hook's shift shows through.
    assert metrics["train/log_prob_mean_abs_diff"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/model_output_max_abs_diff"] == 0.0


@pytest.mark.exercises("--custom-prepare-train-batch-path")
@pytest.mark.parametrize(
    "hook, message",
    [
        (
            "prepare_without_cond",
            "the returned batch lacks cond (needs x, x_next, timestep, sigma, sigma_next, "
            "old_log_prob, advantages, loss_mask, sigma_max, cond, params)",
        ),
        ("prepare_short_rows", "advantages must be a tensor with 2 rows (one per pair), got (1,)"),
    ],
)
def test_prepare_hook_results_are_checked(tiny_sd3, rollout, hook, message):
    samples, advantages = rollout
    path = f"{HERE}.{hook}"
    trainer = make_trainer(
        SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, *PROBE, *TILE, "--custom-prepare-train-batch-path", path)
    )
    with pytest.raises(ValueError) as error:
        trainer.train_rollout(samples, advantages)
    assert str(error.value) == f"--custom-prepare-train-batch-path {path}: {message}"


# -- gradient checkpointing and attention backend -----------------------------------------


def gradients(trainer: Trainer, batch: list[TrainPair]) -> dict[str, torch.Tensor]:
    trainer.optimizer.zero_grad(set_to_none=True)
    data = on_device(trainer.prepare(batch), trainer.family.device)
    log_prob = trainer._log_prob(data)[0]
    (log_prob * data["advantages"]).mean().backward()
    return {name: p.grad.clone() for name, p in trainer.named_trainable().items() if p.grad is not None}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-8) for k in a)


@pytest.mark.exercises("--gradient-checkpointing")
def test_gradient_checkpointing_recomputes_and_keeps_gradients(tiny_sd3, rollout):
    samples, advantages = rollout
    plain = make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3))
    checkpointed = make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, "--gradient-checkpointing"))
    assert checkpointed.modules["transformer"].is_gradient_checkpointing
    assert not plain.modules["transformer"].is_gradient_checkpointing
    pairs = plain.pairs_from(plain.config, samples, advantages)
    batch, other = pairs[:4], pairs[4:8]

    calls = []

    def counted(forward):
        # A wrapped forward, not a forward hook: torch runs no module hooks when it recomputes.
        def forward_counted(*args, **kwargs):
            calls.append(1)
            return forward(*args, **kwargs)

        return forward_counted

    for trainer in (plain, checkpointed):
        block = trainer.modules["transformer"].transformer_blocks[0]
        block.forward = counted(block.forward)
    expected = gradients(plain, batch)
    plain_calls, calls[:] = len(calls), []
    got = gradients(checkpointed, batch)
    assert (plain_calls, len(calls)) == (1, 2)  # the block's forward runs again in the backward
    assert len(expected) > 10 and close(expected, got)
    # Control: the comparison can fail; other pairs give other gradients.
    assert not close(expected, gradients(checkpointed, other))


@pytest.mark.exercises("--gradient-checkpointing")
def test_gradient_checkpointing_names_an_unsupported_component():
    from miles_core.training.backend_options import enable_gradient_checkpointing

    with pytest.raises(ValueError) as error:
        enable_gradient_checkpointing({"transformer_2": torch.nn.Linear(2, 2)})
    assert str(error.value) == (
        "--gradient-checkpointing: component transformer_2 (Linear) does not support gradient checkpointing "
        "(not a diffusers model with _supports_gradient_checkpointing)"
    )


@pytest.mark.exercises("--fsdp-attention-backend")
def test_attention_backend_native_keeps_outputs_and_bad_names_fail(tiny_sd3, rollout):
    samples, advantages = rollout
    plain = make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, *PROBE))
    native = make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, *PROBE, "--fsdp-attention-backend", "native"))
    batch = plain.pairs_from(plain.config, samples, advantages)[:4]
    with torch.no_grad():
        outputs = [t._log_prob(on_device(collate(batch), t.family.device))[1] for t in (plain, native)]
    assert torch.equal(*outputs)

    with pytest.raises(ValueError) as error:
        make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, "--fsdp-attention-backend", "bogus"))
    message = str(error.value)
    assert message.startswith("--fsdp-attention-backend bogus: unknown attention backend; diffusers offers ")
    assert "native" in message.split("offers ")[1].split(", ") and "\n" not in message
    # SD3's processors call torch's SDPA directly: another backend would do nothing.
    with pytest.raises(
        ValueError,
        match=r"^--fsdp-attention-backend _native_math: no attention processor of component "
        r"transformer \(SD3Transformer2DModel\) dispatches",
    ):
        make_trainer(SD3Family.from_pretrained(tiny_sd3), make_config(tiny_sd3, "--fsdp-attention-backend", "_native_math"))


@pytest.mark.exercises("--fsdp-attention-backend")
def test_attention_backend_reaches_dispatching_processors():
    """On a model whose processors dispatch (Wan's), the backend is set on each of them."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from miles_core.training.backend_options import set_attention_backend

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4, 1, 4, 4),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 3, 16),
        return_dict=False,
    )
    processors = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert processors and all(p._attention_backend is None for p in processors)
    with torch.no_grad():
        before = model(**inputs)[0]
    try:
        set_attention_backend({"transformer": model}, "_native_math")
        assert all(p._attention_backend == AttentionBackendName._NATIVE_MATH for p in processors)
        with torch.no_grad():
            after = model(**inputs)[0]
        assert torch.allclose(before, after, atol=1e-5)
    finally:
        # diffusers also made it the process-wide default: restore it for other tests.
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


@pytest.mark.exercises("--fsdp-attention-backend")
def test_a_bad_attention_backend_is_one_line_from_the_train_command(tiny_sd3, prompts, tmp_path, capsys):
    from miles_core.cli.main import main

    code = main(
        [
            "train",
            "--hf-checkpoint",
            str(tiny_sd3),
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "1",
            "--diffusion-num-sde-steps",
            "1",
            "--diffusion-num-steps",
            "2",
            "--fsdp-attention-backend",
            "warp_drive",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(
        "miles-core train: error: --fsdp-attention-backend warp_drive: unknown attention backend; diffusers offers "
    )
