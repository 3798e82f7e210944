"""Tests for harness.report: summary.json, junit.xml, summary.md, the files of a report directory and its words
(results from tests/report_cases.py).
"""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from report_cases import (
    BROKEN_DETAIL,
    CLIP,
    FAIL_DETAIL,
    INV_LINES,
    MARKUP_NAME,
    REPLICA,
    RUN_FILES,
    _cards,
    _dd,
    _files,
    _runs_rows,
    _structural_block,
    _variant,
    _write_trace,
    make_result,
    make_structural_result,
)

from harness import report
from harness.judging.results import FirstDivergence
from harness.report import writer


def test_summary_dict_schema_and_values(result):
    s = report.summary_dict(result)
    assert {"case", "baseline", "elapsed_s", "variants"} <= set(s)
    assert set(s) <= {"case", "baseline", "elapsed_s", "variants", "all_pass", "cross_implementation", "golden",
                      "megatron_sources", "agreement", "not_run", "environment"}
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
            assert type(fd["step"]) is int and fd["kind"] in ("loss", "grad", "grad_norm", "optimizer_state", "param")

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
