"""The report's configuration: every flag by group with its value and where the value
came from (config.yaml's ``sources:``; a flag absent from it has its default), and, for
several runs, the flags whose values differ."""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any

from miles_core.report.run_files import NON_FLAG_SECTIONS, Run


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def show(value: Any) -> str:
    """A value as one line: YAML-ish scalars, JSON for lists and maps."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def flags(run: Run) -> dict[str, tuple[str, Any]]:
    """dest -> (group, value) of every flag in the run's config.yaml."""
    found = {}
    for group, values in run.config.items():
        if group in NON_FLAG_SECTIONS or not isinstance(values, dict):
            continue
        for dest, value in values.items():
            found[str(dest)] = (str(group), value)
    return found


def config_html(run: Run) -> str:
    sources = run.sources
    parts = []
    by_group: dict[str, list[tuple[str, Any]]] = {}
    for dest, (group, value) in flags(run).items():
        by_group.setdefault(group, []).append((dest, value))
    for group, rows in by_group.items():
        changed = sum(dest in sources for dest, _ in rows)
        count = f"{len(rows)} flag{'' if len(rows) == 1 else 's'}"
        parts.append(f"<details{' open' if changed else ''}><summary>{escape(group)} ({count}, {changed} not default)</summary>")
        parts.append('<table class="config"><tr><th>flag</th><th>value</th><th>source</th></tr>')
        for dest, value in rows:
            source = sources.get(dest)
            css = ' class="set"' if source else ""
            parts.append(
                f"<tr{css}><td><code>{escape(flag_name(dest))}</code></td><td><code>{escape(show(value))}</code></td><td>{escape(source or 'default')}</td></tr>"
            )
        parts.append("</table></details>")
    components = run.config.get("components")
    if isinstance(components, dict) and components:
        parts.append('<table class="config"><tr><th>component</th><th>name</th><th>provided by</th></tr>')
        for slot, info in components.items():
            info = info if isinstance(info, dict) else {}
            parts.append(
                f"<tr><td>{escape(str(slot))}</td><td>{escape(show(info.get('name')))}</td><td>{escape(show(info.get('provided_by')))}</td></tr>"
            )
        parts.append("</table>")
    return "".join(parts)


def config_differences(runs: Sequence[Run]) -> list[tuple[str, list[str]]]:
    """(flag, its value in each run) for every flag whose value is not the same in all
    ``runs`` ("(absent)" where a run's config.yaml lacks it), in config order."""
    tables = [flags(run) for run in runs]
    order: dict[str, None] = {}
    for table in tables:
        order.update(dict.fromkeys(table))
    rows = []
    for dest in order:
        values = [show(table[dest][1]) if dest in table else "(absent)" for table in tables]
        if len(set(values)) > 1:
            rows.append((flag_name(dest), values))
    return rows


def differences_html(runs: Sequence[Run]) -> str:
    rows = config_differences(runs)
    if not rows:
        return "<p>The runs' configurations are the same.</p>"
    head = "".join(f"<th>{escape(run.name)}</th>" for run in runs)
    body = "".join(
        f"<tr><td><code>{escape(flag)}</code></td>{''.join(f'<td><code>{escape(v)}</code></td>' for v in values)}</tr>"
        for flag, values in rows
    )
    return f'<table class="config diff"><tr><th>flag</th>{head}</tr>{body}</table>'
