"""Primitives shared by the report's charts.

Every chart of the report is hand-written SVG (not matplotlib): a few hundred bytes per curve instead of tens
of kilobytes of glyph paths, the same output for the same input on every machine (no font or backend in
the loop), a ``<title>`` tooltip on every mark, and nothing that needs JavaScript or the network.
"""
from __future__ import annotations

import math

from .words import attr, num

FONT = "system-ui, -apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif"
#: Estimated width of one character of the 11 px chart font; used to lay legends out without a renderer.
CHAR_W = 6.2


def tick_step(unit_px: float) -> int:
    """The smallest round step (1, 2, 5, 10, ...) whose ticks are at least 30 px apart at `unit_px` px per unit."""
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000):
        if step * unit_px >= 30:
            return step
    return 10000


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (about `target` of them, 1/2/5 x 10^k apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def tick_words(x: float, ticks: list[float]) -> str:
    """A tick label with just the decimals the tick spacing needs (``5.5``, ``5.525``)."""
    if len(ticks) < 2:
        return f"{x:.6g}"
    step = min(b - a for a, b in zip(ticks, ticks[1:]))
    for d in range(10):
        if abs(round(step, d) - step) <= step * 1e-6:
            return f"{x:.{d}f}"
    return f"{x:.6g}"


def flow_lines(widths: list[float], avail: float) -> list[list[tuple[int, float]]]:
    """Lay items of the given widths out left to right in lines of at most `avail` px:
    ``[[(item index, x offset), ...], ...]`` (an item wider than a line gets a line of its own)."""
    lines, cur, cur_w = [], [], 0.0
    for i, w in enumerate(widths):
        if cur and cur_w + w > avail:
            lines.append(cur)
            cur, cur_w = [], 0.0
        cur.append((i, cur_w))
        cur_w += w
    if cur:
        lines.append(cur)
    return lines


def svg_open(cls: str, width: float, height: float, label: str, font_size: int = 11) -> str:
    """The opening ``<svg>`` tag of an inline chart: namespace, class, size = viewBox, accessible label."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" width="{num(width)}" height="{num(height)}" '
            f'viewBox="0 0 {num(width)} {num(height)}" role="img" aria-label="{attr(label)}" '
            f'font-family="{FONT}" font-size="{font_size}">')
