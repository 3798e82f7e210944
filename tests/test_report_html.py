"""Tests for harness.report: index.html: the run list, verdict matrix, header, cards, grad-norm and structural sections
(results from tests/report_cases.py).
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from report_cases import (
    BROKEN_DETAIL,
    CLIP,
    FAIL_NORM_HEX,
    FAIL_NORMS,
    INV_LINES,
    REF_NORM_HEX,
    REPLICA,
    _cards,
    _dd,
    _gradnorm_rows,
    _gradnorm_section,
    _matrix,
    _matrix_cells,
    _pages,
    _runs_rows,
    _structural_block,
    _svg_in,
    make_evidence_result,
    make_result,
    make_structural_result,
)

from harness import report
from harness.judging.results import FAMILIES


def test_html_run_list_rows(html):
    rows = _runs_rows(html)
    assert [cls.split()[0] for cls, _ in rows] == ["verdict-pass", "verdict-pass", "verdict-fail", "verdict-error"]
    assert "pp2_vpp2" in rows[1][1]
    fail_row = rows[2][1]
    assert "pp4_mtp" in fail_row and 'class="badge fail"' in fail_row
    assert "step 0 · grad · embedding.word_embeddings.weight" in fail_row
    assert "0x3c23d70a (baseline) vs 0x3c23d70b (variant)" in fail_row
    assert 'class="badge error"' in rows[3][1]
    assert "31.0 s" in fail_row
    assert '<a href="#card-pp4_mtp">pp4_mtp</a>' in fail_row


def test_html_verdict_matrix_layouts_by_option_groups(html):
    m = _matrix(html)
    # columns: option groups (reductions x clipping, then other overrides), each run in exactly one cell
    heads = re.findall(r'<th class="col" title="[^"]*">(.*?)</th>', m, re.S)
    cols = [re.findall(r"<span>(.*?)</span>", h) for h in heads]
    assert cols == [["megatron", "clip off"], ["megatron", "clip 0.05", "micro_batches=4"],
                    ["megatron", "clip 0.05", "mtp_standalone=True", "seed=7"], ["canonical", "clip off"]]
    rows = re.findall(r'<th class="row"[^>]*>(.*?)<span class="layout">(.*?)</span>', m, re.S)
    assert [(h.strip(), lay) for h, lay in rows] == [
        ("P1 · no pipelining · MTP with the loss", "E|t*4|L"), ("P2 · V2 · MTP with the loss", "E,t|t,t|t,L"),
        ("P4 · V1 · MTP standalone", "E|t,t|t,t|L,M"), ("P2 · V1 · MTP with the loss", "E|t&lt;t&gt;|L")]
    cells = _matrix_cells(html)
    assert [(c["row"], c["col"]) for c in cells] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [c["href"] for c in cells] == ["#card-baseline", "#card-pp2_vpp2", "#card-pp4_mtp", "#card-pp2-b-x-b"]
    # colours: reference outlined, equal green, unexpected red, error grey; the reference of pp4_mtp outlined too
    assert [c["cls"] for c in cells] == [["reference", "is-ref"], ["equal", "is-ref"], ["unexpected"], ["error"]]
    # tooltip: name, outcome, first divergence, reference run
    tip = cells[2]["title"]
    assert tip.startswith("pp4_mtp\nunexpected difference (fail)\nfirst divergence: step 0 · grad · embedding.word")
    assert "compared with pp2_vpp2" in tip
    assert cells[3]["run"] == "pp2 &lt;b&gt;x&lt;/b&gt;" and "rank 1 exited with code 1" in cells[3]["title"]
    # one line per failing run under the matrix, linked to its card
    sec = html.split('<section id="matrix">', 1)[1].split("</section>", 1)[0]
    failing = re.findall(r"<li>(.*?)</li>", sec.split('<ul class="failing">', 1)[1], re.S)
    assert len(failing) == 2
    assert '<a href="#card-pp4_mtp">pp4_mtp</a> · unexpected difference:' in failing[0]
    assert "step 0 · grad · embedding.word_embeddings.weight" in failing[0]
    assert "rank 1 exited with code 1" in failing[1]
    # every matrix link has its card
    for c in cells:
        assert f'id="{c["href"][1:]}"' in html
    # the matrix comes before every other section
    assert html.index('<section id="matrix">') < html.index('<section id="runs">') < html.index('<section id="loss">')


def test_html_matrix_all_clear_line_and_legend():
    r = make_result()
    r.variants = r.variants[:2]
    html = report.render_html(r)
    sec = html.split('<section id="matrix">', 1)[1].split("</section>", 1)[0]
    assert "failing" not in sec and "Nothing moved unexpectedly" in sec
    legend = re.search(r'<p class="mlegend">(.*?)</p>', sec, re.S).group(1)
    assert "equal 1" in legend and "unexpected difference 0" in legend and "reference run 1" in legend


def test_html_header_and_sections(html, result):
    assert html.lstrip().startswith("<!DOCTYPE html>")
    assert "dsv3_small" in html
    assert result.command in html  # no characters that need escaping in it
    assert 'class="badge overall fail"' in html
    for section in ("matrix", "runs", "loss", "mismatches", "variants", "environment"):
        assert f'id="{section}"' in html
    # layout grid kept verbatim in <pre>, on the run's detail page
    assert "<pre>rank 0: E t | t L\nrank 1: t t</pre>" in report.render_run_page(result, 1)
    assert "micro_batches" in html and "2.13.0" in html


def test_html_is_self_contained(html):
    assert "<svg" in html
    lowered = html.lower()
    for forbidden in ("<script", "<link", "@import", "url(http", "<iframe", "<img"):
        assert forbidden not in lowered, forbidden
    # Only SVG namespace declarations may mention http(s).
    for m in re.finditer(r"https?://", html):
        before = html[max(0, m.start() - 20):m.start()]
        assert re.search(r'xmlns(:\w+)?="$', before), html[m.start() - 40:m.start() + 60]
    assert "<?xml" not in html and "<!DOCTYPE svg" not in html


def test_html_escapes_markup(html):
    assert "&lt;b&gt;x&lt;/b&gt;" in html
    assert "<b>x</b>" not in html and "<b>" not in html
    assert "&lt;boom&gt; &amp; co" in html
    assert "E|t&lt;t&gt;|L" in html
    assert "\x1b" not in html and "\x00" not in html


def test_html_family_tables(html):
    sec = html.split('id="mismatches"', 1)[1].split('id="variants"', 1)[0]
    # Only pp4_mtp has nonzero counts; pp2_vpp2's all-zero tables collapse into one muted line.
    assert "pp4_mtp" in sec and "pp2_vpp2" in sec
    tables = re.findall(r'<table class="family-table">(.*?)</table>', sec, re.S)
    assert len(tables) == 2  # grad + param of pp4_mtp only
    quiet = re.findall(r'<p class="muted small no-mismatch">(.*?)</p>', sec, re.S)
    assert len(quiet) == 1
    assert "pp2_vpp2" in quiet[0] and "no mismatching tensors in any step" in quiet[0]
    assert sec.count("no mismatching tensors in any step") == 1
    # pp4_mtp's counts are relative to its reference run.
    assert re.search(r'pp4_mtp</a>.*?vs pp2_vpp2', sec, re.S)
    fams = re.findall(r"<tr>\s*<td>([^<]+)</td>", tables[-2])
    assert fams == [f.replace("&", "&amp;") for f in FAMILIES]
    experts = re.search(r"<td>experts</td>(.*?)</tr>", tables[-2], re.S).group(1)
    cells = re.findall(r'<td class="num (?:total )?(zero|nonzero)">(\d+)</td>', experts)
    assert cells == [("zero", "0"), ("nonzero", "5"), ("zero", "0"), ("nonzero", "5")]
    assert "grad · 11 mismatches" in sec and "param · 5 mismatches" in sec


def test_html_run_list_reductions_clip_and_reference(html):
    head = re.search(r'<table class="runs">\s*<thead>(.*?)</thead>', html, re.S).group(1)
    headers = re.findall(r"<th[^>]*>([^<]+)</th>", head)
    assert headers == ["run", "layout", "options", "compared with", "expect", "verdict", "first divergence", "elapsed"]
    rows = [r for _, r in _runs_rows(html)]
    sched = [re.search(r'<td class="layout">.*?· ([^<·]*)</span></td>', r).group(1) for r in rows]
    assert sched == ["no pipelining", "interleaved", "1F1B", "1F1B"]
    red = [re.search(r'<span class="reductions">([^<]*)</span>', r).group(1) for r in rows]
    assert red == ["megatron", "megatron", "megatron", "canonical"]
    clip = [re.search(r'<span class="clip">([^<]*)</span>', r).group(1) for r in rows]
    assert clip == ["off", "0.05", "0.05", "off"]
    refs = [re.search(r'<td class="ref([^"]*)">(.*?)</td>', r, re.S).groups() for r in rows]
    # The baseline is compared with itself; pp2_vpp2 with the baseline (styled as such); pp4_mtp with pp2_vpp2.
    assert refs[0][0] == "" and "itself" in refs[0][1]
    assert refs[1][0] == " is-baseline"
    assert '<a href="#card-baseline">baseline</a>' in refs[1][1] and 'class="ref-baseline"' in refs[1][1]
    assert refs[2][0] == "" and '<a href="#card-pp2_vpp2">pp2_vpp2</a>' in refs[2][1]
    assert "ref-baseline" not in refs[2][1]
    assert refs[3][0] == " is-baseline"


def test_html_variant_card_names_reference_and_reductions(html):
    card = html.split('id="card-pp4_mtp"', 1)[1].split('<div class="variant', 1)[0]
    assert "<code>megatron</code> · clip_grad 0.05" in card
    assert '<a href="#card-pp2_vpp2">pp2_vpp2</a>' in card
    assert "expected bitwise equality with reference run &#39;pp2_vpp2&#39;" in card


def test_html_grad_norm_section(html):
    sec = _gradnorm_section(html)
    heads = re.findall(r'<h3 class="gradnorm-variant"><a href="#(card-[\w-]+)">([^<]+)</a>', sec)
    assert heads == [("card-pp2_vpp2", "pp2_vpp2"), ("card-pp4_mtp", "pp4_mtp")]
    tables = re.findall(r'<table class="gradnorm-table">(.*?)</table>', sec, re.S)
    assert len(tables) == 2
    ref_rows, fail_rows = _gradnorm_rows(tables[0]), _gradnorm_rows(tables[1])
    assert len(ref_rows) == len(fail_rows) == 3

    # columns: step, bits, value, ulp, reference bits, clip coeff, clipped
    for step, row in enumerate(fail_rows):
        assert row[0][1] == str(step)
        assert row[1] == ("hex", FAIL_NORM_HEX[step])
        assert row[2][1] == repr(FAIL_NORMS[step])
        assert row[4][1] == REF_NORM_HEX[step]
        assert row[5][1] == repr(CLIP / (FAIL_NORMS[step] + 1e-6))
    ulp = [(cls, text) for cls, text in (r[3] for r in fail_rows)]
    assert ulp == [("num ulp zero", "0"), ("num ulp nonzero", "1"), ("num ulp nonzero", "3")]
    assert [r[4][0] for r in fail_rows] == ["hex", "hex differs", "hex differs"]
    assert [r[6] for r in fail_rows] == [("clipped", "no"), ("clipped", "no"), ("clipped clipped-yes", "yes")]
    # pp2_vpp2 is compared with the unclipped baseline: no ULP distance, no reference bits.
    assert [r[3] for r in ref_rows] == [("num ulp na muted", "—")] * 3
    assert [r[4] for r in ref_rows] == [("hex muted", "—")] * 3
    assert [r[1][1] for r in ref_rows] == REF_NORM_HEX

    fail_intro = sec.split('href="#card-pp4_mtp">pp4_mtp', 1)[1].split("<table", 1)[0]
    assert "reductions <code>megatron</code> (fp32 grad norm)" in fail_intro
    assert "clip_grad 0.05" in fail_intro and '<a href="#card-pp2_vpp2">pp2_vpp2</a>' in fail_intro
    assert "2 steps with a nonzero ULP distance" in fail_intro
    ref_intro = sec.split('href="#card-pp2_vpp2">pp2_vpp2', 1)[1].split("<table", 1)[0]
    assert 'class="ref-baseline"' in ref_intro and "nonzero ULP" not in ref_intro

    off = re.findall(r'<p class="muted small clipping-off">(.*?)</p>', sec, re.S)
    assert len(off) == 1
    assert off[0].startswith("clipping off: ")
    assert re.findall(r'<a href="#card-[\w-]+">([^<]+)</a>', off[0]) == ["baseline", "pp2 &lt;b&gt;x&lt;/b&gt;"]


def test_html_grad_norm_canonical_fp64_and_all_off():
    r = make_result()
    v = r.variants[1]
    v.reductions = "canonical"
    v.series.grad_norm_hex = ["0x3fa0000000000000", "0x3fa4000000000000", "0x3fb0000000000000"]
    sec = _gradnorm_section(report.render_html(r))
    assert "reductions <code>canonical</code> (fp64 grad norm)" in sec
    assert "0x3fa4000000000000" in sec

    for v in r.variants:
        v.clip_grad = 0.0
    sec = _gradnorm_section(report.render_html(r))
    assert "gradnorm-table" not in sec and "clipping-off" not in sec
    assert "Gradient clipping is off in every variant" in sec


def test_html_structural_checks_in_every_card():
    r = make_structural_result()
    cards = _cards(report.render_html(r))
    assert len(cards) == 5
    base, ok, bad, err, drift = (_structural_block(c) for c in cards)

    # inventory: baseline is the reference, pp2_vpp2 matches, pp4_mtp lists its differing lines highlighted
    assert "reference run" in _dd(base, "inventory-check") and "matches" not in _dd(base, "inventory-check")
    inv_ok = _dd(ok, "inventory-check")
    assert '<span class="struct-ok">matches the reference</span>' in inv_ok and "parameters)" not in inv_ok
    inv_bad = _dd(bad, "inventory-check")
    assert 'class="inventory-check differs"' in bad
    assert "differs from pp2_vpp2 in 2 parameters" in inv_bad
    items = re.findall(r'<li class="mono differs">(.*?)</li>', inv_bad)
    assert items == [INV_LINES[0], "decoder.layers.0.&lt;mlp&gt;.weight: only in the baseline"]
    assert "matches the reference" not in inv_bad
    assert "not compared" in _dd(err, "inventory-check")
    assert "<li" not in _dd(ok, "inventory-check") + _dd(drift, "inventory-check")

    # replicas: consistent with detail and keys; broken at step k with detail and keys; errored: not checked
    rep_base = _dd(base, "replica-check")
    assert 'class="replica-check consistent"' in base and '<span class="struct-ok">consistent</span>' in rep_base
    assert "match their originals at init and after all 3 steps" in rep_base
    assert re.findall(r'<li class="mono">(.*?)</li>', rep_base) == [REPLICA]
    rep_ok = _dd(ok, "replica-check")
    assert "no replicas in this run" in rep_ok and "<li" not in rep_ok
    rep_drift = _dd(drift, "replica-check")
    assert 'class="replica-check broken"' in drift
    assert '<span class="struct-bad">broken at step 1</span>' in rep_drift
    assert f'<span class="replica-detail broken">{BROKEN_DETAIL}</span>' in rep_drift
    assert re.findall(r'<li class="mono">(.*?)</li>', rep_drift) == [REPLICA, "x.weight@mtp"]
    assert "broken" not in rep_base and "consistent" not in rep_drift
    assert 'class="replica-check unknown"' in err and "not checked" in _dd(err, "replica-check")


def test_html_run_list_marks_structural_failures_only():
    html = report.render_html(make_structural_result())
    rows = _runs_rows(html)
    assert len(rows) == 5
    flags = [re.findall(r'<span class="struct-flag (\w+)" title="([^"]*)">', r) for _, r in rows]
    assert [[c for c, _ in f] for f in flags] == [[], [], ["inventory"], [], ["replicas"]]
    assert ["structural-flag" in cls for cls, _ in rows] == [False, False, True, False, True]
    # the marker sits in the variant cell and its tooltip says what is wrong
    name_cell = re.search(r'<td class="name">(.*?)</td>', rows[2][1], re.S).group(1)
    assert "pp4_mtp" in name_cell and 'class="struct-flag inventory"' in name_cell
    assert flags[2][0][1].startswith("parameter inventory differs from pp2_vpp2 (2 parameters): output_layer.weight")
    assert flags[4][0][1] == f"replicas inconsistent: broken at step 1 · {BROKEN_DETAIL}"
    # no structural data at all: no markers
    plain = report.render_html(make_result())
    assert 'class="struct-flag' not in plain and "structural-flag" not in plain


def test_html_with_evidence_is_self_contained_and_escaped():
    r = make_evidence_result()
    html = report.render_html(r)
    for page in [html] + _pages(r):
        lowered = page.lower()
        for forbidden in ("<script", "<link", "@import", "url(http", "<iframe", "<img", "<mlp>", "<dump>", "<w>"):
            assert forbidden not in lowered, forbidden
        for m in re.finditer(r"https?://", page):
            assert re.search(r'xmlns(:\w+)?="$', page[max(0, m.start() - 20):m.start()])
        for cls in ("ulp-hist-svg", "heatmap-svg", "timeline-svg", "loss-svg"):
            for svg in _svg_in(page, cls):
                ET.fromstring(svg)
    assert report.render_html(make_evidence_result()) == html
