"""Reward workers under Ray (``--reward-num-workers``, ``--reward-num-gpus-per-worker``),
on a local Ray instance where a ``{"CPU": 1}`` bundle stands in for each worker's GPU:

- each worker is a ``serve-reward --run-worker`` process started by its host actor, which
  requires the workers' secret;
- two workers score what one worker and the in-process scorer score, sample by sample,
  failures masked, and report the same reward metrics (the workers' reward counters
  summed); a changed pixel, the control, changes the rewards;
- each worker scores one contiguous chunk of a call (whole prompt groups under
  ``--group-rm``), and calls rotate over the workers;
- a worker whose server is killed is one line naming it and its node; a reward that cannot
  be built is the reward's own one-line error;
- the placement: one bundle per worker, GPUs per worker, ``--colocate-reward``; bad
  input is one line naming the flag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import ray
import torch
import yaml

from miles_core.api import Flag
from miles_core.cli.serve_reward import add_serve_arguments
from miles_core.cluster.placement import plan_placement
from miles_core.cluster.reward_worker import RayRewardScorer, split_chunks, worker_values
from miles_core.cluster.session import RaySession
from miles_core.config.parser import flag_entries
from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError, PlacementError, RewardError, RewardWorkerDiedError
from miles_core.plugin_manager import OwnedFlag, get_host
from miles_core.registry import PluginInfo
from miles_core.testing import serve_reward_in_thread
from miles_core.training.rewards import RewardScorer
from tests.fake_dists import make_dist
from tests.ray_nodes import wait_gone
from tests.test_recipes import recipe_paths, validate_recipe

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
    "--use-ray",
]
MIXTURE = ("--reward-weights", '{"brightness": 0.5, "redness": 0.5}')
PICKSCORE_PATHS = ("--pickscore-model-path", "org/clip", "--pickscore-processor-path", "org/processor")


def make_samples(groups: int, *, nan: tuple[int, ...] = (), reward: str | None = None) -> list[SimpleNamespace]:
    """Two samples per prompt group with random RGB pixels; a sample in ``nan`` has a NaN
    pixel (its rewards are NaN: that sample fails alone); ``reward``: each row's own
    reward (``metadata.rm_type``)."""
    generator = torch.Generator().manual_seed(7)
    samples = []
    for i in range(2 * groups):
        pixels = torch.rand((3, 8, 8), generator=generator)
        if i in nan:
            pixels[1, 2, 3] = math.nan
        samples.append(
            SimpleNamespace(
                pixels=pixels,
                prompt=f"prompt {i // 2}",
                metadata={"rm_type": reward} if reward else {},
                seed=100 + i,
                group_index=i // 2,
                index_in_group=i % 2,
                reward=None,
                reward_components={},
                reward_failed=False,
                remove_sample=False,
            )
        )
    return samples


def copies(samples: list[SimpleNamespace]) -> list[SimpleNamespace]:
    return [SimpleNamespace(**{**vars(s), "metadata": dict(s.metadata)}) for s in samples]


def outcomes(samples: list[Any]) -> list[tuple]:
    """What scoring set on each sample (a failed reward, NaN, as None so that it compares)."""
    return [
        (None if math.isnan(s.reward) else s.reward, s.reward_components, s.reward_failed, s.reward_failures, s.remove_sample)
        for s in samples
    ]


def scored(scorer: Any, samples: list[Any]) -> tuple[list[tuple], dict[str, float]]:
    asyncio.run(scorer.score(samples))
    return outcomes(samples), scorer.finish(samples)


COUNTING_PLUGIN = """
from miles_core.api import RewardSpec, hookimpl

@hookimpl
def miles_register_rewards():
    return [RewardSpec(name="counting", ref="tests.reward_examples:Counting", description="counts its calls")]
"""


def register_counting() -> None:
    """Register ``tests.reward_examples.Counting`` (a reward counting its calls and outputs,
    reported through ``pop_metrics``) as reward ``counting`` in this process's plugin host."""
    from miles_core.registry import PluginInfo, Registration
    from miles_core.specs import RewardSpec

    spec = RewardSpec(name="counting", ref="tests.reward_examples:Counting")
    get_host().registries.reward.add(Registration(spec, PluginInfo("counting", "tests", "0")))


def counting_plugin(root: Path) -> str:
    """A distribution under ``root`` registering reward ``counting``, as an installed plugin
    does (the workers' servers find it on their path); returns the path entry."""
    make_dist(root, "miles-counting", "0", {"counting": COUNTING_PLUGIN})
    return str(root)


def post(scorer: RayRewardScorer, index: int, path: str, body: dict[str, Any], *, key: bool = True) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(scorer.headers if key else {})}
    request = urllib.request.Request(scorer.urls[index] + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ended(pid: int) -> bool:
    """Whether process ``pid`` ends within 30 s (a zombie counts: its parent, a host
    actor, reaps it only when it stops its server)."""
    try:
        return not wait_gone([psutil.Process(pid)], 30.0)
    except psutil.NoSuchProcess:
        return True


def outputs_per_worker(scorer: RayRewardScorer) -> list[float]:
    """The outputs reward ``counting`` scored on each worker since last asked."""
    counted = [post(scorer, i, "/worker/counters", {"rewards": ["counting"], "prefix": ""})[1]["counters"] for i in range(len(scorer.urls))]
    return [c.get("counting/outputs", 0.0) for c in counted]


@pytest.mark.exercises("--reward-num-workers", "--reward-weights", "--group-rm")
def test_two_workers_score_what_one_worker_and_one_process_score(ray_cluster, request, tmp_path, caplog):
    config = resolve_config([*BASE, *MIXTURE, "--group-rm", "--reward-num-workers", "2"])
    # Sample 5's rewards are NaN: it alone is masked. The rows' own reward "counting"
    # (groups 0 and 3) reports counters, which the driver sums over the workers.
    samples = make_samples(4, nan=(5,))
    for i in (0, 1, 6, 7):
        samples[i].metadata["rm_type"] = "counting"
    register_counting()
    request.addfinalizer(lambda: get_host().registries.reward.discard("counting"))
    with caplog.at_level(logging.WARNING, logger="miles_core.rewards"):
        local, local_metrics = scored(RewardScorer(config), copies(samples))
    local_warnings = sorted(r.getMessage() for r in caplog.records if r.name == "miles_core.rewards")
    local_eval = scored(RewardScorer(config, evaluation=True), copies(samples))
    assert [o[2] for o in local] == [False] * 5 + [True] + [False] * 2 and local[5][0] is None and local[5][4]
    assert local_metrics["rollout/reward/failed"] == 1 and local_metrics["rollout/reward/counting/outputs"] == 4

    session = RaySession.start(config, engines=0, reward_worker=True)
    # The workers' servers find the plugin as an installed one: on their path.
    session.runtime.env_vars["PYTHONPATH"] = counting_plugin(tmp_path / "site")
    try:
        two = session.reward_scorer(tmp_path / "logs")
        assert len(two.urls) == 2 and session.runtime.plan.bundles[1:] == [{"CPU": 1.0}, {"CPU": 1.0}]
        # Each worker is a serve-reward process of its own, logging where the run said.
        pids = ray.get([host.pid.remote() for host in two.hosts])
        for pid in pids:
            command = psutil.Process(pid).cmdline()
            assert command[command.index("serve-reward") + 1] == "--run-worker"
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["reward_0.log", "reward_1.log"]
        # It requires the workers' secret (the driver's client holds it).
        assert post(two, 0, "/worker/counters", {"rewards": []}, key=False)[0] == 401
        one = RayRewardScorer(two.urls[:1], api_key=two.api_key, places=two.places[:1])
        assert scored(one, copies(samples)) == (local, local_metrics)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="miles_core.rewards"):
            assert scored(two, copies(samples)) == (local, local_metrics)
        # The workers' warnings (sample 5's NaN) are logged here, as in one process.
        assert sorted(r.getMessage() for r in caplog.records if r.name == "miles_core.rewards") == local_warnings != []
        # The evaluation scorer, on the same workers: the evaluation's rewards and metrics.
        assert scored(two.evaluation_scorer(), copies(samples)) == local_eval
        # Each worker scores its chunk: three groups of two go as groups 0-1 and group 2
        # (an even cut of the samples, 3 and 3, would split group 1).
        asyncio.run(two.score(make_samples(3, reward="counting")))
        assert outputs_per_worker(two) == [4.0, 2.0]
        # One group per call (streaming): the calls take turns on the workers.
        turns = []
        for _ in range(3):
            asyncio.run(two.score(make_samples(1, reward="counting")))
            turns.append(outputs_per_worker(two))
        assert turns == [[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]
        # The control: one changed pixel changes that sample's rewards.
        nudged = copies(samples)
        nudged[3].pixels = nudged[3].pixels.clone()
        nudged[3].pixels[0, 0, 0] += 0.5
        assert scored(two, nudged)[0] != local
        # A reward a row names that no plugin provides: the in-process scorer's error, exit 2.
        unknown = make_samples(1, reward="no_such_reward")
        with pytest.raises(RewardError) as info:
            asyncio.run(RewardScorer(config).score(copies(unknown)))
        with pytest.raises(RewardError) as remote:
            asyncio.run(two.score(unknown))
        assert str(remote.value) == str(info.value) and remote.value.exit_code == 2
        # A worker whose server is killed: one line naming it and its node, exit status 1.
        psutil.Process(pids[1]).kill()
        assert ended(pids[1])
        with pytest.raises(RewardWorkerDiedError) as info:
            asyncio.run(two.score(copies(samples)))
        (node,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        assert str(info.value).startswith(f"reward worker 1 of 2 on node {node} (") and "\n" not in str(info.value)
        assert " died: " in str(info.value) and info.value.exit_code == 1
        # A host actor killed (it cannot stop its server): the server stops by itself.
        ray.kill(two.hosts[0])
        assert ended(pids[0])
    finally:
        session.close()
    assert all(ended(pid) for pid in pids)  # closing the session stopped the servers


def start_up_error(config: Any, log_dir: Path) -> RewardError:
    """The error starting ``config``'s reward workers raises."""
    session = RaySession.start(config, engines=0, reward_worker=True)
    try:
        with pytest.raises(RewardError) as info:
            session.reward_scorer(log_dir)
    finally:
        session.close()
    return info.value


def test_a_remote_reward_on_the_workers_sends_the_runs_key(ray_cluster, tmp_path, monkeypatch):
    """--rm-type remote under --use-ray: each worker's remote reward sends the key the run's
    would (here MILES_API_KEY in the driver's environment), and scores as in one process.
    Without the key (the control) the reward cannot be built: the workers' start-up stops
    with the error the run gives in one process, one line, exit status 2."""
    samples = make_samples(2)
    served = resolve_config(["--rm-type", "brightness"], prog="miles-core serve-reward", scope="reward")
    with serve_reward_in_thread(served, api_key="remote-key-0123") as url:
        config = resolve_config([*BASE, "--rm-type", "remote", "--rm-url", url, "--reward-num-gpus-per-worker", "0"])
        monkeypatch.setenv("MILES_API_KEY", "remote-key-0123")
        local = scored(RewardScorer(config), copies(samples))
        session = RaySession.start(config, engines=0, reward_worker=True)
        try:
            assert scored(session.reward_scorer(tmp_path / "logs"), copies(samples)) == local
        finally:
            session.close()
        monkeypatch.delenv("MILES_API_KEY")
        with pytest.raises(RewardError) as in_one_process:
            RewardScorer(config)
        error = start_up_error(config, tmp_path / "logs")
    assert str(error) == str(in_one_process.value) and "the server refused the key" in str(error)
    assert "\n" not in str(error) and error.exit_code == 2


@pytest.mark.parametrize("path", recipe_paths(), ids=lambda p: p.name)
def test_a_worker_resolves_the_values_the_run_was_given(path, tmp_path):
    """Every recipe, with a mixture and the worker flags on the command line: the values a
    worker's server reads back from its YAML are the run's, its key left out."""
    extra = ("--reward-weights", '{"brightness": 0.5, "pickscore": 2}', "--group-rm", "--reward-num-workers", "2", *PICKSCORE_PATHS)
    config = validate_recipe(path, "--rollout-engine-urls", "http://10.0.0.1:30000", "--api-key", "secret", *extra)
    values = worker_values(config)
    assert set(values) == {dest for dest in config if config.source(dest).user_set} - {"api_key", "custom_config_path"}
    assert values["rollout_engine_urls"] == "http://10.0.0.1:30000" and values["hf_checkpoint"] == config.hf_checkpoint
    written = tmp_path / "reward.yaml"
    written.write_text(yaml.safe_dump(values, sort_keys=True), encoding="utf-8")
    argv = ["--run-worker", "--custom-config-path", str(written)]
    worker = resolve_config(argv, prog="miles-core serve-reward", scope="reward", extend=add_serve_arguments)
    assert {dest: worker.get(dest) for dest in values} == {dest: config.get(dest) for dest in values}
    assert worker.reward_weights == {"brightness": 0.5, "pickscore": 2.0} and worker.command_arguments["serve_run_worker"]


def test_chunks_are_contiguous_balanced_and_keep_groups_whole():
    flat = make_samples(4)
    assert split_chunks(flat, 2, whole_groups=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_chunks(flat[:3], 2, whole_groups=False) == [[0, 1], [2]]
    assert split_chunks(flat[:1], 3, whole_groups=False) == [[0]]
    # Groups of three on two workers: whole groups, while an even cut splits group 1 (the control).
    threes = [SimpleNamespace(group_index=i // 3) for i in range(9)]
    assert split_chunks(threes, 2, whole_groups=True) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert split_chunks(threes, 2, whole_groups=False) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]


def _config(*extra: str) -> Any:
    return resolve_config([*BASE, "--rm-type", "brightness", *extra])


@pytest.mark.exercises("--reward-num-gpus-per-worker", "--colocate-reward")
def test_each_worker_gets_a_bundle_with_its_gpus():
    plan = plan_placement(_config("--reward-num-workers", "2", "--reward-num-gpus-per-worker", "0.5"), gpus=True)
    assert plan.rewards == [1, 2] and plan.bundles[1:] == [{"GPU": 0.5, "CPU": 1.0}] * 2 and plan.reward_gpus == 0.5
    assert plan.describe().endswith("1 training rank(s), 2 reward workers x 0.5 GPU")
    # CPUs stand in for GPUs; 0 GPUs is a CPU bundle on a GPU cluster.
    assert (
        plan_placement(_config("--reward-num-workers", "2", "--reward-num-gpus-per-worker", "0.5"), gpus=False).bundles[1:]
        == [{"CPU": 1.0}] * 2
    )
    assert plan_placement(_config("--reward-num-gpus-per-worker", "0"), gpus=True).bundles[1:] == [{"CPU": 1.0}]
    # Unset: a weight-free reward runs on the CPU, a model reward (its spec's uses_gpu) gets a GPU.
    assert _config().reward_num_gpus_per_worker == 0.0
    pickscore = resolve_config([*BASE, "--rm-type", "pickscore", "--pickscore-model-path", "org/m", "--pickscore-processor-path", "org/p"])
    assert pickscore.reward_num_gpus_per_worker == 1.0
    assert plan_placement(pickscore, gpus=True).bundles[1:] == [{"GPU": 1.0, "CPU": 1.0}]
    # --colocate-reward: one worker per rollout device, a 0.05 share each.
    colocated = ("--actor-num-gpus-per-node", "2", "--colocate", "--colocate-reward")
    plan = plan_placement(_config(*colocated, "--reward-num-workers", "2"), gpus=True, engines=2)
    assert len(plan.bundles) == 2 and plan.rewards == [0, 1] and plan.reward_share == plan.reward_gpus == 0.05
    with pytest.raises(PlacementError) as info:
        plan_placement(_config(*colocated, "--reward-num-workers", "3"), gpus=True, engines=2)
    assert str(info.value) == (
        "--reward-num-workers 3 with --colocate-reward: a colocated reward worker takes a 0.05 share of a rollout "
        "device, one worker per device, and the engines have 2"
    )


def test_bad_worker_settings_are_one_line_naming_the_flag(ray_cluster):
    with pytest.raises(ConfigError) as info:
        _config("--reward-num-workers", "0", "--reward-num-gpus-per-worker", "-1")
    assert str(info.value).splitlines() == [
        "--reward-num-workers 0: must be at least 1",
        "--reward-num-gpus-per-worker -1.0: must not be negative",
    ]
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError, match=r"^--reward-num-gpus-per-worker 0.5 and --colocate-reward cannot be combined"):
        _config("--colocate", "--colocate-reward", "--reward-num-gpus-per-worker", "0.5")
    with pytest.raises(PlacementError) as info:
        plan_placement(_config("--reward-num-gpus-per-worker", "1.5"), gpus=True)
    assert (
        str(info.value)
        == "--reward-num-gpus-per-worker 1.5: above 1 it must be a whole number (Ray gives an actor a fraction of one GPU or whole GPUs)"
    )
    # More workers than the cluster holds (as many as its CPUs, beside the rank's bundle):
    # refused at once, before any placement group.
    groups = len(ray.util.placement_group_table())
    cpus = int(ray.cluster_resources()["CPU"])
    with pytest.raises(PlacementError) as info:
        RaySession.start(_config("--reward-num-workers", str(cpus)), engines=0, reward_worker=True)
    assert str(info.value) == (
        f"--reward-num-workers {cpus}: {cpus} reward worker bundle(s) of {{'CPU': 1.0}} do not fit beside the run's other 1 "
        f"bundle(s): together they need {cpus + 1} CPU and the cluster has {cpus}"
    )
    assert info.value.exit_code == 2 and len(ray.util.placement_group_table()) == groups


def test_an_alias_flag_must_name_a_flag_of_its_type():
    owner = PluginInfo("example", "miles-example", "0")
    for alias, why in (
        (Flag(name="--x-workers", group="reward", type="int", alias_of="--no-such-flag"), "no such flag"),
        (Flag(name="--x-workers", group="reward", type="float", alias_of="--reward-num-workers"), "it takes int, not float"),
    ):
        with pytest.raises(ConfigError) as info:
            flag_entries([OwnedFlag(alias, owner)])
        assert str(info.value) == f"--x-workers (miles-example 0) is declared an alias of {alias.alias_of}: {why}"
    with pytest.raises(ValueError, match="an alias of --reward-num-workers has no default"):
        Flag(name="--x-workers", group="reward", type="int", default=1, alias_of="--reward-num-workers")
