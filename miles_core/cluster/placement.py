"""Where a Ray run puts its work: one placement group whose bundles are the training
ranks' devices, then the engines' (unless ``--colocate``), then the reward worker's.

The plan is computed from the cluster flags alone (no Ray import), so it can be checked
and printed before anything starts:

- training: ``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` bundles, one per rank;
- engines (the servers the run starts, ``--rollout-num-engines``): each takes
  ``--rollout-num-gpus-per-engine`` bundles; ``--rollout-num-gpus``, when given, must
  equal engines x GPUs per engine. Under ``--colocate`` the engines take turns with the
  trainer on the training bundles instead of bundles of their own;
- the reward worker: one bundle of one CPU (``--colocate-reward``: a 0.05 share of the
  first rollout device instead, as the reference places it).

On a machine without GPUs a CPU stands in for each GPU: a "device" bundle is
``{"CPU": 1}`` rather than ``{"GPU": 1, "CPU": 1}``, so the same flags place the same
number of actors. ``--num-gpus-per-node``, when given, caps the devices per node: a
training node or an engine asking for more is refused before Ray starts.
"""

from __future__ import annotations

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
    reward: int | None = None
    """The reward worker's bundle (None: the reward runs in the driver)."""
    device: str = "CPU"
    """``GPU``, or ``CPU`` where CPUs stand in for GPUs."""
    train_share: float = 1.0
    """The share of its device a training rank asks for (below 1 when engines or the
    reward are colocated on it)."""
    engine_share: float = 1.0
    reward_share: float = 1.0

    @property
    def cpus(self) -> float:
        return sum(bundle.get("CPU", 0.0) for bundle in self.bundles)

    def describe(self) -> str:
        """One line for the run's log."""
        parts = [f"{len(self.train)} training rank(s)"]
        if self.engines:
            shared = " on the training devices (--colocate)" if self.engines and set(self.engines[0]) <= set(self.train) else ""
            parts.append(f"{len(self.engines)} engine(s) x {len(self.engines[0])} {self.device}{shared}")
        if self.reward is not None:
            parts.append("a reward worker")
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
    reward = None
    reward_share = 1.0
    if reward_worker:
        if config.colocate_reward and engine_bundles:
            reward, reward_share = engine_bundles[0][0], 0.05
        else:
            bundles.append({"CPU": 1.0})
            reward = len(bundles) - 1
    # Colocated roles split a device as the reference does: train 0.7, rollout 0.25, reward 0.05.
    train_share = 0.7 if colocate and engine_bundles else 1.0
    engine_share = 0.25 if colocate else 1.0
    return PlacementPlan(
        bundles=bundles,
        train=train,
        engines=engine_bundles,
        reward=reward,
        device=device,
        train_share=train_share,
        engine_share=engine_share,
        reward_share=reward_share,
    )


__all__ = ["PlacementError", "PlacementPlan", "plan_placement"]
