"""Tests for harness.report: the SVG charts (loss, timeline, heatmap, ULP histograms) and the detail pages that carry
them (results from tests/report_cases.py).
"""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from report_cases import (
    EVIDENCE_ERROR,
    EVIDENCE_KEY,
    NONDET,
    P1_GRAD,
    PP2_VPP2_TIMELINE,
    SVG_NS,
    ULP_LABELS,
    WIDE_PARAM,
    _cards,
    _cells,
    _fill_luminance,
    _heat_cells,
    _hex,
    _pages,
    _r2r_block,
    _svg_in,
    _svg_rects,
    _ulp_block,
    _variant,
    make_evidence_result,
    make_result,
)

from harness import report
from harness.judging.results import FAMILIES, StepSeries


def test_html_loss_hex_table_highlights_differences(html):
    m = re.search(r'<table class="hex-table">(.*?)</table>', html, re.S)
    assert m
    table = m.group(1)
    assert _hex(9.7500009) != _hex(9.75)
    differing = re.findall(r'<td class="hex differs"[^>]*>(0x[0-9a-f]{8})</td>', table)
    assert differing == [_hex(9.7500009), _hex(9.1)]
    assert table.count(_hex(10.5)) == 3  # step 0 equal in all three variants with data
    # one row per run with data (long, not wide), one column per step
    header = re.search(r"<thead>(.*?)</thead>", table, re.S).group(1)
    assert re.findall(r"<th[^>]*>([^<]*)</th>", header) == ["run", "step 0", "step 1", "step 2"]
    names = re.findall(r'<td><a href="#card-[^"]*">([^<]*)</a></td>', table)
    assert names == ["baseline", "pp2_vpp2", "pp4_mtp"]   # the errored variant has no data


def test_html_without_loss_data_has_no_svg():
    r = make_result()
    for v in r.variants:
        v.series = StepSeries()
    out = report.render_html(r)
    loss = out.split('id="loss"', 1)[1].split('id="gradnorm"', 1)[0]
    assert "<svg" not in loss and "No loss data recorded." in loss
    # timelines and heatmaps are drawn on the detail pages, not in index.html
    assert "<svg" not in out
    assert report.render_run_page(r, 1).count('class="timeline-svg"') == 1


def test_loss_svg_is_deterministic_and_embeddable(result):
    a = report.loss_curves_svg(result)
    b = report.loss_curves_svg(result)
    assert a == b
    assert a.startswith("<svg") and a.rstrip().endswith("</svg>")
    assert "<!--" not in a


def test_timeline_svg_one_rect_per_cell_coloured_by_direction(result):
    v = result.variants[1]
    svg = report.timeline_svg(v)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    cells = _svg_rects(svg, "cell")
    assert len(cells) == len(PP2_VPP2_TIMELINE) == 16
    fwd = {f for f, _ in report.TIMELINE_FORWARD}
    bwd = {f for f, _ in report.TIMELINE_BACKWARD}
    assert not fwd & bwd and report.TIMELINE_IDLE not in fwd | bwd
    ops = [e.get("class").split()[1] for e in cells]
    assert ops.count("F") == 8 and ops.count("B") == 8
    for e in cells:
        assert e.get("fill") in (fwd if e.get("class").split()[1] == "F" else bwd)
    # Chunk shading: stage s of a P=2 layout is chunk s // 2.
    x_of = {e.find(f"{SVG_NS}title").text: e for e in cells}
    assert x_of["rank 0 · forward · stage 0 (chunk 0) · microbatch 0 · t 0–1"].get("fill") == \
        report.TIMELINE_FORWARD[0][0]
    f2 = x_of["rank 0 · forward · stage 2 (chunk 1) · microbatch 0 · t 2–3"]
    b2 = x_of["rank 0 · backward · stage 2 (chunk 1) · microbatch 0 · t 8–10"]
    b0 = x_of["rank 0 · backward · stage 0 (chunk 0) · microbatch 0 · t 14–16"]
    assert f2.get("fill") == report.TIMELINE_FORWARD[1][0]
    assert b2.get("fill") == report.TIMELINE_BACKWARD[1][0] and b0.get("fill") == report.TIMELINE_BACKWARD[0][0]
    # Geometry: x proportional to time (backward twice as wide as forward); rank 0 above rank 1.
    assert float(b2.get("width")) == pytest.approx(2 * float(f2.get("width")))
    assert float(b2.get("x")) - float(f2.get("x")) == pytest.approx(6 * float(f2.get("width")))
    r1 = x_of["rank 1 · forward · stage 1 (chunk 0) · microbatch 0 · t 1–2"]
    assert float(r1.get("y")) > float(f2.get("y"))
    # Idle time: one light lane per rank behind the cells, nothing drawn in the gaps.
    lanes = _svg_rects(svg, "lane")
    assert len(lanes) == 2 and {e.get("fill") for e in lanes} == {report.TIMELINE_IDLE}
    # Microbatch numbers inside the cells (all fit at this scale), and a legend.
    labels = re.findall(r'<text class="mb"[^>]*>(\d+)</text>', svg)
    assert sorted(labels) == sorted(str(c["microbatch"]) for c in PP2_VPP2_TIMELINE)
    for text in ("forward · chunk 0", "forward · chunk 1", "backward · chunk 0", "backward · chunk 1",
                 "idle (bubble)"):
        assert f">{text}</text>" in svg
    assert len(_svg_rects(svg, "swatch")) == 5
    assert "<script" not in svg.lower() and "href" not in svg


def test_timeline_svg_single_chunk_legend_and_deterministic(result):
    v = result.variants[0]
    svg = report.timeline_svg(v)
    assert ">forward (1 unit)</text>" in svg and ">backward (2 units)</text>" in svg and "chunk" not in svg.split("</title>")[-1]
    assert report.timeline_svg(v) == svg
    shuffled = _variant(name=v.name, pp=v.pp, timeline=list(reversed(v.timeline)))
    assert report.timeline_svg(shuffled) == svg


def test_timeline_svg_large_schedule_fits_and_skips_bad_cells():
    cells = []
    for r in range(16):
        t = r
        for mb in range(50):
            cells.append({"rank": r, "start": t, "end": t + 1, "op": "F", "stage": r, "microbatch": mb})
            t += 1
        for mb in range(50):
            cells.append({"rank": r, "start": t, "end": t + 2, "op": "B", "stage": r, "microbatch": mb})
            t += 2
    bad = [{"rank": 0, "start": 1, "end": 1, "op": "F"}, {"start": 0, "end": 1, "op": "F"}, "junk",
           {"rank": "x", "start": 0, "end": 1, "op": "F"}, {"rank": 0, "start": float("nan"), "end": 1, "op": "B"}]
    svg = report.timeline_svg(_variant(pp=16, timeline=cells + bad))
    root = ET.fromstring(svg)
    assert float(root.get("width")) <= report.TIMELINE_MAX_WIDTH
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
    assert len(_svg_rects(svg, "cell")) == 16 * 100
    assert len(_svg_rects(svg, "lane")) == 16
    ys = sorted({float(e.get("y")) for e in _svg_rects(svg, "lane")})
    assert len(ys) == 16
    # Labels are only drawn where they fit: two-digit numbers do not fit a forward cell at this scale.
    assert 0 < len(re.findall(r'<text class="mb"', svg)) < 16 * 100
    assert report.timeline_svg(_variant(timeline=bad)) is None
    assert report.timeline_svg(_variant(timeline=[])) is None


def test_timeline_svg_unknown_op_and_escaped_name():
    v = _variant(name='a "<q>" & b', timeline=_cells((0, 0, 1, "W", 0, 0), (1, 0, 1, "F", 1, 0)))
    svg = report.timeline_svg(v)
    root = ET.fromstring(svg)
    assert root.get("aria-label").startswith('schedule timeline of a "<q>" & b')
    assert "<q>" not in svg
    cells = _svg_rects(svg, "cell")
    assert [e.get("fill") for e in cells] == [report.TIMELINE_OTHER[0], report.TIMELINE_FORWARD[0][0]]


def test_html_timeline_on_detail_pages_and_summary_in_cards(html, result):
    pages = [report.render_run_page(result, i) for i in range(4)]
    base, ok, bad, err = pages
    # After the layout grid, before the reproduce command; the bubble fraction printed under it.
    i_grid = ok.index("rank 0: E t | t L\nrank 1: t t")
    i_svg = ok.index('<svg xmlns="http://www.w3.org/2000/svg" class="timeline-svg"')
    assert i_grid < i_svg < ok.index('<h2 id="reproduce">Reproduce</h2>')
    assert ok.count('<rect class="cell ') == 16
    assert "bubble fraction 33.3 %" in ok
    assert "bubble fraction 0.0 %" in base
    assert base.count('<rect class="cell ') == 4
    assert "timeline-svg" not in bad and "No schedule timeline recorded." in bad
    assert "bubble fraction —" in err                                   # cells but no fraction
    assert 'aria-label="schedule timeline of pp2 &lt;b&gt;x&lt;/b&gt;: 2 ranks, 6 time units"' in err
    # the Chrome trace beside it, planned only (no trainer records per-action times)
    assert '<a class="trace-link" href="schedule.trace.json">' in ok and "Planned only" in ok
    # the detail page links back to its card in the report
    assert '<a class="back" href="../../index.html#card-pp2_vpp2">' in ok
    # index.html: one line per card, no SVG
    cards = _cards(html)
    assert "timeline-svg" not in html
    assert "schedule: bubble fraction 33.3 %" in cards[1] and "16 compute actions" in cards[1]
    assert '<a href="runs/pp2_vpp2/index.html#timeline">timeline</a>' in cards[1]
    assert '<a class="trace-link" href="runs/pp2_vpp2/schedule.trace.json">Chrome trace</a>' in cards[1]
    assert "bubble fraction" not in cards[2]


def test_ulp_bucket_labels():
    assert [report.ulp_bucket_label(b) for b in report.ULP_BUCKETS] == ULP_LABELS
    assert report.ulp_bucket_label(32) == "≤32" and report.ulp_bucket_label(3000) == "≤3000"
    assert report.ulp_bucket_label(2.0) == "≤2" and report.ulp_bucket_label(2 ** 12) == "≤2^12"


def test_ulp_histogram_svg_bars_labels_and_heights():
    svg = report.ulp_histogram_svg(P1_GRAD)
    root = ET.fromstring(svg)
    assert root.get("class") == "ulp-hist-svg"
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
    # every standard bucket is labelled, in order, so all histograms share one axis
    labels = [t.text for t in root.iter(f"{SVG_NS}text") if t.get("class", "").startswith("ulp-bucket")]
    assert labels == ULP_LABELS
    bars = [e for e in root.iter(f"{SVG_NS}rect") if e.get("class") == "ulp-bar"]
    titles = [b.find(f"{SVG_NS}title").text for b in bars]
    assert titles[0] == "≤1 ULP: 228 elements (78.9 % of the differing ones)"
    assert [t.split(" ULP")[0] for t in titles] == ["≤1", "≤2", "≤4", "≤8", "≤16", "≤64"]
    counts = [int(t.text) for t in root.iter(f"{SVG_NS}text") if t.get("class") == "ulp-count"]
    assert counts == [228, 31, 10, 12, 4, 4]
    heights = [float(b.get("height")) for b in bars]
    assert heights[0] == max(heights)
    assert heights[1] / heights[0] == pytest.approx(31 / 228, abs=0.01)
    assert heights[2] < heights[3]            # 10 < 12
    # bars sit on one baseline, left to right in bucket order
    assert len({round(float(b.get("y")) + float(b.get("height")), 2) for b in bars}) == 1
    xs = [float(b.get("x")) for b in bars]
    slot = xs[1] - xs[0]
    assert slot > float(bars[0].get("width")) and [b - a for a, b in zip(xs, xs[1:])] == [slot] * 5
    assert report.ulp_histogram_svg(dict(P1_GRAD)) == svg
    assert "<script" not in svg.lower() and "href" not in svg


def test_ulp_histogram_svg_unbounded_bucket_escaping_and_bad_input():
    svg = report.ulp_histogram_svg(WIDE_PARAM)
    root = ET.fromstring(svg)
    assert root.get("aria-label") == f"ULP histogram of param {EVIDENCE_KEY}: 7 differing elements"
    assert "<mlp>" not in svg
    bars = [e for e in root.iter(f"{SVG_NS}rect") if e.get("class") == "ulp-bar"]
    tips = [e.find(f"{SVG_NS}title").text for e in bars]
    assert [t.split(" ULP")[0] for t in tips] == ["≤1", "≤2^16", "≤2^24", ">2^24"]
    # empty buckets keep their place on the axis: ≤1 and ≤2^16 are eight slots apart
    xs = [float(b.get("x")) for b in bars]
    assert xs[1] - xs[0] == pytest.approx(8 * (xs[2] - xs[1]))
    # +inf and "inf" are the unbounded bucket too; repeated bounds are summed; junk is skipped
    messy = {"histogram": [[1, 2], [1, 3], [float("inf"), 1], ["inf", 1], [float("nan"), 9], "junk", [4],
                           [-1, 5], [2, -3], [8, "x"]]}
    root = ET.fromstring(report.ulp_histogram_svg(messy))
    tips = [e.find(f"{SVG_NS}title").text for e in root.iter(f"{SVG_NS}rect") if e.get("class") == "ulp-bar"]
    assert tips == ["≤1 ULP: 5 elements (71.4 % of the differing ones)",
                    ">2^24 ULP: 2 elements (28.6 % of the differing ones)"]
    for bad in (None, "x", {}, {"histogram": []}, {"histogram": [[1, 0]]}, {"histogram": "junk"}):
        assert report.ulp_histogram_svg(bad) is None


def test_html_ulp_evidence_on_the_detail_page():
    r = make_evidence_result()
    pages = _pages(r)
    assert len(pages) == 5
    block = _ulp_block(pages[2])
    table = re.search(r'<table class="ulp-table">(.*?)</table>', block, re.S).group(1)
    rows = re.findall(r'<tr class="ulp-row">(.*?)</tr>', table, re.S)
    assert len(rows) == 2
    cells = [dict(re.findall(r'<td class="[^"]*?(ulp-\w+)[^"]*">(.*?)</td>', r, re.S)) for r in rows]
    g, p = cells
    assert "embedding.<wbr>word_embeddings.<wbr>weight<wbr>" in g["ulp-tensor"]
    assert (g["ulp-what"], g["ulp-differing"], g["ulp-fraction"], g["ulp-max"], g["ulp-median"]) == \
        ("grad", "289 / 8,192", "3.53 %", "40", "1")
    assert (g["ulp-abs"], g["ulp-rel"], g["ulp-nan"]) == ("2.98e-08", "3.79e-06", "0")
    assert "float32" in rows[0]
    assert (p["ulp-what"], p["ulp-differing"], p["ulp-max"], p["ulp-median"], p["ulp-rel"], p["ulp-nan"]) == \
        ("param", "9 / 512", str(2 ** 30), "2.5", "—", "2")
    assert 'class="num ulp-nan nonzero"' in rows[1] and 'class="num ulp-nan zero"' in rows[0]
    # the key with markup is escaped in the table and in the histogram
    assert "&lt;mlp&gt;" in p["ulp-tensor"] and "<mlp>" not in pages[2]
    # one histogram per tensor, inside its row
    assert [len(_svg_in(r, "ulp-hist-svg")) for r in rows] == [1, 1]
    assert "step 0 (the first diverging step)" in block and "differ from pp2_vpp2" in block
    # only pp4_mtp has evidence; the errored variant shows its evidence error, escaped; the others nothing
    for i in (0, 1, 4):
        assert "ULP evidence" not in pages[i] and "ulp-hist-svg" not in pages[i]
    err = _ulp_block(pages[3])
    assert "ulp-table" not in err
    assert '<pre class="error evidence-error">rank 0 exited with code 1: &lt;dump&gt; &amp; friends</pre>' in err
    assert sum(p.count('class="ulp-hist-svg"') for p in pages) == 2
    # the cards in index.html: one line each, the histograms only on the detail page; the evidence error shown
    html = report.render_html(r)
    cards = _cards(html)
    line = re.search(r'<li class="ulp-line">(.*?)</li>', cards[2], re.S).group(1)
    assert "ULP evidence at step 0: 2 differing tensors · max 2^30 ULP" in line
    assert '<a href="runs/pp4_mtp/index.html#ulp-evidence">table and histograms</a>' in line
    assert "could not be collected" in cards[3] and "&lt;dump&gt; &amp; friends" in cards[3]
    assert "ulp-hist-svg" not in html and "<mlp>" not in html


def test_html_ulp_evidence_error_next_to_partial_evidence_and_empty_rows():
    r = make_evidence_result()
    bad = r.variants[2]
    bad.evidence_error = "variant re-run timed out"
    bad.ulp_evidence = [dict(P1_GRAD, histogram=[]), "junk"]
    block = _ulp_block(report.render_run_page(r, 2))
    assert len(re.findall(r'<tr class="ulp-row">', block)) == 1
    assert "no histogram" in block and "ulp-hist-svg" not in block
    assert "variant re-run timed out" in block
    bad.ulp_evidence, bad.evidence_error = [], ""
    assert "ULP evidence" not in report.render_run_page(r, 2)
    assert "ulp-line" not in _cards(report.render_html(r))[2]


def test_run_to_run_words():
    assert report.run_to_run_words({}) == "" and report.run_to_run_words(None) == ""
    assert report.run_to_run_words({"runs": 3, "deterministic": True, "first_divergence": None,
                                    "detail": "whatever"}) == "3 runs bitwise equal"
    assert report.run_to_run_words(NONDET) == "NONDETERMINISTIC: repeat 2 differs from run 1: step 1 grad x.<w>"
    assert report.run_to_run_words({"runs": 3, "deterministic": False, "first_divergence": None,
                                    "detail": "repeat 3 did not complete: boom"}) == \
        "NONDETERMINISTIC: repeat 3 did not complete: boom"


def test_html_run_to_run_control_separate_from_the_layout_comparison():
    html = report.render_html(make_evidence_result())
    cards = _cards(html)
    state, block = _r2r_block(cards[1])
    assert state == "deterministic"
    assert "<h4>Run-to-run control</h4>" in block
    assert '<span class="r2r-ok">3 runs bitwise equal</span>' in block
    assert "NONDETERMINISTIC" not in block and "r2r-bad" not in block
    state, block = _r2r_block(cards[4])
    assert state == "nondeterministic"
    assert '<span class="r2r-bad">NONDETERMINISTIC: repeat 2 differs from run 1: step 1 grad x.&lt;w&gt;</span>' \
        in block
    assert "step 1 · grad · x.&lt;w&gt;" in block and "grad fingerprint aa vs bb" in block
    assert "not a layout effect" in block
    # red: its own style, not the pass/fail styles of the comparison
    css = html.split("<style>", 1)[1].split("</style>", 1)[0]
    assert re.search(r"\.run-to-run\.nondeterministic \{[^}]*var\(--fail\)", css)
    assert re.search(r"\.r2r-bad \{[^}]*var\(--fail\)", css)
    # kept apart from the layout comparison: not inside the card's meta list (first divergence vs reference)
    for card in (cards[1], cards[4]):
        meta = card.split('<dl class="meta">', 1)[1].split("</dl>", 1)[0]
        assert "Run-to-run" not in meta and "runs bitwise equal" not in meta and "NONDETERMINISTIC" not in meta
        assert card.index("<h4>Structural checks</h4>") < card.index("Run-to-run control")
    # variants that ran once: no block
    for i in (0, 2, 3):
        assert _r2r_block(cards[i]) is None and "Run-to-run" not in cards[i]
    assert html.count("<h4>Run-to-run control</h4>") == 2


def test_family_heatmap_svg_cells_and_colours(result):
    v = result.variants[2]       # grad [{emb 2}, {experts 5, router 1}, {mtp 3}]; param [{}, {emb 1}, {experts 4}]
    svg = report.family_heatmap_svg(v)
    root = ET.fromstring(svg)
    assert root.get("class") == "heatmap-svg"
    assert float(root.get("width")) <= report.HEATMAP_MAX_WIDTH
    cells = _heat_cells(svg)
    assert len(cells) == 2 * len(FAMILIES) * 3
    five = cells["grad · experts · step 1: 5 differing tensors"]
    one = cells["grad · router · step 1: 1 differing tensor"]
    zero = cells["grad · experts · step 0: 0 differing tensors"]
    assert five.get("class") == "hm-cell grad nonzero" and zero.get("class") == "hm-cell grad zero"
    # zero cells light grey, every other cell a shade of the ramp, darker with the count (darkest at the max)
    nonzero = {t: e for t, e in cells.items() if e.get("class").endswith(" nonzero")}
    assert len(nonzero) == 6
    assert {e.get("fill") for t, e in cells.items() if t not in nonzero} == {report.HEATMAP_ZERO}
    assert report.HEATMAP_ZERO not in {e.get("fill") for e in nonzero.values()}
    assert five.get("fill") == "#%02x%02x%02x" % report.HEATMAP_HIGH
    by_count = sorted(nonzero.values(), key=lambda e: int(e.find(f"{SVG_NS}title").text.split(": ")[1].split()[0]))
    lum = [_fill_luminance(e.get("fill")) for e in by_count]
    assert lum == sorted(lum, reverse=True) and lum[0] > lum[-1]
    assert _fill_luminance(one.get("fill")) < _fill_luminance(report.HEATMAP_ZERO)
    # same count, same colour in both panels (one scale per variant)
    assert cells["param · embedding/head · step 1: 1 differing tensor"].get("fill") == one.get("fill")
    # geometry: steps are columns, families rows, grad panel above param
    x = [float(cells[f"grad · experts · step {s}: {n} differing tensor{'s' if n != 1 else ''}"].get("x"))
         for s, n in ((0, 0), (1, 5), (2, 0))]
    assert x == sorted(x) and len(set(x)) == 3
    assert float(cells["grad · router · step 1: 1 differing tensor"].get("y")) < float(five.get("y"))
    assert float(five.get("y")) < float(cells["param · experts · step 2: 4 differing tensors"].get("y"))
    # the count is written in every nonzero cell (they are wide enough here), never in a zero cell
    labels = [t.text for t in root.iter(f"{SVG_NS}text") if t.get("class") == "hm-count"]
    assert sorted(labels) == ["1", "1", "2", "3", "4", "5"]
    assert report.family_heatmap_svg(v) == svg


def test_family_heatmap_svg_none_without_differences_escapes_and_fits():
    assert report.family_heatmap_svg(_variant(family_mismatches={})) is None
    assert report.family_heatmap_svg(_variant(family_mismatches={"grad": [{f: 0 for f in FAMILIES}] * 4})) is None
    weird = _variant(name='a "<q>" & b', family_mismatches={"grad": [{"<odd> & family": 2}], "param": [{}]})
    svg = report.family_heatmap_svg(weird)
    root = ET.fromstring(svg)
    assert "<odd>" not in svg and "<q>" not in svg
    assert root.get("aria-label") == 'differing parameters of a "<q>" & b by family and step: grad 2, param 0'
    cells = _heat_cells(svg)
    assert len(cells) == 2 * (len(FAMILIES) + 1)
    assert cells["grad · <odd> & family · step 0: 2 differing tensors"].get("class") == "hm-cell grad nonzero"
    many = _variant(family_mismatches={"grad": [{"experts": s % 7} for s in range(500)]})
    root = ET.fromstring(report.family_heatmap_svg(many))
    assert float(root.get("width")) <= report.HEATMAP_MAX_WIDTH
    assert root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
    assert len(_heat_cells(report.family_heatmap_svg(many))) == 500 * len(FAMILIES)
    steps = [t.text for t in root.iter(f"{SVG_NS}text") if t.get("class") == "hm-step"]
    assert 5 <= len(steps) < 100 and steps[0] == "0"


def test_html_heatmap_on_detail_pages_and_tables_kept(html, result):
    base, ok, bad, err = _pages(result)
    assert len(_svg_in(bad, "heatmap-svg")) == 1
    assert '<h2 id="heatmap">Differing parameters by family and step</h2>' in bad
    assert "grad 11" in bad and "param 5" in bad
    # all-zero counts: a line instead of a grey map; the baseline (compared with itself) and the errored
    # variant (no counts): nothing
    assert "heatmap-svg" not in ok and "no differing parameters in any of the 3 steps" in ok
    for page in (base, err):
        assert "Differing parameters" not in page and "heatmap-svg" not in page
    # index.html: the totals in the card with a link, no SVG
    cards = _cards(html)
    line = re.search(r'<li class="heatmap-line">(.*?)</li>', cards[2], re.S).group(1)
    assert "grad 11 · param 5" in line and 'href="runs/pp4_mtp/index.html#heatmap"' in line
    assert "no differing parameters in any of the 3 steps" in cards[1]
    assert "heatmap-svg" not in html
    # the mismatch tables are still there, and link to the heatmap
    sec = html.split('id="mismatches"', 1)[1].split('id="variants"', 1)[0]
    assert len(re.findall(r'<table class="family-table">', sec)) == 2
    assert '<a class="small heatmap-link" href="runs/pp4_mtp/index.html#heatmap">heatmap</a>' in sec


def test_summary_json_run_to_run_and_ulp_evidence():
    s = report.summary_dict(make_evidence_result())
    base, ok, bad, err, flaky = s["variants"]
    for v in s["variants"]:
        assert type(v["run_to_run"]) is dict and type(v["ulp_evidence"]) is list and type(v["evidence_error"]) is str
    assert base["run_to_run"] == bad["run_to_run"] == err["run_to_run"] == {}
    assert ok["run_to_run"] == {"runs": 3, "deterministic": True, "first_divergence": None,
                                "detail": "3 runs bitwise equal"}
    assert flaky["run_to_run"] == NONDET
    assert bad["ulp_evidence"][0] == P1_GRAD
    wide = bad["ulp_evidence"][1]
    assert wide["histogram"] == [[1, 3], [2 ** 16, 2], [2 ** 24, 1], [None, 1]]
    assert wide["max_rel_err"] == "inf" and wide["key"] == EVIDENCE_KEY   # strict JSON: inf as a string
    assert base["ulp_evidence"] == ok["ulp_evidence"] == err["ulp_evidence"] == []
    assert err["evidence_error"] == EVIDENCE_ERROR and bad["evidence_error"] == ""
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    plain = report.summary_dict(make_result())["variants"]
    assert all(v["run_to_run"] == {} and v["ulp_evidence"] == [] and v["evidence_error"] == "" for v in plain)
