"""The schedule timeline of one run as inline SVG: ranks as rows, time in unit costs (forward 1, backward 2,
merged forward|backward 3) as x, one rect per compute action with a tooltip.

Hand-written (like every chart of the report, `harness.report.svg`): deterministic for equal input, escaped,
no JavaScript, no external resources.  The same cells go to the Chrome trace (`harness.report.chrome_trace`).
"""
from __future__ import annotations

from typing import Optional

from harness.judging.results import VariantResult

from .svg import FONT, tick_step
from .words import attr, clean_text, finite_or_none, num

#: (fill, text colour) per virtual chunk, cycling; forward in blues, backward in oranges.  Adjacent chunks
#: alternate dark and light so neighbouring chunks stay distinguishable.
TIMELINE_FORWARD = (("#0969da", "#ffffff"), ("#80ccff", "#1f2328"), ("#0550ae", "#ffffff"),
                    ("#b6e3ff", "#1f2328"))
TIMELINE_BACKWARD = (("#bc4c00", "#ffffff"), ("#ffb77c", "#1f2328"), ("#762c00", "#ffffff"),
                     ("#ffd8b5", "#1f2328"))
TIMELINE_OTHER = ("#8c959f", "#ffffff")
TIMELINE_MERGED = "#6639ba"       # outline (and legend swatch) of a merged forward|backward cell
TIMELINE_IDLE = "#f6f8fa"
TIMELINE_MAX_WIDTH = 1100

_TL_LABEL_W = 58      # rank labels
_TL_PAD_R = 12
_TL_AXIS_H = 20       # time axis above the rows
_TL_ROW_H = 18
_TL_ROW_GAP = 3
_TL_MAX_UNIT = 32     # px per time unit for short schedules


def timeline_cells(v: VariantResult) -> list[dict]:
    """The valid cells of `v.timeline`, normalised and sorted (rank, start, end, op, stage, microbatch)."""
    cells = []
    for c in v.timeline or []:
        if not isinstance(c, dict):
            continue
        try:
            rank, stage, mb = int(c.get("rank")), int(c.get("stage", 0)), int(c.get("microbatch", 0))
        except (TypeError, ValueError):
            continue
        start, end = finite_or_none(c.get("start")), finite_or_none(c.get("end"))
        if rank < 0 or start is None or end is None or end <= start or start < 0:
            continue
        cell = {"rank": rank, "start": start, "end": end, "op": str(c.get("op", "")), "stage": stage,
                "microbatch": mb}
        if cell["op"] == "FB":      # merged forward + backward (1F1B overlap)
            try:
                cell.update(b_stage=int(c.get("b_stage")), b_microbatch=int(c.get("b_microbatch")))
            except (TypeError, ValueError):
                continue
        cells.append(cell)
    cells.sort(key=lambda c: (c["rank"], c["start"], c["end"], c["op"], c["stage"], c["microbatch"]))
    return cells


def _cell_colours(op: str, chunk: int) -> tuple[str, str]:
    palette = {"F": TIMELINE_FORWARD, "B": TIMELINE_BACKWARD}.get(op)
    return TIMELINE_OTHER if palette is None else palette[chunk % len(palette)]


def _cell_label(text: str, x: float, w: float, y: float, ink: str) -> list[str]:
    """The microbatch label of a timeline cell [x, x + w) in the row at y, in the largest font that fits
    (digits are about 0.6 em wide); [] when none does."""
    size = next((fs for fs in (10, 9, 8) if w >= 0.6 * fs * len(text) + 2), None)
    if size is None:
        return []
    return [f'<text class="mb" x="{num(x + w / 2)}" y="{num(y + _TL_ROW_H / 2 + size * 0.35)}" '
            f'text-anchor="middle" fill="{ink}" font-size="{size}">{attr(text)}</text>']


def _merged_cell(c: dict, pp: int, x: float, w: float, y: float) -> list[str]:
    """SVG of one merged 1F1B-overlap cell: the forward third and the backward two thirds in their chunks'
    colours inside one outlined box, labelled ``f|b`` (the two microbatches) when it fits."""
    fchunk, bchunk = c["stage"] // pp, c["b_stage"] // pp
    (ffill, _), (bfill, _) = _cell_colours("F", fchunk), _cell_colours("B", bchunk)
    tip = (f'rank {c["rank"]} · merged (1F1B overlap): forward stage {c["stage"]} (chunk {fchunk}) microbatch '
           f'{c["microbatch"]} + backward stage {c["b_stage"]} (chunk {bchunk}) microbatch {c["b_microbatch"]}'
           f' · t {num(c["start"])}–{num(c["end"])}')
    out = [f'<g class="cell FB merged chunk-{fchunk} bchunk-{bchunk}"><title>{attr(tip)}</title>',
           f'<rect x="{num(x)}" y="{y}" width="{num(w / 3)}" height="{_TL_ROW_H}" fill="{ffill}"/>',
           f'<rect x="{num(x + w / 3)}" y="{y}" width="{num(2 * w / 3)}" height="{_TL_ROW_H}" fill="{bfill}"/>',
           f'<rect x="{num(x)}" y="{y}" width="{num(w)}" height="{_TL_ROW_H}" fill="none" '
           f'stroke="{TIMELINE_MERGED}" stroke-width="1.4"/>']
    out += _cell_label(f'{c["microbatch"]}|{c["b_microbatch"]}', x, w, y, "#1f2328")
    out.append("</g>")
    return out


def timeline_svg(v: VariantResult) -> Optional[str]:
    """Inline SVG of the schedule timeline of `v` (None when it has no valid cells).

    Ranks are rows (rank 0 at the top), x is time in units (forward 1, backward 2), one
    ``<rect class="cell ...">`` per compute action: forward in blue, backward in orange, the shade cycling
    with the virtual chunk (``stage // pp``); the microbatch is written inside a cell when it fits and every
    cell has a ``<title>`` tooltip.  Idle time shows the light lane background.  A legend sits below.
    The output depends only on the cells (sorted), so it is deterministic; width <= TIMELINE_MAX_WIDTH.
    """
    cells = timeline_cells(v)
    if not cells:
        return None
    try:
        pp = max(1, int(v.pp))
    except (TypeError, ValueError):
        pp = 1
    n_ranks = max(pp, max(c["rank"] for c in cells) + 1)
    makespan = max(c["end"] for c in cells)
    avail = TIMELINE_MAX_WIDTH - _TL_LABEL_W - _TL_PAD_R
    unit = min(float(_TL_MAX_UNIT), avail / makespan)
    plot_w = makespan * unit
    x0 = _TL_LABEL_W
    rows_h = n_ranks * (_TL_ROW_H + _TL_ROW_GAP) - _TL_ROW_GAP

    # Legend items: (fill, stroke, label); forward/backward per chunk present, then idle.
    chunks = sorted({c["stage"] // pp for c in cells})
    ops = [op for op in ("F", "B") if any(c["op"] == op for c in cells)]
    legend = []
    for op in ops:
        word = "forward" if op == "F" else "backward"
        for ch in chunks:
            if any(c["op"] == op and c["stage"] // pp == ch for c in cells):
                label = f"{word} (1 unit)" if op == "F" else f"{word} (2 units)"
                if len(chunks) > 1:
                    label = f"{word} · chunk {ch}"
                legend.append((_cell_colours(op, ch)[0], None, label))
    if any(c["op"] == "FB" for c in cells):
        legend.append((TIMELINE_MERGED, None, "merged forward | backward (1F1B overlap, 3 units)"))
    if any(c["op"] not in ("F", "B", "FB") for c in cells):
        legend.append((TIMELINE_OTHER[0], None, "other"))
    legend.append((TIMELINE_IDLE, "#d0d7de", "idle (bubble)"))
    legend_note = "number in a cell = microbatch"

    # Lay the legend out in lines that fit the width.
    width = max(x0 + plot_w + _TL_PAD_R, 360.0)
    item_w = [12 + 6 + 6.2 * len(label) + 16 for _, _, label in legend] + [6.2 * len(legend_note)]
    lines, cur, cur_w = [], [], 0.0
    for i, w in enumerate(item_w):
        if cur and x0 + cur_w + w > width - _TL_PAD_R:
            lines.append(cur)
            cur, cur_w = [], 0.0
        cur.append((i, cur_w))
        cur_w += w
    lines.append(cur)
    legend_y0 = _TL_AXIS_H + rows_h + 12
    height = legend_y0 + 18 * len(lines)

    out = []
    label = f"schedule timeline of {clean_text(v.name)}: {n_ranks} ranks, {num(makespan)} time units"
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline-svg" width="{num(width)}" '
               f'height="{num(height)}" viewBox="0 0 {num(width)} {num(height)}" role="img" '
               f'aria-label="{attr(label)}" font-family="{FONT}" font-size="11">')
    # time axis: ticks and light vertical guides
    step = tick_step(unit)
    t = 0
    while t <= makespan + 1e-9:
        x = x0 + t * unit
        out.append(f'<line class="tick" x1="{num(x)}" y1="{_TL_AXIS_H - 4}" x2="{num(x)}" '
                   f'y2="{num(_TL_AXIS_H + rows_h)}" stroke="#d0d7de" stroke-width="0.5"/>')
        out.append(f'<text x="{num(x)}" y="{_TL_AXIS_H - 7}" text-anchor="middle" fill="#656d76" '
                   f'font-size="10">{t}</text>')
        t += step
    # lanes (light background where a rank idles) and rank labels
    for r in range(n_ranks):
        y = _TL_AXIS_H + r * (_TL_ROW_H + _TL_ROW_GAP)
        out.append(f'<text x="{x0 - 6}" y="{num(y + _TL_ROW_H / 2 + 4)}" text-anchor="end" '
                   f'fill="#1f2328">rank {r}</text>')
        out.append(f'<rect class="lane" x="{x0}" y="{y}" width="{num(plot_w)}" height="{_TL_ROW_H}" '
                   f'fill="{TIMELINE_IDLE}" fill-opacity="0.85" stroke="#d0d7de" stroke-width="0.5"/>')
    # cells
    for c in cells:
        if c["op"] == "FB":
            out += _merged_cell(c, pp, x0 + c["start"] * unit, (c["end"] - c["start"]) * unit,
                                _TL_AXIS_H + c["rank"] * (_TL_ROW_H + _TL_ROW_GAP))
            continue
        chunk = c["stage"] // pp
        fill, ink = _cell_colours(c["op"], chunk)
        x = x0 + c["start"] * unit
        w = (c["end"] - c["start"]) * unit
        y = _TL_AXIS_H + c["rank"] * (_TL_ROW_H + _TL_ROW_GAP)
        op_cls = c["op"] if c["op"] in ("F", "B") else "other"
        tip = (f'rank {c["rank"]} · {"forward" if c["op"] == "F" else "backward" if c["op"] == "B" else c["op"]}'
               f' · stage {c["stage"]} (chunk {chunk}) · microbatch {c["microbatch"]}'
               f' · t {num(c["start"])}–{num(c["end"])}')
        out.append(f'<rect class="cell {op_cls} chunk-{chunk}" x="{num(x)}" y="{y}" width="{num(w)}" '
                   f'height="{_TL_ROW_H}" fill="{fill}" stroke="#ffffff" stroke-width="0.6">'
                   f'<title>{attr(tip)}</title></rect>')
        out += _cell_label(str(c["microbatch"]), x, w, y, ink)
    # legend
    for li, line in enumerate(lines):
        y = legend_y0 + li * 18
        for i, dx in line:
            x = x0 + dx
            if i == len(legend):
                out.append(f'<text x="{num(x)}" y="{num(y + 10)}" fill="#656d76">{attr(legend_note)}</text>')
                continue
            fill, stroke, text = legend[i]
            stroke_attr = f' stroke="{stroke}" stroke-width="0.8"' if stroke else ""
            out.append(f'<rect class="swatch" x="{num(x)}" y="{num(y + 1)}" width="12" height="12" '
                       f'fill="{fill}"{stroke_attr}/>')
            out.append(f'<text x="{num(x + 18)}" y="{num(y + 11)}" fill="#1f2328">{attr(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)
