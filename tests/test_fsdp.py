"""FSDP2 data parallelism at the Trainer level: two gloo ranks (``torch.multiprocessing``
spawn, one process group) train the tiny SD3 pipeline on the same rollout as one plain
process, and must agree with it.

One spawn runs every two-rank scenario in turn (start-up dominates on two cores); each
rank writes its results to a file, the tests compare them with one-process runs.
"""

from __future__ import annotations

import asyncio
import copy
import math
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.config.resolve import resolve_config

BASE = (
    "--diffusion-model-family",
    "sd3",
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
    "--lr",
    "1e-3",
    "--micro-batch-size",
    "2",
)
LORA = ("--use-lora", "--lora-rank", "4", "--num-steps-per-rollout", "2", "--clip-grad", "0.1")
"""Two optimizer steps of 4 samples (2 per rank); the gradient norm (about 0.24) is clipped."""
TWO = ("--actor-num-nodes", "2")
"""What a two-rank run resolves: world size 2, data-parallel size 2."""
NFT = ("--loss-type", "nft", "--use-lora", "--lora-rank", "4", "--diffusion-nft-timestep-fraction", "0.5")

SCENARIOS: dict[str, tuple[str, ...]] = {
    "lora": LORA,
    "stride": (*LORA, "--train-dp-split-mode", "stride"),
    "hsdp": (*LORA, "--dp-replicate-size", "2"),
    "reduce_bf16": (*LORA, "--fsdp-reduce-dtype", "bf16"),
    "master_bf16": (*LORA, "--fsdp-master-dtype", "bf16"),
    "forward_bf16": (*LORA, "--diffusion-forward-dtype", "bf16"),
    "cpu_offload": (*LORA, "--fsdp-cpu-offload"),
    "full": ("--num-steps-per-rollout", "2", "--lr", "1e-4"),
    "nft": NFT,
    "unequal": NFT,
    "checkpoint": (*LORA, "--use-ema", "--ema-rollout-policy", "ema"),
    "sft": ("--loss-type", "sft_loss", "--use-lora", "--lora-rank", "4"),
    "sharded": ("--num-steps-per-rollout", "2", "--lr", "1e-4", "--use-ema", "--ema-rollout-policy", "ema"),
    "deferred": LORA,
    "deferred_full": ("--num-steps-per-rollout", "2", "--lr", "1e-4"),
}
"""Two-rank scenario -> its flags (besides BASE and TWO)."""

ATOL = 2e-6
"""Two ranks against one process, on the LoRA weights after two Adam steps at lr 1e-3: the
ranks sum the gradients in another order, which rounds differently. Measured on AVX-512
under MKL's default, COMPATIBLE and AVX2 paths and ATen's avx2 and default kernels: at
most 4.3e-7 (nft, the checkpoint continuation: under 3e-8). A 2% change of one sample's
advantage moves the weights by 2e-3, an untrained LoRA is 2e-3 away."""


def make_config(checkpoint: Any, *extra: str) -> Any:
    return resolve_config(["--hf-checkpoint", str(checkpoint), *BASE, *extra])


def transformer_audit(trainer: Any) -> dict[str, Any]:
    """This process's bytes of the trained transformer's parameters (local shards when
    sharded) and of every other pipeline module, by device (the memory audit)."""
    from miles_core.memory import audit_memory

    transformer = trainer.modules["transformer"]
    others = [m for n, m in trainer.family.pipeline.components.items() if isinstance(m, torch.nn.Module) and n != "transformer"]
    return audit_memory(parameters=list(transformer.parameters()), engine_modules=others).as_dict()


def make_trainer(checkpoint: Any, config: Any, dp_rank: int = 0) -> Any:
    from miles_core.model_loading import torch_dtype
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer
    from miles_sd3.family import SD3Family

    host = get_host()
    # LoRA's initialisation draws from the global generator: each rank draws its own (seeded
    # by its rank), the sharded trainer adopts rank 0's, the one process draws rank 0's.
    torch.manual_seed(dp_rank)
    family = SD3Family.from_pretrained(checkpoint, dtype=torch_dtype(config.diffusion_forward_dtype))
    return Trainer(
        family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
        dp_rank=dp_rank,
    )


def generate_rollout(checkpoint: Any) -> tuple[list, torch.Tensor]:
    """2 prompts x 4 samples (microgroups of 2), SDE steps 0-2 of 4, rewards 0, 1, 2, 0, ..."""
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, strategy_from_config
    from miles_core.rollout.generate import generate_rollout as generate
    from miles_core.training.advantages import advantages_from_config
    from miles_sd3.family import SD3Family

    config = make_config(checkpoint)
    groups = asyncio.run(
        generate(
            EmbeddedEngine(SD3Family.from_pretrained(checkpoint)),
            RolloutSettings.from_config(config),
            0,
            [PromptRecord("a red cube"), PromptRecord("a blue ball")],
            strategy_from_config(config),
        )
    )
    samples = [s for group in groups for s in group]
    for i, sample in enumerate(samples):
        sample.reward = float(i % 3)
    advantages = advantages_from_config(torch.tensor([s.reward for s in samples]), config, samples)
    return samples, advantages


def removing(rollout: tuple[list, torch.Tensor], index: int) -> tuple[list, torch.Tensor]:
    """The rollout with sample ``index`` removed by a "per-sample filter": it trains
    nothing (its pairs are masked; nft skips it)."""
    samples = copy.deepcopy(rollout[0])
    samples[index].remove_sample = True
    return samples, rollout[1]


POLICY_ROLLOUT = 1
"""The policy-loss scenarios remove sample 1: under the contiguous split the ranks then
keep different numbers of pairs (9 and 12), which the loss weights must account for."""


def full_state(trainer: Any) -> dict[str, Any]:
    return {"weights": trainer.trainable_state(), "optimizer": trainer.optimizer_state()}


# -- the two ranks ----------------------------------------------------------------------------------


def _scenario(name: str, rank: int, checkpoint: Path, rollout: tuple[list, torch.Tensor], out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from miles_core.training import fsdp
    from miles_core.training.checkpoint import capture_rng, load_checkpoint, save_checkpoint

    config = make_config(checkpoint, *TWO, *SCENARIOS[name])
    if name == "unequal":
        samples, advantages = removing(rollout, 5)  # in rank 1's share only: fewer nft items there
    elif name == "nft":
        samples, advantages = rollout
    else:
        samples, advantages = removing(rollout, POLICY_ROLLOUT)
    result: dict[str, Any] = {}
    if name.startswith("deferred"):
        return _deferred_scenario(rank, config, samples, advantages, result)
    trainer = make_trainer(checkpoint, config, dp_rank=rank)
    module = trainer.modules["transformer"]
    policy = module._get_fsdp_state()._mp_policy
    result["mp_policy"] = (policy.param_dtype, policy.reduce_dtype)
    result["mesh"] = tuple(trainer.mesh.shape)
    result["local"] = {
        n: (p.to_local().dtype, tuple(p.to_local().shape), tuple(p.shape), tuple(map(str, p.placements)))
        for n, p in trainer.named_trainable().items()
    }
    result["frozen_dtypes"] = {p.to_local().dtype for p in module.parameters() if not p.requires_grad}
    result["blocks_sharded"] = sum(1 for block in module.transformer_blocks if hasattr(block, "_get_fsdp_state"))
    sharded = [module, *(block for block in module.transformer_blocks if hasattr(block, "_get_fsdp_state"))]
    fsdp_params = [p for m in sharded for group in [m._get_fsdp_state()._fsdp_param_group] if group for p in group.fsdp_params]
    result["offload"] = {(p.offload_to_cpu, p.pin_memory, p.sharded_param.device.type) for p in fsdp_params}
    if name == "sft":
        from miles_core.training.sft import SftRow, sft_params

        rows = [SftRow(f"colour {i % 4}", out / "images" / f"{i % 4}.png") for i in range(8)]
        before = trainer.trainable_state()
        result["metrics"] = [trainer.train_sft(rows, sft_params(trainer.family, config))]
        result["moved"] = max_difference(trainer.trainable_state(), before)
        return result
    if name == "unequal":
        try:
            trainer.train_rollout(samples, advantages)
        except ValueError as exc:
            result["error"] = str(exc)
        dist.barrier()  # the group still works: nothing hangs after the error
        return result
    if name == "sharded":
        return _sharded_scenario(rank, trainer, samples, advantages, out / "sharded", result)
    if name in ("lora", "full"):
        result["audit"] = transformer_audit(trainer)
    if name == "checkpoint":
        fsdp.restore_rank_rng(None, rank=rank, world_size=2, seed=config.seed)  # each rank its own stream
        result["metrics"] = [trainer.train_rollout(samples, advantages)]
        saved = {**full_state(trainer), "ema": trainer.ema.state_dict()}
        ranks_rng = fsdp.all_gather_object(fsdp.rank_rng_state())
        if rank == 0:
            save_checkpoint(
                out / "ckpt",
                0,
                model_state=saved["weights"],
                optimizer_state=saved["optimizer"],
                rng_state=capture_rng(),
                extra={"optimizer_steps": trainer.optimizer_steps, "ema": saved["ema"], "rank_rng": ranks_rng},
            )
        dist.barrier()
        with torch.no_grad():  # spoil everything, then load it back
            for parameter in trainer.parameters:
                parameter.add_(0.5)
        ckpt = load_checkpoint(out / "ckpt")
        trainer.load_trainable_state(ckpt.model_state)
        trainer.load_optimizer_state(ckpt.optimizer_state)
        trainer.ema.load_state_dict(ckpt.extra["ema"])
        result["saved"] = saved
        result["reloaded"] = {**full_state(trainer), "ema": trainer.ema.state_dict()}
        result["metrics"].append(trainer.train_rollout(samples, -advantages))
        result["final"] = {**full_state(trainer), "ema": trainer.ema.state_dict()}
        return result
    result["metrics"] = [trainer.train_rollout(samples, advantages)]
    result["final"] = full_state(trainer)
    if name == "master_bf16":
        result["optimizer_local_dtypes"] = {
            key: value.to_local().dtype
            for entry in trainer.optimizer.state.values()
            for key, value in entry.items()
            if fsdp.is_sharded(value)
        }
    return result


def _deferred_scenario(rank: int, config: Any, samples: list, advantages: torch.Tensor, result: dict[str, Any]) -> dict[str, Any]:
    """The ranks load only their share (miles_core.training.rank_loading), then train as
    the whole-load scenario of the same flags."""
    from miles_core.plugin_manager import get_host
    from miles_core.training.rank_loading import load_rank_family, named_tensors
    from miles_core.training.trainer import Trainer

    host = get_host()
    torch.manual_seed(rank)  # as make_trainer: rank 0's LoRA draw must be the one every rank starts from
    loaded = load_rank_family(config, rank)
    transformer = loaded.family.components()["transformer"]
    result["loaded"] = {
        "whole": loaded.whole,
        "meta": all(t.is_meta for _, t in named_tensors(transformer)),
        "sources": sorted(loaded.sources),
        "source_bytes": {n: sum(t.nbytes for _, t in named_tensors(m)) for n, m in loaded.sources.items()},
    }
    trainer = Trainer(
        loaded.family,
        config,
        host.registries.sde_backend.get(config.diffusion_sde_type).load(),
        host.registries.loss.get(config.loss_type).load(),
        dp_rank=rank,
        sources=loaded.sources,
    )
    result["sources_left"] = len(loaded.sources)
    result["audit"] = transformer_audit(trainer)
    result["metrics"] = [trainer.train_rollout(samples, advantages)]
    result["final"] = full_state(trainer)
    return result


def _sharded_scenario(
    rank: int, trainer: Any, samples: list, advantages: torch.Tensor, root: Path, result: dict[str, Any]
) -> dict[str, Any]:
    """Full fine-tuning with an EMA: a sharded save (rank 0 plays the driver, the ranks
    write through the Ray actor's methods), a second save whose temporary directory is
    written by both ranks and never published (a save killed mid-write), the next rollout
    trained on, then the checkpoint read back into the shards and the same rollout trained
    again."""
    import torch.distributed as dist

    from miles_core.cluster.train_ranks import TrainRank
    from miles_core.training import fsdp
    from miles_core.training.checkpoint import capture_rng, load_checkpoint, new_temporary
    from miles_core.training.sharded_checkpoint import SHARD_DIR, ShardedPart, save_sharded_checkpoint, write_shards

    actor = TrainRank(trainer.config, rank, 2)  # its methods, called here without Ray
    actor.trainer = trainer

    def state() -> dict[str, Any]:  # gathered here only to compare; the checkpoint never gathers
        return {**full_state(trainer), "ema": trainer.ema.state_dict()}

    def write(directory: Path) -> Any:
        fsdp.all_gather_object(str(directory))  # the driver tells the ranks where
        return ShardedPart.from_record(actor.save_sharded(str(directory), True), directory)

    result["metrics"] = [trainer.train_rollout(samples, advantages)]
    result["saved"] = state()
    if rank == 0:
        save_sharded_checkpoint(root, 0, write, rng_state=capture_rng(), extra={"optimizer_steps": trainer.optimizer_steps})
    else:
        actor.save_sharded(fsdp.all_gather_object(None)[0], True)
    unpublished = new_temporary(root, 1) if rank == 0 else None
    write_shards(trainer, Path(fsdp.all_gather_object(unpublished)[0]) / SHARD_DIR)
    dist.barrier()

    result["metrics"].append(trainer.train_rollout(samples, -advantages))
    result["uninterrupted"] = state()
    with torch.no_grad():  # spoil everything, then read it back
        for parameter in trainer.parameters:
            parameter.add_(0.5)
        for shadow in trainer.ema.shadow.values():
            shadow.add_(0.5)
        for entry in trainer.optimizer.state.values():
            entry["exp_avg"].zero_()
    ckpt = load_checkpoint(root)
    actor.load_sharded(str(ckpt.path / SHARD_DIR), ckpt.sharded, True)
    trainer.optimizer_steps = ckpt.extra["optimizer_steps"]
    result["reloaded"] = state()
    result["metrics"].append(trainer.train_rollout(samples, -advantages))
    result["resumed"] = state()
    return result


def _rank_main(rank: int, port: int, checkpoint: str, rollout_path: str, out: str) -> None:
    torch.set_num_threads(1)
    from miles_core.training import fsdp

    fsdp.init_process_group(rank, 2, master_addr="127.0.0.1", master_port=port, backend="gloo", timeout_minutes=2)
    rollout = torch.load(rollout_path, weights_only=False)
    try:
        for name in SCENARIOS:
            try:
                result = _scenario(name, rank, Path(checkpoint), rollout, Path(out))
            except Exception:
                result = {"crash": traceback.format_exc()}
                torch.save(result, Path(out) / f"{name}.rank{rank}.pt")
                raise  # the other rank may be waiting in a collective: stop the spawn
            torch.save(result, Path(out) / f"{name}.rank{rank}.pt")
    finally:
        fsdp.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def rollout(tiny_sd3):
    return generate_rollout(tiny_sd3)


@pytest.fixture(scope="module")
def two_ranks(tiny_sd3, rollout, tmp_path_factory):
    """scenario -> [rank 0's results, rank 1's]; ``out`` holds the two-rank checkpoint."""
    import torch.multiprocessing as mp
    from PIL import Image

    out = tmp_path_factory.mktemp("fsdp")
    torch.save(rollout, out / "rollout.pt")
    (out / "images").mkdir()
    for i, colour in enumerate([(220, 30, 30), (30, 30, 220), (30, 200, 30), (240, 240, 240)]):
        Image.new("RGB", (40, 40), colour).save(out / "images" / f"{i}.png")
    mp.spawn(_rank_main, args=(_free_port(), str(tiny_sd3), str(out / "rollout.pt"), str(out)), nprocs=2, join=True)
    results = {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)] for name in SCENARIOS}
    results["out"] = out
    return results


@pytest.fixture(scope="module")
def one_rank(tiny_sd3, rollout):
    """The one-process runs the two-rank ones must equal, computed once."""
    cache: dict[str, Any] = {}

    def get(name: str, *extra: str) -> dict[str, Any]:
        samples, advantages = rollout if name == "nft" else removing(rollout, POLICY_ROLLOUT)
        if name not in cache:
            trainer = make_trainer(tiny_sd3, make_config(tiny_sd3, *extra))
            assert trainer.mesh is None
            metrics = trainer.train_rollout(samples, advantages)
            cache[name] = {"metrics": metrics, "final": full_state(trainer)}
        return cache[name]

    return get


# -- comparisons --------------------------------------------------------------------------------------


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two nested structures of tensors and numbers
    (inf when their structure, keys or dtypes differ)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return float("inf")
        return max([max_difference(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return float("inf")
        return max([max_difference(x, y) for x, y in zip(a, b)], default=0.0)
    if torch.is_tensor(a):
        if not torch.is_tensor(b) or a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    return 0.0 if a == b else float("inf")


def metric_mismatches(ours: dict[str, Any], reference: dict[str, Any], *, rel: float = 1e-5, abs: float = 1e-6) -> list[str]:
    """The keys whose values (or per-step lists) differ beyond ``rel`` or ``abs``.

    ``abs`` covers the drift metrics (``|log p - old log p|`` and the ratio's deviation):
    differences of log-probabilities of magnitude about 1, whose rounding is absolute, one
    ulp being 1.2e-7 (measured: at most 2.4e-7 between two ranks and one process, under
    the kernel variants ``ATOL`` names); gradient norms and mean losses agree to 5e-7
    relative."""
    assert ours.keys() == reference.keys()
    mismatched = []
    for key, value in reference.items():
        values = value if isinstance(value, list) else [value]
        others = ours[key] if isinstance(ours[key], list) else [ours[key]]
        if len(values) != len(others) or any(y != pytest.approx(x, rel=rel, abs=abs) for x, y in zip(values, others)):
            mismatched.append(key)
    return mismatched


def assert_close_metrics(ours: dict[str, Any], reference: dict[str, Any], *, rel: float = 1e-5, abs: float = 1e-6) -> None:
    mismatched = metric_mismatches(ours, reference, rel=rel, abs=abs)
    assert not mismatched, {key: (ours[key], reference[key]) for key in mismatched}


def check_ranks_ran(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result.get('crash')}"


# -- policy loss -----------------------------------------------------------------------------------------


@pytest.mark.exercises("--actor-num-nodes", "--train-dp-split-mode", "--use-lora")
@pytest.mark.parametrize("scenario", ["lora", "stride"])
def test_two_ranks_train_the_policy_loss_as_one_process(two_ranks, one_rank, scenario):
    results = two_ranks[scenario]
    check_ranks_ran(results)
    reference = one_rank("lora", *LORA)
    for result in results:
        assert result["mesh"] == (2,) and result["blocks_sharded"] == 2
        (metrics,) = result["metrics"]
        # Every rank returns the global metrics: those of one process, to float rounding.
        assert metrics["train/num_pairs"] == reference["metrics"]["train/num_pairs"] == 24
        assert_close_metrics(metrics, reference["metrics"])
        assert max_difference(result["final"], reference["final"]) <= ATOL


def test_the_policy_comparison_can_fail(tiny_sd3, rollout, one_rank):
    """Controls: the weights moved by far more than the tolerance, and a 2% change of one
    sample's advantage is seen at it, in the weights and in the metrics (a scale of all of
    them would not be: Adam and the clipping undo it)."""
    samples, advantages = removing(rollout, POLICY_ROLLOUT)
    reference = one_rank("lora", *LORA)
    untrained = make_trainer(tiny_sd3, make_config(tiny_sd3, *LORA))
    assert max_difference(untrained.trainable_state(), reference["final"]["weights"]) > 100 * ATOL
    nudged = advantages.clone()
    nudged[2] *= 1.02
    metrics = untrained.train_rollout(samples, nudged)
    assert max_difference(full_state(untrained), reference["final"]) > 10 * ATOL
    assert "train/loss" in metric_mismatches(metrics, reference["metrics"])


@pytest.mark.exercises("--actor-num-nodes")
def test_full_fine_tuning_on_two_ranks_equals_one_process(two_ranks, one_rank):
    results = two_ranks["full"]
    check_ranks_ran(results)
    reference = one_rank("full", *SCENARIOS["full"])
    moved = max_difference(one_rank("full-untrained", *SCENARIOS["full"], "--lr", "0")["final"]["weights"], reference["final"]["weights"])
    assert moved > 1e-4  # lr 1e-4, two Adam steps
    for result in results:
        # Adam divides by each gradient's root mean square, so an element whose gradient is
        # tiny magnifies the rounding of the other summation order (measured: at most
        # 4.8e-6, 5% of a step, under the kernel variants ATOL names), and the second
        # step's log-probabilities see it.
        assert_close_metrics(result["metrics"][0], reference["metrics"], rel=1e-4, abs=1e-6)
        assert max_difference(result["final"], reference["final"]) <= 2e-5


@pytest.mark.exercises("--dp-replicate-size")
def test_hybrid_sharding_replicates_and_trains_as_one_process(two_ranks, one_rank):
    results = two_ranks["hsdp"]
    check_ranks_ran(results)
    reference = one_rank("lora", *LORA)
    for result in results:
        assert result["mesh"] == (2, 1)  # (replicate, shard)
        assert {placements for *_, placements in result["local"].values()} == {("R", "S(0)")}
        assert all(local == full for _, local, full, _ in result["local"].values())  # whole on each replica
        assert_close_metrics(result["metrics"][0], reference["metrics"])
        assert max_difference(result["final"], reference["final"]) <= ATOL
    # Control: the plain two-rank run shards the same parameters in halves.
    assert {placements for *_, placements in two_ranks["lora"][0]["local"].values()} == {("S(0)",)}


@pytest.mark.exercises("--fsdp-reduce-dtype", "--fsdp-master-dtype", "--diffusion-forward-dtype")
def test_fsdp_dtypes_take_effect(two_ranks, one_rank):
    for name in ("lora", "reduce_bf16", "master_bf16"):
        check_ranks_ran(two_ranks[name])
    reference = one_rank("lora", *LORA)["final"]
    fp32 = two_ranks["lora"][0]
    assert fp32["mp_policy"] == (torch.float32, torch.float32)
    assert {dtype for dtype, *_ in fp32["local"].values()} == {torch.float32}

    reduced = two_ranks["reduce_bf16"][0]
    assert reduced["mp_policy"] == (torch.float32, torch.bfloat16)
    # Gradients summed in bf16: near the fp32 result, but not it (measured 3.8e-5 to 4e-5).
    assert 5 * ATOL < max_difference(reduced["final"], reference) < 1e-3

    master = two_ranks["master_bf16"][0]
    assert master["mp_policy"] == (torch.float32, torch.float32)  # the forward still runs in fp32
    assert {dtype for dtype, *_ in master["local"].values()} == {torch.bfloat16}
    assert set(master["optimizer_local_dtypes"].values()) == {torch.bfloat16}
    weights = master["final"]["weights"]["transformer"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    as_fp32 = {"transformer": {k: t.float() for k, t in weights.items()}}
    assert 10 * ATOL < max_difference(as_fp32, reference["weights"]) < 2e-2

    # The GPU default: a bf16 model and forward, fp32 master weights (the LoRA adapters,
    # created in bf16 next to their bf16 base layers, are kept in fp32 by the shards).
    forward = two_ranks["forward_bf16"][0]
    check_ranks_ran(two_ranks["forward_bf16"])
    assert forward["mp_policy"] == (torch.bfloat16, torch.float32)
    assert {dtype for dtype, *_ in forward["local"].values()} == {torch.float32}
    assert forward["frozen_dtypes"] == {torch.bfloat16} and fp32["frozen_dtypes"] == {torch.float32}
    assert {t.dtype for t in forward["final"]["weights"]["transformer"].values()} == {torch.float32}
    assert 10 * ATOL < max_difference(forward["final"], reference) < 2e-2
    assert forward["metrics"][0]["train/loss"] == pytest.approx(fp32["metrics"][0]["train/loss"], rel=5e-2)


@pytest.mark.exercises("--loss-type", "--diffusion-nft-timestep-fraction")
def test_nft_on_two_ranks_draws_what_one_process_draws(two_ranks, one_rank):
    results = two_ranks["nft"]
    check_ranks_ran(results)
    reference = one_rank("nft", *NFT)
    for result in results:
        assert_close_metrics(result["metrics"][0], reference["metrics"])
        assert max_difference(result["final"], reference["final"]) <= ATOL
    # Control: other noise (another --seed) trains to other weights, beyond the tolerance.
    other = one_rank("nft-seed", *NFT, "--seed", "7")
    assert max_difference(other["final"], reference["final"]) > 100 * ATOL


def test_unequal_micro_batch_counts_stop_every_rank_with_the_counts(two_ranks):
    results = two_ranks["unequal"]
    check_ranks_ran(results)
    # nft skips sample 5 (rank 1's share): 3 samples x 2 timesteps there against 4 x 2 on
    # rank 0, in micro-batches of 2.
    expected = (
        "optimizer step 0 of this rollout: data-parallel ranks would run different numbers of micro-batches "
        "(rank 0: 4, rank 1: 3); under FSDP2 every rank must run the same number of forward and backward "
        "passes, or their collectives deadlock"
    )
    assert [result["error"] for result in results] == [expected, expected]


@pytest.mark.exercises("--load", "--use-ema")
def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, tiny_sd3, rollout):
    from miles_core.training.checkpoint import load_checkpoint
    from miles_core.training.run_state import restore_run_state

    results = two_ranks["checkpoint"]
    check_ranks_ran(results)
    for result in results:
        # Loaded back into the shards (after spoiling them): the saved full state, bit for bit.
        assert max_difference(result["reloaded"], result["saved"]) == 0.0
    saved = results[0]["saved"]
    ckpt = load_checkpoint(two_ranks["out"] / "ckpt")
    assert max_difference(ckpt.model_state, saved["weights"]) == 0.0
    assert max_difference(ckpt.optimizer_state, saved["optimizer"]) == 0.0
    assert len(ckpt.extra["rank_rng"]) == 2

    # One process resumes through the run's own restore (--load) and takes the next step.
    config = make_config(tiny_sd3, *SCENARIOS["checkpoint"], "--load", str(two_ranks["out"] / "ckpt"), "--no-load-rng")
    trainer = make_trainer(tiny_sd3, config)
    assert restore_run_state(config, trainer) == 1
    assert max_difference(trainer.trainable_state(), saved["weights"]) == 0.0
    assert max_difference(trainer.optimizer_state(), saved["optimizer"]) == 0.0
    assert max_difference(trainer.ema.state_dict(), saved["ema"]) == 0.0
    assert trainer.optimizer_steps == 2
    samples, advantages = removing(rollout, POLICY_ROLLOUT)
    metrics = trainer.train_rollout(samples, -advantages)
    final = {**full_state(trainer), "ema": trainer.ema.state_dict()}
    for result in results:
        assert_close_metrics(result["metrics"][1], metrics)
        assert max_difference(result["final"], final) <= ATOL
    assert max_difference(final["weights"], saved["weights"]) > 100 * ATOL  # the step moved them


def test_per_rank_rng_is_restored_at_the_same_world_size_and_reseeded_otherwise(two_ranks):
    from miles_core.training.checkpoint import capture_rng, load_checkpoint, restore_rng
    from miles_core.training.fsdp import restore_rank_rng

    states = load_checkpoint(two_ranks["out"] / "ckpt").extra["rank_rng"]
    assert not torch.equal(states[0]["torch_cpu"], states[1]["torch_cpu"])  # each rank its own
    before = capture_rng()
    try:
        assert restore_rank_rng(states, rank=1, world_size=2, seed=1234) is True
        assert torch.equal(torch.get_rng_state(), states[1]["torch_cpu"])
        assert restore_rank_rng(states, rank=0, world_size=1, seed=1234) is False
        first = torch.rand(3)
        restore_rank_rng(None, rank=0, world_size=1, seed=1234)
        assert torch.equal(torch.rand(3), first)  # reseeded from (seed, rank)
        restore_rank_rng(None, rank=1, world_size=1, seed=1234)
        assert not torch.equal(torch.rand(3), first)
    finally:
        restore_rng(before)


def test_sft_trains_on_two_ranks(two_ranks):
    """SFT's draws differ from one process's on ranks above 0 (documented), so only: the
    step runs, every rank reports the same global metrics, and the weights move."""
    results = two_ranks["sft"]
    check_ranks_ran(results)
    first, second = (result["metrics"][0] for result in results)
    assert first == second
    assert math.isfinite(first["train/loss"]) and first["train/loss"] > 0
    assert all(result["moved"] > 0 for result in results)


# -- sharded checkpoints (full fine-tuning) -------------------------------------------------------------


def _weights_and_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    return {"weights": state["weights"], "optimizer": state["optimizer"], "shadow": state["ema"]["shadow"]}


@pytest.mark.exercises("--actor-num-nodes", "--use-ema")
def test_a_sharded_checkpoint_reloads_at_two_ranks_and_continues_exactly(two_ranks):
    results = two_ranks["sharded"]
    check_ranks_ran(results)
    for result in results:
        # Read back into the spoiled shards: the saved state bit for bit, and the same
        # rollout trained from it gives the uninterrupted run's weights, optimizer and EMA
        # bit for bit (same shards, same computation).
        assert max_difference(result["reloaded"], result["saved"]) == 0.0
        assert max_difference(result["resumed"], result["uninterrupted"]) == 0.0
        assert result["metrics"][2] == result["metrics"][1]
        # Control: that rollout moved every part far beyond 0.
        moved = max_difference(_weights_and_optimizer(result["uninterrupted"]), _weights_and_optimizer(result["saved"]))
        assert moved > 1e-5


def test_each_rank_writes_only_its_own_shards(two_ranks):
    from miles_core.training.checkpoint import load_checkpoint
    from miles_core.training.sharded_checkpoint import SHARD_DIR, read_metadata

    results = two_ranks["sharded"]
    check_ranks_ran(results)
    ckpt = load_checkpoint(two_ranks["out"] / "sharded")
    assert ckpt.model_state == {} and ckpt.optimizer_state is None and ckpt.sharded["world_size"] == 2
    assert sorted(p.name for p in ckpt.path.iterdir()) == ["dcp", "meta.json", "rng.json", "rng.safetensors"]
    metadata = read_metadata(ckpt.path / SHARD_DIR)
    stored: dict[tuple[str, str], int] = {}  # (file, model/optim/ema) -> elements
    for index, info in metadata.storage_data.items():
        kind = index.fqn.split(".", 1)[0]
        chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
        stored[info.relative_path, kind] = stored.get((info.relative_path, kind), 0) + math.prod(chunk.sizes)
    full = sum(math.prod(shape) for _, _, shape, _ in results[0]["local"].values())
    steps = []
    for rank, result in enumerate(results):
        local = sum(math.prod(shape) for _, shape, _, _ in result["local"].values())
        assert 0 < local < full
        # Rank r's file holds exactly its shard of the weights, of each Adam moment and of
        # the EMA: nothing of the other rank's and nothing gathered.
        assert stored[f"__{rank}_0.distcp", "model"] == local
        assert stored[f"__{rank}_0.distcp", "ema"] == local
        steps.append(stored[f"__{rank}_0.distcp", "optim"] - 2 * local)  # exp_avg, exp_avg_sq and scalar steps
    assert min(steps) >= 0 and sum(steps) == len(results[0]["local"])  # one step per parameter, stored once
    assert {path for path, _ in stored} == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.exercises("--load")
def test_a_sharded_checkpoint_resumes_in_one_process(two_ranks, tiny_sd3, rollout):
    from miles_core.training.checkpoint import available_iterations, latest_iteration
    from miles_core.training.run_state import restore_run_state

    results = two_ranks["sharded"]
    check_ranks_ran(results)
    root = two_ranks["out"] / "sharded"
    # The second save was written by both ranks and never published (killed mid-write):
    # it is there, and never loaded.
    (unpublished,) = root.glob(".iter_0000001.tmp-*")
    assert {p.name for p in (unpublished / "dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert latest_iteration(root) == 0 and available_iterations(root) == [0]

    samples, advantages = removing(rollout, POLICY_ROLLOUT)

    def resume(nudge: float = 0.0) -> dict[str, Any]:
        config = make_config(tiny_sd3, *SCENARIOS["sharded"], "--load", str(root), "--no-load-rng")
        trainer = make_trainer(tiny_sd3, config)
        assert trainer.mesh is None and restore_run_state(config, trainer) == 1
        loaded = copy.deepcopy({**full_state(trainer), "ema": trainer.ema.state_dict()})  # training goes on in place
        with torch.no_grad():
            trainer.parameters[0].view(-1)[0] += nudge
        trainer.train_rollout(samples, -advantages)
        return {"loaded": loaded, "final": {**full_state(trainer), "ema": trainer.ema.state_dict()}}

    one = resume()
    saved = results[0]["saved"]
    assert max_difference(one["loaded"], saved) == 0.0  # resharded into plain tensors, bit for bit
    # The next rollout's weights, Adam moments and EMA: within the full fine-tuning
    # tolerance of test_full_fine_tuning_on_two_ranks_equals_one_process (two ranks sum
    # in another order); measured here 1.5e-8 (weights and EMA), 4.4e-10 (Adam moments).
    for result in results:
        assert max_difference(one["final"], result["uninterrupted"]) <= 2e-5
    # Control: one weight nudged by 1e-3 before the step is seen.
    nudged = resume(1e-3)
    assert max_difference(nudged["final"], results[0]["uninterrupted"]) > 1e-4


@pytest.mark.exercises("--fsdp-master-dtype", "--diffusion-forward-dtype")
def test_a_sharded_checkpoint_loads_into_one_process_master_weights(two_ranks, tiny_sd3):
    from miles_core.training.run_state import restore_run_state

    check_ranks_ran(two_ranks["sharded"])
    saved = two_ranks["sharded"][0]["saved"]
    root = two_ranks["out"] / "sharded"
    config = make_config(tiny_sd3, *SCENARIOS["sharded"], "--diffusion-forward-dtype", "bf16", "--load", str(root), "--no-load-rng")
    trainer = make_trainer(tiny_sd3, config)
    assert restore_run_state(config, trainer) == 1
    # The fp32 master copies take the saved master weights bit for bit, the bf16
    # parameters their rounding; Adam's moments and the EMA are the masters'.
    assert max_difference(trainer.trainable_state(), saved["weights"]) == 0.0
    assert max_difference(trainer.optimizer_state(), saved["optimizer"]) == 0.0
    assert max_difference(trainer.ema.state_dict(), saved["ema"]) == 0.0
    params = {k: p.detach() for k, p in trainer.modules["transformer"].named_parameters() if p.requires_grad}
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(torch.equal(params[k], v.to(torch.bfloat16)) for k, v in saved["weights"]["transformer"].items())


def test_a_corrupt_or_partial_sharded_checkpoint_is_one_line(two_ranks, tiny_sd3, tmp_path):
    import shutil

    from miles_core.errors import RunError
    from miles_core.training.run_state import restore_run_state

    config = make_config(tiny_sd3, *SCENARIOS["sharded"], "--load", str(tmp_path / "ckpt"))
    trainer = make_trainer(tiny_sd3, config)
    shard = tmp_path / "ckpt" / "iter_0000000" / "dcp" / "__1_0.distcp"

    def fresh() -> None:
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        shutil.copytree(two_ranks["out"] / "sharded", tmp_path / "ckpt")

    fresh()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RunError) as info:
        restore_run_state(config, trainer)
    assert str(info.value) == f"--load {shard.parents[1]}: {shard}: sha256 differs from meta.json's manifest (corrupt shard)"

    fresh()
    (shard.parent / ".metadata").unlink()
    with pytest.raises(RunError) as info:
        restore_run_state(config, trainer)
    assert str(info.value) == (
        f"--load {tmp_path / 'ckpt'}: {tmp_path / 'ckpt' / 'latest_checkpointed_iteration.txt'} names iteration 0, but "
        f"{shard.parent / '.metadata'}: missing from the checkpoint (no complete checkpoint there)"
    )


# -- FSDP2 CPU offload, master weights ----------------------------------------------------------------


@pytest.mark.exercises("--fsdp-cpu-offload")
def test_fsdp_cpu_offload_trains_exactly_as_without_it(two_ranks):
    results = two_ranks["cpu_offload"]
    check_ranks_ran(results)
    for result, plain in zip(results, two_ranks["lora"]):
        # FSDP2's own CPUOffloadPolicy on every sharded parameter (pinned only where CUDA is).
        assert result["offload"] == {(True, torch.cuda.is_available(), "cpu")}
        assert plain["offload"] == {(False, False, "cpu")}  # control: the plain run offloads nothing
        # On a CPU mesh the offloaded shards, gradients and Adam state are the same CPU
        # tensors and the same arithmetic runs on them (only FSDP2's copies differ): bit for bit.
        assert result["metrics"] == plain["metrics"]
        assert max_difference(result["final"], plain["final"]) == 0.0


@pytest.mark.exercises("--fsdp-master-dtype", "--diffusion-forward-dtype")
def test_one_process_keeps_fp32_masters_of_a_bf16_model_as_the_fsdp_ranks_do(two_ranks, one_rank):
    """A bf16 model with fp32 master weights (the GPU default) trains in one process as
    on two FSDP2 ranks: the same bf16 forwards (FSDP2 does not cast the inputs, so the
    timestep stays fp32 in both), the bf16 gradients summed into fp32 (over micro-batches
    here, over micro-batches and ranks there), the same fp32 Adam steps. Tolerance:
    ``ATOL``, the summation order."""
    check_ranks_ran(two_ranks["forward_bf16"])
    ours = one_rank("forward_bf16", *SCENARIOS["forward_bf16"])
    assert {t.dtype for t in ours["final"]["weights"]["transformer"].values()} == {torch.float32}  # the masters
    for result in two_ranks["forward_bf16"]:
        assert_close_metrics(result["metrics"][0], ours["metrics"])
        assert max_difference(result["final"], ours["final"]) <= ATOL
    # Control: bf16 master weights in the one process round Adam's steps away.
    rounded = one_rank("forward_bf16_master_bf16", *SCENARIOS["forward_bf16"], "--fsdp-master-dtype", "bf16")
    as_fp32 = {"transformer": {k: t.float() for k, t in rounded["final"]["weights"]["transformer"].items()}}
    assert max_difference(as_fp32, ours["final"]["weights"]) > 100 * ATOL


SD35 = ("--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2")
RAY_TWO = ("--use-ray", "--actor-num-nodes", "2")


def config_errors(*argv: str) -> list[str]:
    from miles_core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        resolve_config([*SD35, *argv])
    return caught.value.messages


@pytest.mark.exercises("--fsdp-cpu-offload", "--fsdp-cpu-backend", "--distributed-backend")
def test_fsdp_cpu_offload_configuration():
    assert config_errors("--fsdp-cpu-offload") == [
        "--fsdp-cpu-offload offloads the FSDP2 shards of a world size above 1 (--actor-num-nodes x --actor-num-gpus-per-node); "
        "a one-process trainer has none: use --offload-train to move its weights, gradients and optimizer state off the GPU "
        "while the engine generates"
    ]
    assert config_errors(*RAY_TWO, "--fsdp-cpu-offload", "--fsdp-cpu-backend", "nccl") == [
        "--fsdp-cpu-backend nccl: must be one of gloo, mpi, ucc (a backend for CPU tensors)"
    ]
    assert config_errors(*RAY_TWO, "--fsdp-cpu-offload", "--distributed-backend", "gloo", "--fsdp-cpu-backend", "mpi") == [
        "--fsdp-cpu-backend mpi with --distributed-backend gloo: a gloo group runs the CPU collectives itself; use --fsdp-cpu-backend gloo"
    ]
    offload = resolve_config([*SD35, *RAY_TWO, "--fsdp-cpu-offload", "--distributed-backend", "nccl", "--fsdp-cpu-backend", "mpi"])
    assert offload.notes == []
    assert resolve_config([*SD35, *RAY_TWO, "--fsdp-cpu-backend", "gloo"]).notes == [
        "--fsdp-cpu-backend gloo has no effect without --fsdp-cpu-offload"
    ]


@pytest.mark.exercises("--fsdp-cpu-offload", "--fsdp-cpu-backend")
def test_the_cpu_backend_serves_the_cpu_tensors_of_an_nccl_group(monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from miles_core.training import fsdp

    # One group, two backends: collectives on CUDA tensors run on nccl, those on the
    # offloaded CPU shards on the CPU backend (the mesh's groups inherit both).
    assert fsdp.group_backend("nccl", "gloo") == "cpu:gloo,cuda:nccl"
    assert fsdp.group_backend("nccl", "ucc") == "cpu:ucc,cuda:nccl"
    assert fsdp.group_backend("nccl", None) == "nccl" and fsdp.group_backend("gloo", "gloo") == "gloo"
    with pytest.raises(ValueError, match="a gloo group runs the CPU collectives itself"):
        fsdp.group_backend("gloo", "mpi")
    assert fsdp.has_cpu_collectives("cpu:gloo,cuda:nccl") and fsdp.has_cpu_collectives("gloo")
    assert not fsdp.has_cpu_collectives("nccl") and not fsdp.has_cpu_collectives("cuda:nccl")
    # init_from_config passes the flag's backend, only under --fsdp-cpu-offload (recorded:
    # an nccl group cannot be joined on this machine).
    joined: list[tuple[str, str | None]] = []

    def record(rank, world_size, *, backend, cpu_backend, **_):
        joined.append((backend, cpu_backend))

    monkeypatch.setattr(fsdp, "init_process_group", record)
    for extra in ((), ("--fsdp-cpu-offload",)):
        config = resolve_config([*SD35, *RAY_TWO, "--distributed-backend", "nccl", *extra])
        fsdp.init_from_config(config, 0, master_addr="127.0.0.1", master_port=1)
    assert joined == [("nccl", None), ("nccl", "gloo")]
    policy = fsdp.offload_policy(resolve_config([*SD35, *RAY_TWO, "--fsdp-cpu-offload"]))
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory == torch.cuda.is_available()
    assert not isinstance(fsdp.offload_policy(resolve_config([*SD35, *RAY_TWO])), CPUOffloadPolicy)


# -- each rank loads only its share ---------------------------------------------------------------


@pytest.mark.parametrize(("deferred", "whole"), [("deferred", "lora"), ("deferred_full", "full")])
def test_ranks_that_load_only_their_share_train_as_a_whole_load(two_ranks, one_rank, tiny_sd3, deferred, whole):
    check_ranks_ran(two_ranks[deferred])
    ranks = two_ranks[deferred]
    # Before the trainer: every rank's transformer is built on the meta device, no data;
    # rank 0 alone holds the weights, on the host, and the trainer consumed them.
    assert [r["loaded"]["whole"] for r in ranks] == [None, None]
    assert [r["loaded"]["meta"] for r in ranks] == [True, True]
    assert [r["loaded"]["sources"] for r in ranks] == [["transformer"], []]
    assert [r["sources_left"] for r in ranks] == [0, 0]
    # The same training as the whole load on two ranks, bit for bit (the same starting
    # weights, LoRA included, and the same shards) ...
    for ours, theirs in zip(ranks, two_ranks[whole]):
        assert max_difference(ours["final"], theirs["final"]) == 0.0
        assert metric_mismatches(ours["metrics"][0], theirs["metrics"][0], rel=0, abs=0) == []
    # ... and as one process, to the ranks' rounding (full fine-tuning: the tolerance of
    # test_full_fine_tuning_on_two_ranks_equals_one_process, which says why it is wider).
    extra = LORA if whole == "lora" else SCENARIOS["full"]
    assert max_difference(ranks[0]["final"], one_rank(whole, *extra)["final"]) <= (ATOL if whole == "lora" else 2e-5)
    # The memory audit: each rank holds half the transformer's parameter bytes (to the
    # shards' padding), the whole load's ranks as much once sharded, one process all of it.
    one = make_trainer(tiny_sd3, make_config(tiny_sd3, *extra))
    whole_bytes = transformer_audit(one)["parameters"]["cpu"]
    for ours, theirs in zip(ranks, two_ranks[whole]):
        local = ours["audit"]["parameters"]["cpu"]
        assert local == theirs["audit"]["parameters"]["cpu"]
        assert whole_bytes / 2 <= local <= whole_bytes / 2 * 1.02, (local, whole_bytes)
        # Frozen components stay whole on every rank.
        assert ours["audit"]["engine_weights"] == transformer_audit(one)["engine_weights"]


def test_the_share_comparison_can_fail(two_ranks):
    """Control: one weight of the deferred run nudged by 1e-6 is seen by the exact comparison."""
    state = copy.deepcopy(two_ranks["deferred"][0]["final"])
    weights = state["weights"]
    while not torch.is_tensor(weights):
        weights = next(iter(weights.values()))
    weights.view(-1)[0] += 1e-6
    assert max_difference(state, two_ranks["lora"][0]["final"]) > 0.0
