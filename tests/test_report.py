"""Tests for harness.report: summary.json, junit.xml, summary.md and the self-contained index.html."""
from __future__ import annotations

import json
import pathlib
import re
import struct
import xml.etree.ElementTree as ET

import pytest

from harness import report
from harness.results import FAMILIES, CaseResult, FirstDivergence, StepSeries, VariantResult

MARKUP_NAME = "pp2 <b>x</b>"
FAIL_DETAIL = "grad bits 0x3c23d70a (baseline) vs 0x3c23d70b (variant)"


def _hex(x: float) -> str:
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


def _series(losses: list[float]) -> StepSeries:
    return StepSeries(lm_loss=list(losses), lm_loss_hex=[_hex(x) for x in losses],
                      mtp_loss=[[x + 0.1] for x in losses], grad_norm=[None] * len(losses),
                      grad_norm_hex=[None] * len(losses))


BASE_LOSSES = [10.5, 9.75, 9.125]
FAIL_LOSSES = [10.5, 9.7500009, 9.1]  # step 0 equal, steps 1 and 2 differ


def make_result() -> CaseResult:
    """A baseline, a passing variant, a failing variant with a divergence and an errored variant."""
    baseline = VariantResult(
        name="baseline", layout="E|t*4|L", pp=1, vpp=1, mtp_standalone=False, expect="bitwise",
        verdict="pass", bitwise_equal=True, first_divergence=None, reason="baseline run",
        layout_grid="rank 0: E t t t t L", options={}, series=_series(BASE_LOSSES),
        elapsed_s=12.5, run_dir="runs/baseline", command="bitparity verify cases/x.yaml --only baseline")
    passing = VariantResult(
        name="pp2_vpp2", layout="E,t|t,t|t,L", pp=2, vpp=2, mtp_standalone=False, expect="bitwise",
        verdict="pass", bitwise_equal=True, first_divergence=None,
        reason="bitwise equal over 3 steps", layout_grid="rank 0: E t | t L\nrank 1: t t",
        options={"micro_batches": 4}, series=_series(BASE_LOSSES),
        family_mismatches={"grad": [{f: 0 for f in FAMILIES}] * 3, "param": [{}] * 3},
        elapsed_s=20.25, run_dir="runs/pp2_vpp2", command="bitparity verify cases/x.yaml --only pp2_vpp2")
    failing = VariantResult(
        name="pp4_mtp", layout="E|t,t|t,t|L,M", pp=4, vpp=1, mtp_standalone=True, expect="bitwise",
        verdict="fail", bitwise_equal=False,
        first_divergence=FirstDivergence(step=0, kind="grad", microbatch=None,
                                         name="embedding.word_embeddings.weight", detail=FAIL_DETAIL),
        reason="grads differ from baseline at step 0", layout_grid="rank 0: E\nrank 3: L M",
        options={"mtp_standalone": True, "seed": 7}, series=_series(FAIL_LOSSES),
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
        command="bitparity verify cases/x.yaml --only 'pp2 <b>x</b>'")
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
    assert set(s) <= {"case", "baseline", "elapsed_s", "variants", "environment"}
    assert s["case"] == "dsv3_small"
    assert s["baseline"] == "baseline"
    assert s["elapsed_s"] == 66.75
    assert [v["name"] for v in s["variants"]] == ["baseline", "pp2_vpp2", "pp4_mtp", MARKUP_NAME]

    required = {"name": str, "layout": str, "pp": int, "vpp": int, "mtp_standalone": bool,
                "expect": str, "verdict": str}
    for v in s["variants"]:
        assert set(required) | {"bitwise_equal", "first_divergence"} <= set(v)
        assert set(v) <= set(required) | {"bitwise_equal", "first_divergence", "reason", "elapsed_s"}
        for key, typ in required.items():
            assert type(v[key]) is typ, (key, v[key])
        assert v["verdict"] in ("pass", "fail", "error")
        assert v["bitwise_equal"] is None or type(v["bitwise_equal"]) is bool
        fd = v["first_divergence"]
        if fd is not None:
            assert set(fd) == {"step", "kind", "microbatch", "name"}
            assert type(fd["step"]) is int and fd["kind"] in ("loss", "grad", "param")

    base, ok, bad, err = s["variants"]
    assert (base["verdict"], ok["verdict"], bad["verdict"], err["verdict"]) == ("pass", "pass", "fail", "error")
    assert (ok["pp"], ok["vpp"], bad["pp"], bad["mtp_standalone"]) == (2, 2, 4, True)
    assert bad["bitwise_equal"] is False and err["bitwise_equal"] is None and ok["bitwise_equal"] is True
    assert ok["first_divergence"] is None and err["first_divergence"] is None
    assert bad["first_divergence"] == {"step": 0, "kind": "grad", "microbatch": None,
                                       "name": "embedding.word_embeddings.weight"}
    assert bad["reason"] == "grads differ from baseline at step 0"
    assert bad["elapsed_s"] == 31.0
    assert s["environment"]["torch"] == "2.13.0"
    # Round-trips through strict JSON.
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_summary_dict_loss_divergence_keeps_microbatch():
    r = make_result()
    r.variants[2].first_divergence = FirstDivergence(step=3, kind="loss", microbatch=1, name="mtp_1")
    fd = report.summary_dict(r)["variants"][2]["first_divergence"]
    assert fd == {"step": 3, "kind": "loss", "microbatch": 1, "name": "mtp_1"}
    assert report.divergence_words(r.variants[2].first_divergence) == "step 3 · loss · mb 1 · mtp_1"


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
    assert "expected bitwise equality" in failure.text

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
    # Every row has the same number of unescaped cell separators (names with `|` must not break it).
    seps = {len(re.findall(r"(?<!\\)\|", ln)) for ln in table}
    assert seps == {8}
    fail_row = next(ln for ln in table if "pp4" in ln)
    assert "fail" in fail_row and "step 0 · grad · embedding.word" in fail_row
    assert "| 4 | 1 |" in fail_row
    assert "[Full report](reports/dsv3_small/index.html)" in md
    assert "<b>" not in md and "&lt;b&gt;x&lt;/b&gt;" in md
    assert "FAIL" in lines[0]


# ---------------------------------------------------------------------------------------------- html

def test_html_verdict_matrix_rows(html):
    m = re.search(r'<table class="matrix">(.*?)</table>', html, re.S)
    assert m, "verdict matrix missing"
    body = m.group(1).split("<tbody>", 1)[1]
    rows = re.findall(r"<tr class=\"verdict-(\w+)[^\"]*\">(.*?)</tr>", body, re.S)
    assert [v for v, _ in rows] == ["pass", "pass", "fail", "error"]
    assert "pp2_vpp2" in rows[1][1]
    fail_row = rows[2][1]
    assert "pp4_mtp" in fail_row and 'class="badge fail"' in fail_row
    assert "step 0 · grad · embedding.word_embeddings.weight" in fail_row
    assert "0x3c23d70a (baseline) vs 0x3c23d70b (variant)" in fail_row
    assert "grads differ from baseline at step 0" in fail_row
    assert 'class="badge error"' in rows[3][1]
    assert "31.0 s" in fail_row


def test_html_header_and_sections(html, result):
    assert html.lstrip().startswith("<!DOCTYPE html>")
    assert "dsv3_small" in html
    assert result.command in html  # no characters that need escaping in it
    assert 'class="badge overall fail"' in html
    for section in ("matrix", "loss", "mismatches", "variants", "environment"):
        assert f'id="{section}"' in html
    assert "rank 0: E t | t L\nrank 1: t t" in html  # layout grid kept verbatim in <pre>
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
    header = re.search(r"<thead>(.*?)</thead>", table, re.S).group(1)
    assert MARKUP_NAME not in header and "&lt;b&gt;" not in header  # errored variant has no data


def test_html_family_tables(html):
    sec = html.split('id="mismatches"', 1)[1].split('id="variants"', 1)[0]
    # Only pp4_mtp has nonzero counts; pp2_vpp2 has all-zero tables but they are still shown.
    assert "pp4_mtp" in sec and "pp2_vpp2" in sec
    tables = re.findall(r'<table class="family-table">(.*?)</table>', sec, re.S)
    assert len(tables) == 4  # grad + param for each of pp2_vpp2 and pp4_mtp
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
    assert "<svg" not in out and "No loss data recorded." in out


def test_loss_svg_is_deterministic_and_embeddable(result):
    a = report.loss_curves_svg(result)
    b = report.loss_curves_svg(result)
    assert a == b
    assert a.startswith("<svg") and a.rstrip().endswith("</svg>")
    assert "<!--" not in a


# --------------------------------------------------------------------------------------------- files

def test_write_report_files_atomic(tmp_path, result):
    out = tmp_path / "nested" / "report"
    paths = report.write_report(result, out)
    assert set(paths) == {"index.html", "summary.json", "junit.xml", "summary.md"}
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "junit.xml", "summary.json", "summary.md"]
    for name, p in paths.items():
        assert p == out / name and p.stat().st_size > 0
    assert json.loads(paths["summary.json"].read_text()) == report.summary_dict(result)
    ET.parse(paths["junit.xml"])
    assert paths["index.html"].read_text(encoding="utf-8") == report.render_html(result)

    # Rewriting over an existing report replaces the files and still leaves no temp files.
    result2 = make_result()
    result2.case = "second"
    report.write_report(result2, out)
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "junit.xml", "summary.json", "summary.md"]
    assert json.loads((out / "summary.json").read_text())["case"] == "second"


def test_write_report_failure_leaves_no_temp_files(tmp_path, monkeypatch, result):
    out = tmp_path / "r"
    report.write_report(result, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", boom)
    r2 = make_result()
    r2.case = "other"
    with pytest.raises(OSError, match="disk full"):
        report.write_report(r2, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
