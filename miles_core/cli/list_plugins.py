"""``miles-core list-plugins``: what is installed, what each plugin registers, and why a
plugin failed. Answers from registrations only (no model code is imported)."""

from __future__ import annotations

import json
from typing import Sequence

from miles_core.config.parser import OneLineParser
from miles_core.plugin_manager import PluginHost, PluginRecord


def _registers_text(record: PluginRecord) -> str:
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in record.registers.items()) or "-"


def format_table(records: Sequence[PluginRecord]) -> str:
    headers = ("NAME", "DISTRIBUTION", "VERSION", "STATUS", "REGISTERS")
    rows = [(r.name, r.distribution, r.version, r.status, _registers_text(r)) for r in records]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(headers)).rstrip()]
    for record, row in zip(records, rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if record.error:
            lines.append(f"    error: {record.error} (entry point {record.entry_point})")
    return "\n".join(lines)


def build_parser(prog: str = "miles-core list-plugins") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON list of plugin objects")
    return parser


def run(argv: Sequence[str], prog: str = "miles-core list-plugins") -> int:
    args = build_parser(prog).parse_args(list(argv))
    # Never strict here: listing broken plugins is the point of this command.
    host = PluginHost(strict=False)
    if args.json:
        print(json.dumps([record.to_json() for record in host.records], indent=2))
    else:
        print(format_table(host.records))
    return 0


