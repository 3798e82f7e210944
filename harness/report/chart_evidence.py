"""Charts of a variant's differences as inline SVG: the ULP histogram of one differing tensor and the
heatmap of differing parameters per family and step.

Hand-written like every chart of the report (`harness.report.svg`): deterministic for equal input, escaped,
no JavaScript, no external resources.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from harness.judging.results import FAMILIES, VariantResult

from .svg import FONT, tick_step
from .words import attr, clean_text, finite_or_none, int_or_none, num

#: Upper bounds (in ULPs) of the histogram buckets of `harness.judging.ulp.tensor_stats`; None = above the last one.
ULP_BUCKETS = (1, 2, 4, 8, 16, 64, 256, 1024, 2 ** 16, 2 ** 24, None)
ULP_BAR = "#0969da"
HEATMAP_ZERO = "#eaeef2"
#: Colour ramp of nonzero heatmap cells: light (one differing tensor) to dark (the variant's maximum).
HEATMAP_LOW = (255, 216, 211)
HEATMAP_HIGH = (130, 7, 30)
HEATMAP_MAX_WIDTH = 1100

_UH_SLOT = 34        # px per histogram bucket
_UH_BAR = 26
_UH_PAD = 6
_UH_TOP = 14         # room for the counts above the bars
_UH_PLOT_H = 46
_UH_LABEL_H = 16

_HM_ROW_H = 16
_HM_MAX_CELL = 28
_HM_AXIS_H = 16
_HM_TITLE_H = 18
_HM_PANEL_GAP = 10
_HM_PAD_R = 12


def ulp_bound_words(upper: Any) -> str:
    """A bucket's upper bound: ``1``, ``1024``; powers of two from 2^11 up as ``2^16``, ``2^24``."""
    n = int_or_none(upper)
    if n is None:
        f = finite_or_none(upper)
        return "?" if f is None else num(f)
    if n > 1024 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return str(n)


def _ulp_buckets(hist: Any) -> list[tuple[Optional[float], int]]:
    """The histogram on the standard buckets (`ULP_BUCKETS`, plus any other bound it names), in order,
    zero counts included; None (unbounded) last.  Malformed entries are skipped, repeated bounds summed."""
    counts: dict = {}
    for item in hist if isinstance(hist, (list, tuple)) else []:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            continue
        upper, n = item
        count = int_or_none(n)
        if count is None or count < 0:
            continue
        if upper is None:
            key = None
        else:
            try:
                key = float(upper)
            except (TypeError, ValueError):
                continue
            if math.isnan(key) or key <= 0:
                continue
            if math.isinf(key):
                key = None          # +inf: the unbounded bucket
        counts[key] = counts.get(key, 0) + count
    bounds = sorted({float(b) for b in ULP_BUCKETS if b is not None} | {k for k in counts if k is not None})
    return [(b, counts.get(b, 0)) for b in bounds] + [(None, counts.get(None, 0))]


def ulp_bucket_label(upper: Any, top: Any = ULP_BUCKETS[-2]) -> str:
    """``≤1``, ``≤2``, ... ``≤2^24``; the unbounded bucket (None) reads ``>`` + `top` (``>2^24``)."""
    return f">{ulp_bound_words(top)}" if upper is None else f"≤{ulp_bound_words(upper)}"


def _compact(n: int) -> str:
    if n < 10000:
        return str(n)
    if n < 1_000_000:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M"


def ulp_histogram_svg(entry: Any) -> Optional[str]:
    """Small inline SVG: one bar per ULP bucket of one ULP-evidence row (linear height, the count above it,
    a ``<title>`` tooltip with the exact count), buckets labelled ``≤1``, ``≤2``, ... ``>2^24``.

    Every standard bucket is drawn (empty ones as a gap) so all histograms share one axis.  None when the
    entry has no histogram or every count is zero.  Deterministic for equal input.
    """
    if not isinstance(entry, dict):
        return None
    buckets = _ulp_buckets(entry.get("histogram"))
    total = sum(n for _, n in buckets)
    if total <= 0:
        return None
    top = max(b for b, _ in buckets if b is not None)
    peak = max(n for _, n in buckets)
    width = 2 * _UH_PAD + len(buckets) * _UH_SLOT
    base_y = _UH_TOP + _UH_PLOT_H
    height = base_y + _UH_LABEL_H
    what, key = clean_text(entry.get("what") or "tensor"), clean_text(entry.get("key") or "")
    label = f"ULP histogram of {what} {key}: {total} differing elements"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="ulp-hist-svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{attr(label)}" '
           f'font-family="{FONT}" font-size="9">',
           f'<line x1="{_UH_PAD}" y1="{base_y}" x2="{width - _UH_PAD}" y2="{base_y}" stroke="#8c959f" '
           f'stroke-width="0.8"/>']
    for i, (upper, n) in enumerate(buckets):
        x = _UH_PAD + i * _UH_SLOT + (_UH_SLOT - _UH_BAR) / 2
        cx = _UH_PAD + i * _UH_SLOT + _UH_SLOT / 2
        text = ulp_bucket_label(upper, top)
        if n:
            h = max(1.5, _UH_PLOT_H * n / peak)
            share = f"{100.0 * n / total:.3g} %"
            tip = f"{text} ULP: {n} element{'s' if n != 1 else ''} ({share} of the differing ones)"
            out.append(f'<rect class="ulp-bar" x="{num(x)}" y="{num(base_y - h)}" width="{_UH_BAR}" '
                       f'height="{num(h)}" fill="{ULP_BAR}"><title>{attr(tip)}</title></rect>')
            out.append(f'<text class="ulp-count" x="{num(cx)}" y="{num(base_y - h - 3)}" text-anchor="middle" '
                       f'fill="#1f2328">{_compact(n)}</text>')
        out.append(f'<text class="ulp-bucket{" empty" if not n else ""}" x="{num(cx)}" y="{base_y + 12}" '
                   f'text-anchor="middle" font-size="8" fill="{"#1f2328" if n else "#8c959f"}">{attr(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)



def family_tables(v: VariantResult) -> list[dict]:
    """Mismatch-count tables of one variant, one per kind present (``grad``, ``param``, then ``buffer``: the
    routers' expert bias, counted apart from the parameters, and shown only when one differs: eight family rows
    of which at most two can hold a buffer would otherwise add an empty panel to every card)."""
    fm = v.family_mismatches or {}
    tables = []
    for kind in ("grad", "optimizer_state", "param", "buffer"):
        per_step = fm.get(kind)
        if not per_step:
            continue
        per_step = [d or {} for d in per_step]
        if kind == "buffer" and not any(any(d.values()) for d in per_step):
            continue
        extra = sorted({f for d in per_step for f in d} - set(FAMILIES))
        rows = []
        for fam in list(FAMILIES) + extra:
            counts = [int(d.get(fam, 0) or 0) for d in per_step]
            rows.append({"family": fam, "counts": counts, "total": sum(counts)})
        col_totals = [sum(r["counts"][s] for r in rows) for s in range(len(per_step))]
        tables.append({"kind": kind, "steps": list(range(len(per_step))), "rows": rows,
                       "col_totals": col_totals, "total": sum(col_totals)})
    return tables


# --------------------------------------------------------------------------------------------------


def _heat_colour(n: int, peak: int) -> tuple[str, str]:
    """(fill, text colour) of a heatmap cell with `n` differing tensors, `peak` the variant's maximum."""
    if n <= 0:
        return HEATMAP_ZERO, "#8c959f"
    t = 1.0 if peak <= 1 else (n - 1) / (peak - 1)
    t = 0.15 + 0.85 * t          # one differing tensor is already clearly tinted
    rgb = tuple(round(lo + (hi - lo) * t) for lo, hi in zip(HEATMAP_LOW, HEATMAP_HIGH))
    return "#%02x%02x%02x" % rgb, "#ffffff" if t > 0.55 else "#1f2328"


def family_heatmap_svg(v: VariantResult) -> Optional[str]:
    """Inline SVG heatmap of `v.family_mismatches`: one panel per kind present (grad, param, buffer), families as
    rows, steps as columns; colour intensity by the number of differing tensors (one scale for both panels,
    darkest at the variant's maximum), zero cells light grey.  Every cell has a ``<title>`` tooltip and
    shows its count when it fits.  None when there are no counts or all are zero.  Deterministic."""
    tables = family_tables(v)
    if not tables or sum(t["total"] for t in tables) == 0:
        return None
    peak = max(max(r["counts"] or [0]) for t in tables for r in t["rows"])
    families = [r["family"] for r in tables[0]["rows"]]
    for t in tables[1:]:
        families += [r["family"] for r in t["rows"] if r["family"] not in families]
    label_w = max(96.0, 6.2 * max(len(clean_text(f)) for f in families) + 14)
    n_steps = max(len(t["steps"]) for t in tables)
    avail = HEATMAP_MAX_WIDTH - label_w - _HM_PAD_R
    cell = min(float(_HM_MAX_CELL), avail / max(1, n_steps))
    width = max(label_w + n_steps * cell + _HM_PAD_R, 360.0)
    tick = tick_step(cell) if cell < 24 else 1
    stroke = "1" if cell >= 8 else "0.25"      # thin separators when the cells are narrow

    out, y = [], 0.0
    for t in tables:
        rows = {r["family"]: r["counts"] for r in t["rows"]}
        out.append(f'<text class="hm-title" x="0" y="{num(y + 12)}" fill="#1f2328" font-weight="600">'
                   f'{attr(t["kind"])} · {t["total"]} differing</text>')
        y += _HM_TITLE_H
        for s in t["steps"]:
            if s % tick == 0:
                out.append(f'<text class="hm-step" x="{num(label_w + (s + 0.5) * cell)}" y="{num(y + 11)}" '
                           f'text-anchor="middle" fill="#656d76" font-size="10">{s}</text>')
        y += _HM_AXIS_H
        for fam in families:
            counts = rows.get(fam, [0] * len(t["steps"]))
            out.append(f'<text x="{num(label_w - 6)}" y="{num(y + _HM_ROW_H / 2 + 4)}" text-anchor="end" '
                       f'fill="#1f2328">{attr(fam)}</text>')
            for s, n in enumerate(counts):
                fill, ink = _heat_colour(n, peak)
                x = label_w + s * cell
                tip = f"{t['kind']} · {fam} · step {s}: {n} differing tensor{'s' if n != 1 else ''}"
                out.append(f'<rect class="hm-cell {attr(t["kind"])} {"nonzero" if n else "zero"}" x="{num(x)}" '
                           f'y="{num(y)}" width="{num(cell)}" height="{_HM_ROW_H}" fill="{fill}" '
                           f'stroke="#ffffff" stroke-width="{stroke}"><title>{attr(tip)}</title></rect>')
                if n and cell >= 6.5 * len(str(n)) + 3:
                    out.append(f'<text class="hm-count" x="{num(x + cell / 2)}" y="{num(y + _HM_ROW_H / 2 + 3.5)}" '
                               f'text-anchor="middle" fill="{ink}" font-size="10">{n}</text>')
            y += _HM_ROW_H
        y += _HM_PANEL_GAP
    # legend: zero, then the ramp at a few counts up to the maximum
    samples = sorted({1, peak} | {max(1, round(peak * q)) for q in (0.25, 0.5, 0.75)})
    note = "differing tensors per family and step"
    items = [(0, "0")] + [(n, str(n)) for n in samples]
    legend_w = sum(22 + 6.2 * len(text) for _, text in items) + 6 + 6.2 * len(note)
    x0 = label_w if label_w + legend_w <= width else 0.0
    width = max(width, x0 + legend_w + _HM_PAD_R)
    x, y = x0, y + 2
    for n, text in items:
        fill, _ = _heat_colour(n, peak)
        out.append(f'<rect class="hm-swatch" x="{num(x)}" y="{num(y)}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{num(x + 16)}" y="{num(y + 10)}" fill="#1f2328">{text}</text>')
        x += 22 + 6.2 * len(text)
    out.append(f'<text x="{num(x + 6)}" y="{num(y + 10)}" fill="#656d76">{note}</text>')
    height = y + 16
    label = (f"differing parameters of {clean_text(v.name)} by family and step: "
             + ", ".join(f"{t['kind']} {t['total']}" for t in tables))
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap-svg" width="{num(width)}" '
            f'height="{num(height)}" viewBox="0 0 {num(width)} {num(height)}" role="img" '
            f'aria-label="{attr(label)}" font-family="{FONT}" font-size="11">')
    return "\n".join([head] + out + ["</svg>"])
