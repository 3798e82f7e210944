"""Tests for harness.report: summary.json, junit.xml, summary.md and the self-contained index.html."""
from __future__ import annotations

import json
import pathlib
import re
import struct
import xml.etree.ElementTree as ET
from typing import Optional

import pytest

from harness import report
from harness.judging.results import FAMILIES, CaseResult, FirstDivergence, StepSeries, VariantResult
from harness.report import writer

MARKUP_NAME = "pp2 <b>x</b>"
FAIL_DETAIL = "grad bits 0x3c23d70a (baseline) vs 0x3c23d70b (variant)"


def _hex(x: float) -> str:
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bits(h: str) -> float:
    return struct.unpack("<f", struct.pack("<I", int(h, 16)))[0]


def _cells(*rows: tuple) -> list[dict]:
    return [dict(zip(("rank", "start", "end", "op", "stage", "microbatch"), r)) for r in rows]


def _series(losses: list[float]) -> StepSeries:
    return StepSeries(lm_loss=list(losses), lm_loss_hex=[_hex(x) for x in losses],
                      mtp_loss=[[x + 0.1] for x in losses], grad_norm=[None] * len(losses),
                      grad_norm_hex=[None] * len(losses))


BASE_LOSSES = [10.5, 9.75, 9.125]
FAIL_LOSSES = [10.5, 9.7500009, 9.1]  # step 0 equal, steps 1 and 2 differ

CLIP = 0.05
# Grad norms of the clipped reference (pp2_vpp2) and of pp4_mtp, which is compared with it: step 0 equal,
# step 1 one ULP apart, step 2 three ULPs apart.  Clipping triggers at step 2 only.
REF_NORMS = [_f32(0.03125), _f32(0.0390625), _f32(0.0625)]
REF_NORM_HEX = [_hex(x) for x in REF_NORMS]
FAIL_NORM_HEX = [REF_NORM_HEX[0], "0x%08x" % (int(REF_NORM_HEX[1], 16) + 1), "0x%08x" % (int(REF_NORM_HEX[2], 16) - 3)]
FAIL_NORMS = [_bits(h) for h in FAIL_NORM_HEX]

# 2 ranks x 2 chunks (stages 0..3, stage s on rank s % 2), 2 microbatches: 8 F cells, 8 B cells, makespan 18,
# 12 busy units per rank -> bubble 1/3.
PP2_VPP2_TIMELINE = _cells(
    (0, 0, 1, "F", 0, 0), (0, 1, 2, "F", 0, 1), (0, 2, 3, "F", 2, 0), (0, 3, 4, "F", 2, 1),
    (0, 8, 10, "B", 2, 0), (0, 10, 12, "B", 2, 1), (0, 14, 16, "B", 0, 0), (0, 16, 18, "B", 0, 1),
    (1, 1, 2, "F", 1, 0), (1, 2, 3, "F", 1, 1), (1, 3, 4, "F", 3, 0), (1, 4, 5, "F", 3, 1),
    (1, 5, 7, "B", 3, 0), (1, 7, 9, "B", 3, 1), (1, 11, 13, "B", 1, 0), (1, 13, 15, "B", 1, 1))
BASELINE_TIMELINE = _cells((0, 0, 1, "F", 0, 0), (0, 1, 3, "B", 0, 0), (0, 3, 4, "F", 0, 1), (0, 4, 6, "B", 0, 1))


def make_result() -> CaseResult:
    """A baseline, a passing variant, a failing variant with a divergence and an errored variant."""
    baseline = VariantResult(
        name="baseline", layout="E|t*4|L", pp=1, vpp=1, mtp_standalone=False, expect="bitwise",
        verdict="pass", bitwise_equal=True, first_divergence=None, reason="baseline run",
        layout_grid="rank 0: E t t t t L", options={}, series=_series(BASE_LOSSES),
        elapsed_s=12.5, run_dir="runs/baseline", command="bitparity verify cases/x.yaml --only baseline",
        compare_to="baseline", timeline=BASELINE_TIMELINE, bubble_fraction=0.0)
    ref_series = _series(BASE_LOSSES)
    ref_series.grad_norm, ref_series.grad_norm_hex = list(REF_NORMS), list(REF_NORM_HEX)
    ref_series.grad_norm_ulp = [None, None, None]  # the baseline does not clip: not comparable
    ref_series.clip_coeff = [CLIP / (x + 1e-6) for x in REF_NORMS]
    ref_series.clipped = [False, False, True]
    fail_series = _series(FAIL_LOSSES)
    fail_series.grad_norm, fail_series.grad_norm_hex = list(FAIL_NORMS), list(FAIL_NORM_HEX)
    fail_series.grad_norm_ulp = [0, 1, 3]
    fail_series.clip_coeff = [CLIP / (x + 1e-6) for x in FAIL_NORMS]
    fail_series.clipped = [False, False, True]
    passing = VariantResult(
        name="pp2_vpp2", layout="E,t|t,t|t,L", pp=2, vpp=2, mtp_standalone=False, expect="bitwise",
        verdict="pass", bitwise_equal=True, first_divergence=None,
        reason="bitwise equal over 3 steps", layout_grid="rank 0: E t | t L\nrank 1: t t",
        options={"micro_batches": 4, "clip_grad": CLIP}, series=ref_series,
        family_mismatches={"grad": [{f: 0 for f in FAMILIES}] * 3, "param": [{}] * 3},
        elapsed_s=20.25, run_dir="runs/pp2_vpp2", command="bitparity verify cases/x.yaml --only pp2_vpp2",
        compare_to="baseline", clip_grad=CLIP, timeline=PP2_VPP2_TIMELINE, bubble_fraction=1 / 3)
    failing = VariantResult(
        name="pp4_mtp", layout="E|t,t|t,t|L,M", pp=4, vpp=1, mtp_standalone=True, expect="bitwise",
        verdict="fail", bitwise_equal=False,
        first_divergence=FirstDivergence(step=0, kind="grad", microbatch=None,
                                         name="embedding.word_embeddings.weight", detail=FAIL_DETAIL),
        reason="grads differ from baseline at step 0", layout_grid="rank 0: E\nrank 3: L M",
        options={"mtp_standalone": True, "seed": 7}, series=fail_series,
        compare_to="pp2_vpp2", clip_grad=CLIP,
        family_mismatches={
            "grad": [{"embedding/head": 2, "experts": 0}, {"experts": 5, "router": 1}, {"mtp": 3}],
            "param": [{}, {"embedding/head": 1}, {"experts": 4}],
        },
        elapsed_s=31.0, run_dir="runs/pp4_mtp", command="bitparity verify cases/x.yaml --only pp4_mtp")
    errored = VariantResult(
        name=MARKUP_NAME, layout="E|t<t>|L", pp=2, vpp=1, mtp_standalone=False, expect="bitwise",
        verdict="error", bitwise_equal=None, first_divergence=None,
        reason="rank 1 exited with code 1",
        error="Traceback (most recent call last):\n  \x1b[31mRuntimeError: <boom> & co\x1b[0m\x00",
        series=StepSeries(), elapsed_s=3.0, run_dir="runs/err",
        command="bitparity verify cases/x.yaml --only 'pp2 <b>x</b>'",
        compare_to="baseline", reductions="canonical",
        timeline=_cells((0, 0, 1, "F", 0, 0), (1, 1, 2, "F", 1, 0), (1, 2, 4, "B", 1, 0), (0, 4, 6, "B", 0, 0)))
    return CaseResult(
        case="dsv3_small", case_path="cases/dsv3_small.yaml", baseline="baseline",
        variants=[baseline, passing, failing, errored], elapsed_s=66.75,
        environment={"torch": "2.13.0", "python": "3.11.7", "threads": 4, "device": "cpu"},
        command="bitparity verify cases/dsv3_small.yaml --out reports/dsv3_small")


@pytest.fixture(scope="module")
def result() -> CaseResult:
    return make_result()


@pytest.fixture(scope="module")
def html(result) -> str:
    return report.render_html(result)


# ---------------------------------------------------------------------------------------------- json

def test_summary_dict_schema_and_values(result):
    s = report.summary_dict(result)
    assert {"case", "baseline", "elapsed_s", "variants"} <= set(s)
    assert set(s) <= {"case", "baseline", "elapsed_s", "variants", "all_pass", "cross_implementation", "golden",
                      "megatron_sources", "agreement", "environment"}
    assert s["agreement"] == {}         # not computed (harness.judging.agreement; tests/test_agreement.py)
    assert s["case"] == "dsv3_small"
    assert s["baseline"] == "baseline"
    assert s["elapsed_s"] == 66.75
    assert [v["name"] for v in s["variants"]] == ["baseline", "pp2_vpp2", "pp4_mtp", MARKUP_NAME]

    required = {"name": str, "layout": str, "pp": int, "vpp": int, "mtp_standalone": bool,
                "expect": str, "verdict": str}
    for v in s["variants"]:
        assert set(required) | {"bitwise_equal", "first_divergence"} <= set(v)
        assert {"reason", "elapsed_s", "compare_to", "reductions", "clip_grad", "bubble_fraction"} <= set(v)
        for key, typ in required.items():
            assert type(v[key]) is typ, (key, v[key])
        assert v["verdict"] in ("pass", "fail", "error")
        assert v["outcome"] in ("", "reference", "equal", "differs only where allowed", "differs as expected",
                                "unexpected difference", "unexpectedly equal", "not finite", "error")
        assert v["bitwise_equal"] is None or type(v["bitwise_equal"]) is bool
        fd = v["first_divergence"]
        if fd is not None:
            assert set(fd) == {"step", "kind", "microbatch", "name", "ulp", "canonical"}
            assert type(fd["step"]) is int and fd["kind"] in ("loss", "grad", "grad_norm", "param")

    base, ok, bad, err = s["variants"]
    assert (base["verdict"], ok["verdict"], bad["verdict"], err["verdict"]) == ("pass", "pass", "fail", "error")
    assert (ok["pp"], ok["vpp"], bad["pp"], bad["mtp_standalone"]) == (2, 2, 4, True)
    assert bad["bitwise_equal"] is False and err["bitwise_equal"] is None and ok["bitwise_equal"] is True
    assert ok["first_divergence"] is None and err["first_divergence"] is None
    assert bad["first_divergence"] == {"step": 0, "kind": "grad", "microbatch": None,
                                       "name": "embedding.word_embeddings.weight", "ulp": None, "canonical": None}
    assert bad["reason"] == "grads differ from baseline at step 0"
    assert bad["elapsed_s"] == 31.0
    assert s["environment"]["torch"] == "2.13.0"
    assert [v["compare_to"] for v in s["variants"]] == ["baseline", "baseline", "pp2_vpp2", "baseline"]
    assert [v["reductions"] for v in s["variants"]] == ["megatron", "megatron", "megatron", "canonical"]
    assert [v["clip_grad"] for v in s["variants"]] == [0.0, CLIP, CLIP, 0.0]
    assert [v["bubble_fraction"] for v in s["variants"]] == [0.0, 1 / 3, None, None]
    # keys added with the report package: empty defaults, links to the detail pages and Chrome traces
    assert [v["outside_signature"] for v in s["variants"]] == [[]] * 4
    assert [v["golden"] for v in s["variants"]] == [{}] * 4 and s["golden"] is None
    assert [v["detail_page"] for v in s["variants"]] == [f"runs/{d}/index.html" for d in
                                                         ("baseline", "pp2_vpp2", "pp4_mtp", "err")]
    assert [v["schedule_trace"] for v in s["variants"]] == ["runs/baseline/schedule.trace.json",
                                                            "runs/pp2_vpp2/schedule.trace.json", None,
                                                            "runs/err/schedule.trace.json"]
    # Round-trips through strict JSON.
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_summary_dict_loss_divergence_keeps_microbatch():
    r = make_result()
    r.variants[2].first_divergence = FirstDivergence(step=3, kind="loss", microbatch=1, name="mtp_1")
    fd = report.summary_dict(r)["variants"][2]["first_divergence"]
    assert fd == {"step": 3, "kind": "loss", "microbatch": 1, "name": "mtp_1", "ulp": None, "canonical": None}
    assert report.divergence_words(r.variants[2].first_divergence) == "step 3 · loss · mb 1 · mtp_1"


def test_summary_dict_grad_norm_divergence_and_unset_compare_to():
    r = make_result()
    r.variants[2].first_divergence = FirstDivergence(step=1, kind="grad_norm", microbatch=None,
                                                     name="grad norm", detail="grad norm 0x1 vs 0x2 (1 ulp)", ulp=1)
    r.variants[3].compare_to = ""       # older results: no compare_to means the baseline
    r.variants[1].clip_grad = float("nan")
    s = report.summary_dict(r)
    assert s["variants"][2]["first_divergence"] == {"step": 1, "kind": "grad_norm", "microbatch": None,
                                                    "name": "grad norm", "ulp": 1, "canonical": None}
    assert s["variants"][3]["compare_to"] == "baseline"
    assert s["variants"][1]["clip_grad"] == 0.0
    json.dumps(s, allow_nan=False)


# --------------------------------------------------------------------------------------------- junit

def test_junit_counts_and_elements(result):
    root = ET.fromstring(report.junit_xml(result).encode("utf-8"))
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    assert suite.get("name") == "dsv3_small"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "1", "1")

    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["baseline", "pp2_vpp2", "pp4_mtp", MARKUP_NAME]
    assert all(c.get("classname") == "bitparity.dsv3_small" for c in cases)
    assert [float(c.get("time")) for c in cases] == [12.5, 20.25, 31.0, 3.0]

    base, ok, bad, err = cases
    for c in (base, ok):
        assert c.find("failure") is None and c.find("error") is None
    failure = bad.find("failure")
    assert failure is not None and bad.find("error") is None
    assert failure.get("message") == "grads differ from baseline at step 0"
    assert "step 0 · grad · embedding.word_embeddings.weight" in failure.text
    assert FAIL_DETAIL in failure.text
    assert "expected bitwise equality with reference run 'pp2_vpp2'" in failure.text
    assert "reductions: megatron · clip_grad: 0.05 · compared with: pp2_vpp2" in failure.text

    error = err.find("error")
    assert error is not None and err.find("failure") is None
    assert error.get("message") == "rank 1 exited with code 1"
    # Error text survives, minus ANSI codes and the NUL that XML cannot carry.
    assert "RuntimeError: <boom> & co" in error.text
    assert "\x1b" not in error.text and "\x00" not in error.text


def test_junit_all_pass_has_zero_counts():
    r = make_result()
    r.variants = r.variants[:2]
    suite = ET.fromstring(report.junit_xml(r))
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "0", "0")


# ------------------------------------------------------------------------------------------ markdown

def test_markdown_summary(result):
    md = report.markdown_summary(result, report_link="reports/dsv3_small/index.html")
    lines = md.splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + 4  # header, separator, one row per variant
    assert "variant" in table[0] and "first divergence" in table[0]
    assert "| P | V | reductions | clip | expect |" in table[0]
    # Every row has the same number of unescaped cell separators (names with `|` must not break it).
    seps = {len(re.findall(r"(?<!\\)\|", ln)) for ln in table}
    assert seps == {10}
    fail_row = next(ln for ln in table if "pp4" in ln)
    assert "fail" in fail_row and "step 0 · grad · embedding.word" in fail_row
    assert "| 4 | 1 | megatron | 0.05 | bitwise |" in fail_row
    base_row = next(ln for ln in table if "(baseline)" in ln)
    assert "| 1 | 1 | megatron | off | bitwise |" in base_row
    err_row = next(ln for ln in table if "&lt;b&gt;" in ln)
    assert "| canonical | off |" in err_row
    assert "[Full report](reports/dsv3_small/index.html)" in md
    assert "<b>" not in md and "&lt;b&gt;x&lt;/b&gt;" in md
    assert "FAIL" in lines[0]


# ---------------------------------------------------------------------------------------------- html

def _runs_rows(html: str) -> list[tuple[str, str]]:
    """(tr class, row html) of the "All runs" list."""
    body = re.search(r'<table class="runs">(.*?)</table>', html, re.S).group(1).split("<tbody>", 1)[1]
    return re.findall(r'<tr class="([^"]*)">(.*?)</tr>', body, re.S)


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


def _matrix(html: str) -> str:
    return re.search(r'<table class="vmatrix">(.*?)</table>', html, re.S).group(1)


def _matrix_cells(html: str) -> list[dict]:
    """Every run cell of the verdict matrix: its row, column, classes, link, tooltip and run name."""
    out = []
    body = _matrix(html).split("<tbody>", 1)[1]
    for r, tr in enumerate(re.findall(r"<tr>(.*?)</tr>", body, re.S)):
        for c, td in enumerate(re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)):
            for cls, href, title, run in re.findall(
                    r'<a class="vcell ([^"]*)" href="([^"]*)" title="([^"]*)" data-run="([^"]*)">', td):
                out.append({"row": r, "col": c, "cls": cls.split(), "href": href, "title": title, "run": run})
    return out


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


# --------------------------------------------------------------------------------------------- files

def _files(root: pathlib.Path) -> dict:
    """{relative path: bytes} of every file under root (hidden temp files included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


RUN_FILES = {f"runs/{d}/{f}" for d in ("baseline", "pp2_vpp2", "pp4_mtp", "err") for f in
             ("index.html", "schedule.trace.json")} - {"runs/pp4_mtp/schedule.trace.json"}   # no timeline


def test_write_report_files_atomic(tmp_path, result):
    out = tmp_path / "nested" / "report"
    paths = report.write_report(result, out)
    top = {"index.html", "summary.json", "junit.xml", "summary.md"}
    assert set(paths) == top | RUN_FILES
    assert set(_files(out)) == top | RUN_FILES
    for name, p in paths.items():
        assert p == out / name and p.stat().st_size > 0
    assert json.loads(paths["summary.json"].read_text()) == report.summary_dict(result)
    ET.parse(paths["junit.xml"])
    assert paths["index.html"].read_text(encoding="utf-8") == report.render_html(result)
    assert paths["runs/pp2_vpp2/index.html"].read_text(encoding="utf-8") == report.render_run_page(result, 1)
    # every link of the page to a run file points at a written file
    html = paths["index.html"].read_text(encoding="utf-8")
    for link in set(re.findall(r'href="(runs/[^"#]+)', html)):
        assert (out / link).is_file() or (out / link).is_dir(), link

    # Rewriting over an existing report replaces the files and still leaves no temp files.
    result2 = make_result()
    result2.case = "second"
    report.write_report(result2, out)
    assert set(_files(out)) == top | RUN_FILES
    assert json.loads((out / "summary.json").read_text())["case"] == "second"


def test_write_report_failure_leaves_no_temp_files(tmp_path, monkeypatch, result):
    out = tmp_path / "r"
    report.write_report(result, out)
    before = _files(out)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(writer.os, "replace", boom)
    r2 = make_result()
    r2.case = "other"
    with pytest.raises(OSError, match="disk full"):
        report.write_report(r2, out)
    assert _files(out) == before


# ------------------------------------------------------------------------ matrix: reductions, clip, ref

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


# ------------------------------------------------------------------------------ grad norm & clipping

def _gradnorm_section(html: str) -> str:
    return html.split('<section id="gradnorm">', 1)[1].split("</section>", 1)[0]


def _gradnorm_rows(table: str) -> list[list[tuple[str, str]]]:
    body = table.split("<tbody>", 1)[1]
    return [re.findall(r'<td class="([^"]*)"[^>]*>(.*?)</td>', tr, re.S)
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


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


# --------------------------------------------------------------------------------- schedule timeline

SVG_NS = "{http://www.w3.org/2000/svg}"


def _svg_rects(svg: str, kind: str) -> list[ET.Element]:
    root = ET.fromstring(svg)  # well-formed XML
    return [e for e in root.iter(f"{SVG_NS}rect") if e.get("class", "").split()[:1] == [kind]]


def _variant(**kw) -> VariantResult:
    base = dict(name="v", layout="L", pp=2, vpp=1, mtp_standalone=False, expect="bitwise", verdict="pass",
                bitwise_equal=True, first_divergence=None)
    base.update(kw)
    return VariantResult(**base)


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


# -------------------------------------------------------------- structural checks: inventory, replicas

INV_LINES = ["output_layer.weight: weight_decay True (baseline) vs False",
             "decoder.layers.0.<mlp>.weight: only in the baseline"]
REPLICA = "embedding.word_embeddings.weight@mtp"
BROKEN_DETAIL = f"{REPLICA}: gradient at step 1 0xaaaa vs 0xbbbb of embedding.word_embeddings.weight"


def make_structural_result() -> CaseResult:
    """make_result() with structural checks: consistent replicas in the baseline and pp2_vpp2, an inventory
    difference (first divergence kind inventory) in pp4_mtp and a broken replica in a fifth variant; the
    errored variant has no replica status."""
    r = make_result()
    base, ok, bad, err = r.variants
    consistent = {"consistent": True, "first_broken_step": None, "replicas": [REPLICA],
                  "detail": "1 replica(s) match their originals at init and after all 3 steps"}
    base.replica_status = dict(consistent)
    ok.replica_status = {"consistent": True, "first_broken_step": None, "replicas": [],
                         "detail": "no replicas in this run"}
    bad.inventory = list(INV_LINES)
    bad.first_divergence = FirstDivergence(step=0, kind="inventory", microbatch=None, name="output_layer.weight",
                                           detail="parameter inventory differs (2): " + "; ".join(INV_LINES))
    bad.reason = f"parameter inventory differs from pp2_vpp2 (2): {INV_LINES[0]}"
    bad.replica_status = dict(consistent)
    err.replica_status = {}
    drift = VariantResult(
        name="drift", layout="E|t|t|L", pp=4, vpp=1, mtp_standalone=True, expect="bitwise", verdict="fail",
        bitwise_equal=False, first_divergence=FirstDivergence(step=1, kind="grad", microbatch=None,
                                                              name="embedding.word_embeddings.weight"),
        reason=f"expected bitwise equality; replica inconsistent from step 1: {BROKEN_DETAIL}",
        series=_series(BASE_LOSSES), compare_to="baseline", run_dir="runs/drift",
        replica_status={"consistent": False, "first_broken_step": 1, "replicas": [REPLICA, "x.weight@mtp"],
                        "detail": BROKEN_DETAIL})
    r.variants.append(drift)
    return r


def _cards(html: str) -> list[str]:
    return re.split(r'<div class="variant \w+" id="card-[\w-]+">', html.split('<section id="variants">', 1)[1])[1:]


def _structural_block(card: str) -> str:
    assert card.count("<h4>Structural checks</h4>") == 1
    return card.split("<h4>Structural checks</h4>", 1)[1].split("</dl>", 1)[0]


def _dd(block: str, cls: str) -> str:
    return re.search(rf'<dd class="{cls}[^"]*">(.*?)</dd>', block, re.S).group(1)


def test_divergence_words_inventory_is_before_training():
    fd = FirstDivergence(step=0, kind="inventory", microbatch=None, name="output_layer.weight")
    assert report.divergence_words(fd) == "before training · inventory · output_layer.weight"
    # other kinds keep their step
    assert report.divergence_words(FirstDivergence(0, "grad", None, "w")) == "step 0 · grad · w"
    r = make_structural_result()
    md_row = next(ln for ln in report.markdown_summary(r).splitlines() if ln.startswith("| pp4\\_mtp"))
    assert "before training · inventory · output\\_layer.weight" in md_row
    fail_row = _runs_rows(report.render_html(r))[2][1]
    assert "before training · inventory · output_layer.weight" in fail_row and "step 0 · inventory" not in fail_row


def test_summary_json_inventory_and_replica_status():
    r = make_structural_result()
    s = report.summary_dict(r)
    for v in s["variants"]:
        assert type(v["inventory"]) is list and type(v["replica_status"]) is dict
    base, ok, bad, err, drift = s["variants"]
    assert bad["inventory"] == INV_LINES
    assert base["inventory"] == ok["inventory"] == err["inventory"] == drift["inventory"] == []
    assert bad["first_divergence"] == {"step": 0, "kind": "inventory", "microbatch": None,
                                       "name": "output_layer.weight", "ulp": None, "canonical": None}
    assert base["replica_status"] == {"consistent": True, "first_broken_step": None, "replicas": [REPLICA],
                                      "detail": "1 replica(s) match their originals at init and after all 3 steps"}
    assert ok["replica_status"]["replicas"] == []
    assert err["replica_status"] == {}
    assert drift["replica_status"] == {"consistent": False, "first_broken_step": 1,
                                       "replicas": [REPLICA, "x.weight@mtp"], "detail": BROKEN_DETAIL}
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    # defaults (older producers): empty list and dict
    plain = report.summary_dict(make_result())["variants"]
    assert all(v["inventory"] == [] and v["replica_status"] == {} for v in plain)


def test_junit_failure_text_has_inventory_and_replicas_when_present():
    r = make_structural_result()
    suite = ET.fromstring(report.junit_xml(r)).find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    bad = cases["pp4_mtp"].find("failure").text
    assert "first divergence: before training · inventory · output_layer.weight" in bad
    assert "parameter inventory differs from reference run 'pp2_vpp2' (2 parameters):" in bad
    for line in INV_LINES:
        assert f"\n  {line}\n" in bad
    assert "replica consistency: consistent · 1 replica(s) match" in bad
    assert f"  replicas: {REPLICA}" in bad
    drift = cases["drift"].find("failure").text
    assert f"replica consistency: broken at step 1 · {BROKEN_DETAIL}" in drift
    assert f"  replicas: {REPLICA}, x.weight@mtp" in drift
    assert "parameter inventory" not in drift
    # nothing structural to say: no lines (make_result has neither inventory nor replica status)
    plain = ET.fromstring(report.junit_xml(make_result())).find("testsuite")
    text = [c for c in plain.findall("testcase") if c.get("name") == "pp4_mtp"][0].find("failure").text
    assert "parameter inventory" not in text and "replica" not in text


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


def _write_trace(report_dir: pathlib.Path, run_dir: str, n: int, replicas: int = 1) -> None:
    params = {f"p{i}.weight": {"name": f"p{i}.weight", "replica": None} for i in range(n)}
    params.update({f"p{i}.weight@mtp": {"name": f"p{i}.weight", "replica": "mtp"} for i in range(replicas)})
    (report_dir / run_dir).mkdir(parents=True, exist_ok=True)
    (report_dir / run_dir / "trace.json").write_text(json.dumps({"format": "t", "params": params}))


def test_parameter_count_from_the_run_traces(tmp_path):
    r = make_structural_result()
    _write_trace(tmp_path, "runs/baseline", 130)
    _write_trace(tmp_path, "runs/pp2_vpp2", 130, replicas=0)
    (tmp_path / "runs/pp4_mtp").mkdir(parents=True)
    (tmp_path / "runs/pp4_mtp/trace.json").write_text("{not json")
    base, ok, bad = r.variants[:3]
    assert report.parameter_count(base, tmp_path) == 130       # the replica is not counted
    assert report.parameter_count(ok, tmp_path) == 130
    assert report.parameter_count(bad, tmp_path) is None       # unreadable trace
    assert report.parameter_count(ok, None) is None
    outside = tmp_path / "elsewhere"
    _write_trace(tmp_path, "elsewhere/run", 5)
    escaped = _variant(run_dir="../elsewhere/run")
    assert report.parameter_count(escaped, tmp_path / "report") is None   # not inside the report directory
    assert report.parameter_count(_variant(run_dir=str(outside / "run")), tmp_path) is None  # absolute path

    paths = report.write_report(r, tmp_path)
    cards = _cards(paths["index.html"].read_text(encoding="utf-8"))
    assert "reference run (130 parameters)" in _dd(_structural_block(cards[0]), "inventory-check")
    inv_ok = _dd(_structural_block(cards[1]), "inventory-check")
    assert re.search(r'<span class="struct-ok">matches the reference</span> \(130 parameters\)', inv_ok)
    # rendered without the report directory the count is left out
    assert "130 parameters" not in report.render_html(r)


# ------------------------------------------------------- ULP evidence, run-to-run control, heatmap

EVIDENCE_KEY = "decoder.layers.0.<mlp>.weight"
P1_GRAD = {"key": "embedding.word_embeddings.weight", "what": "grad", "dtype": "float32", "numel": 8192,
           "differing": 289, "fraction": 0.0352783203125, "max_ulp": 40, "median_ulp": 1.0,
           "histogram": [[1, 228], [2, 31], [4, 10], [8, 12], [16, 4], [64, 4]],
           "max_abs_err": 2.9802322387695312e-08, "max_rel_err": 3.794539354306005e-06, "nan_mismatch": 0}
WIDE_PARAM = {"key": EVIDENCE_KEY, "what": "param", "dtype": "bfloat16", "numel": 512, "differing": 9,
              "fraction": 9 / 512, "max_ulp": 2 ** 30, "median_ulp": 2.5,
              "histogram": [[1, 3], [2 ** 16, 2], [2 ** 24, 1], [None, 1]],
              "max_abs_err": 1.5, "max_rel_err": float("inf"), "nan_mismatch": 2}
NONDET = {"runs": 2, "deterministic": False,
          "first_divergence": {"step": 1, "kind": "grad", "microbatch": None, "name": "x.<w>",
                               "detail": "grad fingerprint aa vs bb"},
          "detail": "repeat 2 differs from run 1: step 1 grad x.<w>"}
EVIDENCE_ERROR = "rank 0 exited with code 1: <dump> & friends"
ULP_LABELS = ["≤1", "≤2", "≤4", "≤8", "≤16", "≤64", "≤256", "≤1024", "≤2^16", "≤2^24", ">2^24"]


def make_evidence_result() -> CaseResult:
    """make_result() with ULP evidence on pp4_mtp (two tensors), an evidence error on the errored variant, a
    deterministic run-to-run control on pp2_vpp2 and a nondeterministic fifth variant."""
    r = make_result()
    base, ok, bad, err = r.variants
    bad.ulp_evidence = [dict(P1_GRAD), dict(WIDE_PARAM)]
    err.evidence_error = EVIDENCE_ERROR
    ok.run_to_run = {"runs": 3, "deterministic": True, "first_divergence": None, "detail": "3 runs bitwise equal"}
    flaky = _variant(name="flaky", verdict="fail", bitwise_equal=False, compare_to="baseline", run_dir="runs/flaky",
                     reason="run-to-run nondeterminism: " + NONDET["detail"], run_to_run=dict(NONDET),
                     family_mismatches={"grad": [{}, {}], "param": [{}, {}]})
    r.variants.append(flaky)
    return r


def _svg_in(html: str, cls: str) -> list[str]:
    return re.findall(rf'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}".*?</svg>', html, re.S)


def _fill_luminance(fill: str) -> float:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


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


ULP_HEAD = '<h2 id="ulp-evidence">ULP evidence</h2>'


def _pages(r: CaseResult) -> list[str]:
    """The detail page of every variant of `r`."""
    return [report.render_run_page(r, i) for i in range(len(r.variants))]


def _ulp_block(page: str) -> str:
    assert page.count(ULP_HEAD) == 1
    return page.split(ULP_HEAD, 1)[1].split("<h2", 1)[0]


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


def _r2r_block(card: str) -> Optional[str]:
    m = re.search(r'<div class="run-to-run (\w+)">(.*?)</div>', card, re.S)
    return None if m is None else m.groups()


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


def _heat_cells(svg: str) -> dict:
    root = ET.fromstring(svg)
    out = {}
    for e in root.iter(f"{SVG_NS}rect"):
        if e.get("class", "").split()[:1] == ["hm-cell"]:
            out[e.find(f"{SVG_NS}title").text] = e
    return out


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


def test_outcome_words_reach_markdown_html_and_summary_json():
    """The verdict says whether the expectation held; the outcome words say what happened (may_diverge)."""
    r = make_result()
    r.variants[1].expect, r.variants[1].outcome = "may_diverge", "differs only where allowed"
    r.variants[1].reason = "differs only where allowed: grad norm, step 1, 1 ULP"
    row = next(ln for ln in report.markdown_summary(r).splitlines() if "vpp2" in ln)
    assert "| may\\_diverge |" in row and "pass differs only where allowed |" in row
    assert report.summary_dict(r)["variants"][1]["outcome"] == "differs only where allowed"
    html = report.render_html(r)
    assert "differs only where allowed" in html and "or a first divergence only where allowed" in html


# ------------------------------------------------- at scale: a dsv3-shaped case (32 runs, real schedules)

DSV3_LAYOUTS = {"pp16-vpp2-mtp-standalone": ("Et*3|(tt|)*29,m|L", 16),
                "pp16-vpp2-mtp-with-loss": ("Et*2|(tt|)*29,t|mL", 16),
                "pp8-vpp4-mtp-standalone": ("Et*3|(tt|)*29,m|L", 8),
                "pp2-1f1b-mtp-with-loss": ("Et*30|t*31mL", 2),
                "pp1-no-pipelining": ("Et*61mL", 1)}
L_BASE, L_P1, L_CLIP, L_CLIP_PP8, L_CLIP_PP2, L_CLIP_PP1, L_CANON_CLIP, L_EP_CLIP, L_BROKEN = (
    [5.5452, 5.5391, 5.5337], [5.5452, 5.5391003, 5.5337005], [5.5452, 5.5389, 5.5331],
    [5.5452, 5.5389, 5.5331004], [5.5452, 5.5389, 5.5331008], [5.5452, 5.5389002, 5.533101],
    [5.5452, 5.5389001, 5.5331002], [5.5452, 5.5389, 5.5331006], [5.5452, 5.5391, 5.5349])
FAILING_RUN = "ep2/pp2-1f1b-mtp-with-loss"
ERRORED_RUN = "ep2/overlap/pp16-vpp2-mtp-with-loss"
OUTSIDE = ["step 1 grad decoder.layers.40.mlp.experts.3.linear_fc1.weight",
           "step 1 grad decoder.layers.40.mlp.experts.3.linear_fc2.weight", "step 2 param <all> … and 812 more"]
CANONICAL_LINE = "step 1 grad decoder.layers.3.mlp.router.weight: 0x3c23d70a vs 0x3c23d70b"
# EP=2 replicates every parameter but the routed experts on the second EP rank: hundreds of replica keys
EP_REPLICAS = [f"decoder.layers.{i}.self_attention.linear_proj.weight@ep1" for i in range(200)]

# (name, layout, options, compare_to, expect, outcome, first divergence (step, kind, name) or None, losses)
DSV3_RUNS = [
    ("pp16-vpp2-mtp-standalone", "pp16-vpp2-mtp-standalone", {}, "", "bitwise", "reference", None, L_BASE),
    ("pp16-vpp2-mtp-with-loss", "pp16-vpp2-mtp-with-loss", {}, "", "bitwise", "equal", None, L_BASE),
    ("pp8-vpp4-mtp-standalone", "pp8-vpp4-mtp-standalone", {}, "", "bitwise", "equal", None, L_BASE),
    ("pp2-1f1b-mtp-with-loss", "pp2-1f1b-mtp-with-loss", {}, "", "bitwise", "equal", None, L_BASE),
    ("pp1-no-pipelining", "pp1-no-pipelining", {}, "", "may_diverge", "differs only where allowed",
     (1, "grad", "embedding.word_embeddings.weight"), L_P1),
]
_CLIP_REF = "clip/pp16-vpp2-mtp-standalone"
for _lay, _fd, _loss in (("pp16-vpp2-mtp-standalone", (0, "param", "decoder.layers.0.mlp.linear_fc1.weight"), L_CLIP),
                         ("pp16-vpp2-mtp-with-loss", None, L_CLIP),
                         ("pp8-vpp4-mtp-standalone", (1, "grad_norm", "grad norm"), L_CLIP_PP8),
                         ("pp2-1f1b-mtp-with-loss", (1, "grad_norm", "grad norm"), L_CLIP_PP2),
                         ("pp1-no-pipelining", (1, "grad", "embedding.word_embeddings.weight"), L_CLIP_PP1)):
    DSV3_RUNS.append((f"clip/{_lay}", _lay, {"clip_grad": 0.05}, "" if _fd and _fd[1] == "param" else _CLIP_REF,
                      "may_diverge", "equal" if _fd is None else "differs only where allowed", _fd, _loss))
for _lay in DSV3_LAYOUTS:
    DSV3_RUNS.append((f"canonical/{_lay}", _lay, {"reductions": "canonical"}, "", "bitwise", "equal", None, L_BASE))
for _lay in DSV3_LAYOUTS:
    _first = _lay == "pp16-vpp2-mtp-standalone"
    DSV3_RUNS.append((f"canonical-clip/{_lay}", _lay, {"reductions": "canonical", "clip_grad": 0.05},
                      _CLIP_REF if _first else "canonical-clip/pp16-vpp2-mtp-standalone",
                      "diverge" if _first else "bitwise", "differs as expected" if _first else "equal",
                      (0, "grad_norm", "grad norm") if _first else None, L_CANON_CLIP))
for _lay in ("pp16-vpp2-mtp-standalone", "pp16-vpp2-mtp-with-loss", "pp8-vpp4-mtp-standalone", "pp1-no-pipelining"):
    DSV3_RUNS.append((f"overlap/{_lay}", _lay, {"overlap": True, "delay": _lay != "pp8-vpp4-mtp-standalone"},
                      "" if _lay == "pp16-vpp2-mtp-standalone" else _lay, "bitwise", "equal", None,
                      L_P1 if _lay == "pp1-no-pipelining" else L_BASE))
DSV3_RUNS += [
    ("ep2/pp16-vpp2-mtp-standalone", "pp16-vpp2-mtp-standalone", {"ep": 2}, "", "bitwise", "equal", None, L_BASE),
    (FAILING_RUN, "pp2-1f1b-mtp-with-loss", {"ep": 2}, "pp2-1f1b-mtp-with-loss", "bitwise", "unexpected difference",
     (1, "grad", "decoder.layers.40.mlp.experts.3.linear_fc1.weight"), L_BROKEN),
    ("ep2/canonical-clip/pp8-vpp4-mtp-standalone", "pp8-vpp4-mtp-standalone",
     {"ep": 2, "reductions": "canonical", "clip_grad": 0.05}, "canonical-clip/pp8-vpp4-mtp-standalone", "bitwise",
     "equal", None, L_CANON_CLIP),
    ("ep2/canonical-clip/pp16-vpp2-mtp-with-loss", "pp16-vpp2-mtp-with-loss",
     {"ep": 2, "reductions": "canonical", "clip_grad": 0.05}, "canonical-clip/pp16-vpp2-mtp-with-loss", "bitwise",
     "equal", None, L_CANON_CLIP),
    (ERRORED_RUN, "pp16-vpp2-mtp-with-loss", {"ep": 2, "overlap": True, "delay": True},
     "overlap/pp16-vpp2-mtp-with-loss", "bitwise", "error", None, None),
    # three more than cases/dsv3.yaml, so the fixture has 30+ runs and two more option groups
    ("ep2/clip/pp8-vpp4-mtp-standalone", "pp8-vpp4-mtp-standalone", {"ep": 2, "clip_grad": 0.05},
     "clip/pp8-vpp4-mtp-standalone", "may_diverge", "differs only where allowed", (1, "grad_norm", "grad norm"),
     L_EP_CLIP),
    ("ep2/canonical/pp1-no-pipelining", "pp1-no-pipelining", {"ep": 2, "reductions": "canonical"},
     "canonical/pp1-no-pipelining", "bitwise", "equal", None, L_BASE),
    ("ep2/canonical/pp2-1f1b-mtp-with-loss", "pp2-1f1b-mtp-with-loss", {"ep": 2, "reductions": "canonical"},
     "canonical/pp2-1f1b-mtp-with-loss", "bitwise", "equal", None, L_BASE),
]


def _dsv3_timeline(layout_key: str, overlap: bool) -> list[dict]:
    from dataclasses import asdict

    from trainerkit.layout import PipelineLayout
    from trainerkit.schedule import build_schedule, timeline
    text, pp = DSV3_LAYOUTS[layout_key]
    layout = PipelineLayout.from_string(text, pp, 61, 1)
    cells, _ = timeline(build_schedule(layout, 16, 16, 1, 32, overlap))
    return [asdict(c) for c in cells]


def make_dsv3_like() -> CaseResult:
    """cases/dsv3.yaml's 29 runs plus three (32), with the real P x V x microbatch schedules, nine groups of
    bitwise-identical loss curves, one unexpected difference (outside its signature, with ULP evidence and a
    canonical-order line), one error and one golden comparison that differs."""
    timelines: dict = {}
    variants = []
    for name, lay, opts, ref, expect, outcome, fd, losses in DSV3_RUNS:
        text, pp = DSV3_LAYOUTS[lay]
        overlap = bool(opts.get("overlap"))
        key = (lay, overlap)
        if key not in timelines:
            timelines[key] = _dsv3_timeline(lay, overlap)
        verdict = {"error": "error", "unexpected difference": "fail"}.get(outcome, "pass")
        first = None if fd is None else FirstDivergence(step=fd[0], kind=fd[1], microbatch=None, name=fd[2],
                                                         detail=f"{fd[1]} bits differ at step {fd[0]}")
        v = VariantResult(
            name=name, layout=text, pp=pp, vpp=(4 if pp == 8 else 2 if pp == 16 else 1),
            mtp_standalone="standalone" in lay, expect=expect, verdict=verdict,
            bitwise_equal=None if verdict == "error" else fd is None, first_divergence=first,
            reason={"error": "rank 3 exited with code 1: RuntimeError: boom"}.get(outcome, outcome),
            error="Traceback ...\nRuntimeError: boom" if verdict == "error" else None,
            layout_grid="\n".join(f"rank {r}: ..." for r in range(pp)),
            options={k: val for k, val in opts.items() if k in ("clip_grad", "reductions")},
            series=_series(losses) if losses else StepSeries(), elapsed_s=20.0 + len(variants),
            run_dir="runs/" + re.sub(r"[^A-Za-z0-9._-]+", "_", name), compare_to=ref or DSV3_RUNS[0][0],
            reductions=opts.get("reductions", "megatron"), clip_grad=opts.get("clip_grad", 0.0),
            timeline=timelines[key], bubble_fraction=0.25, expert_model_parallel_size=opts.get("ep", 1),
            overlap=overlap, delay_wgrad=bool(opts.get("delay")), outcome=outcome,
            command=f"bitparity verify cases/dsv3.yaml --only {name}",
            family_mismatches={} if verdict == "error" else {
                "grad": [{}, {"experts": 3 if fd else 0}, {"experts": 40 if fd else 0}],
                "param": [{}, {"experts": 2 if fd else 0}, {"experts": 812 if fd else 0}]},
            replica_status={} if verdict == "error" else {"consistent": True, "first_broken_step": None,
                                                          "replicas": [REPLICA] + EP_REPLICAS * ("ep" in opts),
                                                          "detail": "ok"})
        variants.append(v)
    by_name = {v.name: v for v in variants}
    bad = by_name[FAILING_RUN]
    bad.outside_signature = list(OUTSIDE)
    bad.first_divergence.canonical = CANONICAL_LINE
    bad.ulp_evidence = [dict(P1_GRAD), dict(WIDE_PARAM)]
    by_name["ep2/canonical/pp1-no-pipelining"].golden = {
        "status": "differs", "first_divergence": {"step": 2, "kind": "param", "name": "output_layer.weight"},
        "detail": "param bits differ from the golden trace"}
    return CaseResult(case="dsv3", case_path="cases/dsv3.yaml", baseline=DSV3_RUNS[0][0], variants=variants,
                      elapsed_s=565.0, environment={"torch": "2.13.0", "threads": 1},
                      command="bitparity verify cases/dsv3.yaml",
                      golden={"dir": "golden/dsv3", "environment": "same", "verdict": "fail"})


@pytest.fixture(scope="module")
def dsv3() -> CaseResult:
    return make_dsv3_like()


def test_dsv3_matrix_is_layouts_by_option_groups(dsv3):
    html = report.render_html(dsv3)
    m = _matrix(html)
    rows = re.findall(r'<th class="row"[^>]*>(.*?)<span class="layout">', m, re.S)
    assert [r.strip() for r in rows] == ["P16 · V2 · MTP standalone", "P16 · V2 · MTP with the loss",
                                         "P8 · V4 · MTP standalone", "P2 · V1 · MTP with the loss",
                                         "P1 · no pipelining · MTP with the loss"]
    heads = [re.findall(r"<span>(.*?)</span>", h) for h in re.findall(r'<th class="col" title="[^"]*">(.*?)</th>', m,
                                                                       re.S)]
    assert heads[:4] == [["megatron", "clip off"], ["megatron", "clip 0.05"], ["canonical", "clip off"],
                         ["canonical", "clip 0.05"]]
    assert ["megatron", "clip off", "overlap + delayed wgrad"] in heads and ["megatron", "clip off", "EP 2"] in heads
    assert len(heads) == 11
    cells = _matrix_cells(html)
    assert len(cells) == len(dsv3.variants) == 32
    assert len({(c["row"], c["col"]) for c in cells}) == 32          # one run per cell
    by_run = {c["run"]: c for c in cells}
    assert by_run[FAILING_RUN]["cls"] == ["unexpected"]
    assert "first divergence: step 1 · grad · decoder.layers.40.mlp.experts.3.linear_fc1.weight" in \
        by_run[FAILING_RUN]["title"]
    assert f"in canonical order: {CANONICAL_LINE}" in by_run[FAILING_RUN]["title"]
    assert by_run[ERRORED_RUN]["cls"] == ["error"]
    assert by_run["pp16-vpp2-mtp-standalone"]["cls"] == ["reference", "is-ref"]
    assert by_run["clip/pp8-vpp4-mtp-standalone"]["cls"] == ["allowed", "is-ref"]
    assert by_run["canonical-clip/pp16-vpp2-mtp-standalone"]["cls"] == ["expected", "is-ref"]
    assert by_run["canonical/pp16-vpp2-mtp-with-loss"]["cls"] == ["equal"]
    # the golden comparison that differs is marked in its cell
    golden_cell = re.search(r'data-run="ep2/canonical/pp1-no-pipelining">(.*?)</a>', m).group(1)
    assert 'class="golden"' in golden_cell and "G≠" in golden_cell
    assert '<p class="headline golden-line small">golden trace <code>golden/dsv3</code>' in html


def test_dsv3_failing_card_shows_outside_signature_and_canonical_line(dsv3):
    html = report.render_html(dsv3)
    card = html.split('id="card-ep2-pp2-1f1b-mtp-with-loss"', 1)[1].split('<div class="variant', 1)[0]
    block = re.search(r'<div class="outside">(.*?)</div>', card, re.S).group(1)
    assert "3 differences outside the expected signature" in block
    assert re.findall(r"<li>(.*?)</li>", block) == [OUTSIDE[0], OUTSIDE[1], "step 2 param &lt;all&gt; … and 812 more"]
    fd = re.search(r'<dd class="first-divergence">(.*?)</dd>', card, re.S).group(1)
    assert fd.index("decoder.layers.40.mlp") < fd.index("in canonical order") < fd.index("decoder.layers.3.mlp.router")
    # ... and is counted in the failing run's line under the matrix
    sec = html.split('<section id="matrix">', 1)[1].split("</section>", 1)[0]
    assert ('<a class="outside-count" href="#card-ep2-pp2-1f1b-mtp-with-loss">3 differences outside the expected '
            'signature</a>') in sec
    # outside the signature shows above the structural checks, the golden status in the card it belongs to
    assert card.index('<div class="outside">') < card.index("<h4>Structural checks</h4>")
    golden_card = html.split('id="card-ep2-canonical-pp1-no-pipelining"', 1)[1].split('<div class="variant', 1)[0]
    assert re.search(r'<dd class="golden-status golden-differs">differs · step 2 · param · output_layer.weight',
                     golden_card)
    # the run list repeats the canonical line; summary.md and summary.json carry both
    assert f"in canonical order: <span class=\"mono\">{CANONICAL_LINE}</span>" in html
    md = report.markdown_summary(dsv3)
    assert f"- ep2/pp2-1f1b-mtp-with-loss: {report.md_cell(CANONICAL_LINE)}" in md
    assert "**ep2/pp2-1f1b-mtp-with-loss**: 3 differences outside the expected signature:" in md
    assert "Golden trace golden/dsv3: ❌ fail · environment same" in md
    assert "- ep2/canonical/pp1-no-pipelining: differs · step 2 · param · output\\_layer.weight" in md
    s = report.summary_dict(dsv3)
    bad = next(v for v in s["variants"] if v["name"] == FAILING_RUN)
    assert bad["outside_signature"] == OUTSIDE and bad["first_divergence"]["canonical"] == CANONICAL_LINE
    assert s["golden"] == {"dir": "golden/dsv3", "environment": "same", "verdict": "fail"}
    junit = ET.fromstring(report.junit_xml(dsv3))
    text = next(c for c in junit.iter("testcase") if c.get("name") == FAILING_RUN).find("failure").text
    assert "differences outside the expected signature (3):" in text and f"in canonical order: {CANONICAL_LINE}" in text


def test_dsv3_loss_curves_grouped_by_identical_bits(dsv3):
    groups = report.loss_groups(dsv3)
    sizes = [len(g["members"]) for g in groups]
    assert len(groups) == 9 and sum(sizes) == 31                      # the errored run has no losses
    assert groups[0]["label"] == f"{sizes[0]} runs, bitwise identical" and sizes[0] == 15
    assert groups[0]["members"][0].name == dsv3.baseline
    svg = report.loss_curves_svg(dsv3)
    root = ET.fromstring(svg)
    curves = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "loss-group"]
    assert len(curves) == 9                                           # each group drawn once
    legend = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "legend-item"]
    assert [g.find(f"{SVG_NS}text").text for g in legend][:2] == ["15 runs, bitwise identical", "2 runs, bitwise identical"]
    # the legend lies below the axes: no legend text above the plot's bottom edge
    axis_y = max(float(line.get("y1")) for line in root.iter(f"{SVG_NS}line") if line.get("stroke") == "#8c959f")
    assert min(float(g.find(f"{SVG_NS}text").get("y")) for g in legend) > axis_y + 20
    assert report.loss_curves_svg(dsv3) == svg
    html = report.render_html(dsv3)
    items = re.findall(r"<li><span class=\"swatch\"[^>]*></span><strong>(.*?)</strong>", html)
    assert items[0] == "15 runs, bitwise identical" and len(items) == 9


def test_dsv3_report_size_and_detail_pages(tmp_path, dsv3):
    paths = report.write_report(dsv3, tmp_path)
    size = paths["index.html"].stat().st_size
    print(f"\ndsv3-shaped index.html: {size} bytes ({len(dsv3.variants)} runs)")
    assert size < 500_000                                              # the issue asks < 2 MB
    html = paths["index.html"].read_text(encoding="utf-8")
    assert html.count("<svg") == 1                                     # the loss chart; the rest on detail pages
    detail = tmp_path / "runs" / "pp16-vpp2-mtp-standalone" / "index.html"
    assert detail.is_file() and 'class="timeline-svg"' in detail.read_text(encoding="utf-8")
    # hundreds of replica keys: a few in the card, all of them on the detail page
    card = html.split('id="card-ep2-pp16-vpp2-mtp-standalone"', 1)[1].split('<div class="variant', 1)[0]
    assert len(re.findall(r'<li class="mono">', card)) == 8 and "… and 193 more" in card
    assert '<a href="runs/ep2_pp16-vpp2-mtp-standalone/index.html#replicas">all replica keys</a>' in card
    page = (tmp_path / "runs" / "ep2_pp16-vpp2-mtp-standalone" / "index.html").read_text(encoding="utf-8")
    assert '<h2 id="replicas">Replica keys (201)</h2>' in page
    # every link to a run file exists
    for link in set(re.findall(r'href="(runs/[^"#]+)', html)):
        assert (tmp_path / link).exists(), link


def test_dsv3_chrome_trace_files(tmp_path, dsv3):
    paths = report.write_report(dsv3, tmp_path)
    for i, v in enumerate(dsv3.variants):
        rel = f"{v.run_dir}/schedule.trace.json"
        trace = json.loads(paths[rel].read_text())
        events = trace["traceEvents"]
        xs = [e for e in events if e["ph"] == "X"]
        assert len(xs) == len(v.timeline)                              # one per compute action
        names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        assert names == {f"pp rank {r}" for r in range(v.pp)}
        assert trace["otherData"]["measured"] is False
    trace = json.loads(paths["runs/pp16-vpp2-mtp-standalone/schedule.trace.json"].read_text())
    first = min((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: (e["pid"], e["ts"]))
    assert first["name"] == "F mb0 s0" and first["ts"] == 0 and first["dur"] == 1000 and first["tid"] == 0
    overlap = json.loads(paths["runs/overlap_pp16-vpp2-mtp-standalone/schedule.trace.json"].read_text())
    assert any(" + B mb" in e["name"] for e in overlap["traceEvents"] if e["ph"] == "X")


def test_chrome_trace_adds_measured_times_when_the_trace_has_them(tmp_path, result):
    v = result.variants[1]
    run_trace = {"steps": [{"actions": {"0": [{"op": "F", "stage": 0, "microbatch": 0, "start_s": 0.0,
                                               "end_s": 0.002}],
                                        "1": [{"op": "B", "stage": 1, "microbatch": 0, "start_s": 0.001,
                                               "end_s": 0.004}, {"op": "F", "stage": "x"}]}},
                           {"actions": {"0": [{"op": "F", "stage": 0, "microbatch": 1, "start_s": 0.0,
                                               "end_s": 0.001}]}}]}
    trace = report.chrome_trace(v, run_trace)
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000]
    assert [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in measured] == [
        (1000, 0, "F mb0 s0", 0.0, 2000.0), (1001, 0, "B mb0 s1", 1000.0, 3000.0), (1000, 1, "F mb1 s0", 4000.0, 1000.0)]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"pp rank 0", "pp rank 1", "measured · pp rank 0", "measured · pp rank 1"}
    assert trace["otherData"]["measured"] is True
    assert report.chrome_trace(_variant(timeline=[]), run_trace) is None
    # the detail page says which it holds
    (tmp_path / "runs" / "pp2_vpp2").mkdir(parents=True)
    (tmp_path / "runs" / "pp2_vpp2" / "trace.json").write_text(json.dumps(run_trace))
    assert "measured per-action times" in report.render_run_page(result, 1, tmp_path)
    assert "Planned only" in report.render_run_page(result, 1)


@pytest.mark.parametrize("verdict,count,element", [("fail", "failures", "failure"), ("unchecked", "skipped", "skipped"),
                                                    ("pass", None, "system-out")])
def test_junit_has_a_golden_testcase(verdict, count, element):
    """A golden failure fails the JUnit suite (CI widgets read it); an unchecked CPU family is a skipped test."""
    r = make_result()
    base = ET.fromstring(report.junit_xml(r)).find("testsuite")
    r.golden = {"dir": "goldens/smoke", "environment": "same", "verdict": verdict, "checked_on": ["x"],
                "detail": f"golden {verdict} detail"}
    r.variants[0].golden = {"status": "differs" if verdict == "fail" else "equal", "first_divergence": None,
                            "detail": "first difference from the golden"}
    suite = ET.fromstring(report.junit_xml(r)).find("testsuite")
    case = [c for c in suite.findall("testcase") if c.get("name") == "golden"][0]
    assert case.find(element) is not None and f"golden {verdict} detail" in (case.find(element).text or "")
    assert int(suite.get("tests")) == int(base.get("tests")) + 1
    if count:
        assert int(suite.get(count)) == int(base.get(count)) + 1
