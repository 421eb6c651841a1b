"""``miles-core make-tiny FAMILY DIR [--seed N] [--variant V] [--scale bench] [--demo]``: write
a randomly initialised, tiny version of a family's real diffusers pipeline, for trying
things offline (``--variant``: another model of the family, such as FLUX.2 [klein] for
``flux``; ``--scale bench``: a larger one, for benchmarks, where the family has one). The
directory is written under a temporary name and renamed when complete, so an
interrupted build never leaves a half-written pipeline; an existing non-empty DIR is
never overwritten."""

from __future__ import annotations

import inspect
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from miles_core.config.parser import OneLineParser
from miles_core.errors import ComponentLoadError
from miles_core.plugin_manager import get_host
from miles_core.quiet import quiet_hub_libraries

SCALES = ("tiny", "bench")


def build_parser(families: Sequence[str], prog: str = "miles-core make-tiny") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("family", metavar="FAMILY", help=f"model family: {', '.join(families) or '(none installed)'}")
    parser.add_argument("out_dir", metavar="DIR", help="directory to write (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument(
        "--variant",
        default=None,
        help="which of the family's models to build, for a family that serves several (its tiny_variants, "
        "listed in the error for an unknown name; the first is the default); a family without variants refuses it",
    )
    parser.add_argument(
        "--scale",
        choices=SCALES,
        default=None,
        help="tiny (the default) or bench: a pipeline large enough for model compute to dominate, "
        "for benchmarks (only families whose tiny factory takes a scale)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="the demo variant: trained so that RL visibly moves image rewards (SD3: a VAE trained on "
        "synthetic shapes and a transformer fine-tuned on them with sft_loss; about a minute on 2 cores, "
        "then cached under $MILES_CACHE_DIR, default ~/.cache/miles-core)",
    )
    return parser


def run(argv: Sequence[str], prog: str = "miles-core make-tiny") -> int:
    families = get_host().registries.model_family
    parser = build_parser(families.names(), prog)
    args = parser.parse_args(list(argv))
    if args.family not in families:
        parser.error(families.unknown_message(args.family, flag="FAMILY"))
    out_dir = Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        parser.error(f"DIR {out_dir}: exists and is not an empty directory; choose another path")
    try:
        family = families.get(args.family).load()
    except ComponentLoadError as exc:
        parser.error(str(exc))
    kwargs: dict[str, object] = {"seed": args.seed}
    if args.scale is not None:
        if "scale" not in inspect.signature(family.build_tiny_pipeline).parameters:
            parser.error(f"--scale {args.scale}: the {args.family} family builds only its tiny pipeline (no --scale)")
        kwargs["scale"] = args.scale
    if args.variant is not None:
        variants = getattr(family, "tiny_variants", ())
        if not variants:
            parser.error(f"--variant {args.variant}: the {args.family} family builds one tiny pipeline (no variants)")
        if args.variant not in variants:
            parser.error(f"--variant {args.variant}: not a variant of the {args.family} family (its variants: {', '.join(variants)})")
        kwargs["variant"] = args.variant
    if args.demo:
        if "demo" not in inspect.signature(family.build_tiny_pipeline).parameters:
            parser.error(f"--demo: the {args.family} family has no demo variant")
        if args.scale not in (None, "tiny"):
            parser.error(f"--demo and --scale {args.scale} cannot be combined: the demo variant is tiny")
        kwargs["demo"] = True
    quiet_hub_libraries()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        family.build_tiny_pipeline(staging, **kwargs)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    kind = "demo" if args.demo else ("tiny" if args.scale in (None, "tiny") else f"{args.scale}-scale")
    if args.variant is not None:
        kind += f" {args.variant}"
    print(f"wrote a {kind} {args.family} pipeline to {out_dir} ({size / 1e6:.2f} MB, seed {args.seed})", file=sys.stderr)
    return 0
