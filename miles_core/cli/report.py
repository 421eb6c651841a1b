"""``miles-core report``: write the HTML report of one run, or of several runs overlaid
(their curves on the same charts, their configuration differences listed). The file is
self-contained: it opens offline in any browser (docs/report.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from miles_core.config.parser import OneLineParser


def build_parser(prog: str = "miles-core report") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output directory (holds config.yaml and metrics.jsonl)")
    parser.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to write the report (default: RUN_DIR/report.html for one run, ./report.html for several)",
    )
    return parser


def default_out(run_dirs: Sequence[str]) -> Path:
    return Path(run_dirs[0]) / "report.html" if len(run_dirs) == 1 else Path("report.html")


def run(argv: Sequence[str], prog: str = "miles-core report") -> int:
    from miles_core.report import write_report

    args = build_parser(prog).parse_args(list(argv))
    out = Path(args.out) if args.out else default_out(args.run_dirs)
    print(write_report([Path(d) for d in args.run_dirs], out))
    return 0
