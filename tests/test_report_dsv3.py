"""Tests for harness.report: a report the size of cases/dsv3.yaml: matrix, cards, grouped loss curves, detail pages,
Chrome traces (results from tests/report_cases.py).
"""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from report_cases import CANONICAL_LINE, ERRORED_RUN, FAILING_RUN, OUTSIDE, SVG_NS, _matrix, _matrix_cells, _variant

from harness import report


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
