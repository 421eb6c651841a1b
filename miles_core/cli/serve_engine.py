"""``miles-core serve-engine --hf-checkpoint DIR``: serve one embedded engine over HTTP
(``POST /rollout/generate``, ``GET /health``, weight updates and checksums), the contract
sglang-diffusion speaks, for ``--rollout-engine http``. The server listens at once and
loads the model in the background; ``GET /health`` answers 200 when it is ready. Binds
127.0.0.1 unless ``--host`` says otherwise; SIGTERM or SIGINT stops it."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from miles_core.cli.model_options import add_model_options, device_and_dtype, family_name
from miles_core.config.parser import OneLineParser
from miles_core.engine.auth import API_KEY_ENV, open_server_warning, resolve_api_key
from miles_core.engine.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_OUTPUTS,
    FALLBACK_MAX_STEPS,
    VIDEO_REFERENCE_FRAMES,
    WORK_OUTPUTS,
    WORK_STEPS,
)
from miles_core.engine.limits import FLAGS as LIMIT_FLAGS
from miles_core.engine.weight_roots import resolve_roots
from miles_core.errors import ApiKeyError, ConfigError
from miles_core.plugin_manager import get_host

if TYPE_CHECKING:
    from aiohttp import web


def _buffer_default() -> int:
    from miles_core.config.reference_flags import FLAGS

    return next(flag.default for flag in FLAGS if flag.name == "--update-weight-buffer-size")


def build_parser(families: Sequence[str] = (), prog: str = "miles-core serve-engine") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    add_model_options(parser, families, checkpoint_help="diffusers pipeline directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: 0, a free port)")
    parser.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=_buffer_default(),
        metavar="BYTES",
        help="largest weight-update bucket clients send, in bytes; request bodies up to twice this plus 16 MiB "
        "are accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--accept-ipc-weights",
        action="store_true",
        help="take sglang-diffusion's /update_weights_from_tensor format (serialized_named_tensors: pickled "
        "CUDA-IPC handles) from loopback peers; unpickling runs its sender's code, so a run sets this only for "
        "an engine it places on its trainer's GPU (default: refused with 403)",
    )
    parser.add_argument(
        "--prompt-embeddings",
        metavar="FILE",
        help="a prompt-embeddings manifest (a run's OUTPUT_DIR/prompt_embeddings.json under --precompute-prompt-embeddings): "
        "at start-up the server loads the encodings of its requests from the cache folder it names (encoding and "
        "writing any missing or corrupt entry), then frees its text encoders; a request for any other prompt is "
        "answered 400 (default: encode per request, as without it)",
    )
    access = parser.add_argument_group(
        "access",
        "Who may drive the server (docs/engine.md, Authentication). With a key, every request but GET /health "
        "must carry 'Authorization: Bearer KEY' (else 401). The key comes from --api-key, else --api-key-file, "
        f"else the environment variable {API_KEY_ENV}; with none the server takes every request, and warns at "
        "start-up when it listens beyond loopback.",
    )
    access.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the key; a command line shows in ps to every user of the machine, so prefer {API_KEY_ENV} or --api-key-file",
    )
    access.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file holding the key, readable by its owner only (chmod 600; a looser one is used with a warning)",
    )
    access.add_argument(
        "--allowed-weight-roots",
        nargs="+",
        default=[],
        metavar="DIR",
        help="directories POST /update_weights_from_disk may load from (a path must lie under one, after its links "
        "are resolved; else 403). Default: none, so disk loads are refused; a run passes its sync folders",
    )
    parser.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="deterministic kernels, as the run's --deterministic-mode: torch's deterministic algorithms and "
        'CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set; GET /health reports it ("deterministic": true)',
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the transformer's repeated blocks with torch.compile, as the run's --compile (docs/guide.md, "
        "'Compiled transformer'); the first request of each shape pays the compile",
    )
    limits = parser.add_argument_group(
        "request limits",
        "The most one POST /rollout/generate may ask for; over a limit the server answers 400 (a field) or 413 "
        "(the total work, or the body) naming the limit and the flag that raises it. Unset: derived from the "
        "model's default output (see docs/engine.md, Limits).",
    )
    limits.add_argument(
        "--max-outputs-per-request", type=int, metavar="N", help=f"largest num_outputs_per_prompt (default: {DEFAULT_MAX_OUTPUTS})"
    )
    limits.add_argument(
        "--max-inference-steps",
        type=int,
        metavar="N",
        help=f"largest num_inference_steps (default: the scheduler's num_train_timesteps, {FALLBACK_MAX_STEPS} when it has none)",
    )
    limits.add_argument(
        "--max-resolution",
        type=int,
        metavar="PIXELS",
        help="largest width or height (default: twice the larger side of the model's default output)",
    )
    limits.add_argument(
        "--max-num-frames",
        type=int,
        metavar="N",
        help="largest num_frames (default: 1 for an image model; for a video model twice its default "
        f"clip, that clip counted as at least {VIDEO_REFERENCE_FRAMES} frames)",
    )
    limits.add_argument(
        "--max-request-work",
        type=int,
        metavar="N",
        help="largest outputs x frames x height x width x steps (default: "
        f"{WORK_OUTPUTS} outputs x {WORK_STEPS} steps of the default output, its clip counted "
        "as for --max-num-frames)",
    )
    limits.add_argument(
        "--max-generate-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest POST /rollout/generate body (default: %(default)s)",
    )
    return parser


def parse_args(
    argv: Sequence[str], prog: str = "miles-core serve-engine", environ: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, str]:
    """The checked arguments and the model family to serve; a bad argument exits with
    status 2 and a one-line error. ``args.api_key`` becomes the key from whichever source
    set it (``environ``: the process's environment by default), and
    ``args.allowed_weight_roots`` the roots, checked and resolved."""
    registry = get_host().registries.model_family
    parser = build_parser(registry.names(), prog)
    args = parser.parse_args(list(argv))
    try:
        args.api_key = resolve_api_key(args.api_key, args.api_key_file, environ=environ, warn=_warn)
        args.allowed_weight_roots = resolve_roots(args.allowed_weight_roots)
    except (ApiKeyError, ConfigError) as exc:
        parser.error(str(exc))
    if args.prompt_embeddings is not None:  # a bad manifest stops here, before the model loads
        from miles_core.engine.prompt_store import read_manifest

        try:
            read_manifest(args.prompt_embeddings)
        except ValueError as exc:
            parser.error(f"--prompt-embeddings {exc}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port}: must be in [0, 65535]")
    if args.update_weight_buffer_size < 1:
        parser.error(f"--update-weight-buffer-size {args.update_weight_buffer_size}: must be at least 1")
    for name in (*LIMIT_FLAGS, "max_generate_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    try:
        family = family_name(args.hf_checkpoint, args.diffusion_model_family, registry)
    except ValueError as exc:
        parser.error(str(exc))
    if args.compile:  # here, not at the first request
        from miles_core.regional_compile import compile_unavailable

        problem = compile_unavailable(cuda=device_and_dtype(args.device, args.dtype)[0].startswith("cuda"))
        if problem is not None:
            parser.error(f"--compile: {problem}")
    return args, family


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(argv: Sequence[str], prog: str = "miles-core serve-engine") -> int:
    args, family = parse_args(argv, prog)
    # Read once; gone from the environment, so no process this one starts inherits it.
    os.environ.pop(API_KEY_ENV, None)
    warning = open_server_warning(prog, args.host, args.api_key)
    if warning is not None:
        _warn(warning)
    if args.deterministic_mode:  # before the model loads and before CUDA starts
        from types import SimpleNamespace

        from miles_core.config.determinism import apply_deterministic_mode

        apply_deterministic_mode(SimpleNamespace(deterministic_mode=True, train_env_vars=None))
    try:
        return asyncio.run(_serve(args, family))
    except OSError as exc:  # the address is taken or cannot be bound
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


def build_app(args: argparse.Namespace, family: str, on_load_error: Callable[[BaseException], None] | None = None) -> web.Application:
    """The server application of parsed ``serve-engine`` arguments; it loads the model
    in the background once it starts."""
    import torch

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.server import create_app
    from miles_core.engine.torch_threads import pin_current_thread

    device, dtype = device_and_dtype(args.device, args.dtype)

    def load() -> EmbeddedEngine:
        engine = EmbeddedEngine.from_checkpoint(args.hf_checkpoint, family, device=device, dtype=dtype)
        # The engine's worker is the server's compute thread, with the threads this process
        # was given (OMP_NUM_THREADS: a run's thread plan sets it); every other thread that
        # calls torch (this one, weight updates, checksums) runs on one, so that only one
        # OpenMP team holds the cores (docs/guide.md, "Threads").
        engine.pin_compute_threads(torch.get_num_threads())
        pin_current_thread(1)  # after the engine's pin: also the count of threads started later
        if args.compile:  # lazy: each shape compiles at its first request
            from miles_core.model_loading import compile_family

            compile_family(engine.family)
        if args.prompt_embeddings:
            from miles_core.engine.prompt_store import preload

            # On the compute thread: the encodings are the calls a request would make.
            engine.run_compute_sync(functools.partial(preload, engine, args.prompt_embeddings, log=_warn))
        return engine

    return create_app(
        load,
        update_weight_buffer_size=args.update_weight_buffer_size,
        on_load_error=on_load_error,
        limits={name: getattr(args, name) for name in LIMIT_FLAGS},
        max_generate_body_bytes=args.max_generate_body_bytes,
        accept_ipc_weights=args.accept_ipc_weights,
        api_key=args.api_key,
        allowed_weight_roots=args.allowed_weight_roots,
    )


async def _serve(args: argparse.Namespace, family: str) -> int:
    from miles_core.engine.server import start_server
    from miles_core.quiet import show_hub_libraries

    show_hub_libraries()  # a hub id with its download progress; a tiny pipeline loads quietly (load_pipeline)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    status = {"code": 0}

    def failed(exc: BaseException) -> None:
        print(f"miles-core serve-engine: error: loading {args.hf_checkpoint} as {family} failed: {exc}", file=sys.stderr)
        status["code"] = 1
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await start_server(build_app(args, family, failed), args.host, args.port)
    # One write: print() writes the line and its end apart, and the loader thread's error
    # can land between them (the fleet reads this line for the URL).
    sys.stderr.write(f"serving {family} {args.hf_checkpoint} on {server.url}\n")
    sys.stderr.flush()
    try:
        await stop.wait()
    finally:
        await server.close()
    return status["code"]
