"""A fleet across nodes, for real: a Ray cluster of two nodes on this machine
(``tests/ray_nodes.py``: ``ray start --head`` and ``ray start --address``, 2 CPUs each),
joined by the runs with ``--ray-address``.

- a 2-rollout training with one engine server on each node, its requests posted from the
  engines' nodes (``--use-distributed-post``), gives the metrics of the same fleet on one
  node without Ray, bit for bit; each engine's URL host is its node's IP, and, since both
  nodes share that IP here, each server runs in the process tree of its own node's raylet
  (not the other's);
- every request was posted by a post actor on its engine's node
  (``MILES_HTTP_POST_ACTORS_PER_NODE`` of them per node), and no response was decoded in
  the driver (the run without the flag, the control, decodes each one there);
- a bad ``MILES_HTTP_POST_ACTORS_PER_NODE``, or the flag without Ray: one-line errors, exit 2.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
import ray

import miles_core.engine.http as http_engine
from miles_core.cluster.session import RaySession
from tests.ray_nodes import LocalRayCluster, kill_actor, two_node_cluster  # noqa: F401  (the fixture)
from tests.tiny_runs import run_metrics, tiny_run_args

FLEET = ("--rollout-engine", "http", "--rollout-num-engines", "2")
ROLLOUTS, PROMPTS, SAMPLES, PER_REQUEST = 2, 2, 2, 2


def _args(tiny_sd3: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        *tiny_run_args(tiny_sd3, prompts, out, batch=PROMPTS, n=SAMPLES, steps=2, sde_steps=1),
        "--num-rollout",
        str(ROLLOUTS),
        "--lr",
        "3e-2",
        "--use-lora",
        "--lora-rank",
        "2",
        "--global-batch-size",
        "2",
        *FLEET,
        *extra,
    ]


def _outcome(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


@pytest.fixture(scope="module")
def one_thread() -> Any:
    # Ray gives an actor of one CPU one thread (its servers inherit it); the fleet without
    # Ray gets the same through this environment. The comparisons below are exact.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("MKL_NUM_THREADS", "1")
        yield patch


class Observed:
    """What a run's Ray session started, seen from the driver while the run ran, and the
    responses the driver decoded itself."""

    def __init__(self, cluster: LocalRayCluster | None = None) -> None:
        self.cluster = cluster
        self.placements: list[Any] = []
        self.node_ips: dict[str, str] = {}
        self.ancestors: dict[int, list[int]] = {}
        self.raylets: dict[str, int] = {}
        self.posters: list[Any] = []
        self.driver_decodes = 0

    def record(self, patch: pytest.MonkeyPatch) -> None:
        """Wrap the real session methods and decoder with ``patch`` to record into this."""
        engine_fleet, poster, unpack = RaySession.engine_fleet, RaySession.poster, http_engine.unpack_outputs

        def recording_fleet(session: RaySession, log_dir: Any, **kw: Any) -> Any:
            fleet = engine_fleet(session, log_dir, **kw)
            self.seen_fleet(fleet)
            return fleet

        def recording_poster(session: RaySession, fleet: Any, **kw: Any) -> Any:
            self.posters.append(poster(session, fleet, **kw))
            return self.posters[-1]

        def counting_unpack(raw: Any) -> Any:
            self.driver_decodes += 1
            return unpack(raw)

        patch.setattr(RaySession, "engine_fleet", recording_fleet)
        patch.setattr(RaySession, "poster", recording_poster)
        patch.setattr(http_engine, "unpack_outputs", counting_unpack)

    def seen_fleet(self, fleet: Any) -> None:
        assert self.cluster is not None
        self.placements = fleet.placements()
        self.node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        self.raylets = {node_id: self.cluster.raylet_pid(node_id) for node_id in self.cluster.node_ids}
        self.ancestors = {p.index: [parent.pid for parent in psutil.Process(p.pid).parents()] for p in self.placements}


REQUESTS = ROLLOUTS * PROMPTS * SAMPLES // PER_REQUEST
"""``/rollout/generate`` requests of a run: one per microgroup of 2 samples."""


@pytest.fixture(scope="module")
def one_node(tiny_sd3: Path, prompts: Path, tmp_path_factory: Any, one_thread: pytest.MonkeyPatch) -> tuple[list[dict], Observed]:
    """The fleet of two engines without Ray, on this process's node: the reference."""
    seen = Observed()
    with pytest.MonkeyPatch.context() as patch:
        seen.record(patch)
        records = run_metrics(_args(tiny_sd3, prompts, tmp_path_factory.mktemp("one_node")))
    return records, seen


@pytest.fixture(scope="module")
def two_nodes(
    tiny_sd3: Path,
    prompts: Path,
    tmp_path_factory: Any,
    one_thread: pytest.MonkeyPatch,
    two_node_cluster: LocalRayCluster,  # noqa: F811
) -> tuple[list[dict], Observed]:
    """The same run on the two nodes, with --use-distributed-post and two post actors per
    node (one run for both tests: a Ray run's actors take most of its time here)."""
    seen = Observed(two_node_cluster.wait())
    with pytest.MonkeyPatch.context() as patch:
        seen.record(patch)
        patch.setenv("MILES_HTTP_POST_ACTORS_PER_NODE", "2")
        out = tmp_path_factory.mktemp("two_nodes")
        records = run_metrics(_args(tiny_sd3, prompts, out, "--ray-address", two_node_cluster.address, "--use-distributed-post"))
    return records, seen


@pytest.mark.exercises("--ray-address")
def test_a_fleet_across_two_nodes_matches_the_one_node_fleet(two_node_cluster, one_node, two_nodes):  # noqa: F811
    (reference, _), (records, seen) = one_node, two_nodes
    # Outputs depend only on seeds and weights (synced from the rank, checksums checked).
    assert _outcome(records) == _outcome(reference)
    assert all(r["perf/weight_sync_bytes"] > 0 for r in records)
    # One engine on each node (the placement group's PACK fills the node it picks first
    # with bundles in order: the rank and engine 0 on one node, engine 1 and the reward
    # worker on the other).
    placements = seen.placements
    assert [p.index for p in placements] == [0, 1]
    assert sorted(p.node_id for p in placements) == sorted(two_node_cluster.node_ids)
    for p in placements:
        # Its URL's host is the IP Ray reports for the node it was placed on ...
        assert urlparse(p.url).hostname == p.node_ip == seen.node_ips[p.node_id]
        # ... and, both nodes sharing that IP here, the server ran under that node's raylet
        # (server < its host actor's worker < raylet), not under the other node's.
        own, other = (seen.raylets[node] for node in sorted(seen.raylets, key=lambda node: node != p.node_id))
        assert own in seen.ancestors[p.index] and other not in seen.ancestors[p.index]
    # Control: the compared records follow the images the engines generate: rollout 1's
    # requests (the next prompt groups' seeds, the updated weights) give another reward
    # than rollout 0's, and a reward depends only on its image.
    assert reference[0]["rollout/reward/raw_mean"] != reference[1]["rollout/reward/raw_mean"]


@pytest.mark.exercises("--use-distributed-post")
def test_distributed_post_posts_from_the_engines_nodes(two_node_cluster, one_node, two_nodes):  # noqa: F811
    (_, plain), (_, seen) = one_node, two_nodes
    # Two post actors on each engine's node; each posted only to the engine on its node.
    (poster,) = seen.posters
    node_of = {p.url: p.node_id for p in seen.placements}
    reports = poster.reports
    assert Counter(report["node_id"] for report in reports) == dict.fromkeys(two_node_cluster.node_ids, 2)
    for report in reports:
        assert all(node_of[url] == report["node_id"] for url in report["posted"])
    posted: Counter[str] = Counter()
    for report in reports:
        posted.update(report["posted"])
    # Every request was posted by them, both engines served, and the driver decoded none;
    # the control, the run without the flag, decoded every response in the driver.
    assert sum(posted.values()) == REQUESTS and set(posted) == set(node_of)
    assert seen.driver_decodes == 0
    assert plain.posters == [] and plain.driver_decodes == REQUESTS


def test_post_actors_fail_as_the_driver_would(two_node_cluster):  # noqa: F811
    """Through a post actor, a server's error answer, an undecodable answer and no answer at
    all are the errors the driver's own client gives for the same URL; a post actor that
    died fails its request as unanswered and is replaced."""
    from aiohttp import web

    from miles_core.cluster.post_actors import DistributedPoster
    from miles_core.engine.http import HttpEngine
    from miles_core.errors import EngineRequestError
    from miles_core.request import RolloutRequest

    cluster = two_node_cluster.wait()
    ip = ray.util.get_node_ip_address()
    request = RolloutRequest(prompt="a red cube", num_inference_steps=2, request_id="r")

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": "num_inference_steps: too many"}, status=400)

    async def garble(_: web.Request) -> web.Response:
        return web.Response(body=b"\xc1 not msgpack", content_type="application/msgpack")

    async def failure(call: Any) -> EngineRequestError:
        with pytest.raises(EngineRequestError) as info:
            await call
        return info.value

    async def check() -> None:
        apps = [web.Application(), web.Application()]
        apps[0].router.add_post("/rollout/generate", refuse)
        apps[1].router.add_post("/rollout/generate", garble)
        runners = [web.AppRunner(app) for app in apps]
        urls = []
        for runner in runners:
            await runner.setup()
            await web.TCPSite(runner, ip, 0).start()
            urls.append(f"http://{ip}:{runner.addresses[0][1]}")
        silent = f"http://{ip}:{_free_port()}"
        # The refusing server on the head, the others on the second node.
        nodes = {urls[0]: cluster.node_ids[0], urls[1]: cluster.node_ids[1], silent: cluster.node_ids[1]}
        poster = await asyncio.to_thread(DistributedPoster(lambda: nodes, per_node=1).ready)
        try:
            for url in (*urls, silent):
                direct = HttpEngine([url])
                try:
                    expected = await failure(direct.generate(request))
                finally:
                    await direct.close()
                got = await failure(poster.generate(url, request, None))
                assert (got.url, got.status, got.message) == (expected.url, expected.status, expected.message)
            (actor,) = poster.actors[cluster.node_ids[0]]
            ray.kill(actor)
            died = await failure(poster.generate(urls[0], request, None))
            assert (died.status, died.message) == (None, f"its post actor on node {cluster.node_ids[0]} died (ActorDiedError)")
            assert (await failure(poster.generate(urls[0], request, None))).status == 400  # its replacement
        finally:
            await asyncio.to_thread(poster.close)
            for runner in runners:
                await runner.cleanup()
        assert sorted((r["node_id"], sum(r["posted"].values())) for r in poster.reports) == sorted(
            [(cluster.node_ids[0], 1), (cluster.node_ids[1], 2)]
        )

    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(check())
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _train_status(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cli = str(Path(sys.executable).with_name("miles-core"))
    return subprocess.run([cli, "train", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


@pytest.mark.parametrize(
    ("env", "extra", "message"),
    [
        (
            {"MILES_HTTP_POST_ACTORS_PER_NODE": "two"},
            ("--use-ray",),
            "MILES_HTTP_POST_ACTORS_PER_NODE='two': the post actors per node (--use-distributed-post) must be a positive integer",
        ),
        (
            {"MILES_HTTP_POST_ACTORS_PER_NODE": "0"},
            ("--use-ray",),
            "MILES_HTTP_POST_ACTORS_PER_NODE='0': the post actors per node (--use-distributed-post) must be a positive integer",
        ),
        ({}, (), "--use-distributed-post requires --use-ray (its post actors are Ray actors on the engines' nodes)"),
    ],
)
def test_bad_distributed_post_settings_are_one_line(tiny_sd3, prompts, tmp_path, env, extra, message):
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError

    args = [*_args(tiny_sd3, prompts, tmp_path / "out"), "--use-distributed-post", *extra]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            resolve_config(args)
    assert info.value.messages == [message]
    if env.get("MILES_HTTP_POST_ACTORS_PER_NODE") == "two":  # the command line: that line, exit 2
        done = _train_status(*args, env=env)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"miles-core train: error: {message}"]
