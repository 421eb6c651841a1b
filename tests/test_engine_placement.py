"""Engines placed like training ranks under ``--use-ray``: each engine holds every bundle it
was given (its host on the first, a holder on each other one), all on one node, its server
bound to that node's address with exactly those bundles' devices and the run's
``--deterministic-mode`` environment, and a restart stays in the same bundles. On this
machine a ``{"CPU": 1}`` bundle stands in for each GPU (so no device ids); sglang-diffusion
servers are the suite's stand-in package. Also: the one-line refusals (a serve-engine
server given several devices, an engine across nodes, a work directory the engine's node
does not share). Our serve-engine servers' placement and restart, with
``--deterministic-mode``: tests/test_ray_runs.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import ray
import torch

from miles_core.cluster.engine_hosts import PROBE_NAME, SglangHost
from miles_core.cluster.placement import device_env, engine_nodes
from miles_core.cluster.runtime import RayRuntime
from miles_core.cluster.session import RaySession
from miles_core.config.resolve import resolve_config
from miles_core.engine.sglang import engine_device_args
from miles_core.errors import ConfigError, PlacementError, SglangEngineError
from miles_core.training.run_engine import start_fleet
from tests.sglang_stand_in import build_stand_in_sglang, children
from tests.tiny_runs import tiny_run_args

RAY_CPUS = 6
"""Logical CPUs this module needs of the suite's Ray cluster (the conftest's ``ray_head`` has
the most any module asks for)."""


def _config(tiny_sd3: Path, prompts: Path, out: Path, *extra: str):
    return resolve_config([*tiny_run_args(tiny_sd3, prompts, out, batch=1, n=2, steps=3, sde_steps=2), *extra])


def _held(runtime: RayRuntime, bundle: int) -> bool:
    """Whether an actor holds bundle ``bundle``'s CPU (Ray names a bundle's resource so)."""
    name = f"CPU_group_{bundle}_{runtime.group.id.hex()}"
    return ray.available_resources().get(name, 0.0) == 0.0


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.exercises("--rollout-num-gpus-per-engine", "--rollout-engine", "--sglang-python", "--deterministic-mode")
def test_sglang_engines_hold_their_bundles_on_one_node_and_restart_in_them(tiny_sd3, prompts, tmp_path, ray_cluster):
    python, record = build_stand_in_sglang(tmp_path)
    out = tmp_path / "run"
    config = _config(
        tiny_sd3,
        prompts,
        out,
        "--use-ray",
        "--rollout-engine",
        "sglang",
        "--sglang-python",
        str(python),
        "--rollout-num-engines",
        "2",
        "--rollout-num-gpus-per-engine",
        "2",
        "--deterministic-mode",
    )
    runtime = RayRuntime.start(config, engines=2)
    assert runtime.plan.engines == [[1, 2], [3, 4]]
    engine = fleet = None
    try:
        engine, fleet = start_fleet(config, out, lambda line: None, RaySession(config, runtime))
        node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        placed = fleet.placements()
        assert [p.index for p in placed] == [0, 1] and [p.url for p in placed] == engine.urls
        for place, bundles in zip(placed, runtime.plan.engines, strict=True):
            assert place.bundles == tuple(bundles) and (place.node_id, place.node_ip) == (node, ip)
            assert urlparse(place.url).hostname == ip  # bound to its node's address, not loopback
            assert place.device_ids == ()  # CPUs stand in: no GPU ids, no CUDA_VISIBLE_DEVICES
            # Read back from the server process's own environment.
            assert place.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
            # The run's secret puts each server behind an authenticating proxy (place.pid, on
            # the node's address); sglang itself listens on loopback.
            proxy = Path(f"/proc/{place.pid}/cmdline").read_bytes().decode().split("\0")
            assert proxy[proxy.index("--host") + 1] == ip
            (server,) = children(place.pid)
            argv = json.loads(Path(f"{record}.{server}").read_text())
            assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--num-gpus") + 1] == "2"
        # Every bundle of both engines is held (the second by its holder); the training one is not.
        assert all(_held(runtime, bundle) for bundles in runtime.plan.engines for bundle in bundles)
        assert not _held(runtime, 0)

        # The driver reaches the servers on the node's address and syncs them through the disk.
        from miles_core.model_loading import load_family
        from miles_core.training.weight_sync import sync_to_engine

        async def go():
            before = await engine.weights_checksums(["transformer"])
            module = load_family(config).components()["transformer"]
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter.add_(0.01)
            # sync_to_engine checks that every server reports the checksum of the sent weights
            return before, await sync_to_engine(engine, {"transformer": module}, config)

        before, synced = asyncio.run(go())
        assert sorted(before) == sorted(engine.urls)
        assert all(answer["transformer"] != synced.checksums["transformer"] for answer in before.values())  # the control

        # A restart: a new server in the same bundles, with the same environment.
        os.killpg(placed[1].pid, signal.SIGKILL)
        url = fleet.restart(1)
        again = fleet.placements()[1]
        assert again.url == url and again.pid != placed[1].pid
        assert (again.bundles, again.node_id, again.env) == (placed[1].bundles, node, placed[1].env)
        # The stand-in runs serve-engine without --deterministic-mode: the control of
        # tests/test_ray_runs.py's server started with it, which says true.
        assert _health(url) == {"status": "ok", "deterministic": False}
        assert (out / "sglang" / "logs" / "engine-1.restart1.log").is_file()
        pids = [p.pid for p in fleet.placements()]
    finally:
        if engine is not None:
            asyncio.run(engine.close())
        if fleet is not None:
            fleet.stop()
        runtime.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("engine", [["--rollout-engine", "http", "--rollout-num-engines", "2"], []])
def test_a_serve_engine_server_is_refused_several_devices(tiny_sd3, prompts, tmp_path, engine):
    args = ["--use-ray", *engine, "--rollout-num-gpus-per-engine", "2"]
    with pytest.raises(ConfigError) as info:
        _config(tiny_sd3, prompts, tmp_path, *args)
    name = "http" if engine else "embedded"
    assert str(info.value) == (
        f"--rollout-num-gpus-per-engine 2 and --rollout-engine {name}: a miles-core serve-engine server runs on one "
        "device; use more engines (--rollout-num-engines) or --rollout-engine sglang"
    )
    assert info.value.exit_code == 2
    # Without Ray the flag places nothing (a hardware-only note), so nothing is refused.
    assert _config(tiny_sd3, prompts, tmp_path, *args[1:]).rollout_num_gpus_per_engine == 2


def test_an_engine_across_two_nodes_is_refused():
    engines = [[1, 2], [3, 4]]
    one = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b"}
    assert engine_nodes(engines, one) == ["a", "b"]
    assert engine_nodes(engines, {str(k): v for k, v in one.items()}) == ["a", "b"]  # keys as Ray may send them
    with pytest.raises(PlacementError) as info:
        engine_nodes(engines, {**one, 4: "c"})
    assert str(info.value) == (
        "engine 1: its bundles [3, 4] are on 2 nodes (b, c); an engine server runs on one node, so "
        "--rollout-num-gpus-per-engine must fit the devices of one node (see --num-gpus-per-node)"
    )
    assert info.value.exit_code == 2


def test_an_engine_sees_exactly_its_bundles_devices():
    assert device_env("GPU", [["3"], ["5"]]) == {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert device_env("GPU", [[0, 1], [1]]) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert device_env("CPU", [[], []]) == {}  # CPUs stand in: nothing to restrict
    with pytest.raises(PlacementError, match="^an engine on GPU bundles was assigned no GPU by Ray$"):
        device_env("GPU", [[]])


def test_sglang_gets_its_devices_through_num_gpus_and_the_users_value_wins():
    assert engine_device_args(["--sglang-attention-backend", "x"], 2) == ["--sglang-attention-backend", "x", "--sglang-num-gpus", "2"]
    assert engine_device_args(["--sglang-num-gpus=4"], 2) == ["--sglang-num-gpus=4"]
    assert engine_device_args(["--sglang-num-gpus", "1"], 2) == ["--sglang-num-gpus", "1"]
    assert engine_device_args(["--sglang-sp-degree", "2"], 1) == ["--sglang-sp-degree", "2"]  # one device: nothing added


def test_an_sglang_host_refuses_a_work_directory_its_node_does_not_share(tmp_path, ray_cluster):
    (tmp_path / PROBE_NAME).write_text("the driver's token")
    host = SglangHost(3, "/no/python", "/no/model", [], str(tmp_path), "another run's token")
    with pytest.raises(SglangEngineError) as info:
        host.start()
    assert str(info.value) == (
        f"sglang-diffusion engine 3 on node {ray.util.get_node_ip_address()}: the run's sglang work directory {tmp_path} is "
        "not the driver's there; weight syncs go through it, so on several nodes put --output-dir on a filesystem all "
        "nodes share"
    )
