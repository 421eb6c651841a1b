"""An HTTP server for one :class:`EmbeddedEngine`, speaking sglang-diffusion's contract.

Routes (docs/design.md, "The wire contract"):

- ``POST /rollout/generate``: a JSON :class:`RolloutRequest`; answers ``application/msgpack``,
  a list with one record per output (tensors as ``{"__tensor__": true, ...}`` records).
- ``GET /health``: 503 while the model loads (the server listens first and loads in a
  background thread, so a client can wait for it), 200 once it is ready.
- ``POST /update_weights_from_disk``: ``{"model_path": DIR, "target_modules": [...] | null,
  "flush_cache": bool}`` as sglang-diffusion takes it; answers ``{"success", "message"}``.
- ``POST /update_weights_from_tensor``: our CUDA-IPC-free format, an ``application/msgpack``
  body ``{"target_module": NAME, "bucket": <safetensors bytes>, "lora_only": bool,
  "lora_config": {r, lora_alpha, target_modules, init_lora_weights} (optional, LoRA-only)}``,
  one request per bucket of at most ``--update-weight-buffer-size`` bytes. With
  ``lora_config`` a module without an adapter gets that one first (diffusers'
  ``add_adapter``); one with another adapter answers 409.
- ``POST /get_weights_checksum``: ``{"module_names": [...] | null}``; answers
  ``{name: sha256}`` as sglang-diffusion does (see :func:`miles_core.weights.module_checksum`).
- ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` (no body, or
  ``{}``), as sglang-diffusion names them: release the storages of every module of the
  served pipeline (copied to host memory) and bring them back; each answers
  ``{"success": true, "sleeping": bool, "message": ...}``, and asking twice is harmless.
  While released, generation, weight updates and checksums answer 409 naming the state.

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
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
from aiohttp import web

from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.limits import BODY_FLAG, DEFAULT_MAX_BODY_BYTES, RequestLimits, body_too_large
from miles_core.engine.wire import pack_outputs
from miles_core.errors import (
    EngineReleasedError,
    LoraAdapterError,
    LoraAdapterMismatch,
    RequestError,
    RequestLimitError,
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


def create_app(
    engine: EmbeddedEngine | Callable[[], EmbeddedEngine],
    *,
    update_weight_buffer_size: int = DEFAULT_BUFFER_SIZE,
    max_request_bytes: int | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    limits: Mapping[str, int | None] | None = None,
    max_generate_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> web.Application:
    """The application. ``engine`` is an engine, or a loader called in a background
    thread when the application starts (``/health`` answers 503 until it returns).

    Request bodies are capped at ``max_request_bytes`` (default: twice the weight-update
    buffer size plus 16 MiB, so one bucket always fits; a single tensor larger than that
    is refused with 413), ``/rollout/generate`` bodies at ``max_generate_body_bytes``.
    ``limits`` overrides some of the :class:`RequestLimits` derived from the model
    (``{"max_outputs_per_request": 128}``; None: derived)."""
    loader = (lambda: engine) if isinstance(engine, EmbeddedEngine) else engine
    if max_request_bytes is None:
        max_request_bytes = 2 * update_weight_buffer_size + 16 * 1024**2
    overrides = dict(limits or {})
    RequestLimits.check_overrides(overrides)  # a bad override fails here, not in the loader thread
    app = web.Application(client_max_size=max_request_bytes, middlewares=[_errors])
    app[STATE] = EngineState(
        loader, on_load_error=on_load_error, limit_overrides=overrides, max_generate_body_bytes=max_generate_body_bytes
    )
    app.on_startup.append(_start_loading)
    app.add_routes(
        [
            web.get("/health", _health),
            web.post("/rollout/generate", _generate),
            web.post("/update_weights_from_disk", _update_from_disk),
            web.post("/update_weights_from_tensor", _update_from_tensor),
            web.post("/get_weights_checksum", _checksum),
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
    engine loader starts at the same time."""
    # handler_cancellation: a handler whose client goes away is cancelled (aiohttp's
    # default lets it run on), which is what stops that client's generation.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    addresses = runner.addresses
    return RunningServer(runner, host, addresses[0][1] if addresses else port)


# -- plumbing ---------------------------------------------------------------------------


async def _start_loading(app: web.Application) -> None:
    state = app[STATE]
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
        return web.json_response({"status": "ok"})
    if state.error is not None:
        return web.json_response({"status": "failed", "error": f"engine: failed to load: {state.error}"}, status=503)
    return web.json_response({"status": "loading"}, status=503)


async def _generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.require()
    engine.require_resident("generate")  # before the body is read; a request racing a release fails in the engine
    rollout_request = RolloutRequest.from_json(await _json_body(request, state.max_generate_body_bytes, BODY_FLAG))
    rollout_request = rollout_request.with_request_id()  # the same id in the server's and the engine's logs
    # The family's own checks and defaults (cheap: no tensors), then the server's limits,
    # before the request waits for the engine or allocates anything.
    assert state.limits is not None  # set with the engine
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
    engine = request.app[STATE].require()
    body = _json_object(await _json_body(request))
    model_path = body.get("model_path")
    if not model_path:
        raise BadRequest("model_path", "is required")
    if not isinstance(model_path, str):
        raise BadRequest("model_path", f"must be a string, got {model_path!r}")
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
    engine = request.app[STATE].require()
    if request.content_type == "application/json":
        raise BadRequest(
            "body",
            "this server takes an application/msgpack body {target_module, bucket, lora_only} "
            "(safetensors buckets); sglang's serialized_named_tensors (CUDA IPC, pickled) is not supported",
            status=415,
        )
    raw = await request.read()
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise BadRequest("body", f"not a valid msgpack document ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a msgpack map, got {type(body).__name__}")
    unknown = sorted(set(body) - {"target_module", "bucket", "lora_only", "lora_config"})
    if unknown:
        raise BadRequest(str(unknown[0]), "unknown field (expected target_module, bucket, lora_only, lora_config)")
    module = body.get("target_module")
    if not isinstance(module, str):
        raise BadRequest("target_module", f"must be a module name, got {module!r}")
    _module_names(engine, [module], "target_module")
    lora_only = body.get("lora_only", False)
    if not isinstance(lora_only, bool):
        raise BadRequest("lora_only", f"must be true or false, got {lora_only!r}")
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
    except LoraAdapterMismatch as exc:
        raise BadRequest("lora_config", str(exc), status=409) from None
    except LoraAdapterError as exc:
        raise BadRequest("lora_config", str(exc)) from None
    except WeightUpdateError as exc:
        raise BadRequest("bucket", str(exc)) from None
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


__all__ = ["DEFAULT_BUFFER_SIZE", "STATE", "BadRequest", "EngineState", "RunningServer", "create_app", "start_server"]
