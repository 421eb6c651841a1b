"""``--rm-type remote``: score through one or more reward servers (``miles-core
serve-reward``, or any server speaking the wire of docs/rewards.md, "The reward wire").

At construction, before the run spends anything, every ``--rm-url`` must answer
``GET /health`` (a server still loading its reward is waited for, up to ``--rm-timeout``)
and ``GET /info`` (with the run's key); the servers must speak wire
version 1, serve ``--rm-remote-reward`` when it is set and all serve the same reward with
the same weights (their ``/info`` ``rewards`` records equal), take
``--rm-pixel-encoding``, and accept a ``--rm-batch-size`` request. A server scoring whole
prompt groups needs ``--group-rm`` here too. Any of these failing is one
:class:`~miles_core.errors.RewardError` line naming the URL (exit status 2).

A call's samples go out in requests of ``--rm-batch-size`` (under ``--group-rm`` the
call is one prompt group and goes whole), at most ``--rm-max-in-flight`` at once; request
``j`` of a call goes first to the URL after the one the previous request started on, and
each retry (:func:`~miles_core.reward_service.retry.post_with_retries`) to the next URL. A
request over a server's size limits (413) goes again in halves. A request that still
fails, or that a server refuses (another 4xx), a sample that cannot be sent (pixels PNG
cannot carry, metadata that is not JSON) or a sample the server's reward failed on comes
back as an exception in that sample's place: the scorer masks those samples and counts
them (``rollout/reward/remote_failed``). A server answering 422 (its reward cannot be
used at all) raises :class:`~miles_core.errors.RewardError`, which stops the run as the
same reward would in-process. ``pop_metrics`` reports ``requests``, ``retries``,
``failed_requests``, ``split_requests`` and, for a server's mixture, each component's
mean (``rollout/reward/remote/<component>_mean``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from miles_core.errors import MilesError, RewardError
from miles_core.reward_service.retry import Answer, CallFailed, RetryPolicy, gather_bounded, post_with_retries, run_in_new_loop
from miles_core.reward_service.wire import WIRE_VERSION, decode_response, encode_sample

log = logging.getLogger("miles_core.rewards")

NAME = "remote"


class SampleNotScored(MilesError):
    """Why a remote sample got no reward: the server's reason, or the request's failure."""


def check_urls(urls: Any) -> list[str]:
    """``--rm-url``'s values as a list of base URLs; :class:`RewardError` for a value that
    is not an ``http://`` or ``https://`` URL with a host."""
    if not urls:
        raise RewardError("reward remote: --rm-url is not set; give the base URL of at least one reward server")
    if isinstance(urls, str):
        urls = [urls]
    checked = []
    for url in urls:
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RewardError(f"reward remote: --rm-url {url!r}: not an http:// or https:// URL with a host")
        try:
            parts.port  # noqa: B018  (raises on a bad port)
        except ValueError as exc:
            raise RewardError(f"reward remote: --rm-url {url!r}: {exc}") from None
        checked.append(str(url).rstrip("/"))
    return checked


class RemoteReward:
    """The ``remote`` reward (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        from miles_core.engine.auth import auth_headers, resolve_api_key

        get = config.get
        self.urls = check_urls(get("rm_url"))
        self.expected: str | None = get("rm_remote_reward")
        self.encoding: str = get("rm_pixel_encoding") or "png"
        self.batch_size = int(get("rm_batch_size") or 8)
        self.max_in_flight = int(get("rm_max_in_flight") or 4)
        self.group_rm = bool(get("group_rm"))
        self.group_size = get("n_samples_per_prompt")
        self.policy = RetryPolicy.from_config(config)
        self.headers = auth_headers(resolve_api_key(get("api_key"), get("api_key_file")))
        self._turn = itertools.count()
        self._lock = threading.Lock()  # the counters: pop_metrics may run while a call does
        self._counts = {"requests": 0, "retries": 0, "failed_requests": 0, "split_requests": 0}
        self._components: dict[str, list[float]] = {}
        self.info = run_in_new_loop(self._check_servers())
        self.served: str = self.info["reward"]

    # -- start-up --------------------------------------------------------------------

    async def _get(self, session: Any, url: str, path: str) -> Answer:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.policy.timeout)
        try:
            async with session.get(f"{url}{path}", headers=self.headers, timeout=timeout) as response:
                return Answer(url, response.status, await response.read(), dict(response.headers))
        except asyncio.TimeoutError:
            raise RewardError(
                f"reward remote: --rm-url {url}: no answer to GET {path} within {self.policy.timeout:g} s (--rm-timeout)"
            ) from None
        except aiohttp.ClientError as exc:
            raise RewardError(f"reward remote: --rm-url {url}: unreachable ({type(exc).__name__}: {' '.join(str(exc).split())})") from None

    async def _info(self, session: Any, url: str) -> dict[str, Any]:
        health = await self._get(session, url, "/health")
        # A server started beside the run may still be loading its model: wait for it, up
        # to --rm-timeout, rather than stop a run its operator started on time.
        deadline = asyncio.get_running_loop().time() + self.policy.timeout
        while health.status == 503 and _loading(health) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.25)
            health = await self._get(session, url, "/health")
        if health.status != 200:
            raise RewardError(
                f"reward remote: --rm-url {url}: GET /health answered {health.status} ({health.error_message()}); is the reward still loading?"
            )
        answer = await self._get(session, url, "/info")
        if answer.status == 401:
            raise RewardError(
                f"reward remote: --rm-url {url}: the server refused the key ({answer.error_message()}); give the run the "
                "server's key with --api-key-file FILE or MILES_API_KEY"
            )
        if answer.status != 200:
            raise RewardError(
                f"reward remote: --rm-url {url}: GET /info answered {answer.status} ({answer.error_message()}); is it a reward server?"
            )
        try:
            info = answer.json()
        except CallFailed as exc:
            raise RewardError(f"reward remote: --rm-url {exc}; is it a reward server?") from None
        if not isinstance(info, dict) or not isinstance(info.get("reward"), str) or "wire_version" not in info:
            raise RewardError(
                f"reward remote: --rm-url {url}: GET /info is not a reward server's (no 'reward' and 'wire_version'); is it a reward server?"
            )
        if info.get("run_worker"):
            raise RewardError(
                f"reward remote: --rm-url {url} is a --use-ray run's reward worker (serve-reward --run-worker), which serves "
                "only its run; start a reward server with serve-reward --rm-type NAME"
            )
        if info["wire_version"] != WIRE_VERSION:
            raise RewardError(
                f"reward remote: --rm-url {url}: speaks reward wire version {info['wire_version']!r}, this client version {WIRE_VERSION}"
            )
        if self.expected is not None and info["reward"] != self.expected:
            raise RewardError(f"reward remote: --rm-url {url} serves reward {info['reward']!r}, not {self.expected!r} (--rm-remote-reward)")
        encodings = info.get("pixel_encodings") or ["png"]
        if self.encoding not in encodings:
            raise RewardError(
                f"reward remote: --rm-url {url} takes pixels as {', '.join(map(str, encodings))}, not {self.encoding} (--rm-pixel-encoding)"
            )
        most = info.get("max_samples")
        if isinstance(most, int) and not self.group_rm and self.batch_size > most:
            raise RewardError(
                f"reward remote: --rm-batch-size {self.batch_size} is above --rm-url {url}'s limit of {most} samples per request"
            )
        group = self.group_size
        if isinstance(most, int) and self.group_rm and group and group > most:
            raise RewardError(
                f"reward remote: a prompt group of {group} samples (--n-samples-per-prompt, sent whole under --group-rm) "
                f"is above --rm-url {url}'s limit of {most} samples per request"
            )
        if info.get("group_rm") and not self.group_rm:
            raise RewardError(
                f"reward remote: --rm-url {url} serves a reward that scores whole prompt groups (--group-rm); run with --group-rm too"
            )
        return info

    async def _check_servers(self) -> dict[str, Any]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            infos = await asyncio.gather(*(self._info(session, url) for url in self.urls))
        first = infos[0]
        for url, info in zip(self.urls[1:], infos[1:]):
            if (info["reward"], info.get("rewards")) != (first["reward"], first.get("rewards")):
                raise RewardError(
                    f"reward remote: --rm-url {url} serves {_served(info)} but {self.urls[0]} serves {_served(first)}; "
                    "every URL must serve the same reward with the same weights"
                )
        return first

    # -- scoring ---------------------------------------------------------------------

    def _retried(self, line: str) -> None:
        with self._lock:
            self._counts["retries"] += 1
        log.warning("reward remote: retrying a request: %s", line)

    async def _request(self, session: Any, first: int, pixels: list[Any], prompts: list[str], metadata: list[Any]) -> list[Any]:
        """One request's samples scored: per sample its reward or a :class:`SampleNotScored`.
        A sample that cannot go on the wire (pixels PNG cannot carry, metadata that is not
        JSON) fails alone; the others are sent."""
        values: list[Any] = [None] * len(prompts)
        entries: dict[int, dict[str, Any]] = {}
        for i, (x, prompt, meta) in enumerate(zip(pixels, prompts, metadata)):
            group = 0 if self.group_rm else i
            try:
                entries[i] = encode_sample(x, prompt, meta if isinstance(meta, Mapping) else {}, encoding=self.encoding, group=group)
            except Exception as exc:  # this sample only
                values[i] = SampleNotScored(f"cannot be sent: {' '.join(str(exc).split()) or type(exc).__name__}")
        if self.group_rm and len(entries) < len(prompts):  # a group reward sees whole groups or nothing
            failure = next(v for v in values if v is not None)
            return [SampleNotScored(f"its prompt group was not sent: {failure}") if v is None else v for v in values]
        if not entries:
            return values
        for i, value in (await self._send(session, first, entries)).items():
            values[i] = value
        return values

    async def _send(self, session: Any, first: int, entries: dict[int, dict[str, Any]]) -> dict[int, Any]:
        """POST ``entries`` (sample index -> wire sample); per index its reward or a
        :class:`SampleNotScored`. A request over the server's size limits (413) goes again in
        halves, down to one sample; a reward the server cannot use at all (422) is a
        :class:`RewardError`, which stops the run as it would in-process."""
        body = {"wire_version": WIRE_VERSION, "reward": self.served, "samples": list(entries.values())}
        try:
            answer = await post_with_retries(
                session, self.urls, "/score", first=first, policy=self.policy, json_body=body, headers=self.headers, on_retry=self._retried
            )
            if answer.status == 413 and len(entries) > 1 and not self.group_rm:
                half = list(entries)[: len(entries) // 2]
                with self._lock:
                    self._counts["requests"] += 1
                    self._counts["split_requests"] += 1
                first_half = await self._send(session, first, {i: entries[i] for i in half})
                second_half = await self._send(session, first + 1, {i: e for i, e in entries.items() if i not in first_half})
                return {**first_half, **second_half}
            if answer.status == 422:
                raise RewardError(f"reward remote: {answer.url}: the server cannot use its reward: {answer.error_message()}")
            if answer.status != 200:
                raise CallFailed(f"{answer.url}: answered {answer.status}: {answer.error_message()}")
            results = decode_response(answer.json(), len(entries))
        except RewardError:
            raise
        except Exception as exc:  # the request's samples fail, and are counted; the run goes on
            with self._lock:
                self._counts["requests"] += 1
                self._counts["failed_requests"] += 1
            reason = " ".join(str(exc).split()) or type(exc).__name__
            failure = SampleNotScored(f"request of {len(entries)} sample(s) failed: {reason}")
            return dict.fromkeys(entries, failure)
        values: dict[int, Any] = {}
        with self._lock:
            self._counts["requests"] += 1
            for i, result in zip(entries, results):
                if isinstance(result, str):
                    values[i] = SampleNotScored(f"{answer.url}: the server's reward failed: {result}")
                    continue
                reward, components = result
                for name, value in components.items():
                    self._components.setdefault(name, []).append(value)
                values[i] = reward
        return values

    async def _score(self, outputs: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Any]) -> list[Any]:
        import aiohttp

        size = len(prompts) if self.group_rm else self.batch_size
        spans = [(start, min(start + size, len(prompts))) for start in range(0, len(prompts), size)]
        firsts = [next(self._turn) % len(self.urls) for _ in spans]
        async with aiohttp.ClientSession() as session:
            parts = await gather_bounded(
                [
                    (lambda a=a, b=b, f=f: self._request(session, f, list(outputs[a:b]), list(prompts[a:b]), list(metadata[a:b])))
                    for (a, b), f in zip(spans, firsts)
                ],
                self.max_in_flight,
            )
        values: list[Any] = []
        for (a, b), part in zip(spans, parts):
            if isinstance(part, RewardError):  # the served reward cannot be used at all
                raise part
            if isinstance(part, BaseException):  # a bug or a cancellation, not a server's answer
                values.extend([SampleNotScored(f"request failed: {type(part).__name__}: {part}")] * (b - a))
            else:
                values.extend(part)
        return values

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[Any]:
        if not prompts:
            return []
        return run_in_new_loop(self._score(outputs, prompts, metadata))

    def pop_metrics(self) -> dict[str, float]:
        with self._lock:
            metrics: dict[str, float] = {key: float(value) for key, value in self._counts.items()}
            metrics.update({f"{name}_mean": sum(v) / len(v) for name, v in self._components.items() if v})
            self._counts = dict.fromkeys(self._counts, 0)
            self._components = {}
        return metrics


def _loading(answer: Answer) -> bool:
    """Whether a ``/health`` answer says the reward is still being built."""
    try:
        body = answer.json()
    except CallFailed:
        return False
    return isinstance(body, dict) and body.get("status") == "loading"


def _served(info: Mapping[str, Any]) -> str:
    return f"{info['reward']!r} ({json.dumps(info.get('rewards'), sort_keys=True)})"


__all__ = ["NAME", "RemoteReward", "SampleNotScored", "check_urls"]
