"""The sequence-parallel check every family's test suite runs: gloo ranks that split each
sample's tokens (``--sequence-parallel-size``) compute the loss and the gradient that one
process computes on the same rollout.

One ``torch.multiprocessing`` spawn of ``world`` ranks runs every scenario in turn
(process start-up dominates). Each scenario is one optimizer step of full fine-tuning at
``--lr 0`` without clipping, so the weights stay put and the reduced gradient is read
from the parameters afterwards (gathered from the shards). The reference is the same
step in this process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

PROMPTS: tuple[str, ...] = ("a red cube on a table",)

LOCAL_ATTENTION = "local-attention"
"""The control scenario's marker: the split and the gather stay, but every attention sees
only its own rank's tokens (``_parallel_config`` cleared on every processor of every rank),
so the result must differ from one process's."""


def check_args(checkpoint: str | Path, out_dir: str | Path, *extra: str, family: str | None = None) -> list[str]:
    """One rollout of 2 samples (one prompt, a microgroup of 2), 2 denoising steps of which
    the first is an SDE step, fp32, full fine-tuning, one optimizer step at lr 0 without
    clipping, micro-batches of one pair; ``extra`` is appended."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": p}) + "\n" for p in PROMPTS), encoding="utf-8")
    return [
        "--hf-checkpoint",
        str(checkpoint),
        *(["--diffusion-model-family", family] if family else []),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--rollout-microgroup-size",
        "2",
        "--diffusion-num-steps",
        "2",
        "--diffusion-num-sde-steps",
        "1",
        "--rm-type",
        "brightness",
        "--diffusion-forward-dtype",
        "fp32",
        "--lr",
        "0",
        "--clip-grad",
        "0",
        "--micro-batch-size",
        "1",
        "--output-dir",
        str(out),
        *extra,
    ]


def _trainer(config: Any, rank: int = 0) -> Any:
    from miles_core.engine.factory import sde_backend
    from miles_core.model_loading import load_family
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    loss_fn = get_host().registries.loss.get(config.loss_type).load()
    return Trainer(load_family(config), config, sde_backend(config), loss_fn, dp_rank=rank)


def make_rollout(args: Sequence[str]) -> tuple[list[Any], torch.Tensor]:
    """The rollout every scenario trains on: sampled once here, rewards 0 and 1."""
    from miles_core.config.resolve import resolve_config
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.model_loading import load_family
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import RolloutSettings, strategy_from_config
    from miles_core.rollout.generate import generate_rollout as generate
    from miles_core.training.advantages import advantages_from_config

    config = resolve_config(list(args))
    engine = EmbeddedEngine(load_family(config))
    groups = asyncio.run(
        generate(engine, RolloutSettings.from_config(config), 0, [PromptRecord(p) for p in PROMPTS], strategy_from_config(config))
    )
    samples = [s for group in groups for s in group]
    for i, sample in enumerate(samples):
        sample.reward = float(i % 2)
    return samples, advantages_from_config(torch.tensor([s.reward for s in samples]), config, samples)


def gradients(trainer: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient as a full CPU tensor (collective when sharded)."""
    from miles_core.training.fsdp import full_tensor

    return {name: full_tensor(p.grad) for name, p in trainer.named_trainable().items() if p.grad is not None}


def train_once(config: Any, rollout: tuple[list[Any], torch.Tensor], rank: int = 0, *, local_attention: bool = False) -> dict[str, Any]:
    """One optimizer step on ``rollout``: the metrics, the gradients and the step's wall
    time in seconds (``train_s``, the device synchronised)."""
    torch.manual_seed(0)
    trainer = _trainer(config, rank)
    if local_attention:
        for module in trainer.modules.values():
            for sub in module.modules():
                if getattr(getattr(sub, "processor", None), "_parallel_config", None) is not None:
                    sub.processor._parallel_config = None
    began = time.perf_counter()
    metrics = trainer.train_rollout(*rollout)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {
        "metrics": metrics,
        "train_s": seconds,
        "gradients": gradients(trainer),
        "dp_rank": trainer.dp_rank,
        "mesh": tuple(trainer.mesh.shape) if trainer.mesh is not None else (),
    }


def _rank_main(
    rank: int, world: int, port: int, scenarios: Mapping[str, Sequence[str]], rollout_path: str, out: str, backend: str = "gloo"
) -> None:
    torch.set_num_threads(1)
    from miles_core.config.resolve import resolve_config
    from miles_core.training import fsdp

    device = f"cuda:{rank}" if backend == "nccl" else None  # one GPU per rank: the families load on the current one
    fsdp.init_process_group(rank, world, master_addr="127.0.0.1", master_port=port, backend=backend, timeout_minutes=2, device=device)
    rollout = torch.load(rollout_path, weights_only=False)
    try:
        for name, args in scenarios.items():
            try:
                flags = [a for a in args if a != LOCAL_ATTENTION]
                result = train_once(resolve_config(flags), rollout, rank, local_attention=LOCAL_ATTENTION in args)
            except Exception:
                torch.save({"crash": traceback.format_exc()}, Path(out) / f"{name}.rank{rank}.pt")
                raise  # the others may wait in a collective: stop the spawn
            torch.save(result, Path(out) / f"{name}.rank{rank}.pt")
    finally:
        fsdp.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    world: int,
    scenarios: Mapping[str, Sequence[str]],
    rollout: tuple[list[Any], torch.Tensor],
    out_dir: str | Path,
    *,
    backend: str = "gloo",
) -> dict[str, list[dict[str, Any]]]:
    """Spawn ``world`` ranks (gloo on CPU; ``backend="nccl"``: one GPU each, for ring
    attention in the GPU lane) that run each scenario (its full argument list, plus
    :data:`LOCAL_ATTENTION` for the control) in turn; scenario -> every rank's
    :func:`train_once` result (or ``{"crash": traceback}``)."""
    import torch.multiprocessing as mp

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(rollout, out / "rollout.pt")
    try:
        mp.spawn(
            _rank_main, args=(world, _free_port(), dict(scenarios), str(out / "rollout.pt"), str(out), backend), nprocs=world, join=True
        )
    except Exception:  # a rank's traceback is in its file
        pass
    results: dict[str, list[dict[str, Any]]] = {}
    for name in scenarios:
        paths = [out / f"{name}.rank{r}.pt" for r in range(world)]
        results[name] = [torch.load(p, weights_only=False) if p.exists() else {"crash": "no result"} for p in paths]
    return results


def split_against_one_process(
    checkpoint: str | Path, workdir: str | Path, flags: Sequence[str], split: Sequence[str], *, family: str | None = None
) -> dict[str, Any]:
    """A family's parity check on two gloo ranks: ``{"sp2": [rank results], "local_attention":
    [rank results], "reference": one process}`` for one rollout of :func:`check_args` with
    ``flags``; ``split`` holds the sequence-parallel flags, and the ``local_attention`` runs
    (the control) add :data:`LOCAL_ATTENTION` to them."""
    workdir = Path(workdir)
    args = check_args(checkpoint, workdir / "run", *flags, family=family)
    rollout = make_rollout(args)
    scenarios = {"sp2": [*args, *split], "local_attention": [*args, *split, LOCAL_ATTENTION]}
    results = run_ranks(2, scenarios, rollout, workdir / "ranks")
    from miles_core.config.resolve import resolve_config

    results["reference"] = train_once(resolve_config(args), rollout)
    return results


def gradient_error(ours: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """The largest gradient difference relative to the largest reference gradient (inf
    when the names or shapes differ)."""
    if ours.keys() != reference.keys() or any(ours[k].shape != reference[k].shape for k in reference):
        return float("inf")
    scale = max(float(g.abs().max()) for g in reference.values())
    return max(float((ours[k].double() - reference[k].double()).abs().max()) for k in reference) / scale


__all__ = [
    "LOCAL_ATTENTION",
    "PROMPTS",
    "check_args",
    "gradient_error",
    "gradients",
    "make_rollout",
    "run_ranks",
    "split_against_one_process",
    "train_once",
]
