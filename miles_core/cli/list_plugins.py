"""``miles-core list-plugins``: what is installed, what each plugin registers, and why a
plugin failed. Answers from registrations only (no model code is imported)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence

from miles_core.config.parser import OneLineParser
from miles_core.errors import PluginLoadError
from miles_core.plugin_manager import PluginHost, PluginLoadWarning, PluginRecord, strict_from_env


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
    # Load leniently so every plugin is listed, the broken ones with their errors; under
    # MILES_STRICT_PLUGINS=1 a failed plugin then fails the command, as it does every other.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        host = PluginHost(strict=False)
    if args.json:
        print(json.dumps([record.to_json() for record in host.records], indent=2))
    else:
        print(format_table(host.records))
    failed = [record for record in host.records if record.status == "failed"]
    if failed and strict_from_env():
        raise PluginLoadError(
            f"miles plugin {failed[0].name!r} ({failed[0].distribution} {failed[0].version}, entry point "
            f"{failed[0].entry_point}) failed to load: {failed[0].error} [MILES_STRICT_PLUGINS=1]"
            + (f" (and {len(failed) - 1} more, listed above)" if len(failed) > 1 else "")
        )
    return 0
