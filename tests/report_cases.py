"""The report tests' results and helpers (tests/test_report_*.py): made-up `CaseResult` s with every kind of run
(passing, failing, errored, structural, with evidence, dsv3-sized) and the parsers of what the report renders.
Its fixtures (`result`, `html`, `dsv3`) reach every test module through ``pytest_plugins`` in conftest.py."""
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


def _runs_rows(html: str) -> list[tuple[str, str]]:
    """(tr class, row html) of the "All runs" list."""
    body = re.search(r'<table class="runs">(.*?)</table>', html, re.S).group(1).split("<tbody>", 1)[1]
    return re.findall(r'<tr class="([^"]*)">(.*?)</tr>', body, re.S)


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


def _files(root: pathlib.Path) -> dict:
    """{relative path: bytes} of every file under root (hidden temp files included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


RUN_FILES = {f"runs/{d}/{f}" for d in ("baseline", "pp2_vpp2", "pp4_mtp", "err") for f in
             ("index.html", "schedule.trace.json")} - {"runs/pp4_mtp/schedule.trace.json"}   # no timeline


def _gradnorm_section(html: str) -> str:
    return html.split('<section id="gradnorm">', 1)[1].split("</section>", 1)[0]


def _gradnorm_rows(table: str) -> list[list[tuple[str, str]]]:
    body = table.split("<tbody>", 1)[1]
    return [re.findall(r'<td class="([^"]*)"[^>]*>(.*?)</td>', tr, re.S)
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


SVG_NS = "{http://www.w3.org/2000/svg}"


def _svg_rects(svg: str, kind: str) -> list[ET.Element]:
    root = ET.fromstring(svg)  # well-formed XML
    return [e for e in root.iter(f"{SVG_NS}rect") if e.get("class", "").split()[:1] == [kind]]


def _variant(**kw) -> VariantResult:
    base = dict(name="v", layout="L", pp=2, vpp=1, mtp_standalone=False, expect="bitwise", verdict="pass",
                bitwise_equal=True, first_divergence=None)
    base.update(kw)
    return VariantResult(**base)


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


def _write_trace(report_dir: pathlib.Path, run_dir: str, n: int, replicas: int = 1) -> None:
    params = {f"p{i}.weight": {"name": f"p{i}.weight", "replica": None} for i in range(n)}
    params.update({f"p{i}.weight@mtp": {"name": f"p{i}.weight", "replica": "mtp"} for i in range(replicas)})
    (report_dir / run_dir).mkdir(parents=True, exist_ok=True)
    (report_dir / run_dir / "trace.json").write_text(json.dumps({"format": "t", "params": params}))


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


ULP_HEAD = '<h2 id="ulp-evidence">ULP evidence</h2>'


def _pages(r: CaseResult) -> list[str]:
    """The detail page of every variant of `r`."""
    return [report.render_run_page(r, i) for i in range(len(r.variants))]


def _ulp_block(page: str) -> str:
    assert page.count(ULP_HEAD) == 1
    return page.split(ULP_HEAD, 1)[1].split("<h2", 1)[0]


def _r2r_block(card: str) -> Optional[str]:
    m = re.search(r'<div class="run-to-run (\w+)">(.*?)</div>', card, re.S)
    return None if m is None else m.groups()


def _heat_cells(svg: str) -> dict:
    root = ET.fromstring(svg)
    out = {}
    for e in root.iter(f"{SVG_NS}rect"):
        if e.get("class", "").split()[:1] == ["hm-cell"]:
            out[e.find(f"{SVG_NS}title").text] = e
    return out


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
