"""The reward on Ray: ``--reward-num-workers`` reward servers, each a ``miles-core
serve-reward --run-worker`` process (:mod:`miles_core.reward_service.run_worker`) that a
:class:`RewardServerHost` actor starts on its own bundle with the bundle's devices, so
reward models load and run there instead of in the driver. A worker's server resolves the
run's reward from the values the user set (written to a YAML file on its node, read with
``--custom-config-path``; secrets left out), scores under ``--deterministic-mode`` when the
run does, requires a secret made for the workers of every request but ``GET /health``, and
logs to ``reward_<i>.log`` in the run directory's ``rewards/``. :class:`RayRewardScorer` is
the driver's side, with the scorer's interface:

- ``score`` splits the samples into contiguous chunks of near-equal size, one per worker
  (whole prompt groups when the reward needs them, ``--group-rm``), sends each worker its
  chunk (pixels as float32, exact), and copies each sample's outcome (reward, components,
  failures) back onto the driver's sample, so a sample whose reward failed stays masked as
  in one process. The first chunk of a call goes to the worker after the previous call's
  last, so streaming calls of one microgroup each spread over the workers too;
- ``finish`` computes the rollout's reward metrics in the driver, over all of its
  samples, from the outcomes the workers sent back and the sum of their rewards' own
  counters (``pop_metrics``): N workers report what one reports (a counter of calls
  counts the calls the N workers made). A :class:`RewardError` is raised as the
  in-process scorer raises it.

A worker whose reward cannot be built stops the run with the server's one-line error (exit
status 2); a worker whose server dies or answers what it should not is a
:class:`RewardWorkerDiedError` naming the worker and its node (exit status 1).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_core.cluster.engine_hosts import ServerHost
from miles_core.cluster.placement import device_env
from miles_core.cluster.runtime import task_result
from miles_core.errors import FleetError, RequestError, RewardError, RewardWorkerDiedError

START_TIMEOUT = 600.0
"""Seconds a reward worker's server may take to build its reward (load its models)."""

CONNECT_TIMEOUT = 30.0
"""Seconds to connect to a worker's server; a scoring request itself has no limit (a big
reward model on a big chunk takes what it takes), a server that dies fails it at once."""

ERROR_MARK = "serve-reward: error: "
"""What starts the error ``miles-core serve-reward`` prints before it stops (``PROG: error:``)."""

CLIENT_KEY_NAME = "client.key"
"""The file in a host's directory holding the key a ``remote`` reward on the worker sends."""

log = logging.getLogger("miles_core.rewards")


class RewardServerHost(ServerHost):
    """Made a Ray actor by :meth:`RayRewardScorer.start`: runs one ``serve-reward
    --run-worker`` process on its bundle."""

    def __init__(self, values: Mapping[str, Any], log_path: str, api_key: str, client_key: str | None = None) -> None:
        self.values = dict(values)
        self.log_path = log_path
        self.api_key = api_key
        """The workers' secret, which the server requires (in its environment, never on disk)."""
        self.client_key = client_key
        """The key the run's ``remote`` reward sends its servers, if any."""
        self.engine: Any = None
        self.env: dict[str, str] = {}
        self.directory: Path | None = None

    def start(self, timeout: float = START_TIMEOUT) -> str:
        """Start the server and wait until its reward is built; returns its URL. A reward
        that cannot be built raises the server's one-line :class:`RewardError`; a server
        that fails otherwise, :class:`FleetError` naming its log."""
        import ray
        import yaml

        from miles_core.engine.fleet import launch_server, wait_for

        self.stop()
        self.directory = Path(tempfile.mkdtemp(prefix="miles-reward-worker-"))  # mode 0700
        values = dict(self.values)
        if self.client_key is not None:  # read as the driver reads --api-key-file; removed with the directory
            key_path = self.directory / CLIENT_KEY_NAME
            key_path.touch(mode=0o600)
            key_path.write_text(self.client_key + "\n", encoding="utf-8")
            values["api_key_file"] = str(key_path)
        config_path = self.directory / "reward.yaml"
        config_path.write_text(yaml.safe_dump(values, sort_keys=True), encoding="utf-8")
        # The server imports what this actor can (a --custom-rm-path module beside the driver's script).
        python_path = os.pathsep.join(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)))
        host = ray.util.get_node_ip_address()
        args = ("--run-worker", "--custom-config-path", str(config_path), "--host", host, "--port", "0")
        self.engine = launch_server(
            "serve-reward",
            *args,
            log_path=self.log_path,
            threads=None,
            env={"PYTHONPATH": python_path, **self.env},
            api_key=self.api_key,
            kind="reward worker server",
        )
        try:
            wait_for([self.engine], timeout, healthy=True)
        except FleetError:
            status = self.engine.process.poll()
            error = _error_line(self.log_path)
            self.stop()
            if status == 2 and error is not None:  # the run's reward cannot be built: the error a run gives in-process
                raise RewardError(error) from None
            raise
        return self.engine.url

    def stop(self) -> None:
        super().stop()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def worker_values(config: Any) -> dict[str, Any]:
    """What a worker's server resolves its configuration from (its ``--custom-config-path``
    YAML): every value the user set, but the keys (``--api-key``, ``--api-key-file``, a
    path on the driver's machine: :func:`client_key` goes to the worker instead) and the
    run's own YAML path."""
    from miles_core.config.document import user_values

    return user_values(config, leave_out=("custom_config_path", "api_key_file"))


def client_key(config: Any) -> str | None:
    """The key a ``remote`` reward in the driver would send its servers (``--api-key``,
    ``--api-key-file`` or MILES_API_KEY), for the workers' own ``remote`` rewards; None
    without one or without ``--rm-url`` (no remote reward)."""
    from miles_core.engine.auth import resolve_api_key

    if not config.get("rm_url"):
        return None
    return resolve_api_key(config.get("api_key"), config.get("api_key_file"))


def _error_line(log_path: str) -> str | None:
    """The error ``serve-reward`` printed before it stopped, if any (its lines, a
    configuration's several violations, joined by ``; ``)."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    marks = [i for i, line in enumerate(lines) if ERROR_MARK in line]
    if not marks:
        return None
    first = lines[marks[-1]].split(ERROR_MARK, 1)[1].strip()
    return "; ".join([first, *(line.strip() for line in lines[marks[-1] + 1 :] if line.strip())])


def split_chunks(samples: Sequence[Any], parts: int, *, whole_groups: bool) -> list[list[int]]:
    """The indices of ``samples`` in at most ``parts`` contiguous chunks of near-equal
    size, in order; with ``whole_groups`` every prompt group (``group_index``) is in one
    chunk (a group whose samples are not adjacent still goes whole, where it first
    appears)."""
    if whole_groups:
        groups: dict[Any, list[int]] = {}
        for index, sample in enumerate(samples):
            groups.setdefault(getattr(sample, "group_index", None), []).append(index)
        units = list(groups.values())
    else:
        units = [[index] for index in range(len(samples))]
    chunks: dict[int, list[int]] = {}
    before = 0
    for unit in units:
        # The chunk holding the unit's first sample, were the samples cut evenly.
        chunks.setdefault(before * parts // len(samples), []).extend(unit)
        before += len(unit)
    return [chunks[key] for key in sorted(chunks)]


class RayRewardScorer:
    """The driver's client of the run's reward worker servers (see the module docstring).
    ``places``: per worker, where it runs, for messages; ``hosts``: their
    :class:`RewardServerHost` actors, which :meth:`close` stops."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None,
        evaluation: bool = False,
        places: Sequence[str] | None = None,
        hosts: Sequence[Any] = (),
    ) -> None:
        from miles_core.engine.auth import auth_headers
        from miles_core.reward_service.retry import run_in_new_loop

        self.urls = list(urls)
        self.api_key = api_key
        self.headers = auth_headers(api_key)
        self.evaluation = evaluation
        self.places = list(places) if places is not None else ["an unknown node"] * len(self.urls)
        self.hosts = list(hosts)
        self.temporary_logs: Path | None = None
        """The logs' directory when the run gave none, removed by :meth:`close`."""
        self._next = 0
        self._outcomes: dict[int, dict[str, str | None]] = {}
        described = run_in_new_loop(self._post_all("/worker/describe", {"evaluation": evaluation}))
        self.name, self.needs_whole_groups = described[0]["reward"], described[0]["group_rm"]
        self.deterministic_algorithms = [bool(d.get("deterministic_algorithms")) for d in described]

    @property
    def worker(self) -> Any:
        """The first worker's host actor (the only one with ``--reward-num-workers 1``)."""
        return self.hosts[0]

    @classmethod
    def start(cls, config: Any, runtime: Any, log_dir: str | Path | None = None) -> RayRewardScorer:
        """Start the run's reward workers, one on each of its bundles of the placement group,
        their logs in ``log_dir`` (None: a temporary directory); on a failure the ones
        started are stopped."""
        import ray

        from miles_core.engine.auth import new_secret

        plan = runtime.plan
        key = new_secret()  # the workers': only the driver and their hosts hold it
        values, remote_key = worker_values(config), client_key(config)
        temporary = log_dir is None
        logs = Path(tempfile.mkdtemp(prefix="miles-reward-workers-")) if temporary else Path(log_dir).absolute()
        hosts: list[Any] = []
        try:
            for index, bundle in enumerate(plan.rewards):
                # A bundle's GPU share may be a fraction, which the default share of its device is not.
                options = {**runtime.options(bundle, plan.reward_share), "num_gpus": plan.reward_gpus}
                log_path = str(logs / f"reward_{index}.log")
                hosts.append(ray.remote(RewardServerHost).options(**options).remote(values, log_path, key, remote_key))
            wheres = task_result([host.where.remote() for host in hosts])
            task_result([host.place.remote(device_env(plan.device, [where["gpu_ids"]])) for host, where in zip(hosts, wheres)])
            urls = task_result([host.start.remote() for host in hosts])
            scorer = cls(urls, api_key=key, places=_places(runtime, plan.rewards), hosts=hosts)
        except BaseException:
            _stop(hosts)
            if temporary:
                shutil.rmtree(logs, ignore_errors=True)
            raise
        scorer.temporary_logs = logs if temporary else None
        return scorer

    def evaluation_scorer(self) -> RayRewardScorer:
        """The evaluation scorer on the same workers (sharing their reward models)."""
        return RayRewardScorer(self.urls, api_key=self.api_key, evaluation=True, places=self.places)

    def _failed(self, index: int, what: str) -> RewardWorkerDiedError:
        return RewardWorkerDiedError(f"reward worker {index} of {len(self.urls)} on {self.places[index]} {what}")

    async def _post(self, session: Any, index: int, path: str, body: Any) -> Any:
        """POST ``body`` (JSON, or bytes already encoded) to worker ``index``; its answer.
        A worker that cannot be reached or answers other than 200 is
        :class:`RewardWorkerDiedError`; a 422 (the reward cannot be used) the reward's
        :class:`RewardError`."""
        import json

        import aiohttp

        from miles_core.reward_service.server import one_line

        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            async with session.post(self.urls[index] + path, data=data, headers=headers) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise self._failed(index, f"died: {type(exc).__name__}: {one_line(exc)}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise self._failed(index, f"answered {status} with what is not JSON: {raw[:80]!r}") from None
        message = answer.get("error") if isinstance(answer, dict) else None
        if status == 422 and isinstance(message, str):
            raise RewardError(message)
        if status != 200:
            raise self._failed(index, f"answered {status} to POST {path}: {message or raw[:80]!r}")
        return answer

    def _session(self) -> Any:
        import aiohttp

        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT))

    async def _post_all(self, path: str, body: Any) -> list[Any]:
        async with self._session() as session:
            return list(await asyncio.gather(*(self._post(session, i, path, body) for i in range(len(self.urls)))))

    def _request(self, samples: list[Any]) -> bytes:
        """A ``/worker/score`` body for ``samples`` (in a thread: encoding takes a while)."""
        import json

        from miles_core.reward_service.wire import WIRE_VERSION, encode_sample

        entries = []
        for position, sample in enumerate(samples):
            group = getattr(sample, "group_index", None)
            try:
                entries.append(
                    encode_sample(
                        sample.pixels,
                        sample.prompt,
                        getattr(sample, "metadata", None) or {},
                        encoding="float32",
                        group=-1 - position if group is None else group,
                        seed=getattr(sample, "seed", None),
                        index_in_group=getattr(sample, "index_in_group", None),
                    )
                )
            except RequestError as exc:
                raise RewardError(
                    f"reward workers: the sample of prompt {str(sample.prompt)[:40]!r} cannot be sent to a worker: {exc}"
                ) from None
        return json.dumps({"wire_version": WIRE_VERSION, "evaluation": self.evaluation, "samples": entries}).encode("utf-8")

    async def _score_on(self, session: Any, index: int, samples: list[Any]) -> list[dict[str, Any]]:
        from miles_core.reward_service.run_worker import decode_outcomes

        body = await asyncio.to_thread(self._request, samples)
        answer = await self._post(session, index, "/worker/score", body)
        for warning in answer.get("warnings") or []:  # the worker scorer's, logged here as in one process
            log.warning("%s", warning)
        try:
            return decode_outcomes(answer, len(samples))
        except RewardError as exc:
            raise self._failed(index, f"answered what is not the worker wire: {exc}") from None

    async def score(self, samples: Sequence[Any]) -> Any:
        import torch

        from miles_core.reward_service.run_worker import apply_outcome

        samples = list(samples)
        chunks = split_chunks(samples, len(self.urls), whole_groups=self.needs_whole_groups) if samples else []
        first, self._next = self._next, (self._next + len(chunks)) % len(self.urls)
        workers = [(first + offset) % len(self.urls) for offset in range(len(chunks))]
        async with self._session() as session:
            calls = (self._score_on(session, w, [samples[i] for i in chunk]) for w, chunk in zip(workers, chunks))
            results = await asyncio.gather(*calls, return_exceptions=True)  # every chunk finishes before the first error is raised
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for chunk, outcomes in zip(chunks, results):
            for index, outcome in zip(chunk, outcomes):
                self._outcomes[id(samples[index])] = apply_outcome(samples[index], outcome)
        return torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)

    def finish(self, samples: Sequence[Any], *, prefix: str = "rollout/reward/") -> dict[str, float]:
        from miles_core.reward_service.retry import run_in_new_loop
        from miles_core.training.rewards import summarize_rewards

        outcomes = [self._outcomes.pop(id(sample), None) or {} for sample in samples]

        def counters(rewards: list[str]) -> dict[str, float]:
            totals: dict[str, float] = {}
            if rewards:
                body = {"evaluation": self.evaluation, "rewards": rewards, "prefix": prefix}
                for answer in run_in_new_loop(self._post_all("/worker/counters", body)):
                    for key, value in answer["counters"].items():
                        totals[key] = totals.get(key, 0.0) + value
            return totals

        return summarize_rewards(samples, outcomes, counters, name=self.name, evaluation=self.evaluation, prefix=prefix)

    def close(self) -> None:
        _stop(self.hosts)
        self.hosts = []
        if self.temporary_logs is not None:
            shutil.rmtree(self.temporary_logs, ignore_errors=True)
            self.temporary_logs = None


def _stop(hosts: Sequence[Any], timeout: float = 60.0) -> None:
    """Stop the hosts' servers, all at once, then the hosts (one that died has nothing to
    stop)."""
    import ray

    refs = []
    for host in hosts:
        try:
            refs.append(host.stop.remote())
        except Exception:
            pass
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    except Exception:
        pass
    for host in hosts:
        ray.kill(host)


def _places(runtime: Any, bundles: Sequence[int]) -> list[str]:
    """Per bundle, ``node IP (node id prefix)`` from the placement group's table."""
    import ray

    try:
        table = ray.util.placement_group_table(runtime.group)
        where = {int(bundle): str(node) for bundle, node in (table.get("bundles_to_node_id") or {}).items()}
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    except Exception:  # the table's shape is Ray's: a message without the node is better than none
        return ["an unknown node"] * len(bundles)
    return [f"node {addresses.get(where.get(b, ''), '?')} ({where.get(b, '?')[:8]})" for b in bundles]


__all__ = ["RayRewardScorer", "RewardServerHost", "client_key", "split_chunks", "worker_values"]
