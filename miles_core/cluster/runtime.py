"""Connecting a run to Ray and holding its placement group.

``--ray-address ADDRESS`` joins a running cluster (``ray start --head`` on the head node;
``auto`` finds the local one). ``--use-ray`` alone starts a local Ray instance for the run
and stops it at the end; its logical CPU count is at least what the placement asks for, so
a small machine can run a 2-rank placement (Ray's CPU counts are for scheduling, not
pinned cores). A process that already called ``ray.init`` (a notebook, a test) keeps its
instance: the run neither starts nor stops Ray then.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from miles_core.cluster.placement import PlacementPlan, check_reward_capacity, plan_placement
from miles_core.config.determinism import deterministic_env
from miles_core.errors import ClusterError

READY_TIMEOUT = 120.0
"""Seconds to wait for the placement group's bundles before giving up."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError("--use-ray needs Ray, which is not installed here: pip install 'miles-core[ray]' (ray==2.60.0)") from None
    return ray


def task_result(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get(refs)``, with an error a task raised re-raised as itself (a ValueError
    stays a ValueError, a RewardError a RewardError) rather than wrapped in Ray's
    ``RayTaskError``; await :func:`task_value` for one reference inside an event loop."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        raise _cause(exc) from None


async def task_value(ref: Any) -> Any:
    """``await ref``, with a task's own error re-raised as in :func:`task_result`."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        raise _cause(exc) from None


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


class RayRuntime:
    """A run's Ray connection and placement group (see :func:`start`)."""

    def __init__(self, ray: Any, plan: PlacementPlan, group: Any, started_here: bool, env_vars: dict[str, str] | None = None) -> None:
        self.ray = ray
        self.plan = plan
        self.group = group
        self.started_here = started_here
        self.env_vars = dict(env_vars or {})
        """What every actor of the run gets in its environment (``--deterministic-mode``'s)."""

    @classmethod
    def start(
        cls, config: Any, *, engines: int = 0, reward_worker: bool = False, log: Callable[[str], None] = lambda line: None
    ) -> RayRuntime:
        """Connect (or start a local Ray), then reserve the run's placement group; a
        :class:`ClusterError` names what is missing when it cannot be placed."""
        from miles_core.machine import visible_gpu_count

        ray = import_ray()
        started_here = not ray.is_initialized()
        plan = None
        if started_here and config.ray_address:
            try:
                ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterError(f"--ray-address {config.ray_address}: cannot connect to a Ray cluster there: {exc}") from None
        elif started_here:
            # A local instance has this machine's devices; logical CPUs: enough for the
            # placement even on a 2-core machine.
            plan = plan_placement(config, gpus=visible_gpu_count() > 0, engines=engines, reward_worker=reward_worker)
            ray.init(num_cpus=max(math.ceil(plan.cpus), os.cpu_count() or 1), include_dashboard=False, log_to_driver=True)
        if plan is None:  # a running cluster: its own devices
            try:
                plan = plan_placement(config, gpus=ray.cluster_resources().get("GPU", 0) > 0, engines=engines, reward_worker=reward_worker)
            except ValueError:
                if started_here:
                    ray.shutdown()
                raise
        from ray.util.placement_group import placement_group, remove_placement_group

        try:
            check_reward_capacity(config, plan, ray.cluster_resources())
        except ValueError:
            if started_here:
                ray.shutdown()
            raise
        group = placement_group(plan.bundles, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=READY_TIMEOUT)
        except Exception as exc:  # GetTimeoutError, or the group was removed
            remove_placement_group(group)
            available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            if started_here:
                ray.shutdown()
            raise ClusterError(
                f"the cluster cannot place {len(plan.bundles)} bundles ({plan.describe()}) within {READY_TIMEOUT:g} s; "
                f"available: {available} ({type(exc).__name__})"
            ) from None
        log(plan.describe())
        return cls(ray, plan, group, started_here, deterministic_env(config))

    def options(self, bundle: int, share: float = 1.0, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        """``.options(...)`` for an actor on ``bundle`` taking ``share`` of its device, its
        environment the run's (:attr:`env_vars`) with ``env_vars`` over it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=bundle,
            ),
            "num_cpus": share,
            "num_gpus": share if self.plan.device == "GPU" and "GPU" in self.plan.bundles[bundle] else 0,
        }
        env = {**self.env_vars, **(env_vars or {})}
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    def shutdown(self) -> None:
        """Release the placement group; stop Ray if this run started it."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        finally:
            if self.started_here:
                self.ray.shutdown()


__all__ = ["ClusterError", "RayRuntime", "import_ray", "task_result", "task_value"]
