"""Training ranks as Ray actors, and the driver-side trainer that drives them.

Each :class:`TrainRank` actor loads the family, joins the torch.distributed group (gloo on
CPU, nccl on GPU) and builds the FSDP2-sharded :class:`~miles_core.training.trainer.Trainer`
for its rank. The driver keeps a :class:`RayTrainer`: it has the interface the run loop
uses on a one-process trainer, and a full copy of the trainable weights (the "mirror",
on the driver's own family, which the embedded engine samples and weight sync reads).

A rollout's training: every rank gets the whole rollout (one object in Ray's store) and
trains its share (``--train-dp-split-mode``); then the full trainable state (and the
EMA's) is gathered from the shards and loaded into the mirror. The ranks' gather is a
collective, so every call that gathers or loads goes to all ranks at once.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from miles_core.cluster.runtime import RayRuntime, task_result


class TrainRank:
    """One training rank (made a Ray actor by :class:`RayTrainer`)."""

    def __init__(self, config: Any, rank: int, world: int) -> None:
        self.config = config
        self.rank = rank
        self.world = world
        self.trainer: Any = None

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

        from miles_core.engine.factory import sde_backend
        from miles_core.model_loading import load_family
        from miles_core.plugin_manager import get_host
        from miles_core.training.fsdp import init_from_config
        from miles_core.training.trainer import Trainer

        config = self.config
        init_from_config(config, self.rank, master_addr=master_addr, master_port=master_port)
        torch.manual_seed(config.seed)
        if config.deterministic_mode:
            torch.use_deterministic_algorithms(True)
        loss_fn = get_host().registries.loss.get(config.loss_type).load()
        self.trainer = Trainer(load_family(config), config, sde_backend(config), loss_fn, dp_rank=self.rank)
        return len(self.trainer.parameters)

    def train_rollout(self, samples: Sequence[Any], advantages: Any, lr_at: Any) -> tuple[dict[str, Any], list, int]:
        metrics = self.trainer.train_rollout(samples, advantages, lr_at)
        return metrics, self._pairs(), self.trainer.optimizer_steps

    def train_sft(self, rows: Sequence[Any], params: Any, lr_at: Any) -> tuple[dict[str, Any], list, int]:
        metrics = self.trainer.train_sft(rows, params, lr_at)
        return metrics, [], self.trainer.optimizer_steps

    def _pairs(self) -> list:
        return list(self.trainer.last_pairs) if self.config.save_debug_train_data else []

    # Gathers and loads: collectives, called on every rank together; rank 0 answers.

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

    def set_optimizer_steps(self, steps: int) -> None:
        self.trainer.optimizer_steps = steps

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

        destroy_process_group()


class _MirrorEma:
    """The driver's EMA: the mirror's, loaded from the ranks after each rollout; loading
    a state (a resumed run) loads it on the ranks too."""

    def __init__(self, owner: RayTrainer) -> None:
        self._owner = owner
        self._local = owner.local.ema

    def state_dict(self) -> dict[str, Any]:
        return self._local.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._local.load_state_dict(state)
        self._owner._on_ranks("load_ema_state", state)

    def swap_into(self, named: Any) -> Any:
        return self._local.swap_into(named)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)


class RayTrainer:
    """The run loop's trainer when the training ranks are Ray actors (see the module
    docstring). ``local`` is a one-process trainer on the driver's family: its modules
    are the mirror; it never takes an optimizer step itself."""

    def __init__(self, local: Any, config: Any, runtime: RayRuntime) -> None:
        import ray

        self.local = local
        self.config = config
        self.family = local.family
        self.modules = local.modules
        self.on_progress = None
        self.last_pairs: list = []
        self._ray = ray
        world = config.world_size
        env = {str(k): str(v) for k, v in (config.train_env_vars or {}).items()}
        actor = ray.remote(TrainRank)
        self.ranks = [
            actor.options(**runtime.options(runtime.plan.train[rank], runtime.plan.train_share, env)).remote(config, rank, world)
            for rank in range(world)
        ]
        try:
            master = task_result(self.ranks[0].address.remote())
            self._on_ranks("setup", *master)
            if config.use_lora:
                # Adapter initialisation draws from each process's RNG: start every rank
                # from the driver's adapters, bit for bit.
                self._on_ranks("load_trainable_state", local.trainable_state())
        except BaseException:
            self.close()
            raise
        self.ema = _MirrorEma(self) if local.ema is not None else None

    @property
    def optimizer_steps(self) -> int:
        return self.local.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, steps: int) -> None:
        self.local.optimizer_steps = steps
        self._on_ranks("set_optimizer_steps", steps)

    def _on_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank at once; an error a rank raised is raised here
        as itself (a ValueError stays one)."""
        refs = [self._ray.put(arg) for arg in args]  # one copy in the object store for all ranks
        return task_result([getattr(rank, method).remote(*refs) for rank in self.ranks])

    def _pull(self) -> None:
        """Load the ranks' full state into the mirror."""
        self.local.load_trainable_state(self._on_ranks("trainable_state")[0])
        if self.local.ema is not None:
            self.local.ema.load_state_dict(self._on_ranks("ema_state")[0])

    # -- the run loop's interface ----------------------------------------------------------

    def named_trainable(self) -> dict[str, Any]:
        return self.local.named_trainable()

    def train_rollout(self, samples: Sequence[Any], advantages: Any, lr_at: Any = None) -> dict[str, Any]:
        results = self._on_ranks("train_rollout", list(samples), advantages, lr_at)
        self.last_pairs = [pair for _, pairs, _ in results for pair in pairs]
        return self._advance(results)

    def train_sft(self, rows: Sequence[Any], params: Any, lr_at: Any = None) -> dict[str, Any]:
        return self._advance(self._on_ranks("train_sft", list(rows), params, lr_at))

    def _advance(self, results: list[tuple[dict[str, Any], list, int]]) -> dict[str, Any]:
        """Mirror the ranks' new state; rank 0's metrics (every rank's are the global ones)."""
        self._pull()
        metrics, _, steps = results[0]
        self.local.optimizer_steps = steps
        return metrics

    def trainable_state(self) -> dict[str, Any]:
        return self.local.trainable_state()

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        self.local.load_trainable_state(state)
        self._on_ranks("load_trainable_state", state)

    def optimizer_state(self) -> dict[str, Any]:
        return self._on_ranks("optimizer_state")[0]

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._on_ranks("load_optimizer_state", state)

    def rank_rng_states(self) -> list[Any]:
        return self._on_ranks("rng_state")

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
