"""Plain SVG line charts: several series, an optional band per series (mean +- spread),
horizontal reference lines (a threshold), "nice" axis ticks, a legend and a ``<title>``
on every point and series so a browser shows the numbers on hover. No script, no
external resource: the markup draws in any browser, offline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 560, 280
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 14, 40
MAX_MARKERS = 120
"""Series with more points than this are drawn as a line only (their title still names them)."""

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
DASHES = ("", "6 3", "2 3", "8 3 2 3")


@dataclass
class Series:
    """One line: ``ys[i]`` at ``xs[i]``; ``band`` (optional): per point (low, high)."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = PALETTE[0]
    dash: str = ""
    band: Sequence[tuple[float, float]] | None = None


@dataclass
class RefLine:
    """A horizontal line across the plot at ``y`` (a threshold), labelled."""

    y: float
    label: str
    color: str = "#d62728"


def nice_step(span: float, target: int = 5) -> float:
    """A step of 1, 2, 2.5 or 5 times a power of ten giving about ``target`` intervals
    (0.0 when ``span`` has none: not positive, not finite, or below the smallest float)."""
    if not span > 0 or not math.isfinite(span):
        return 0.0
    raw = span / target
    power = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 0.0
    for factor in (1, 2, 2.5, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power


MAX_TICKS = 50
"""More ticks than this means the step lost to rounding: the endpoints are used instead."""


def endpoints(low: float, high: float) -> list[float]:
    """Two distinct finite ticks around [low, high] for when no nice step exists."""
    if high > low:
        return [low, high]
    if low > 0:
        return [low * 0.9, low]
    if low < 0:
        return [low, low * 0.9]
    return [-1.0, 1.0]


def nice_ticks(low: float, high: float, target: int = 5) -> list[float]:
    """Ticks at multiples of :func:`nice_step` covering [low, high], the first at or
    below ``low`` and the last at or above ``high``. Always terminates: a span that
    overflows (values near +-1e308) or underflows gets the two endpoints; non-finite
    bounds give [-1, 1] (callers leave non-finite values out)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [-1.0, 1.0]
    if high < low:
        low, high = high, low
    if high - low <= 1e-9 * max(abs(low), abs(high)):
        pad = abs(low) * 0.1 or 1.0
        if not math.isfinite(abs(low) + pad):  # padding would overflow
            return endpoints(low, low)
        low, high = low - pad, high + pad
    step = nice_step(high - low, target)
    if step == 0.0 or not math.isfinite(step):
        return endpoints(low, high)
    try:
        first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    except (OverflowError, ValueError):
        return endpoints(low, high)
    if last == first:
        last += 1
    if last - first > MAX_TICKS:
        return endpoints(low, high)
    # 12 significant digits: drops the float noise of i * step (0.30000000000000004) at any magnitude
    ticks = [float(f"{i * step:.12g}") for i in range(first, last + 1)]
    if not all(math.isfinite(t) for t in ticks) or len(set(ticks)) != len(ticks):
        return endpoints(low, high)
    return ticks


@dataclass
class Scale:
    """The linear map from a domain of values to a range of pixels (range may run backwards)."""

    domain: tuple[float, float]
    range: tuple[float, float]

    def __call__(self, value: float) -> float:
        (d0, d1), (r0, r1) = self.domain, self.range
        # halves (exact for normal floats) so that a domain of +-1e308 does not overflow to inf
        return r0 + (value / 2 - d0 / 2) / (d1 / 2 - d0 / 2) * (r1 - r0)


def format_number(value: float) -> str:
    """A short label: up to 4 significant digits, scientific for very small or big."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e5 or magnitude < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


def step_decimals(step: float) -> int:
    """The fewest decimals that write ``step`` (a nice step) exactly: 0.25 -> 2, 5e-5 -> 5."""
    for decimals in range(16):
        if abs(round(step, decimals) - step) <= step * 1e-9:
            return decimals
    return 16


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for ``ticks`` with as many digits as their step needs, so adjacent ticks never
    print the same label (0.99985, 0.99990, ...; 1000000.5, 1000001.0, ...): fixed decimals
    from the step for ordinary magnitudes, else scientific with enough significant digits."""
    if len(ticks) < 2:
        return [format_number(t) for t in ticks]
    step = min(abs(b - a) for a, b in zip(ticks, ticks[1:]))
    largest = max(abs(t) for t in ticks)

    def distinct(labels: list[str]) -> bool:
        return all(a != b for a, b in zip(labels, labels[1:]))

    if step >= 1e-5 and largest < 1e7:
        decimals = step_decimals(step)
        while decimals < 16:
            labels = [f"{t:.{decimals}f}" for t in ticks]
            if distinct(labels):
                return ["0" if float(label) == 0 else label for label in labels]
            decimals += 1
    for digits in range(2, 18):
        labels = [f"{t:.{digits}g}" for t in ticks]
        if distinct(labels):
            return labels
    return [repr(t) for t in ticks]


def scales(series: Sequence[Series], refs: Sequence[RefLine] = ()) -> tuple[Scale, Scale, list[float], list[float]]:
    """The x and y scales of a chart (domains widened to their outer ticks) and the ticks."""
    xs = [x for s in series for x in s.xs if math.isfinite(x)]
    ys = [y for s in series for y in s.ys if math.isfinite(y)]
    ys += [v for s in series for pair in (s.band or ()) for v in pair if math.isfinite(v)]
    ys += [r.y for r in refs if math.isfinite(r.y)]
    x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    y_ticks = nice_ticks(min(ys, default=0.0), max(ys, default=1.0))
    x = Scale((x_ticks[0], x_ticks[-1]), (MARGIN_LEFT, WIDTH - MARGIN_RIGHT))
    y = Scale((y_ticks[0], y_ticks[-1]), (HEIGHT - MARGIN_BOTTOM, MARGIN_TOP))
    return x, y, x_ticks, y_ticks


def _points(pairs: Sequence[tuple[float, float]]) -> str:
    return " ".join(f"{px:.2f},{py:.2f}" for px, py in pairs)


def line_chart(series: Sequence[Series], *, x_label: str, y_label: str = "", refs: Sequence[RefLine] = ()) -> str:
    """The ``<svg>`` of a line chart of ``series`` (non-finite values are left out)."""
    series = [s for s in series if any(math.isfinite(y) for y in s.ys)]
    x, y, x_ticks, y_ticks = scales(series, refs)
    out = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
        f'height="{HEIGHT}" role="img" aria-label="{escape(y_label or x_label)}">'
    ]
    left, right, top, bottom = MARGIN_LEFT, WIDTH - MARGIN_RIGHT, MARGIN_TOP, HEIGHT - MARGIN_BOTTOM
    out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="#fff" stroke="#ccc"/>')
    for tick, label in zip(y_ticks, tick_labels(y_ticks)):
        py = y(tick)
        out.append(f'<line x1="{left}" x2="{right}" y1="{py:.2f}" y2="{py:.2f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py + 4:.2f}" text-anchor="end" class="tick">{escape(label)}</text>')
    for tick, label in zip(x_ticks, tick_labels(x_ticks)):
        px = x(tick)
        out.append(f'<line x1="{px:.2f}" x2="{px:.2f}" y1="{top}" y2="{bottom}" stroke="#f3f3f3"/>')
        out.append(f'<text x="{px:.2f}" y="{bottom + 16}" text-anchor="middle" class="tick">{escape(label)}</text>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle" class="axis">{escape(x_label)}</text>')
    if y_label:
        out.append(
            f'<text x="14" y="{(top + bottom) / 2:.1f}" text-anchor="middle" class="axis" '
            f'transform="rotate(-90 14 {(top + bottom) / 2:.1f})">{escape(y_label)}</text>'
        )
    for ref in refs:
        py = y(ref.y)
        out.append(
            f'<line class="ref" x1="{left}" x2="{right}" y1="{py:.2f}" y2="{py:.2f}" stroke="{ref.color}" '
            f'stroke-dasharray="5 4"><title>{escape(ref.label)}</title></line>'
        )
    for s in series:
        finite = [(a, b, i) for i, (a, b) in enumerate(zip(s.xs, s.ys)) if math.isfinite(a) and math.isfinite(b)]
        if s.band is not None:
            band = [(a, s.band[i]) for a, _, i in finite if all(math.isfinite(v) for v in s.band[i])]
            if band:
                upper = [(x(a), y(hi)) for a, (lo, hi) in band]
                lower = [(x(a), y(lo)) for a, (lo, hi) in reversed(band)]
                out.append(
                    f'<polygon class="band" points="{_points(upper + lower)}" fill="{s.color}" fill-opacity="0.15" '
                    f'stroke="none"><title>{escape(s.name)} (band)</title></polygon>'
                )
        pixels = [(x(a), y(b)) for a, b, _ in finite]
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        out.append(
            f'<polyline class="series" data-series="{escape(s.name)}" points="{_points(pixels)}" fill="none" '
            f'stroke="{s.color}" stroke-width="1.6"{dash}>'
            f"<title>{escape(s.name)}</title></polyline>"
        )
        if len(finite) <= MAX_MARKERS:
            for (a, b, _), (px, py) in zip(finite, pixels):
                out.append(
                    f'<circle cx="{px:.2f}" cy="{py:.2f}" r="2.4" fill="{s.color}" data-series="{escape(s.name)}">'
                    f"<title>{escape(s.name)}: {escape(format_number(a))}, {escape(format_number(b))}</title></circle>"
                )
    out.append("</svg>")
    legend = "".join(
        f'<span class="key"><svg width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" stroke="{s.color}" '
        f'stroke-width="2"{f" stroke-dasharray={chr(34)}{s.dash}{chr(34)}" if s.dash else ""}/></svg>{escape(s.name)}</span>'
        for s in series
    )
    legend += "".join(
        f'<span class="key"><svg width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" stroke="{r.color}" '
        f'stroke-dasharray="5 4"/></svg>{escape(r.label)}</span>'
        for r in refs
    )
    return "".join(out) + f'<div class="legend">{legend}</div>'
