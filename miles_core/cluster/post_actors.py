"""``--use-distributed-post``: rollout requests posted from the engines' own nodes.

Each node that holds an engine of the run gets ``MILES_HTTP_POST_ACTORS_PER_NODE`` (default
1) :class:`PostActor` actors, pinned to it. The run's :class:`~miles_core.engine.http.HttpEngine`
still decides where each request goes (least busy server, ``--sglang-server-concurrency``,
retries and health checks under ``--use-fault-tolerance``); :class:`DistributedPoster`, its
:class:`~miles_core.engine.http.Poster`, hands the request for engine URL ``u`` to an actor
on ``u``'s node (round robin among that node's actors), which posts ``/rollout/generate``,
decodes the answer there (msgpack and safetensors, as the driver would) and returns the
decoded records: the driver receives only those, and the response bytes never cross nodes.
Weight updates and checksums are not requests of this kind and go from the driver as before.

The actors ask for no CPU (they wait on the network) and live outside the placement group.
A post actor that dies is replaced; the request it held fails as if its engine had not
answered (retried elsewhere under ``--use-fault-tolerance``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
from collections.abc import Callable
from typing import Any

from miles_core.config.distributed_post import post_actors_per_node
from miles_core.engine.http import GENERATE, HttpEngine
from miles_core.errors import EngineRequestError
from miles_core.request import RolloutOutput, RolloutRequest

_UNCAPPED = 1 << 20
"""The actor's own client adds no cap: the driver's balancer holds the places."""


class PostActor:
    """Made a Ray actor (async) by :class:`DistributedPoster`, one of a node's."""

    def __init__(self, decode_workers: int, connect_timeout: float, api_key: str | None = None) -> None:
        self.decode_workers = decode_workers
        self.connect_timeout = connect_timeout
        self.api_key = api_key  # the engines' key (a constructor argument, never the actor's runtime_env)
        self.clients: dict[tuple[str, float | None], Any] = {}
        self.posted: collections.Counter[str] = collections.Counter()
        """Requests this actor posted, by engine URL."""

    async def generate(self, url: str, request: RolloutRequest, timeout: float | None) -> tuple[str, Any]:
        """``("ok", records)``, or ``("error", (url, status, message))`` for an
        :class:`EngineRequestError` (re-raised by the driver as that error)."""
        client = self.clients.get((url, timeout))
        if client is None:
            client = HttpEngine(
                [url],
                max_concurrency=_UNCAPPED,
                request_timeout=timeout,
                connect_timeout=self.connect_timeout,
                decode_workers=self.decode_workers,
                api_key=self.api_key,
            )
            self.clients[(url, timeout)] = client
        self.posted[url] += 1
        try:
            return "ok", await client.generate(request)
        except EngineRequestError as exc:
            return "error", (exc.url, exc.status, exc.message)

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def report(self) -> dict[str, Any]:
        """Its node, process and requests posted by URL."""
        return {**self.where(), "posted": dict(self.posted)}

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        self.clients = {}


class DistributedPoster:
    """The run's post actors (see the module docstring). ``nodes()`` maps each engine URL
    to the Ray node id holding it; it is asked again for a URL it did not know (a
    restarted engine's new URL, on the same bundles)."""

    def __init__(
        self,
        nodes: Callable[[], dict[str, str]],
        *,
        per_node: int,
        env_vars: dict[str, str] | None = None,
        decode_workers: int = 1,
        connect_timeout: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        import ray

        self._ray = ray
        self.env_vars = dict(env_vars or {})
        """The actors' environment (the run's, :attr:`RayRuntime.env_vars <miles_core.cluster.runtime.RayRuntime.env_vars>`)."""
        self._nodes = nodes
        self.node_of: dict[str, str] = {}
        self.per_node = per_node
        self.decode_workers = decode_workers
        self.connect_timeout = connect_timeout
        self.api_key = api_key
        """The engines' key, which the actors' requests carry (None: none)."""
        self.actors: dict[str, list[Any]] = {}
        """The post actors, by node id."""
        self._turn: dict[str, itertools.count] = {}
        self.reports: list[dict[str, Any]] = []
        """What each actor posted (:meth:`PostActor.report`), filled by :meth:`close`."""

    @classmethod
    def start(cls, config: Any, runtime: Any, fleet: Any, *, api_key: str | None = None) -> DistributedPoster:
        """The post actors of ``fleet``'s nodes, started and answering; their requests carry
        ``api_key`` (the engines' key)."""
        poster = cls(
            lambda: {placement.url: placement.node_id for placement in fleet.placements()},
            per_node=post_actors_per_node(),
            env_vars=runtime.env_vars,
            decode_workers=config.rollout_parser_num_workers or 1,
            api_key=api_key,
        )
        return poster.ready()

    def ready(self) -> DistributedPoster:
        """Start the actors of every engine's node and wait until they answer."""
        self.node_of = self._nodes()
        try:
            for node in dict.fromkeys(self.node_of.values()):
                self._actors(node)
            self._ray.get([actor.where.remote() for actors in self.actors.values() for actor in actors])
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = {
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        }
        if self.env_vars:
            options["runtime_env"] = {"env_vars": self.env_vars}
        return self._ray.remote(PostActor).options(**options).remote(self.decode_workers, self.connect_timeout, self.api_key)

    def _actors(self, node: str) -> list[Any]:
        actors = self.actors.get(node)
        if actors is None:
            actors = self.actors[node] = [self._spawn(node) for _ in range(self.per_node)]
            self._turn[node] = itertools.count()
        return actors

    async def _node(self, url: str) -> str:
        if url not in self.node_of:
            self.node_of = await asyncio.to_thread(self._nodes)
        node = self.node_of.get(url)
        if node is None:
            raise EngineRequestError(
                url + GENERATE, None, "--use-distributed-post: no engine of the run has this URL, so no node to post from"
            )
        return node

    async def generate(self, url: str, request: RolloutRequest, timeout: float | None) -> list[RolloutOutput]:
        node = await self._node(url)
        actors = self._actors(node)
        which = next(self._turn[node]) % len(actors)
        actor = actors[which]
        ref = actor.generate.remote(url, request, timeout)
        try:
            kind, value = await ref
        except asyncio.CancelledError:
            self._ray.cancel(ref)
            raise
        except self._ray.exceptions.RayActorError as exc:
            if actors[which] is actor:  # the first of its requests to fail replaces it
                actors[which] = self._spawn(node)
            raise EngineRequestError(url + GENERATE, None, f"its post actor on node {node} died ({type(exc).__name__})") from None
        if kind == "error":
            raise EngineRequestError(*value)
        return value

    def close(self, timeout: float = 30.0) -> None:
        """Keep each actor's report (:attr:`reports`), then stop the actors."""
        actors = [actor for node_actors in self.actors.values() for actor in node_actors]
        self.actors = {}
        for actor in actors:
            try:
                self.reports.append(self._ray.get(actor.report.remote(), timeout=timeout))
                self._ray.get(actor.close.remote(), timeout=timeout)
            except Exception:  # an actor that died has nothing to report
                pass
            self._ray.kill(actor)


__all__ = ["DistributedPoster", "PostActor"]
