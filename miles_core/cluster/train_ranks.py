"""Training ranks as Ray actors, and the driver-side trainer that drives them.

Each :class:`TrainRank` actor joins the torch.distributed group (gloo on CPU, nccl on GPU),
loads the family with only its share of the trained components
(:mod:`miles_core.training.rank_loading`: rank 0 reads their weights and broadcasts each
rank's shard) and builds the FSDP2-sharded :class:`~miles_core.training.trainer.Trainer`
for its rank. The driver keeps a :class:`RayTrainer`: it has the interface the run loop
uses on a one-process trainer, but no model: it loads no family and holds no trainable
tensor.

A rollout's training: every rank gets the whole rollout (one object in Ray's store) and
trains its share (``--train-dp-split-mode``). The ranks themselves send the new weights
to the engines (:meth:`RayTrainer.sync_to_engine`: gathered bucket by bucket, posted by
rank 0, checksums compared by the driver) and write the final weights
(:meth:`RayTrainer.save_weights`). What the driver does fetch is small or on demand: a
LoRA or EMA state for a checkpoint, the optimizer state. A gather is a collective, so
every call that gathers or loads goes to all ranks at once, one call at a time.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from miles_core.cluster.runtime import RayRuntime, task_result


class TrainRank:
    """One training rank (made a Ray actor by :class:`RayTrainer`)."""

    def __init__(self, config: Any, rank: int, world: int) -> None:
        self.config = config
        self.rank = rank
        self.world = world
        self.trainer: Any = None
        self._offload: Any = None  # --offload-train: the TrainerOffload of this rank's trainer

    def address(self) -> tuple[str, int]:
        """This node's address and a free port: rank 0's is the group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind(("", 0))
            return host, probe.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and build this rank's sharded trainer; returns the
        number of trainable parameters this rank holds a shard of."""
        import torch

        from miles_core.config.determinism import apply_deterministic_mode
        from miles_core.engine.factory import sde_backend
        from miles_core.plugin_manager import get_host
        from miles_core.training.fsdp import init_from_config
        from miles_core.training.rank_loading import load_rank_family
        from miles_core.training.trainer import Trainer

        config = self.config
        init_from_config(config, self.rank, master_addr=master_addr, master_port=master_port)
        torch.manual_seed(config.seed)
        apply_deterministic_mode(config)  # the environment came with the actor's runtime_env
        loss_fn = get_host().registries.loss.get(config.loss_type).load()
        # Only this rank's share of the trained components (rank 0 reads the weights).
        loaded = load_rank_family(config, self.rank)
        self.trainer = Trainer(loaded.family, config, sde_backend(config), loss_fn, dp_rank=self.rank, sources=loaded.sources)
        return len(self.trainer.parameters)

    def keeps_ema(self) -> bool:
        return self.trainer.ema is not None

    def sft_params(self) -> Any:
        """The generation parameters SFT trains with (from this rank's family)."""
        from miles_core.training.sft import sft_params

        return sft_params(self.trainer.family, self.config)

    def train_rollout(self, samples: Sequence[Any], advantages: Any, lr_at: Any) -> tuple[dict[str, Any], list, int]:
        metrics = self.trainer.train_rollout(samples, advantages, lr_at)
        return metrics, self._pairs(), self.trainer.optimizer_steps

    def train_sft(self, rows: Sequence[Any], params: Any, lr_at: Any) -> tuple[dict[str, Any], list, int]:
        metrics = self.trainer.train_sft(rows, params, lr_at)
        return metrics, [], self.trainer.optimizer_steps

    def _pairs(self) -> list:
        return list(self.trainer.last_pairs) if self.config.save_debug_train_data else []

    def offload(self) -> None:
        """``--offload-train``: this rank's whole training state (no engine samples a
        rank's modules) to host memory; see :mod:`miles_core.training.offload`."""
        from miles_core.training.offload import TrainerOffload

        if self._offload is None:
            self._offload = TrainerOffload(self.trainer)
        self._offload.offload()

    def reload(self) -> None:
        if self._offload is not None:
            self._offload.reload()

    # Gathers and loads: collectives, called on every rank together; rank 0 answers.

    def send_weights(self, urls: list[str], lora_only: bool, ema: bool, path: str, api_key: str | None = None) -> dict[str, Any] | None:
        """Weight sync to the engine servers ``urls``: every rank gathers, rank 0 posts the
        buckets (:func:`~miles_core.training.weight_sync.send_from_rank`); ``ema``: the
        EMA weights are swapped in meanwhile (``--ema-rollout-policy ema``); ``path``: the
        driver's :meth:`RayTrainer.sync_path`; ``api_key``: the servers' key (an argument of
        each call, kept nowhere on the rank)."""
        from miles_core.training.weight_sync import send_from_rank

        trainer = self.trainer
        policy = trainer.ema.swap_into(trainer.named_trainable()) if ema else nullcontext()
        with policy:
            answer = send_from_rank(
                trainer.modules,
                trainer.engine_dtypes,
                urls,
                self.config,
                lora_only=lora_only,
                sends=self.rank == 0,
                path=path,
                api_key=api_key,
            )
        return answer if self.rank == 0 else None

    def save_weights(self, out: str) -> None:
        """The run's final weights under ``out``, written by rank 0
        (:func:`~miles_core.training.final_weights.save_final_weights`)."""
        from miles_core.training.final_weights import save_final_weights

        save_final_weights(self.trainer, Path(out), writes=self.rank == 0)

    def trainable_state(self) -> Any:
        state = self.trainer.trainable_state()
        return state if self.rank == 0 else None

    def ema_state(self) -> Any:
        state = self.trainer.ema.state_dict()
        return state if self.rank == 0 else None

    def optimizer_state(self) -> Any:
        state = self.trainer.optimizer_state()
        return state if self.rank == 0 else None

    def load_trainable_state(self, state: Any) -> None:
        self.trainer.load_trainable_state(state)

    def load_optimizer_state(self, state: Any) -> None:
        self.trainer.load_optimizer_state(state)

    def load_ema_state(self, state: Any) -> None:
        self.trainer.ema.load_state_dict(state)

    def save_sharded(self, directory: str, optimizer: bool) -> dict[str, Any]:
        """Write this rank's shards into ``directory`` (a sharded checkpoint, nothing
        gathered); every rank returns the same record of what the ranks wrote."""
        from pathlib import Path

        from miles_core.training.sharded_checkpoint import write_shards

        return write_shards(self.trainer, Path(directory), optimizer=optimizer).to_record()

    def load_sharded(self, directory: str, record: dict[str, Any], optimizer: bool) -> None:
        """Read this rank's part of a sharded checkpoint saved at any world size."""
        from pathlib import Path

        from miles_core.training.sharded_checkpoint import ShardedPart, read_shards

        read_shards(self.trainer, Path(directory), ShardedPart.from_record(record, Path(directory)), optimizer=optimizer)

    def set_optimizer_steps(self, steps: int) -> None:
        self.trainer.optimizer_steps = steps

    def memory_report(self) -> dict[str, Any]:
        """This rank's memory: the audit of its trainer's tensors by role and device
        (:func:`~miles_core.training.offload.run_memory_report`, ``{role: {device:
        bytes}}``) and the process's resident and peak RSS in bytes (``bench/memory.py``)."""
        import resource

        from miles_core.training.offload import run_memory_report

        with open("/proc/self/statm", encoding="ascii") as statm:  # Linux: pages, the second field resident
            rss = int(statm.read().split()[1]) * resource.getpagesize()
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss)  # KiB on Linux, updated lazily
        return {"tensors": run_memory_report(self.trainer, None).as_dict(), "rss": rss, "peak_rss": peak}

    def rng_state(self) -> Any:
        from miles_core.training.fsdp import rank_rng_state

        return rank_rng_state()

    def restore_rng(self, states: Any) -> bool:
        """Rank ``r``'s saved state when the world size matches, else a reseed from
        ``(--seed, rank)``; True when the saved state was restored."""
        from miles_core.training.fsdp import restore_rank_rng

        return restore_rank_rng(states, rank=self.rank, world_size=self.world, seed=self.config.seed)

    def close(self) -> None:
        from miles_core.training.fsdp import destroy_process_group
        from miles_core.training.weight_sync import close_weight_groups

        asyncio.run(close_weight_groups())  # rank 0's weight-update groups (--weight-sync-path distributed)
        destroy_process_group()


class _RankEma:
    """The ranks' EMA as the run loop sees it: its state is fetched from the ranks when a
    checkpoint asks for it, and loaded on the ranks; the ranks swap it in themselves
    (``--ema-rollout-policy ema``: :meth:`TrainRank.send_weights`)."""

    def __init__(self, owner: RayTrainer) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, Any]:
        return self._owner._on_ranks("ema_state")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._owner._on_ranks("load_ema_state", state)


class RayTrainer:
    """The run loop's trainer when the training ranks are Ray actors (see the module
    docstring). It holds no model: ``modules`` is empty."""

    modules: dict[str, Any] = {}
    """No module lives in the driver (the ranks hold the trainable weights)."""

    def __init__(self, config: Any, runtime: RayRuntime) -> None:
        import ray

        from miles_core.config.sync_path import ranks_sync_path

        self.config = config
        self.sync_path = ranks_sync_path(config, gpus=runtime.plan.device == "GPU")
        """The path of every weight sync, decided here from the placement (a rank's own
        devices may differ from the driver's)."""
        self.on_progress = None
        self.last_pairs: list = []
        self._ray = ray
        self._steps = 0
        # One rank call at a time: the ranks must meet every collective in the same order,
        # and a background re-sync (fault tolerance) may call from another thread.
        self._calls = threading.Lock()
        world = config.world_size
        env = {str(k): str(v) for k, v in (config.train_env_vars or {}).items()}
        actor = ray.remote(TrainRank)
        self.ranks = [
            actor.options(**runtime.options(runtime.plan.train[rank], runtime.plan.train_share, env)).remote(config, rank, world)
            for rank in range(world)
        ]
        try:
            master = task_result(self.ranks[0].address.remote())
            # Each rank seeds torch with --seed before it builds its trainer, so a LoRA's
            # initial adapters are the one-process run's; FSDP2 starts every rank from
            # rank 0's weights (fsdp.same_starting_weights).
            self._on_ranks("setup", *master)
            keeps_ema = self._on_ranks("keeps_ema")[0]
        except BaseException:
            self.close()
            raise
        self.ema = _RankEma(self) if keeps_ema else None

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    @optimizer_steps.setter
    def optimizer_steps(self, steps: int) -> None:
        self._steps = steps
        self._on_ranks("set_optimizer_steps", steps)

    def _on_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank at once; an error a rank raised is raised here
        as itself (a ValueError stays one)."""
        with self._calls:
            refs = [self._ray.put(arg) for arg in args]  # one copy in the object store for all ranks
            return task_result([getattr(rank, method).remote(*refs) for rank in self.ranks])

    # -- the run loop's interface ----------------------------------------------------------

    def train_rollout(self, samples: Sequence[Any], advantages: Any, lr_at: Any = None) -> dict[str, Any]:
        results = self._on_ranks("train_rollout", list(samples), advantages, lr_at)
        self.last_pairs = [pair for _, pairs, _ in results for pair in pairs]
        return self._advance(results)

    def train_sft(self, rows: Sequence[Any], params: Any, lr_at: Any = None) -> dict[str, Any]:
        return self._advance(self._on_ranks("train_sft", list(rows), params, lr_at))

    def offload(self) -> None:
        """``--offload-train``: every rank offloads its state (the engines hold their own
        copy of the weights, synced from the ranks)."""
        self._on_ranks("offload")

    def reload(self) -> None:
        self._on_ranks("reload")

    def _advance(self, results: list[tuple[dict[str, Any], list, int]]) -> dict[str, Any]:
        """Rank 0's metrics (every rank's are the global ones)."""
        metrics, _, steps = results[0]
        self._steps = steps
        return metrics

    def sft_params(self) -> Any:
        return self._on_ranks("sft_params")[0]

    def trainable_state(self) -> dict[str, Any]:
        """The trainable weights gathered from the ranks into the driver (a checkpoint of
        a LoRA, or of a run that does not save sharded)."""
        return self._on_ranks("trainable_state")[0]

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        self._on_ranks("load_trainable_state", state)

    async def sync_to_engine(self, engine: Any, *, ema: bool = False) -> Any:
        """Weight sync from the ranks to every server of ``engine`` (an
        :class:`~miles_core.engine.http.HttpEngine`) that takes weight updates: the ranks
        gather and rank 0 posts (:meth:`TrainRank.send_weights`); then each server's
        checksums must equal those of what rank 0 sent. Under fault tolerance a server
        that stops answering is marked down and the sync goes on to the others, as
        :meth:`HttpEngine.update_weights_from_tensors` does."""
        from miles_core.errors import EngineRequestError, WeightGroupError
        from miles_core.training.weight_sync import SyncResult, check_checksums, sync_lora_only

        began = time.perf_counter()
        lora_only = sync_lora_only(self.config)
        supervisor = getattr(engine, "supervisor", None)
        api_key = getattr(engine, "api_key", None)  # the engine servers' key, which rank 0's requests carry
        while True:
            urls = engine.weight_urls()
            answer = (await asyncio.to_thread(self._on_ranks, "send_weights", urls, lora_only, ema, self.sync_path, api_key))[0]
            if answer.get("failure"):  # --weight-sync-path distributed: the group could not be made or used
                message, exit_code = answer["failure"]
                raise WeightGroupError(message, startup=exit_code == 2)
            if answer["error"] is None:
                break
            url, status, message = answer["error"]
            if supervisor is None or status is not None:
                raise EngineRequestError(url, status, message)
            supervisor.mark_down(next((u for u in urls if url.startswith(u)), url), f"a request got no answer: {message}")
        result = SyncResult(bytes=answer["bytes"], checksums=answer["checksums"])
        await check_checksums(engine, result.checksums, lora_only=lora_only)
        result.seconds = time.perf_counter() - began
        return result

    def save_weights(self, out: Path) -> None:
        """The run's final weights, written by the ranks (nothing passes through here)."""
        self._on_ranks("save_weights", str(out))

    def optimizer_state(self) -> dict[str, Any]:
        return self._on_ranks("optimizer_state")[0]

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._on_ranks("load_optimizer_state", state)

    def rank_rng_states(self) -> list[Any]:
        return self._on_ranks("rng_state")

    def rank_memory_reports(self) -> list[dict[str, Any]]:
        """Every rank's :meth:`TrainRank.memory_report`, in rank order."""
        return self._on_ranks("memory_report")

    def save_sharded(self, directory: Any, *, optimizer: bool = True) -> Any:
        """Have every rank write its shards into ``directory`` (the driver gathers nothing);
        the :class:`~miles_core.training.sharded_checkpoint.ShardedPart` they report."""
        from miles_core.training.sharded_checkpoint import ShardedPart

        record = self._on_ranks("save_sharded", str(directory), optimizer)[0]
        return ShardedPart.from_record(record, directory)

    def load_sharded(self, directory: Any, part: Any, *, optimizer: bool = True) -> None:
        """Have every rank read its part of a sharded checkpoint."""
        self._on_ranks("load_sharded", str(directory), part.to_record(), optimizer)

    def restore_rank_rng(self, states: Sequence[Any] | None) -> bool:
        """Give the ranks their saved RNG states (see :meth:`TrainRank.restore_rng`)."""
        return all(self._on_ranks("restore_rng", states))

    def close(self) -> None:
        """Leave the process group and stop the rank actors."""
        for rank in self.ranks:
            try:
                self._ray.get(rank.close.remote(), timeout=30)
            except Exception:  # a rank that already died: nothing to leave
                pass
            self._ray.kill(rank)
        self.ranks = []


__all__ = ["RayTrainer", "TrainRank"]
