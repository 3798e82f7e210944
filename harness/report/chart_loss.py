"""The loss chart of the report: lm loss per step, one curve per group of runs whose losses are bitwise
identical, so that 29 runs of which 24 agree draw as a handful of labelled curves ("24 runs, bitwise
identical"), not 29 lines on top of each other.  The legend sits below the axes and never covers a curve.

Hand-written SVG like every chart of the report (`harness.report.svg`).
"""
from __future__ import annotations

from typing import Any, Optional

from harness.judging.results import CaseResult, VariantResult

from .svg import CHAR_W, flow_lines, nice_ticks, svg_open, tick_words
from .words import attr, clean_text, finite_or_none, num

#: (colour, stroke width, dash pattern, opacity) per group, cycling after twelve: the first group (the
#: baseline's) wide and pale underneath, the others thinner and dashed on top, so curves that coincide on
#: screen stay visible.
LOSS_STYLES = (("#57606a", 5.0, "", 0.4), ("#0969da", 2.2, "7 3", 0.95), ("#bf3989", 2.0, "2 2", 0.95),
               ("#1a7f37", 1.8, "9 3 2 3", 0.95), ("#bc4c00", 1.6, "4 2", 0.95), ("#8250df", 1.6, "1 3", 0.95),
               ("#0a7b83", 1.4, "12 4", 0.95), ("#9a6700", 1.4, "5 2 1 2", 0.95), ("#cf222e", 1.4, "3 3", 0.95),
               ("#1b1f24", 1.2, "", 0.9), ("#6e7781", 1.2, "6 2 2 2", 0.95), ("#4d2d00", 1.2, "1 2", 0.95))

_W = 760.0            # chart width (fits the report's column)
_PLOT_L, _PLOT_R, _PLOT_T, _PLOT_H = 58.0, 14.0, 10.0, 220.0
_AXIS_H = 34.0        # x tick labels and axis title under the plot
_LEGEND_ROW = 18.0
_MAX_LABEL = 60       # legend label characters (the full member list is in the tooltip and under the chart)
_MAX_MARKED_STEPS = 40  # markers (with a tooltip each) only while they stay readable


def _series_key(v: VariantResult) -> tuple:
    """Bits of the lm loss per step (decimal repr where no bits were recorded) and the MTP losses."""
    s = v.series
    lm = tuple(str(h).lower() for h in (s.lm_loss_hex or [])) or tuple(repr(x) for x in s.lm_loss)
    mtp = tuple(tuple(repr(x) for x in (row or [])) for row in (s.mtp_loss or []))
    return lm, mtp


def loss_groups(result: CaseResult) -> list[dict]:
    """Runs with loss data, grouped by bitwise-identical lm (and MTP) loss series, in the order of their first
    member (the baseline's group first): ``[{"label", "members": [VariantResult], "indices": [int], "ys":
    [float|None], "hex": [str], "style": (colour, width, dash, opacity)}]``."""
    groups: dict = {}
    for i, v in enumerate(result.variants):
        if not (v.series and v.series.lm_loss):
            continue
        g = groups.setdefault(_series_key(v), {"members": [], "indices": []})
        g["members"].append(v)
        g["indices"].append(i)
    out = []
    for k, g in enumerate(groups.values()):
        first = g["members"][0]
        n = len(g["members"])
        out.append({**g, "label": f"{n} runs, bitwise identical" if n > 1 else clean_text(first.name),
                    "ys": [finite_or_none(y) for y in first.series.lm_loss],
                    "hex": [str(h) for h in (first.series.lm_loss_hex or [])],
                    "style": LOSS_STYLES[k % len(LOSS_STYLES)]})
    return out


def _short(text: str) -> str:
    return text if len(text) <= _MAX_LABEL else text[:_MAX_LABEL - 1] + "…"


def _segments(points: list[tuple[float, Optional[float]]]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive finite points (a NaN loss breaks the curve)."""
    segs, cur = [], []
    for x, y in points:
        if y is None:
            if cur:
                segs.append(cur)
            cur = []
        else:
            cur.append((x, y))
    if cur:
        segs.append(cur)
    return segs


def loss_curves_svg(result: CaseResult, groups: Optional[list[dict]] = None) -> Optional[str]:
    """Inline SVG of the lm loss per step, one curve per group of bitwise-identical runs (`loss_groups`),
    labelled with its size; legend below the axes.  None when no variant has loss values.  Deterministic."""
    groups = loss_groups(result) if groups is None else groups
    finite = [y for g in groups for y in g["ys"] if y is not None]
    if not groups:
        return None
    n_steps = max(len(g["ys"]) for g in groups)
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (hi - lo) * 0.06 if hi > lo else max(abs(lo) * 1e-3, 1e-6)
    lo, hi = lo - pad, hi + pad
    plot_w = _W - _PLOT_L - _PLOT_R
    x_of = (lambda s: _PLOT_L + plot_w * s / (n_steps - 1)) if n_steps > 1 else (lambda s: _PLOT_L + plot_w / 2)

    def y_of(y: float) -> float:
        return _PLOT_T + _PLOT_H * (hi - y) / (hi - lo)

    out = []
    # axes: y grid and labels, x ticks at integer steps
    yticks = nice_ticks(lo, hi)
    for t in yticks:
        y = y_of(t)
        out.append(f'<line x1="{num(_PLOT_L)}" y1="{num(y)}" x2="{num(_W - _PLOT_R)}" y2="{num(y)}" '
                   f'stroke="#d0d7de" stroke-width="0.6"/>')
        out.append(f'<text x="{num(_PLOT_L - 6)}" y="{num(y + 3.5)}" text-anchor="end" fill="#656d76" '
                   f'font-size="10">{tick_words(t, yticks)}</text>')
    every = max(1, -(-n_steps // 12))
    base = _PLOT_T + _PLOT_H
    out.append(f'<line x1="{num(_PLOT_L)}" y1="{num(base)}" x2="{num(_W - _PLOT_R)}" y2="{num(base)}" '
               f'stroke="#8c959f" stroke-width="0.8"/>')
    for s in range(0, n_steps, every):
        out.append(f'<text x="{num(x_of(s))}" y="{num(base + 14)}" text-anchor="middle" fill="#656d76" '
                   f'font-size="10">{s}</text>')
    out.append(f'<text x="{num(_PLOT_L + plot_w / 2)}" y="{num(base + 29)}" text-anchor="middle" '
               f'fill="#656d76">step</text>')
    out.append(f'<text transform="translate(12 {num(_PLOT_T + _PLOT_H / 2)}) rotate(-90)" text-anchor="middle" '
               f'fill="#656d76">lm loss</text>')
    # curves, the first group underneath
    for k, g in enumerate(groups):
        colour, width, dash, alpha = g["style"]
        names = ", ".join(clean_text(v.name) for v in g["members"])
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<g class="loss-group" data-group="{k}"><title>{attr(g["label"])}: {attr(names)}</title>')
        for seg in _segments([(x_of(s), y) for s, y in enumerate(g["ys"])]):
            pts = " ".join(f"{num(x)},{num(y_of(y))}" for x, y in seg)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="{num(width)}" '
                       f'stroke-opacity="{num(alpha)}" stroke-linejoin="round"{dash_attr}/>')
        if n_steps <= _MAX_MARKED_STEPS:
            for s, y in enumerate(g["ys"]):
                if y is None:
                    continue
                bits = g["hex"][s] if s < len(g["hex"]) else ""
                tip = f"{g['label']} · step {s}: {y!r}" + (f" ({bits})" if bits else "")
                out.append(f'<circle cx="{num(x_of(s))}" cy="{num(y_of(y))}" r="{num(max(2.2, width / 2 + 0.6))}" '
                           f'fill="{colour}" fill-opacity="{num(alpha)}"><title>{attr(tip)}</title></circle>')
        out.append("</g>")
    # resume points: a dashed rule between the step a checkpoint was saved after and the first resumed step
    resumes: dict = {}
    for g in groups:
        for v in g["members"]:
            for k in v.series.resumed_after:
                resumes.setdefault(k, []).append(clean_text(v.name))
    for k, who in sorted(resumes.items()):
        x = x_of(min(k + 0.5, n_steps - 1))
        out.append(f'<g class="resume-mark"><title>{attr(f"resumed after step {k}: " + ", ".join(who))}</title>'
                   f'<line x1="{num(x)}" y1="{num(_PLOT_T)}" x2="{num(x)}" y2="{num(base)}" stroke="#9a6700" '
                   f'stroke-width="1" stroke-dasharray="3 3"/>'
                   f'<text x="{num(x + 3)}" y="{num(_PLOT_T + 10)}" fill="#9a6700" font-size="10">resumed</text></g>')
    # legend below the axes: never over a curve
    labels = [_short(g["label"]) for g in groups]
    widths = [30 + CHAR_W * len(t) + 18 for t in labels]
    lines = flow_lines(widths, _W - _PLOT_L - _PLOT_R)
    y0 = base + _AXIS_H + 4
    for li, line in enumerate(lines):
        y = y0 + li * _LEGEND_ROW
        for i, dx in line:
            colour, width, dash, alpha = groups[i]["style"]
            x = _PLOT_L + dx
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<g class="legend-item"><title>{attr(groups[i]["label"])}</title>'
                       f'<line x1="{num(x)}" y1="{num(y + 6)}" x2="{num(x + 24)}" y2="{num(y + 6)}" stroke="{colour}" '
                       f'stroke-width="{num(min(width, 4))}" stroke-opacity="{num(alpha)}"{dash_attr}/>'
                       f'<text x="{num(x + 30)}" y="{num(y + 10)}" fill="#1f2328">{attr(labels[i])}</text></g>')
    height = y0 + len(lines) * _LEGEND_ROW + 2
    n_runs = sum(len(g["members"]) for g in groups)
    plural = "s" if len(groups) != 1 else ""
    label = f"lm loss per step: {n_runs} runs in {len(groups)} group{plural} of bitwise-identical losses"
    return "\n".join([svg_open("loss-svg", _W, height, label)] + out + ["</svg>"])


def group_rows(groups: list[dict], anchors: dict[int, str]) -> list[dict[str, Any]]:
    """Rows of the list under the chart: each group's colour, label and members with their card anchors."""
    return [{"colour": g["style"][0], "label": g["label"],
             "members": [(v.name, anchors.get(i)) for v, i in zip(g["members"], g["indices"])]}
            for g in groups]
