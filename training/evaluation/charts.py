"""Small inline SVG charts for the report page: no scripts, no fonts to fetch, no network.

``line_chart`` draws series of (x, y) points on shared axes, with optional vertical markers
(an iteration kept, a stage boundary); ``confusion_table`` an HTML table shaded by row share.
Tested through tests/training/evaluation/test_report_page.py.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

WIDTH, HEIGHT = 640, 300
MARGIN = {"left": 64, "right": 16, "top": 16, "bottom": 44}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    dashed: bool = False
    markers: bool = False


@dataclass
class Marker:
    """A vertical line at x, labelled."""

    x: float
    label: str


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.4g}"


def line_chart(chart: Chart) -> str:
    """The chart as an <svg> element (a legend row under the plot area)."""
    points = [p for s in chart.series for p in s.points if math.isfinite(p[1])]
    if not points:
        return f"<p>{html.escape(chart.title)}: nothing recorded.</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.05 or abs(max(ys)) * 0.05 or 1.0
    y_lo, y_hi = min(ys) - pad, max(ys) + pad
    plot_w = WIDTH - MARGIN["left"] - MARGIN["right"]
    plot_h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]

    def sx(x: float) -> float:
        return MARGIN["left"] + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return MARGIN["top"] + (y_hi - y) / (y_hi - y_lo) * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT + 24}" '
        f'role="img" aria-label="{html.escape(chart.title)}">',
        f'<rect x="{MARGIN["left"]}" y="{MARGIN["top"]}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#999"/>',
    ]
    for y in _ticks(y_lo, y_hi):
        parts.append(
            f'<line x1="{MARGIN["left"]}" x2="{MARGIN["left"] + plot_w}" y1="{sy(y):.1f}" '
            f'y2="{sy(y):.1f}" stroke="#eee"/><text x="{MARGIN["left"] - 6}" y="{sy(y) + 4:.1f}" '
            f'text-anchor="end" font-size="11">{_label(y)}</text>'
        )
    for x in _ticks(x_lo, x_hi, 8):
        parts.append(
            f'<text x="{sx(x):.1f}" y="{MARGIN["top"] + plot_h + 16}" text-anchor="middle" '
            f'font-size="11">{_label(x)}</text>'
        )
    for marker in chart.markers:
        x = sx(marker.x)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MARGIN["top"]}" y2="{MARGIN["top"] + plot_h}" '
            f'stroke="#555" stroke-dasharray="4 3"/><text x="{x + 4:.1f}" '
            f'y="{MARGIN["top"] + 12}" font-size="11">{html.escape(marker.label)}</text>'
        )
    parts.extend(_series_paths(chart.series, sx, sy))
    parts.append(
        f'<text x="{MARGIN["left"] + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" '
        f'font-size="12">{html.escape(chart.x_label)}</text>'
        f'<text x="14" y="{MARGIN["top"] + plot_h / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {MARGIN["top"] + plot_h / 2})">{html.escape(chart.y_label)}</text>'
    )
    parts.extend(_legend(chart.series))
    parts.append("</svg>")
    return "".join(parts)


def _series_paths(series: list[Series], sx, sy) -> list[str]:
    parts = []
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        finite = [(x, y) for x, y in s.points if math.isfinite(y)]
        if not finite:
            continue
        path = " ".join(
            f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(finite)
        )
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        parts.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
        if s.markers or len(finite) == 1:
            parts.extend(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{colour}"/>'
                for x, y in finite
            )
    return parts


def _legend(series: list[Series]) -> list[str]:
    parts, x = [], MARGIN["left"]
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        parts.append(
            f'<rect x="{x}" y="{HEIGHT + 8}" width="12" height="4" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{HEIGHT + 14}" font-size="11">{html.escape(s.name)}</text>'
        )
        x += 24 + 7 * len(s.name)
    return parts


def confusion_table(true_index: list[int], predicted_index: list[int], classes: list) -> str:
    """Counts of (true class, predicted class) as an HTML table, each cell shaded by its
    share of the true class's row; the diagonal is the correct answers."""
    n = len(classes)
    counts = [[0] * n for _ in range(n)]
    for t, p in zip(true_index, predicted_index, strict=True):
        counts[t][p] += 1
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in classes)
    rows = []
    for t, row in enumerate(counts):
        total = sum(row) or 1
        cells = []
        for p, count in enumerate(row):
            share = count / total
            hue = "0,128,0" if p == t else "200,0,0"
            style = f"background: rgba({hue},{share:.2f})" if count else ""
            cells.append(f'<td style="{style}">{count or ""}</td>')
        rows.append(f"<tr><th>{html.escape(str(classes[t]))}</th>{''.join(cells)}</tr>")
    return (
        '<table class="confusion"><thead><tr><th>true \\ predicted</th>'
        f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
