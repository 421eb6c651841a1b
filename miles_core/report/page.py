"""The report page: one HTML document with its styles inline and no external resource,
sections in reading order (alarms first), each present only when a run recorded its data."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from html import escape
from pathlib import Path

from miles_core.report.charts import Figure, guard_figures, optimisation_figures, reward_figures, time_figures
from miles_core.report.config_table import config_html, differences_html
from miles_core.report.run_files import Run
from miles_core.report.samples import samples_section

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1240px;padding:0 16px 48px;color:#222}
h1{font-size:1.5em;margin:18px 0 4px}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
nav a{margin-right:12px}.meta{color:#555;font-size:.9em}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart-box{margin:0;border:1px solid #e4e4e4;border-radius:4px;padding:8px;background:#fafafa}
.chart-box h4{margin:0 0 4px;font-size:.95em}.chart-box figcaption{max-width:560px;font-size:.8em;color:#555}
svg.chart text.tick{font-size:10px;fill:#555}svg.chart text.axis{font-size:11px;fill:#333}
.legend{font-size:.8em;max-width:560px}.key{margin-right:10px;white-space:nowrap}.key svg{vertical-align:middle;margin-right:3px}
.banner{background:#c62828;color:#fff;padding:10px 14px;border-radius:4px;font-weight:600}.banner a{color:#fff}
.ok{background:#e8f5e9;padding:8px 14px;border-radius:4px}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
tr.set{background:#fff8e1}table.alarms td{background:#ffebee}
table.samples td{text-align:center}table.samples img{display:block;margin:auto;image-rendering:pixelated;min-width:96px}
.cap{font-size:.75em;color:#444;max-width:256px}.links{font-size:.75em}.prompt h4{margin:12px 0 4px;font-weight:500}
details{margin:4px 0}summary{cursor:pointer}.note{color:#555;font-style:italic}.grid img{max-width:100%}
"""


def charts_html(figures: Sequence[Figure]) -> str:
    return '<div class="charts">' + "".join(f.html() for f in figures) + "</div>"


def alarms_html(runs: Sequence[Run]) -> str:
    alarms = [(run, alarm) for run in runs for alarm in run.alarms]
    guarded = any(key.startswith("guard/") for run in runs for record in run.records for key in record)
    if not alarms:
        return '<p class="ok">The reward-hacking guard raised no alarm.</p>' if guarded else ""
    several = len(runs) > 1
    head = (
        ("<th>run</th>" if several else "")
        + "<th>rollouts trained</th><th>eval set</th><th>statistic</th><th>value</th><th>baseline</th><th>drift</th><th>threshold</th><th>message</th>"
    )
    rows = []

    def cell(alarm: dict, key: str) -> str:
        value = alarm.get(key)
        return f"<td>{escape(f'{value:.4g}' if isinstance(value, float) else str(value if value is not None else '-'))}</td>"

    for run, alarm in alarms:
        rows.append(
            "<tr>"
            + (f"<td>{escape(run.name)}</td>" if several else "")
            + "".join(
                cell(alarm, k) for k in ("trained_rollouts", "eval_set", "statistic", "value", "baseline", "drift", "threshold", "message")
            )
            + "</tr>"
        )
    count = len(alarms)
    return (
        f'<div class="banner">The reward-hacking guard raised {count} alarm{"s" if count != 1 else ""}: '
        'the trained reward may be rising while the samples degrade. See the <a href="#guard">guard statistics</a> '
        'and the <a href="#samples">samples</a>.</div>'
        f'<table class="alarms"><tr>{head}</tr>{"".join(rows)}</table>'
    )


def summary_html(run: Run) -> str:
    rollouts = [r["rollout_id"] for r in run.records if isinstance(r.get("rollout_id"), int)]
    total = run.flag("num_rollout")
    done = f"{max(rollouts) + 1} rollouts recorded" if rollouts else "no rollout recorded yet"
    if isinstance(total, int):
        done += f" of {total}"
    family = (run.config.get("resolved") or {}).get("model_family") if isinstance(run.config.get("resolved"), dict) else None
    parts = [f"<strong>{escape(run.name)}</strong> <code>{escape(str(run.path))}</code>", escape(done)]
    if family:
        parts.append(f"family {escape(str(family))}")
    return "<li>" + " · ".join(parts) + "</li>"


def render(runs: Sequence[Run], out: Path) -> str:
    """The report of ``runs`` as a complete HTML document written for ``out``'s directory
    (links to sample files are relative to it)."""
    sections: list[tuple[str, str, str]] = []  # (id, title, html)
    alarms = alarms_html(runs)
    if alarms:
        sections.append(("alarms", "Guard alarms", alarms))
    for anchor, title, figures in (
        ("rewards", "Rewards", reward_figures(runs)),
        ("optimisation", "Optimisation", optimisation_figures(runs)),
        ("time", "Time and throughput", time_figures(runs)),
        ("guard", "Guard statistics", guard_figures(runs)),
    ):
        if figures:
            sections.append((anchor, title, charts_html(figures)))
    samples = samples_section(runs, out.parent)
    if samples:
        sections.append(("samples", "Samples", samples))
    if len(runs) > 1:
        sections.append(("differences", "Configuration differences", differences_html(runs)))
    config = "".join((f"<h3>{escape(run.name)}</h3>" if len(runs) > 1 else "") + config_html(run) for run in runs)
    if config:
        sections.append(
            (
                "configuration",
                "Configuration",
                '<p class="note">Highlighted: flags not at their default, with where the value came from.</p>' + config,
            )
        )
    title = "Run report: " + ", ".join(run.name for run in runs)
    written = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f'<a href="#{anchor}">{escape(name)}</a>' for anchor, name, _ in sections)
    body = "".join(f'<section id="{anchor}"><h2>{escape(name)}</h2>{html}</section>' for anchor, name, html in sections)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f'<h1>{escape(title)}</h1><p class="meta">Written {escape(written)} by miles-core report.</p>'
        f'<ul class="meta">{"".join(summary_html(run) for run in runs)}</ul><nav>{nav}</nav>{body}</body></html>\n'
    )
