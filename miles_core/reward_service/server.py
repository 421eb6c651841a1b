"""An HTTP server for one reward: ``miles-core serve-reward`` (docs/rewards.md, "Serving a
reward"), the server side of the reward wire (:mod:`miles_core.reward_service.wire`).

The reward is the configuration's, exactly as a training run scores with it
(:class:`~miles_core.training.rewards.RewardScorer`: ``--rm-type``, a ``--reward-weights``
mixture, ``--custom-rm-path``, ``--reward-key``, ``--group-rm``); the server listens at once
and builds it in a background thread. Routes:

- ``GET /health`` (no key): 200 ``{"status": "ok"}`` once the reward is built; 503
  ``{"status": "loading" | "failed", "error": ...}`` before, or when building it failed.
- ``GET /info``: the wire version, the reward's name (the scorer's: ``pickscore``,
  ``0.5*ocr + 0.5*pickscore``), each registered reward it runs with the plugin
  distribution and version providing it and ``weights_sha256`` (:func:`weights_sha256`),
  the pixel encodings, the limits (``max_samples``, ``max_values``, ``max_body_bytes``)
  and ``group_rm``.
- ``POST /score``: a wire request; its samples are scored together, as one batch of a
  rollout (concurrent requests are fine: the scorer serialises the calls of each reward
  and coalesces the samples waiting for it). A request naming another reward answers 409;
  a malformed one 400 naming the field; one over ``--max-body-bytes`` or ``--max-samples``
  413. A sample the reward fails on gets ``null`` and its one-line reason, the others their
  rewards; a reward that cannot be used at all (a dict reward without ``--reward-key``)
  answers 422 (not 500, which clients retry).

Every non-200 answer is ``{"error": "one line"}``. With an API key every request but
``GET``/``HEAD /health`` must carry ``Authorization: Bearer KEY`` (401 before its body is
read, :func:`miles_core.engine.auth.bearer_middleware`). A request never names a path:
the reward's weights are the ones its flags gave at start-up, and with
``--allowed-weight-roots`` each of those lies under a root (:func:`check_servable`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from miles_core.engine.auth import bearer_middleware
from miles_core.engine.limits import body_too_large
from miles_core.engine.server import RunningServer, start_server
from miles_core.engine.weight_roots import weight_path_refusal
from miles_core.errors import ConfigError, RequestError, RequestLimitError, RewardError, UsageError
from miles_core.reward_service.wire import (
    DEFAULT_MAX_VALUES,
    PIXEL_ENCODINGS,
    WIRE_VERSION,
    ScoreRequest,
    decode_request,
    encode_response,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SAMPLES = 256
DEFAULT_MAX_BODY_BYTES = 256 * 1024**2
PATH_METAVARS = ("PATH", "DIR", "FILE")
_HASH_CHUNK = 1024**2


# -- the rewards a configuration serves, their weights ---------------------------------------


def served_rewards(config: Any) -> list[str]:
    """The registered rewards the configuration's scorer runs: the ``--reward-weights``
    mixture's, else ``--rm-type``'s; none for ``--custom-rm-path`` (a function of the
    user's, whose files are not known)."""
    if config.get("custom_rm_path"):
        return []
    weights = config.get("reward_weights")
    if isinstance(weights, dict) and weights:
        return [str(name) for name in weights]
    return [config.rm_type] if config.get("rm_type") else []


def is_path_flag(flag: Any) -> bool:
    """Whether a plugin flag names files: a text flag whose metavar is ``PATH``, ``DIR`` or
    ``FILE``, or whose name ends in ``-path``, and that is not a dotted path to code
    (``path_kind``, ``--custom-rm-path``)."""
    return flag.path_kind is None and flag.type == "str" and (flag.metavar in PATH_METAVARS or flag.name.endswith("-path"))


def weight_paths(config: Any, reward: str) -> list[tuple[str, str]]:
    """``(flag, value)`` for each path flag (:func:`is_path_flag`) that the plugin
    distribution providing registered reward ``reward`` declares and the configuration
    sets, in the plugin's order. Every such flag counts (a distribution's rewards share
    models: ``temporal_consistency`` reads ``--clipscore-model-path``)."""
    from miles_core.plugin_manager import get_host

    host = get_host()
    distribution = host.registries.reward.get(reward).plugin.distribution
    paths = []
    for owned in host.flags:
        if owned.owner.distribution != distribution or not is_path_flag(owned.flag):
            continue
        values = config.get(owned.flag.dest)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if isinstance(value, str) and value:
                paths.append((owned.flag.name, value))
    return paths


def _files(root: Path) -> Iterator[tuple[str, Path]]:
    """``(relative path, file)`` under ``root`` sorted by relative path (POSIX form), links
    followed (a hub snapshot's files are links to its blobs), each directory once, names
    starting with a dot skipped (``.cache``: hub download records that differ per machine;
    ``.git``); a file alone is ``("", root)``."""
    if not root.is_dir():
        yield "", root
        return
    found: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for directory, subdirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:  # a link back up the tree
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in names:
            path = Path(directory, name)
            if not name.startswith(".") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    yield from sorted(found)


def weights_sha256(paths: Sequence[tuple[str, str]]) -> str | None:
    """The sha256 of a reward's weight files: for each ``(flag, value)`` whose value is a
    local file or directory (in order), the flag's name and a NUL, then each of its files
    (:func:`_files`) as its relative path (UTF-8; empty for a flag naming a file), a NUL,
    its size as 8 little-endian bytes and its bytes. None when no value is local (a
    weight-free reward, or weights given as hub ids, which are not hashed). Files are read
    in 1 MiB chunks."""
    digest = hashlib.sha256()
    hashed = False
    for flag, value in paths:
        root = Path(value).expanduser()
        if not root.exists():
            continue
        hashed = True
        digest.update(flag.encode("utf-8") + b"\0")
        for relative, path in _files(root):
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                digest.update(relative.encode("utf-8", "surrogateescape") + b"\0" + size.to_bytes(8, "little"))
                for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
                    digest.update(chunk)
    return digest.hexdigest() if hashed else None


def reward_records(config: Any, scorer_name: str | None = None, *, hash_weights: bool = True) -> list[dict[str, Any]]:
    """``/info``'s ``rewards``: each registered reward served with its distribution,
    version and :func:`weights_sha256` (None without ``hash_weights``); a
    ``--custom-rm-path`` function is one record with no distribution, version or hash."""
    from miles_core.plugin_manager import get_host

    names = served_rewards(config)
    if not names:
        name = scorer_name or f"--custom-rm-path {config.get('custom_rm_path')}"
        return [{"name": name, "distribution": None, "version": None, "weights_sha256": None}]
    registry = get_host().registries.reward
    records = []
    for name in names:
        plugin = registry.get(name).plugin
        records.append(
            {
                "name": name,
                "distribution": plugin.distribution,
                "version": plugin.version,
                "weights_sha256": weights_sha256(weight_paths(config, name)) if hash_weights else None,
            }
        )
    return records


def check_servable(config: Any, roots: Sequence[Path] | None, *, worker: bool = False) -> None:
    """Refuse, in one line, a configuration a reward server cannot serve: no reward,
    ``--rm-type remote`` (:class:`~miles_core.errors.UsageError`), or with ``roots``
    (``--allowed-weight-roots``, resolved) a set path flag of a served reward
    (:func:`weight_paths`) that is not a local path under one of them, links resolved
    (:class:`~miles_core.errors.ConfigError`). Runs before anything is built. A run's
    ``worker`` scores with whatever reward the run does, ``remote`` included."""
    if not (config.get("custom_rm_path") or config.get("reward_weights") or config.get("rm_type")):
        raise UsageError("no reward to serve: give --rm-type NAME, --reward-weights (a mixture) or --custom-rm-path")
    names = served_rewards(config)
    if "remote" in names and not worker:
        where = "--reward-weights names remote" if config.get("reward_weights") else "--rm-type remote"
        raise UsageError(f"{where}: a reward server scores itself; serve the reward its clients should get (--rm-type NAME)")
    if roots is None:
        return
    for name in names:
        for flag, value in weight_paths(config, name):
            path = Path(value).expanduser()
            refusal = weight_path_refusal(path, roots, field=flag)
            if refusal is not None:
                raise ConfigError(refusal)
            if not path.exists():
                raise ConfigError(
                    f"{flag} {value!r}: no such file or directory; with --allowed-weight-roots a reward's weights are "
                    "local files under the roots (a hub id is downloaded, not read from them)"
                )


# -- the application -----------------------------------------------------------------------


class ServiceError(Exception):
    """A request the server refuses: answered with ``status`` and the one-line message."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


@dataclass
class RewardState:
    """What the routes share: the scorer once built, or why building it failed."""

    config: Any
    max_samples: int = DEFAULT_MAX_SAMPLES
    max_values: int = DEFAULT_MAX_VALUES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    on_ready: Callable[[Any], None] | None = None
    on_build_error: Callable[[BaseException], None] | None = None
    worker: bool = False
    """``--run-worker``: a ``--use-ray`` run's reward worker (:mod:`.run_worker`)."""
    scorer: Any = None
    info: dict[str, Any] | None = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def build(self) -> None:
        """Build the reward, then hash its weights (in the builder thread; not a run's
        worker's, whose run reads no checksum: N workers would each read every weight file)."""
        from miles_core.training.rewards import RewardScorer

        try:
            scorer = RewardScorer(self.config)
            if not self.worker:
                # A request names no reward: a sample's metadata.rm_type (which a training run
                # routes to a reward of its own before it reaches a remote one) is ignored here,
                # as an evaluation reward set ignores it, so no request builds another reward.
                # A run's own worker scores each sample as the run would, rm_type included.
                scorer.fixed = True
            records = reward_records(self.config, scorer.name, hash_weights=not self.worker)  # hashed once, here
            self.info = {
                "wire_version": WIRE_VERSION,
                "reward": scorer.name,
                "rewards": records,
                "pixel_encodings": list(PIXEL_ENCODINGS),
                "max_samples": self.max_samples,
                "max_values": self.max_values,
                "max_body_bytes": self.max_body_bytes,
                "group_rm": scorer.needs_whole_groups,
                "run_worker": self.worker,
            }
            self.scorer = scorer
            if self.on_ready is not None:
                self.on_ready(scorer)
        except BaseException as exc:  # reported through /health and on_build_error
            log.debug("building the reward failed", exc_info=True)
            self.error = exc
            if self.on_build_error is not None:
                self.on_build_error(exc)
        finally:
            self.ready.set()

    def start(self) -> None:
        self.thread = threading.Thread(target=self.build, name="reward-builder", daemon=True)
        self.thread.start()

    def require(self) -> Any:
        if self.scorer is not None:
            return self.scorer
        if self.error is not None:
            raise ServiceError(503, f"reward: failed to build: {one_line(self.error)}")
        raise ServiceError(503, "reward: still being built; wait for GET /health to answer 200")


STATE = web.AppKey("reward_state", RewardState)


def one_line(exc: BaseException | str, limit: int = 500) -> str:
    text = " ".join(str(exc).split()) or (type(exc).__name__ if isinstance(exc, BaseException) else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def create_reward_app(
    config: Any,
    *,
    api_key: str | None = None,
    allowed_weight_roots: Sequence[Path] | None = None,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_values: int = DEFAULT_MAX_VALUES,
    on_ready: Callable[[Any], None] | None = None,
    on_build_error: Callable[[BaseException], None] | None = None,
    worker: bool = False,
) -> web.Application:
    """The application serving ``config``'s reward; :func:`start_reward_server` starts it
    and builds the reward in the background. :func:`check_servable` runs here, so a
    configuration it refuses raises before anything is built. ``allowed_weight_roots``:
    resolved roots (:func:`miles_core.engine.weight_roots.resolve_roots`), None for no
    check. ``on_ready(scorer)`` and ``on_build_error(exc)`` are called from the builder
    thread."""
    check_servable(config, allowed_weight_roots, worker=worker)
    # The key is checked first (outermost): a refused request's body is never read.
    middlewares = [_errors] if api_key is None else [bearer_middleware(api_key), _errors]
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[STATE] = RewardState(
        config, max_samples, max_values, max_body_bytes, on_ready=on_ready, on_build_error=on_build_error, worker=worker
    )
    app.add_routes([web.get("/health", _health), web.get("/info", _info)])
    if not worker:  # a worker's routes are added by miles_core.reward_service.run_worker.create_worker_app
        app.add_routes([web.post("/score", _score)])
    return app


async def start_reward_server(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Listen on ``host:port`` (0: a free port), then build the reward in a background
    thread (an address that cannot be bound builds nothing)."""
    server = await start_server(app, host, port)
    app[STATE].start()
    return server


# -- plumbing --------------------------------------------------------------------------------

_dumps = functools.partial(json.dumps, allow_nan=False)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": one_line(message)}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ServiceError as exc:
        return _error(exc.status, str(exc))
    except RequestLimitError as exc:
        return _error(exc.status, str(exc))
    except RequestError as exc:
        return _error(400, str(exc))
    except RewardError as exc:  # the reward cannot be used at all (the server's configuration): no retry helps
        return _error(422, str(exc))
    except web.HTTPRequestEntityTooLarge:
        return _error(413, str(body_too_large(request.content_length, request.client_max_size, "--max-body-bytes")))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{request.method} {request.path}: {exc.reason}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


def parse_json(raw: bytes) -> Any:
    """A request body as JSON; :class:`RequestError` when it is empty or not JSON."""
    if not raw:
        raise RequestError("body", "empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError("body", f"not valid JSON ({exc})") from None


def _parse(raw: bytes, scorer: Any, state: RewardState) -> ScoreRequest:
    """The request in ``raw`` (in a worker thread: decoding PNGs takes a while)."""
    body = parse_json(raw)
    reward = body.get("reward") if isinstance(body, dict) else None
    if isinstance(reward, str) and reward != scorer.name:  # before any pixel is decoded
        raise ServiceError(409, f"reward: the request expects {reward!r}; this server serves {scorer.name!r}")
    return decode_request(body, max_samples=state.max_samples, max_values=state.max_values)


def request_samples(request: ScoreRequest, group_rm: bool) -> list[Any]:
    """Samples as a rollout makes them: each request sample its own group unless the
    request groups them (a ``--group-rm`` reward needs the groups)."""
    from miles_core.request import RolloutOutput
    from miles_core.rollout.sample import Sample

    if group_rm and request.groups is None:
        raise RequestError(
            "samples[0].group", "missing; this server's reward scores whole groups (--group-rm): give every sample its group"
        )
    groups = request.groups if request.groups is not None else list(range(len(request.prompts)))
    counts: dict[int, int] = {}
    samples = []
    for i, (prompt, metadata, pixels, group) in enumerate(zip(request.prompts, request.metadata, request.pixels, groups)):
        index = counts.get(group, 0)
        counts[group] = index + 1
        if request.indices[i] is not None:
            index = request.indices[i]
        seed = request.seeds[i] if request.seeds[i] is not None else i
        output = RolloutOutput(request_id=f"score-{group}", prompt=prompt, seed=seed, generated_output=pixels)
        samples.append(
            Sample(
                prompt=prompt,
                metadata=metadata,
                rollout_id=0,
                group_index=group,
                index_in_group=index,
                seed=seed,
                sde_step_indices=(),
                output=output,
            )
        )
    return samples


def _reason(scorer: Any, outcome: dict[str, str | None]) -> str:
    """A failed sample's one-line reason: each reward that failed on it and why."""
    from miles_core.training.rewards import CUSTOM

    failed = [f"{scorer.name if name == CUSTOM else name}: {why}" for name, why in outcome.items() if why is not None]
    return one_line("; ".join(failed) or "no finite reward")


# -- routes ----------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.scorer is not None:
        return web.json_response({"status": "ok"})
    if state.error is not None:
        return web.json_response({"status": "failed", "error": f"reward: failed to build: {one_line(state.error)}"}, status=503)
    return web.json_response({"status": "loading", "error": "reward: still being built"}, status=503)


async def _info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require()
    return web.json_response(state.info, dumps=_dumps)


async def _score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    scorer = state.require()
    raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge, 413
    parsed = await asyncio.to_thread(_parse, raw, scorer, state)
    samples = request_samples(parsed, scorer.needs_whole_groups)
    try:
        await scorer.score(samples)
    finally:  # the scorer keeps each sample's outcome until it is taken
        outcomes = [scorer.take_outcome(sample) for sample in samples]
    values: list[float | None] = []
    errors: list[str | None] = []
    for sample, outcome in zip(samples, outcomes):
        failed = bool(sample.reward_failed)
        values.append(None if failed else float(sample.reward))
        errors.append(_reason(scorer, outcome) if failed else None)
    body = encode_response(values, [dict(s.reward_components) for s in samples], errors)
    return web.json_response(body, dumps=_dumps)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_SAMPLES",
    "STATE",
    "RewardState",
    "ServiceError",
    "check_servable",
    "create_reward_app",
    "is_path_flag",
    "one_line",
    "parse_json",
    "request_samples",
    "reward_records",
    "served_rewards",
    "start_reward_server",
    "weight_paths",
    "weights_sha256",
]
