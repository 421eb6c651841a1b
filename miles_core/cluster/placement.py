"""Where a Ray run puts its work: one placement group whose bundles are the training
ranks' devices, then the engines' (unless ``--colocate``), then the reward workers'.

The plan is computed from the cluster flags alone (no Ray import), so it can be checked
and printed before anything starts:

- training: ``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` bundles, one per rank;
- engines (the servers the run starts, ``--rollout-num-engines``): each takes
  ``--rollout-num-gpus-per-engine`` bundles; ``--rollout-num-gpus``, when given, must
  equal engines x GPUs per engine. Under ``--colocate`` the engines take turns with the
  trainer on the training bundles instead of bundles of their own;
- the reward workers (``--reward-num-workers``): one bundle each,
  ``{"GPU": G, "CPU": 1}`` with G = ``--reward-num-gpus-per-worker`` on a GPU cluster
  (fractions share a GPU), ``{"CPU": 1}`` with G = 0 or where CPUs stand in for GPUs.
  ``--colocate-reward`` puts worker i on a 0.05 share of the i-th rollout device instead,
  as the reference places its reward next to colocated engines and trainer.

On a machine without GPUs a CPU stands in for each GPU: a "device" bundle is
``{"CPU": 1}`` rather than ``{"GPU": 1, "CPU": 1}``, so the same flags place the same
number of actors. ``--num-gpus-per-node``, when given, caps the devices per node: a
training node or an engine asking for more is refused before Ray starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import PlacementError


@dataclass(frozen=True)
class PlacementPlan:
    """Bundle indices of a run's placement group, by role."""

    bundles: list[dict[str, float]]
    """The placement group's bundles, in order."""
    train: list[int]
    """One bundle per training rank (rank ``r`` in ``train[r]``)."""
    engines: list[list[int]] = field(default_factory=list)
    """Per engine server the run starts, its bundles (shared with training under ``--colocate``)."""
    rewards: list[int] = field(default_factory=list)
    """Per reward worker, its bundle (empty: the reward runs in the driver)."""
    device: str = "CPU"
    """``GPU``, or ``CPU`` where CPUs stand in for GPUs."""
    train_share: float = 1.0
    """The share of its device a training rank asks for (below 1 when engines or the
    reward are colocated on it)."""
    engine_share: float = 1.0
    reward_share: float = 1.0
    """The CPU share each reward worker asks for on its bundle."""
    reward_gpus: float = 0.0
    """The GPUs each reward worker asks for (0: none, its reward runs on the CPU)."""

    @property
    def reward(self) -> int | None:
        """The first reward worker's bundle (None: no reward worker)."""
        return self.rewards[0] if self.rewards else None

    @property
    def cpus(self) -> float:
        return sum(bundle.get("CPU", 0.0) for bundle in self.bundles)

    def describe(self) -> str:
        """One line for the run's log."""
        parts = [f"{len(self.train)} training rank(s)"]
        if self.engines:
            shared = " on the training devices (--colocate)" if self.engines and set(self.engines[0]) <= set(self.train) else ""
            parts.append(f"{len(self.engines)} engine(s) x {len(self.engines[0])} {self.device}{shared}")
        if self.rewards:
            count = "a reward worker" if len(self.rewards) == 1 else f"{len(self.rewards)} reward workers"
            parts.append(count + (f" x {self.reward_gpus:g} GPU" if self.reward_gpus else ""))
        stand_in = " (CPUs stand in for GPUs)" if self.device == "CPU" else ""
        return f"placement group of {len(self.bundles)} bundles{stand_in}: " + ", ".join(parts)


def _device_bundle(device: str) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": 1.0} if device == "GPU" else {"CPU": 1.0}


def plan_placement(config: Any, *, gpus: bool, engines: int = 0, reward_worker: bool = True) -> PlacementPlan:
    """The placement of a run: ``engines`` servers started by the run (0: the embedded
    engine, or servers given by URL), a reward worker when ``reward_worker``. ``gpus``:
    whether the cluster's devices are GPUs (otherwise CPUs stand in)."""
    device = "GPU" if gpus else "CPU"
    nodes = int(config.actor_num_nodes)
    per_node = int(config.actor_num_gpus_per_node)
    # The cap binds when given: "auto" counts the driver's GPUs, not the cluster nodes'.
    cap = int(config.num_gpus_per_node) if config.is_user_set("num_gpus_per_node") else 1 << 30
    if per_node > cap:
        raise PlacementError(
            f"--actor-num-gpus-per-node {per_node} exceeds --num-gpus-per-node {cap}: a training node cannot hold more "
            "devices than a node has"
        )
    per_engine = int(config.rollout_num_gpus_per_engine or 1)
    if per_engine < 1:
        raise PlacementError(f"--rollout-num-gpus-per-engine {per_engine}: must be at least 1")
    if engines and per_engine > cap:
        raise PlacementError(
            f"--rollout-num-gpus-per-engine {per_engine} exceeds --num-gpus-per-node {cap}: an engine server runs on one node"
        )
    world = nodes * per_node
    bundles = [_device_bundle(device) for _ in range(world)]
    train = list(range(world))
    colocate = bool(config.colocate)
    rollout_gpus = config.rollout_num_gpus
    engine_bundles: list[list[int]] = []
    if engines:
        wanted = engines * per_engine
        if colocate:
            if wanted > world:
                raise PlacementError(
                    f"--colocate: {engines} engine(s) x --rollout-num-gpus-per-engine {per_engine} = {wanted} devices, "
                    f"more than the {world} training devices they share"
                )
            engine_bundles = [train[i * per_engine : (i + 1) * per_engine] for i in range(engines)]
        else:
            if rollout_gpus is not None and rollout_gpus != wanted:
                raise PlacementError(
                    f"--rollout-num-gpus {rollout_gpus} does not match {engines} engine(s) x "
                    f"--rollout-num-gpus-per-engine {per_engine} = {wanted}"
                )
            for _ in range(engines):
                start = len(bundles)
                bundles.extend(_device_bundle(device) for _ in range(per_engine))
                engine_bundles.append(list(range(start, start + per_engine)))
    rewards: list[int] = []
    reward_share, reward_gpus = 1.0, 0.0
    if reward_worker:
        workers = int(config.reward_num_workers or 1)
        per_worker = float(config.reward_num_gpus_per_worker or 0.0)
        if config.colocate_reward and engine_bundles:
            devices = list(dict.fromkeys(bundle for engine in engine_bundles for bundle in engine))
            if workers > len(devices):
                raise PlacementError(
                    f"{config.given_name('reward_num_workers')} {workers} with --colocate-reward: a colocated reward worker "
                    f"takes a 0.05 share of a rollout device, one worker per device, and the engines have {len(devices)}"
                )
            rewards, reward_share = devices[:workers], 0.05
            reward_gpus = reward_share if device == "GPU" else 0.0
        else:
            if per_worker > 1 and not per_worker.is_integer():
                raise PlacementError(
                    f"{config.given_name('reward_num_gpus_per_worker')} {per_worker:g}: above 1 it must be a whole number "
                    "(Ray gives an actor a fraction of one GPU or whole GPUs)"
                )
            if device == "GPU" and per_worker > cap:
                raise PlacementError(
                    f"{config.given_name('reward_num_gpus_per_worker')} {per_worker:g} exceeds --num-gpus-per-node {cap}: "
                    "a reward worker runs on one node"
                )
            reward_gpus = per_worker if device == "GPU" else 0.0
            for _ in range(workers):
                bundles.append({"GPU": reward_gpus, "CPU": 1.0} if reward_gpus else {"CPU": 1.0})
                rewards.append(len(bundles) - 1)
    # Colocated roles split a device as the reference does: train 0.7, rollout 0.25, reward 0.05.
    train_share = 0.7 if colocate and engine_bundles else 1.0
    engine_share = 0.25 if colocate else 1.0
    return PlacementPlan(
        bundles=bundles,
        train=train,
        engines=engine_bundles,
        rewards=rewards,
        device=device,
        train_share=train_share,
        engine_share=engine_share,
        reward_share=reward_share,
        reward_gpus=reward_gpus,
    )


def check_reward_capacity(config: Any, plan: PlacementPlan, cluster: Mapping[str, float]) -> None:
    """Refuse reward workers that the cluster cannot hold beside the run's other bundles
    (``cluster``: Ray's total resources), before waiting on the placement group: a
    :class:`PlacementError` naming the flag. Other shortfalls are left to the placement
    group's own wait, which names every bundle."""
    own = [plan.bundles[i] for i in dict.fromkeys(plan.rewards) if i not in plan.train and not any(i in e for e in plan.engines)]
    if not own:
        return  # colocated on rollout devices: no bundles of their own
    others = [bundle for i, bundle in enumerate(plan.bundles) if i not in plan.rewards]
    for resource in ("CPU", "GPU"):
        rest = sum(bundle.get(resource, 0.0) for bundle in others)
        needed = rest + sum(bundle.get(resource, 0.0) for bundle in own)
        total = float(cluster.get(resource, 0.0))
        if rest <= total < needed:
            flag = "reward_num_gpus_per_worker" if resource == "GPU" else "reward_num_workers"
            value = config.get(flag)
            raise PlacementError(
                f"{config.given_name(flag)} {value:g}: {len(own)} reward worker bundle(s) of {own[0]} do not fit beside "
                f"the run's other {len(others)} bundle(s): together they need {needed:g} {resource} and the cluster has {total:g}"
            )


def engine_nodes(engines: list[list[int]], bundles_to_node_id: Mapping[Any, str]) -> list[str]:
    """The node of each engine, from the placement group's ``bundles_to_node_id`` (Ray's
    placement group table; keys bundle indices, as ints or strings). An engine server is
    one process tree on one node, so an engine whose bundles Ray put on several nodes is
    refused: a :class:`PlacementError` naming the engine and the nodes."""
    where = {int(bundle): str(node) for bundle, node in bundles_to_node_id.items()}
    nodes: list[str] = []
    for index, bundles in enumerate(engines):
        missing = [bundle for bundle in bundles if bundle not in where]
        if missing:
            raise PlacementError(f"engine {index}: bundles {missing} of the placement group are not on any node")
        held = list(dict.fromkeys(where[bundle] for bundle in bundles))
        if len(held) > 1:
            raise PlacementError(
                f"engine {index}: its bundles {bundles} are on {len(held)} nodes ({', '.join(held)}); an engine server runs "
                "on one node, so --rollout-num-gpus-per-engine must fit the devices of one node (see --num-gpus-per-node)"
            )
        nodes.append(held[0])
    return nodes


def device_env(device: str, gpu_ids: list[list[str | int]]) -> dict[str, str]:
    """The environment that gives an engine server exactly its bundles' devices: on GPUs
    ``CUDA_VISIBLE_DEVICES`` is the union of the GPU ids Ray assigned on each bundle, in
    bundle order; where CPUs stand in for GPUs there is nothing to set."""
    if device != "GPU":
        return {}
    ids = list(dict.fromkeys(str(gpu) for bundle in gpu_ids for gpu in bundle))
    if not ids:
        raise PlacementError("an engine on GPU bundles was assigned no GPU by Ray")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


__all__ = ["PlacementError", "PlacementPlan", "check_reward_capacity", "device_env", "engine_nodes", "plan_placement"]
