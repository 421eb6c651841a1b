"""``miles-core serve-engine --hf-checkpoint DIR``: serve one embedded engine over HTTP
(``POST /rollout/generate``, ``GET /health``, weight updates and checksums), the contract
sglang-diffusion speaks, for ``--rollout-engine http``. The server listens at once and
loads the model in the background; ``GET /health`` answers 200 when it is ready. Binds
127.0.0.1 unless ``--host`` says otherwise; SIGTERM or SIGINT stops it."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Sequence

from miles_core.cli.model_options import add_model_options, device_and_dtype, family_name
from miles_core.config.parser import OneLineParser
from miles_core.plugin_manager import get_host


def _buffer_default() -> int:
    from miles_core.config.reference_flags import FLAGS

    return next(flag.default for flag in FLAGS if flag.name == "--update-weight-buffer-size")


def build_parser(families: Sequence[str] = (), prog: str = "miles-core serve-engine") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    add_model_options(parser, families, checkpoint_help="diffusers pipeline directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: 0, a free port)")
    parser.add_argument(
        "--update-weight-buffer-size", type=int, default=_buffer_default(), metavar="BYTES",
        help="largest weight-update bucket clients send, in bytes; request bodies up to twice this plus 16 MiB "
             "are accepted (default: %(default)s)",
    )
    return parser


def run(argv: Sequence[str], prog: str = "miles-core serve-engine") -> int:
    registry = get_host().registries.model_family
    parser = build_parser(registry.names(), prog)
    args = parser.parse_args(list(argv))
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port}: must be in [0, 65535]")
    if args.update_weight_buffer_size < 1:
        parser.error(f"--update-weight-buffer-size {args.update_weight_buffer_size}: must be at least 1")
    try:
        family = family_name(args.hf_checkpoint, args.diffusion_model_family, registry)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(_serve(args, family))
    except OSError as exc:  # the address is taken or cannot be bound
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


async def _serve(args, family: str) -> int:

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.server import create_app, start_server
    from miles_core.quiet import quiet_hub_libraries

    quiet_hub_libraries()

    device, dtype = device_and_dtype(args.device, args.dtype)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    status = {"code": 0}

    def load() -> EmbeddedEngine:
        return EmbeddedEngine.from_checkpoint(args.hf_checkpoint, family, device=device, dtype=dtype)

    def failed(exc: BaseException) -> None:
        print(f"miles-core serve-engine: error: loading {args.hf_checkpoint} as {family} failed: {exc}", file=sys.stderr)
        status["code"] = 1
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(load, update_weight_buffer_size=args.update_weight_buffer_size, on_load_error=failed)
    server = await start_server(app, args.host, args.port)
    print(f"serving {family} {args.hf_checkpoint} on {server.url}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
    return status["code"]
