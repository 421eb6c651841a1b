"""An HTTP server for one :class:`EmbeddedEngine`, speaking sglang-diffusion's contract.

Routes (docs/design.md, "The wire contract"):

- ``POST /rollout/generate``: a JSON :class:`RolloutRequest`; answers ``application/msgpack``,
  a list with one record per output (tensors as ``{"__tensor__": true, ...}`` records).
- ``GET /health``: 503 while the model loads (the server listens first and loads in a
  background thread, so a client can wait for it), 200 once it is ready, with
  ``"deterministic"``: whether the process runs torch's deterministic algorithms.
- ``POST /update_weights_from_disk``: ``{"model_path": DIR, "target_modules": [...] | null,
  "flush_cache": bool}`` as sglang-diffusion takes it; answers ``{"success", "message"}``.
  ``DIR`` must lie under one of the server's allowed weight roots once its links are
  resolved (:mod:`miles_core.engine.weight_roots`); anything else answers 403, the same
  whether or not it exists.
- ``POST /update_weights_from_tensor``: our CUDA-IPC-free format, an ``application/msgpack``
  body ``{"target_module": NAME, "bucket": <safetensors bytes>, "lora_only": bool,
  "lora_config": {r, lora_alpha, target_modules, init_lora_weights} (optional, LoRA-only)}``,
  one request per bucket of at most ``--update-weight-buffer-size`` bytes. With
  ``lora_config`` a module without an adapter gets that one first (diffusers'
  ``add_adapter``); one with another adapter answers 409. A JSON body is sglang-diffusion's
  own format (``serialized_named_tensors``: pickled CUDA-IPC handles, see
  :mod:`miles_core.engine.ipc_wire`): unpickling it runs its sender's code, so it answers
  403 unless the server was started colocated with its trainer (``accept_ipc_weights``,
  ``serve-engine --accept-ipc-weights``) and the peer is loopback.
- ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``, ``POST
  /destroy_weights_update_group``: weight updates through a torch.distributed group of its
  own with the trainer (sglang's distributed-update API, which sglang-diffusion lacks):
  join the group ``{master_address, master_port, rank_offset, world_size, group_name,
  backend: gloo | nccl, timeout_s}``; receive one bucket ``{names, dtypes, shapes,
  group_name, target_module, lora_only, lora_config}`` broadcast by rank 0 as one flat
  buffer (:mod:`miles_core.engine.weight_group`) and load it as a tensor update; leave
  ``{group_name}``.
- ``POST /get_weights_checksum``: ``{"module_names": [...] | null}``; answers
  ``{name: sha256}`` as sglang-diffusion does (see :func:`miles_core.weights.module_checksum`).
- ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` (no body, or
  ``{}``), as sglang-diffusion names them: release the storages of every module of the
  served pipeline (copied to host memory) and bring them back; each answers
  ``{"success": true, "sleeping": bool, "message": ...}``, and asking twice is harmless.
  While released, generation, weight updates and checksums answer 409 naming the state.

A server started with an API key answers 401 to every request but ``GET /health`` that
does not carry ``Authorization: Bearer <key>`` (:mod:`miles_core.engine.auth`), before
anything else looks at it.

A malformed or out-of-range request answers 400 with ``{"error": "<field>: <message>"}``;
an unexpected failure answers 500 with the message. Either way the server keeps serving.

Limits (:mod:`miles_core.engine.limits`): a ``/rollout/generate`` request over one of the
server's :class:`RequestLimits` is refused before anything is allocated, 400 for a field
(``num_outputs_per_prompt``...) and 413 for its total work, and a body over the route's
byte limit with 413; the JSON body then also carries ``field``, ``value``, ``limit`` and
the ``flag`` that raises the limit. A request whose client goes away is cancelled: its
generation stops at the next denoising step, so the next request is served at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from aiohttp import web

from miles_core.conditioning_image import check_request_image
from miles_core.engine import ipc_wire
from miles_core.engine.auth import bearer_middleware
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.limits import BODY_FLAG, DEFAULT_MAX_BODY_BYTES, RequestLimits, body_too_large
from miles_core.engine.weight_group import (
    BACKENDS,
    DEFAULT_JOIN_TIMEOUT_S,
    WeightGroup,
    bucket_layout,
    in_daemon_thread,
    parse_dtype,
    unpack_bucket,
)
from miles_core.engine.weight_roots import resolve_roots, weight_path_refusal
from miles_core.engine.wire import pack_outputs
from miles_core.errors import (
    EngineReleasedError,
    LoraAdapterError,
    LoraAdapterMismatch,
    RequestError,
    RequestLimitError,
    WeightGroupError,
    WeightUpdateError,
)
from miles_core.request import RolloutRequest
from miles_core.weights import bucket_from_bytes

log = logging.getLogger(__name__)


def _flag_default(name: str) -> Any:
    from miles_core.config.reference_flags import FLAGS

    return next(flag.default for flag in FLAGS if flag.name == name)


DEFAULT_BUFFER_SIZE: int = _flag_default("--update-weight-buffer-size")
"""``--update-weight-buffer-size``'s default (512 MiB)."""

LORA_MARKERS = ("lora_A", "lora_B")


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and ``field: message``."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        self.field = field_name
        self.status = status
        super().__init__(f"{field_name}: {message}")


@dataclass
class EngineState:
    """What the routes share: the engine once loaded, or why loading failed."""

    loader: Callable[[], EmbeddedEngine]
    engine: EmbeddedEngine | None = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    on_load_error: Callable[[BaseException], None] | None = None
    thread: threading.Thread | None = None
    limit_overrides: dict[str, int | None] = field(default_factory=dict)
    limits: RequestLimits | None = None
    """Derived from the model once it is loaded (see :meth:`RequestLimits.derive`)."""
    max_generate_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    accept_ipc_weights: bool = False
    """Whether sglang's pickled ``serialized_named_tensors`` updates are taken (from
    loopback peers): only for a server colocated with its trainer."""
    weight_roots: tuple[Path, ...] = ()
    """The folders ``/update_weights_from_disk`` loads from (none: it loads nothing)."""

    def load(self) -> None:
        try:
            engine = self.loader()
            self.limits = RequestLimits.derive(engine.family, self.limit_overrides)
            log.info("request limits: %s", ", ".join(f"{k}={v}" for k, v in self.limits.as_dict().items()))
            self.engine = engine
        except BaseException as exc:  # reported through /health and on_load_error
            log.exception("loading the engine failed")
            self.error = exc
            if self.on_load_error is not None:
                self.on_load_error(exc)
        finally:
            self.ready.set()

    def require(self) -> EmbeddedEngine:
        if self.engine is not None:
            return self.engine
        if self.error is not None:
            raise BadRequest("engine", f"failed to load: {self.error}", status=503)
        raise BadRequest("engine", "the model is still loading; wait for GET /health to answer 200", status=503)


STATE = web.AppKey("engine_state", EngineState)
GROUPS = web.AppKey("weight_groups", dict)
"""The weight-update groups this server is a member of, by name."""


def create_app(
    engine: EmbeddedEngine | Callable[[], EmbeddedEngine],
    *,
    update_weight_buffer_size: int = DEFAULT_BUFFER_SIZE,
    max_request_bytes: int | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    limits: Mapping[str, int | None] | None = None,
    max_generate_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    accept_ipc_weights: bool = False,
    api_key: str | None = None,
    allowed_weight_roots: Sequence[str | os.PathLike[str]] = (),
) -> web.Application:
    """The application. ``engine`` is an engine, or a loader called in a background
    thread once :func:`start_server` listens (``/health`` answers 503 until it returns).

    With ``api_key`` every request but ``GET /health`` must carry ``Authorization: Bearer
    <api_key>``; one that does not answers 401 before its body is read (None: no
    authentication, for a server started by hand without a key). ``/update_weights_from_disk``
    loads only directories under ``allowed_weight_roots`` (checked and resolved here: one
    that is not a directory raises :class:`~miles_core.errors.ConfigError`; none: every
    disk load answers 403).

    Request bodies are capped at ``max_request_bytes`` (default: twice the weight-update
    buffer size plus 16 MiB, so one bucket always fits; a single tensor larger than that
    is refused with 413), ``/rollout/generate`` bodies at ``max_generate_body_bytes``.
    ``limits`` overrides some of the :class:`RequestLimits` derived from the model
    (``{"max_outputs_per_request": 128}``; None: derived). ``accept_ipc_weights``: take
    sglang's pickled CUDA-IPC weight updates from loopback peers (a server colocated with
    its trainer only; refused with 403 otherwise)."""
    loader = (lambda: engine) if isinstance(engine, EmbeddedEngine) else engine
    if max_request_bytes is None:
        max_request_bytes = 2 * update_weight_buffer_size + 16 * 1024**2
    overrides = dict(limits or {})
    RequestLimits.check_overrides(overrides)  # a bad override fails here, not in the loader thread
    roots = resolve_roots(allowed_weight_roots)
    # The key is checked first (outermost), so a refused request's body is never read and
    # no handler, error mapping included, runs for it.
    middlewares = [_errors] if api_key is None else [bearer_middleware(api_key), _errors]
    app = web.Application(client_max_size=max_request_bytes, middlewares=middlewares)
    app[STATE] = EngineState(
        loader,
        on_load_error=on_load_error,
        limit_overrides=overrides,
        max_generate_body_bytes=max_generate_body_bytes,
        accept_ipc_weights=accept_ipc_weights,
        weight_roots=roots,
    )
    app[GROUPS] = {}
    app.on_cleanup.append(_close_groups)
    app.add_routes(
        [
            web.get("/health", _health),
            web.post("/rollout/generate", _generate),
            web.post("/update_weights_from_disk", _update_from_disk),
            web.post("/update_weights_from_tensor", _update_from_tensor),
            web.post("/get_weights_checksum", _checksum),
            web.post("/init_weights_update_group", _init_group),
            web.post("/update_weights_from_distributed", _update_from_distributed),
            web.post("/destroy_weights_update_group", _destroy_group),
            web.post("/release_memory_occupation", _release_memory),
            web.post("/resume_memory_occupation", _resume_memory),
        ]
    )
    return app


@dataclass
class RunningServer:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Listen on ``host:port`` (0: a free port) and return the running server; the
    engine loader starts once it listens (an address that cannot be bound loads nothing)."""
    # handler_cancellation: a handler whose client goes away is cancelled (aiohttp's
    # default lets it run on), which is what stops that client's generation.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:  # the address cannot be bound
        await runner.cleanup()
        raise
    if STATE in app:
        _start_loading(app[STATE])
    addresses = runner.addresses
    return RunningServer(runner, host, addresses[0][1] if addresses else port)


# -- plumbing ---------------------------------------------------------------------------


def _start_loading(state: EngineState) -> None:
    state.thread = threading.Thread(target=state.load, name="engine-loader", daemon=True)
    state.thread.start()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _limit_error(exc: RequestLimitError) -> web.Response:
    body = {"error": str(exc), "field": exc.field, "value": exc.value, "limit": exc.limit, "flag": exc.flag}
    return web.json_response(body, status=exc.status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(exc.status, str(exc))
    except EngineReleasedError as exc:
        return _error(409, str(exc))
    except RequestLimitError as exc:
        return _limit_error(exc)
    except RequestError as exc:
        return _error(400, str(exc))
    except web.HTTPRequestEntityTooLarge:
        # The application-wide cap, sized for weight-update buckets.
        return _limit_error(
            body_too_large(
                request.content_length,
                request.client_max_size,
                "--update-weight-buffer-size",
                "raises it on the server, which takes bodies up to twice it plus 16 MiB; a lower one on the client sends smaller buckets",
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{request.method} {request.path}: {exc.reason}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


async def _json_body(request: web.Request, max_bytes: int | None = None, flag: str = "") -> Any:
    raw = await request.read() if max_bytes is None else await _read_at_most(request, max_bytes, flag)
    if not raw:
        raise BadRequest("body", "empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest("body", f"not valid JSON ({exc})") from None


async def _read_at_most(request: web.Request, max_bytes: int, flag: str) -> bytes:
    """The body, or a 413 as soon as it is known to exceed ``max_bytes`` (from its
    declared length, else while reading it: a chunked body is never held whole)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(request.content_length, max_bytes, flag)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > max_bytes:
            raise body_too_large(None, max_bytes, flag)
    return bytes(body)


def _json_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(data).__name__}")
    return data


def _refused_update(exc: WeightUpdateError, *, adapter_field: str, tensors_field: str) -> BadRequest:
    """The answer to a weight update the module refused: an adapter that does not match
    the server's (409) or that it cannot take (400) names ``adapter_field``; tensors that
    do not fit (400) name ``tensors_field``."""
    if isinstance(exc, LoraAdapterMismatch):
        return BadRequest(adapter_field, str(exc), status=409)
    return BadRequest(adapter_field if isinstance(exc, LoraAdapterError) else tensors_field, str(exc))


def _target_module(engine: EmbeddedEngine, body: dict[str, Any]) -> tuple[str, bool]:
    """A weight update's ``target_module`` (one of the engine's) and ``lora_only`` flag."""
    module = body.get("target_module")
    if not isinstance(module, str):
        raise BadRequest("target_module", f"must be a module name, got {module!r}")
    _module_names(engine, [module], "target_module")
    lora_only = body.get("lora_only", False)
    if not isinstance(lora_only, bool):
        raise BadRequest("lora_only", f"must be true or false, got {lora_only!r}")
    return module, lora_only


def _module_names(engine: EmbeddedEngine, value: Any, field_name: str) -> list[str]:
    """A list of the engine's module names; None or ["all"]: all of them."""
    components = list(engine.family.components())
    if value is None or value == ["all"]:
        return components
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(field_name, f"must be a list of module names, got {value!r}")
    unknown = [name for name in value if name not in components]
    if unknown:
        raise BadRequest(field_name, f"unknown module {unknown[0]!r}; this engine has {', '.join(components)}")
    return value


# -- routes -----------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        import torch

        # Whether this process runs torch's deterministic algorithms (serve-engine --deterministic-mode).
        return web.json_response({"status": "ok", "deterministic": torch.are_deterministic_algorithms_enabled()})
    if state.error is not None:
        return web.json_response({"status": "failed", "error": f"engine: failed to load: {state.error}"}, status=503)
    return web.json_response({"status": "loading"}, status=503)


async def _generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.require()
    engine.require_resident("generate")  # before the body is read; a request racing a release fails in the engine
    rollout_request = RolloutRequest.from_json(await _json_body(request, state.max_generate_body_bytes, BODY_FLAG))
    rollout_request = rollout_request.with_request_id()  # the same id in the server's and the engine's logs
    # The family's own checks and defaults (cheap: no tensors; an image is read and hashed),
    # then the server's limits, before the request waits for the engine or allocates anything.
    assert state.limits is not None  # set with the engine
    check_request_image(engine.family, rollout_request)
    state.limits.check(rollout_request, engine.family.resolve_params(rollout_request))
    try:
        outputs = await engine.generate(rollout_request)
    except asyncio.CancelledError:
        log.info(
            "POST /rollout/generate %s: cancelled (the client went away, or the server is stopping); stopping its generation",
            rollout_request.request_id,
        )
        raise
    body = await asyncio.to_thread(pack_outputs, outputs)
    return web.Response(body=body, content_type="application/msgpack")


async def _update_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.require()
    body = _json_object(await _json_body(request))
    model_path = body.get("model_path")
    if not model_path:
        raise BadRequest("model_path", "is required")
    if not isinstance(model_path, str):
        raise BadRequest("model_path", f"must be a string, got {model_path!r}")
    # Before anything looks at what the path holds: outside the roots the answer is the same
    # whether it exists or not. The same line as the sglang servers' proxy answers.
    refused = weight_path_refusal(model_path, state.weight_roots, field="model_path")
    if refused is not None:
        return _error(403, refused)
    flush_cache = body.get("flush_cache", True)
    if not isinstance(flush_cache, bool):
        raise BadRequest("flush_cache", f"must be true or false, got {flush_cache!r}")
    names = _module_names(engine, body.get("target_modules"), "target_modules")
    try:
        loaded = await asyncio.to_thread(engine.update_weights_from_disk, model_path, names)
    except WeightUpdateError as exc:
        raise BadRequest("model_path", str(exc)) from None
    message = f"Updated {len(loaded)} modules ({', '.join(loaded)})."
    return web.json_response({"success": True, "message": message, "loaded": loaded})


async def _update_from_tensor(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = await request.read()
    if request.content_type == "application/json" or raw.lstrip()[:1] == b"{":
        return await _update_from_ipc(request, state, raw)
    engine = state.require()
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise BadRequest("body", f"not a valid msgpack document ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a msgpack map, got {type(body).__name__}")
    unknown = sorted(set(body) - {"target_module", "bucket", "lora_only", "lora_config"})
    if unknown:
        raise BadRequest(str(unknown[0]), "unknown field (expected target_module, bucket, lora_only, lora_config)")
    module, lora_only = _target_module(engine, body)
    lora_config = _lora_config(body.get("lora_config"), lora_only)
    bucket = body.get("bucket")
    if not isinstance(bucket, bytes):
        raise BadRequest("bucket", f"must be safetensors bytes, got {type(bucket).__name__}")
    try:
        tensors = await asyncio.to_thread(bucket_from_bytes, bucket)
    except Exception as exc:
        raise BadRequest("bucket", f"not valid safetensors bytes ({exc})") from None
    if not tensors:
        raise BadRequest("bucket", "holds no tensors")
    if lora_only:
        other = sorted(name for name in tensors if not any(marker in name for marker in LORA_MARKERS))
        if other:
            raise BadRequest("bucket", f"lora_only update holds {other[0]!r}, which is not a lora_A/lora_B tensor")
    try:
        count = await asyncio.to_thread(engine.update_weights_from_tensors, module, tensors, lora_only=lora_only, lora_config=lora_config)
    except WeightUpdateError as exc:
        raise _refused_update(exc, adapter_field="lora_config", tensors_field="bucket") from None
    return web.json_response({"success": True, "message": f"Updated {count} tensors of {module}.", "num_tensors": count})


def _lora_config(value: Any, lora_only: bool) -> dict[str, Any] | None:
    """The optional ``lora_config`` of a LoRA-only update: ``{r, lora_alpha,
    target_modules, init_lora_weights}``, the adapter a module without one gets."""
    if value is None:
        return None
    if not lora_only:
        raise BadRequest("lora_config", "goes with lora_only updates only")
    if not isinstance(value, dict):
        raise BadRequest("lora_config", f"must be a map {{r, lora_alpha, target_modules, init_lora_weights}}, got {value!r}")
    unknown = sorted(set(value) - {"r", "lora_alpha", "target_modules", "init_lora_weights"})
    if unknown:
        raise BadRequest(f"lora_config.{unknown[0]}", "unknown field (expected r, lora_alpha, target_modules, init_lora_weights)")
    r, alpha, targets = value.get("r"), value.get("lora_alpha"), value.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise BadRequest("lora_config.r", f"must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise BadRequest("lora_config.lora_alpha", f"must be a positive number, got {alpha!r}")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise BadRequest("lora_config.target_modules", f"must be a non-empty list of module names, got {targets!r}")
    init = value.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise BadRequest("lora_config.init_lora_weights", f"must be true, false or a PEFT scheme name, got {init!r}")
    return {"r": r, "lora_alpha": alpha, "target_modules": targets, "init_lora_weights": init}


async def _update_from_ipc(request: web.Request, state: EngineState, raw: bytes) -> web.Response:
    """sglang-diffusion's ``serialized_named_tensors`` update: refused (403) before anything
    is parsed unless colocated and from a loopback peer; every field is checked (400 naming
    it) before the payload is unpickled."""
    if not state.accept_ipc_weights:
        raise BadRequest(
            "serialized_named_tensors",
            "refused: this format is unpickled (code execution for its sender), so this server takes it only when "
            "started colocated with its trainer (serve-engine --accept-ipc-weights); send msgpack safetensors buckets",
            status=403,
        )
    if not ipc_wire.is_loopback_peer(request.remote):
        raise BadRequest(
            "serialized_named_tensors",
            f"refused: this format is unpickled (code execution for its sender) and taken from loopback peers only, not {request.remote}",
            status=403,
        )
    engine = state.require()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest("body", f"not valid JSON ({exc})") from None
    body = _json_object(body)
    unknown = sorted(set(body) - set(ipc_wire.FIELDS))
    if unknown:
        raise BadRequest(str(unknown[0]), f"unknown field (expected {', '.join(ipc_wire.FIELDS)})")
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads:
        raise BadRequest("serialized_named_tensors", f"must be a non-empty list of base64 payloads, got {payloads!r:.80}")
    uuids = body.get("payload_gpu_uuids")
    if uuids is not None:
        if not isinstance(uuids, list) or not all(isinstance(u, str) and u for u in uuids):
            raise BadRequest("payload_gpu_uuids", f"must be null or a list of GPU UUIDs, got {uuids!r:.80}")
        if len(uuids) != len(payloads):
            raise BadRequest("payload_gpu_uuids", f"needs one entry per payload, got {len(uuids)} for {len(payloads)} payloads")
    load_format = body.get("load_format")
    if load_format is not None:
        raise BadRequest("load_format", f"{load_format!r} is not supported; send null (each payload a list of (name, tensor) pairs)")
    targets = body.get("target_modules")
    targets = [ipc_wire.DEFAULT_TARGET_MODULE] if targets is None else targets
    if not isinstance(targets, list) or len(targets) != 1:
        raise BadRequest("target_modules", f"must name exactly one module per request, got {targets!r}")
    (module,) = _module_names(engine, targets, "target_modules")
    mode = body.get("weight_update_mode")
    if mode not in (None, ipc_wire.LORA_MERGE):
        raise BadRequest("weight_update_mode", f"must be null (full weights) or {ipc_wire.LORA_MERGE!r}, got {mode!r}")
    lora_only = mode == ipc_wire.LORA_MERGE
    for name in ("lora_alpha", "lora_rank"):
        value = body.get(name)
        if value is None:
            continue
        if not lora_only:
            raise BadRequest(name, f"goes with weight_update_mode {ipc_wire.LORA_MERGE!r} only")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(name, f"must be a positive integer, got {value!r}")
    parameter = next(engine.component(module).parameters(), None)
    device = parameter.device if parameter is not None else None
    own_uuid = ipc_wire.device_uuid(device) if device is not None and device.type == "cuda" else None
    try:
        payload = ipc_wire.select_payload(payloads, uuids, own_uuid)
        data = ipc_wire.decode_base64(payload)
        pairs = await asyncio.to_thread(ipc_wire.load_payload, data)
    except ipc_wire.IpcFormatError as exc:
        raise BadRequest(exc.field, exc.message) from None
    tensors = dict(pairs)
    lora_config = None
    if lora_only:
        other = sorted(name for name in tensors if not any(marker in name for marker in LORA_MARKERS))
        if other:
            raise BadRequest(
                "serialized_named_tensors", f"a {ipc_wire.LORA_MERGE} update holds {other[0]!r}, which is not a lora_A/lora_B tensor"
            )
        if not getattr(engine.component(module), "peft_config", None):
            lora_config = _ipc_lora_config(tensors, body.get("lora_rank"), body.get("lora_alpha"))

    def load() -> int:
        loaded = engine.update_weights_from_tensors(module, tensors, lora_only=lora_only, lora_config=lora_config)
        if any(tensor.is_cuda for tensor in tensors.values()):
            # The copies out of the sender's memory finish before the answer lets it reuse that memory.
            ipc_wire.synchronize(tensors.values())
        return loaded

    try:
        count = await asyncio.to_thread(load)
    except WeightUpdateError as exc:
        raise _refused_update(exc, adapter_field="weight_update_mode", tensors_field="serialized_named_tensors") from None
    return web.json_response({"success": True, "message": f"Updated {count} tensors of {module} from IPC handles.", "num_tensors": count})


def _ipc_lora_config(tensors: Mapping[str, Any], rank: int | None, alpha: int | None) -> dict[str, Any]:
    """The adapter a module without one gets for a ``lora_merge`` update: on the layers
    the tensors name, of the tensors' rank (or ``lora_rank``), ``lora_alpha`` defaulting
    to the rank as sglang-diffusion's."""
    layers = sorted({name.split(".lora_A", 1)[0] if ".lora_A" in name else name.split(".lora_B", 1)[0] for name in tensors})
    if rank is None:
        down = next((tensor for name, tensor in sorted(tensors.items()) if ".lora_A" in name), None)
        if down is None or down.dim() < 2:
            raise BadRequest("lora_rank", "required when the payload holds no 2-D lora_A tensor to read the rank from")
        rank = int(down.shape[0])
    return {"r": rank, "lora_alpha": alpha if alpha is not None else rank, "target_modules": layers, "init_lora_weights": True}


async def _checksum(request: web.Request) -> web.Response:
    engine = request.app[STATE].require()
    raw = await request.read()
    body: Any = {}
    if raw.strip():
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest("body", f"not valid JSON ({exc})") from None
    body = _json_object(body)
    names = _module_names(engine, body.get("module_names"), "module_names")
    checksums = await engine.weights_checksum(names)
    return web.json_response(checksums)


async def _memory_occupation(request: web.Request, release: bool) -> web.Response:
    engine = request.app[STATE].require()
    if (await request.read()).strip() and _json_object(await _json_body(request)):
        raise BadRequest("body", "takes no fields (send nothing, or {})")  # as sglang-diffusion's
    message = await (engine.release_memory() if release else engine.resume_memory())
    return web.json_response({"success": True, "sleeping": engine.memory_released, "message": message})


async def _release_memory(request: web.Request) -> web.Response:
    return await _memory_occupation(request, release=True)


async def _resume_memory(request: web.Request) -> web.Response:
    return await _memory_occupation(request, release=False)


# -- weight updates through a torch.distributed group (--weight-sync-path distributed) ------

INIT_GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
DISTRIBUTED_FIELDS = ("names", "dtypes", "shapes", "group_name", "target_module", "lora_only", "lora_config", "flush_cache")


def _known_fields(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(str(unknown[0]), f"unknown field (expected {', '.join(fields)})")


def _int_field(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer from {low} to {high}" if high is not None else f"an integer of at least {low}"
        raise BadRequest(name, f"must be {bound}, got {value!r}")
    return value


def _group_name(body: dict[str, Any]) -> str:
    name = body.get("group_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("group_name", f"must be a non-empty string, got {name!r}")
    return name


def _member_group(request: web.Request, name: str) -> WeightGroup:
    group = request.app[GROUPS].get(name)
    if group is None:
        raise BadRequest("group_name", f"this server is in no weight-update group {name!r}; POST /init_weights_update_group first")
    return group


async def _init_group(request: web.Request) -> web.Response:
    import torch

    request.app[STATE].require()
    body = _json_object(await _json_body(request))
    _known_fields(body, INIT_GROUP_FIELDS)
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise BadRequest("master_address", f"must be a host name or address, got {address!r}")
    port = _int_field(body, "master_port", 1, 65535)
    world = _int_field(body, "world_size", 2)
    rank = _int_field(body, "rank_offset", 1, world - 1)
    name = _group_name(body)
    backend = body.get("backend", "gloo")
    if backend not in BACKENDS:
        raise BadRequest("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise BadRequest("backend", "nccl needs CUDA, and this server has none; use gloo")
    timeout = body.get("timeout_s", DEFAULT_JOIN_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise BadRequest("timeout_s", f"must be a number of seconds in (0, 3600], got {timeout!r}")
    groups = request.app[GROUPS]
    if name in groups:
        raise BadRequest("group_name", f"this server is already in weight-update group {name!r}; destroy it first", status=409)
    try:
        group = await in_daemon_thread(
            lambda: WeightGroup.join(
                name=name, master_address=address, master_port=port, rank=rank, world_size=world, backend=backend, join_timeout=timeout
            )
        )
    except WeightGroupError as exc:
        raise BadRequest("master_address", str(exc), status=504) from None
    groups[name] = group
    log.info("joined weight-update group %s at %s:%d as rank %d of %d (%s)", name, address, port, rank, world, backend)
    return web.json_response({"success": True, "message": f"Joined weight-update group {name!r} as rank {rank} of {world} ({backend})."})


async def _update_from_distributed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.require()
    body = _json_object(await _json_body(request))
    _known_fields(body, DISTRIBUTED_FIELDS)
    group = _member_group(request, _group_name(body))
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise BadRequest("names", f"must be a non-empty list of tensor names, got {names!r:.80}")
    if len(set(names)) != len(names):
        raise BadRequest("names", f"names {sorted(n for n in set(names) if names.count(n) > 1)[0]!r} twice")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise BadRequest("dtypes", f"must be a list with one dtype per name ({len(names)}), got {dtypes!r:.80}")
    parsed = [parse_dtype(d) for d in dtypes]
    if None in parsed:
        raise BadRequest("dtypes", f"unknown dtype {dtypes[parsed.index(None)]!r}")
    if not isinstance(shapes, list) or len(shapes) != len(names):
        raise BadRequest("shapes", f"must be a list with one shape per name ({len(names)}), got {shapes!r:.80}")
    for shape in shapes:
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BadRequest("shapes", f"each shape must be a list of non-negative integers, got {shape!r:.80}")
    module, lora_only = _target_module(engine, body)
    if not isinstance(body.get("flush_cache", True), bool):
        raise BadRequest("flush_cache", f"must be true or false, got {body['flush_cache']!r}")
    lora_config = _lora_config(body.get("lora_config"), lora_only)
    if lora_only:
        other = sorted(name for name in names if not any(marker in name for marker in LORA_MARKERS))
        if other:
            raise BadRequest("names", f"lora_only update holds {other[0]!r}, which is not a lora_A/lora_B tensor")
    _, size = bucket_layout(parsed, shapes)
    if size > request.client_max_size:
        raise BadRequest(
            "shapes",
            f"the bucket holds {size} bytes, over this server's {request.client_max_size} (twice its --update-weight-buffer-size plus "
            "16 MiB); a lower --update-weight-buffer-size on the trainer sends smaller buckets",
            status=413,
        )
    engine.require_resident("update weights")

    def receive_and_load() -> int:
        # One bucket at a time in the group's staging buffer: received, then loaded from it.
        with group.bucket_lock:
            flat = group.staging(size)
            try:
                group.broadcast(flat, src=0)
            except Exception as exc:
                raise WeightGroupError(f"the broadcast in {group.name!r} failed") from exc
            tensors = unpack_bucket(flat, names, parsed, shapes)
            return engine.update_weights_from_tensors(module, tensors, lora_only=lora_only, lora_config=lora_config)

    try:
        count = await in_daemon_thread(receive_and_load)
    except WeightGroupError as failed:
        # The group is out of step (a member went away): this server leaves it.
        request.app[GROUPS].pop(group.name, None)
        group.close()
        cause = failed.__cause__
        detail = f" ({type(cause).__name__}: {' '.join(str(cause).split())[:300]})" if cause is not None else ""
        raise BadRequest("group_name", f"{failed}{detail}; left the group", 502) from None
    except WeightUpdateError as exc:
        raise _refused_update(exc, adapter_field="lora_config", tensors_field="names") from None
    return web.json_response({"success": True, "message": f"Updated {count} tensors of {module}.", "num_tensors": count})


async def _destroy_group(request: web.Request) -> web.Response:
    body = _json_object(await _json_body(request))
    _known_fields(body, ("group_name",))
    name = _group_name(body)
    group = _member_group(request, name)
    request.app[GROUPS].pop(name, None)
    await in_daemon_thread(group.close)  # returns once the trainer's side closes too
    log.info("left weight-update group %s", name)
    return web.json_response({"success": True, "message": f"Left weight-update group {name!r}."})


async def _close_groups(app: web.Application) -> None:
    """Leave every group at shutdown (bounded: a member's side closes once the others close theirs)."""
    groups = app[GROUPS]
    leaving = [in_daemon_thread(groups.popitem()[1].close) for _ in range(len(groups))]
    if leaving:
        await asyncio.wait(leaving, timeout=5)


__all__ = ["DEFAULT_BUFFER_SIZE", "GROUPS", "STATE", "BadRequest", "EngineState", "RunningServer", "create_app", "start_server"]
