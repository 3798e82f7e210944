"""Cross-implementation comparison (harness/judging/crossimpl.py): the reference trainer and megatron-core from identical
weights and data agree within a few ULPs, and a bug that is the same on every layout (so every layout
comparison passes) is caught there: named first in dataflow order (as layout comparisons name their first
divergence), the farthest tensor beside it, each stated bug with the tensor it explains, an all-zero tensor on
one side in words."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.judging.crossimpl import CrossImplementationSpec, compare, expected, scaled_ulp
from harness.judging.judge import judge_cross_implementation as judge
from harness.judging.trace import StepTrace, Trace
from trainerkit import names

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests" / "cases" / "megatron-small.yaml"
NO_MTP = ROOT / "tests" / "cases" / "megatron-seq-aux-no-mtp.yaml"
TRAINERS = ("megatron-core", "reference")
EMB, ROUTER = "embedding.word_embeddings.weight", "decoder.layers.1.mlp.router.weight"
EXPERT, HEAD = "decoder.layers.1.mlp.experts.0.linear_fc1.weight", "output_layer.weight"
ULP1 = 2.0 ** -23               # ulp(1.0) in fp32: each synthetic tensor's largest element is 1.0
# e3fe5508c9's effect undone in megatron-core 0.16.1's router: the seq aux loss's token count is the micro
# batch's (S x B), not one sequence's (S: the routing map is reshaped to [S, B x E] before it is counted)
_SEQ_AUX = '"seq_load_balancing_loss",\n            self.tp_cp_group,\n            valid_token_count=local_num_tokens'
SEQ_AUX_FIX = {"megatron/core/transformer/moe/router.py": [(_SEQ_AUX + ",", _SEQ_AUX + " * bsz,")]}


def _trace(keys, losses) -> Trace:
    """A one-step trace holding `keys` (canonical order) and `losses` ([(lm hex, [mtp hex])] per microbatch)."""
    params = {k: {"name": k, "replica": None, "shape": [4], "dtype": "float32", "family": names.family(k),
                  "order": names.order_key(k), "weight_decay": True} for k in keys}
    rows = [{"microbatch": i, "lm": {"hex": lm}, "mtp": [{"hex": h} for h in mtp], "num_tokens": 8}
            for i, (lm, mtp) in enumerate(losses)]
    return Trace(format="bitparity-trace/2", params=params, order=sorted(keys, key=names.order_key),
                 init=dict.fromkeys(keys, "0x0"), steps=[StepTrace(step=0, losses=rows)], world_size=1)


def _compared(off: dict, zero: dict | None = None, losses_b=None, max_ulp: int = 64) -> dict:
    """The comparison record of two synthetic runs of EMB, ROUTER, EXPERT, HEAD: megatron-core's gradients
    ``[1, 0.5, -0.25, 0.125]``; the reference's the same with element 0 moved by ``off[key]`` ULPs of 1.0 (exact
    in fp32: so many ULPs at tensor scale, by construction); ``zero[key]``: that trainer's gradient all zero."""
    keys = [EMB, ROUTER, EXPERT, HEAD]
    base = torch.tensor([1.0, 0.5, -0.25, 0.125])
    ta, tb = {}, {}
    for k in keys:
        a, b = base.clone(), base.clone()
        b[0] += off.get(k, 0) * ULP1
        if k in (zero or {}):
            (a if zero[k] == TRAINERS[0] else b).zero_()
        ta[f"grad/{k}"], tb[f"grad/{k}"] = a, b
    losses = [("0x40000000", ["0x3f800000"])] * 2
    return compare(_trace(keys, losses), ta, _trace(keys, losses_b or losses), tb, 0, max_ulp, TRAINERS)


def test_scaled_ulp_measures_at_the_tensors_scale():
    a = torch.tensor([1.0, 1e-6, -2.0], dtype=torch.float32)
    assert scaled_ulp(a, a.clone()) == 0.0
    step = float(torch.finfo(torch.float32).eps) * 2          # ulp(2.0)
    b = a.clone()
    b[1] += 3 * step                                          # a tiny element off by 3 ULPs of the largest one
    assert scaled_ulp(a, b) == pytest.approx(3.0, rel=1e-6)
    c = a.clone()
    c[0] = math.inf
    assert scaled_ulp(a, c) == math.inf
    with pytest.raises(ValueError):
        scaled_ulp(a, a[:2])


def _case(tmp_path: Path, inject: str | None) -> Path:
    fault = f"\n  inject: {inject}" if inject else ""
    vfault = f"\n    inject: {inject}" if inject else ""
    # top-4 of the 2 best of 4 groups: the group limit bites, so the seq aux loss's counts (eq. 18: the plain
    # top-K, not the routed experts) matter; a visible aux-loss coefficient
    text = f"""extends: {SMALL}
name: xi
model: {{moe_router_topk: 4, moe_aux_loss_coeff: 0.01}}
baseline:
  name: pp2
  pipeline_model_parallel_layout: "Ett|ttmL"
  pipeline_model_parallel_size: 2{fault}
variants:
  - name: pp2-vpp2
    pipeline_model_parallel_layout: "Et|t|t|tmL"
    pipeline_model_parallel_size: 2{vfault}
cross_implementation: {{variant: pp2, step: 0, max_ulp: 16}}
"""
    path = tmp_path / "xi.yaml"
    path.write_text(text)
    return path


def _verify(tmp_path: Path, inject: str | None):
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "harness", "verify", str(_case(tmp_path, inject)), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "xi" / "summary.json").read_text())
    return proc, summary


@pytest.mark.slow
@pytest.mark.megatron
def test_reference_and_megatron_agree_within_the_bound(tmp_path):
    pytest.importorskip("megatron.core")
    proc, summary = _verify(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    x = summary["cross_implementation"]
    assert x["verdict"] == "pass", x["reason"]
    assert x["trainers"] == ["megatron-core", "reference"]
    assert x["init_differs"] == [] and not any(x["inventory"].values())
    h = x["headline"]
    assert h["loss_max_ulp"] <= 16 and h["grad_max_scaled_ulp"] <= 16
    assert h["tensors"] == len(x["tensors"]) > 50
    assert "Cross-implementation" in (tmp_path / "rep" / "xi" / "summary.md").read_text()
    assert "cross-implementation" in (tmp_path / "rep" / "xi" / "index.html").read_text()


@pytest.mark.newest_megatron
@pytest.mark.slow
@pytest.mark.megatron
def test_a_bug_the_same_on_every_layout_is_caught_only_by_the_other_implementation(tmp_path):
    """megatron_trainer.faults ``mtp_loss_scale_doubled`` in every run: the layouts agree bit for bit, the
    reference trainer does not."""
    pytest.importorskip("megatron.core")
    proc, summary = _verify(tmp_path, "mtp_loss_scale_doubled")
    assert all(v["verdict"] == "pass" for v in summary["variants"]), summary["variants"]
    x = summary["cross_implementation"]
    assert x["verdict"] == "fail"
    assert x["first_beyond_bound"]["kind"] == "grad"
    assert x["headline"]["loss_max_ulp"] <= 16      # the loss values are right; the objective's scale is not
    assert proc.returncode == 1


@pytest.mark.arithmetic_free
def test_cross_implementation_step_other_than_0_is_refused(tmp_path):
    """Only step 0 starts both trainers from identical weights: a later step is one line, exit 2."""
    pytest.importorskip("megatron.core")
    case = _case(tmp_path, None)
    case.write_text(case.read_text().replace("step: 0", "step: 1"))
    proc = subprocess.run([sys.executable, "-m", "harness", "verify", str(case), "--out", str(tmp_path / "rep")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "step 1" in proc.stderr and "identical weights" in proc.stderr
    assert not (tmp_path / "rep" / "xi").exists()


def test_a_failed_cross_implementation_run_still_writes_the_report(tmp_path):
    """The cross-implementation pair errors (here: the other trainer's run cannot start); the variants' report is
    written all the same, with the check as an error: in summary.json, junit.xml and the HTML; exit code 1."""
    from harness.judging.crossimpl import CrossImplementationSpec
    from harness.judging.results import CaseResult
    from harness.report import junit_xml, render_html, summary_dict

    rec = {"trainers": ["megatron-core", "reference"], "variant": "pp2", "step": 0, "max_ulp": 16,
           "params_dtype": "float32", "device": "cpu", "verdict": "error", "reason": "reference run failed: boom"}
    result = CaseResult(case="xi", case_path="xi.yaml", baseline="pp2", variants=[], elapsed_s=1.0, environment={},
                        command="bitparity verify xi.yaml", cross_implementation=rec)
    assert not result.all_pass
    assert summary_dict(result)["cross_implementation"]["verdict"] == "error"
    assert summary_dict(result)["all_pass"] is False
    assert 'name="cross-implementation"' in junit_xml(result) and 'errors="1"' in junit_xml(result)
    assert "reference run failed: boom" in render_html(result)
    assert CrossImplementationSpec().step == 0


def test_the_first_gradient_beyond_the_bound_is_named_in_dataflow_order_with_the_farthest_beside_it():
    """The embedding (first in canonical order) 1e6 ULP off, the router 1e3: the backward computes the router's
    gradient first (it runs the canonical order in reverse), so the router is named, as a layout comparison
    names its first divergence; the embedding is the farthest and the first in canonical order."""
    rec = _compared({EMB: 1_000_000, ROUTER: 1000, EXPERT: 3})
    fb = rec["first_beyond_bound"]
    assert (fb["step"], fb["kind"], fb["microbatch"], fb["name"], fb["ulp"]) == (0, "grad", None, ROUTER, 1000.0)
    assert fb["words"] == f"step 0 grad {ROUTER}, 1e+03 ULP at tensor scale"
    assert fb["canonical"]["name"] == EMB and rec["farthest"]["name"] == EMB and rec["farthest"]["ulp"] == 1e6
    assert rec["verdict"] == "fail"
    assert rec["reason"] == (f"first beyond the bound: step 0 grad {ROUTER}, 1e+03 ULP at tensor scale > 64; "
                             f"farthest: step 0 grad {EMB}, 1e+06 ULP at tensor scale; first in canonical order: "
                             f"step 0 grad {EMB}, 1e+06 ULP at tensor scale")
    # the same tensor first in both orders: no canonical line; within the bound everywhere: pass, farthest named
    assert _compared({EMB: 1000})["first_beyond_bound"]["canonical"] is None
    ok = _compared({EXPERT: 3, HEAD: 1})
    assert ok["verdict"] == "pass" and ok["first_beyond_bound"] is None and ok["farthest"]["name"] == EXPERT
    assert ok["reason"].endswith(f"(bound 64), farthest: {EXPERT}")


def test_a_loss_beyond_the_bound_comes_before_every_gradient():
    """Dataflow order: the forward's losses (microbatches ascending; lm, then mtp_1) before the backward."""
    rec = _compared({ROUTER: 1000}, losses_b=[("0x40000000", ["0x3f800000"]), ("0x40000000", ["0x3f800080"])])
    fb = rec["first_beyond_bound"]
    assert (fb["kind"], fb["microbatch"], fb["name"], fb["ulp"]) == ("loss", 1, "mtp_1", 128)
    assert fb["words"] == "step 0 loss mb 1 mtp_1, 128 ULP" and rec["farthest"]["name"] == ROUTER


def test_a_gradient_zero_on_one_side_is_said_in_words_not_in_ulps():
    """An all-zero tensor's ULP is the smallest subnormal's: megatron-core's router gradient all zero would read
    ~1e41 ULP; the words say which side is zero.  The report's per-tensor cell says it too."""
    from harness.report.sections import cross_section
    rec = _compared({}, zero={ROUTER: "megatron-core"})
    fb = rec["first_beyond_bound"]
    assert fb["name"] == ROUTER and fb["zero_in"] == "megatron-core" and fb["ulp"] > 1e40
    assert fb["words"] == f"step 0 grad {ROUTER}, zero in megatron-core, non-zero in reference (largest |difference| 1)"
    assert "e+41" not in rec["reason"] and "zero in megatron-core, non-zero in reference" in rec["reason"]
    other = _compared({}, zero={HEAD: "reference"})["first_beyond_bound"]
    assert other["name"] == HEAD and "zero in reference, non-zero in megatron-core" in other["words"]
    cells = {r["key"]: r["cells"]["grad"] for r in cross_section(rec)["rows"]}
    assert cells[ROUTER].startswith("zero in megatron-core") and cells[EMB] == "0"
    assert _compared({}, zero={})["tensors"][0]["grad"]["zero_in"] is None


def _two_bugs(second_place: str) -> dict:
    spec = CrossImplementationSpec.model_validate({"max_ulp": 64, "megatron_versions": [
        {"versions": "<0.17", "expect": "disagree", "first_beyond_bound": ROUTER, "bug": "bug A",
         "more_bugs": [{"bug": "bug B", "beyond_bound": second_place}]}]})
    rec = {**_compared({EMB: 1_000_000, ROUTER: 1000}), "trainers": list(TRAINERS)}
    return judge(rec, expected(spec, "0.16.1")), expected(spec, "0.19.2")


def test_a_run_that_carries_two_stated_bugs_names_both_with_the_tensor_each_explains():
    from harness.report.words import cross_bug_words
    rec, elsewhere = _two_bugs(EMB)
    assert rec["verdict"] == "pass", rec["reason"]
    assert [(b["bug"], b["place"], b["caught"]) for b in rec["bugs"]] == [("bug A", ROUTER, True), ("bug B", EMB, True)]
    lines = cross_bug_words(rec)
    assert len(lines) == 2
    assert lines[0].startswith("bug A: caught by the cross-implementation check — disagree as expected: first beyond "
                               f"the bound: step 0 grad {ROUTER}")
    assert lines[1] == (f"bug B: caught by the cross-implementation check — beyond the bound at step 0 grad {EMB}, "
                        "1e+06 ULP at tensor scale > 64")
    # the second bug's tensor within the bound: not caught, and the check fails saying why
    rec, _ = _two_bugs(HEAD)
    assert rec["verdict"] == "fail" and [b["caught"] for b in rec["bugs"]] == [True, False]
    assert rec["reason"].startswith(f"bug B: stated beyond the bound at {HEAD}, but within the bound at step 0 grad "
                                    f"{HEAD}, 0 ULP at tensor scale (bound 64)")
    assert "NOT caught" in cross_bug_words(rec)[1]
    # a place the comparison has no gradient for
    rec, _ = _two_bugs("decoder.layers.0.mlp.router.weight")
    assert rec["verdict"] == "fail" and "is not among the compared places" in rec["bugs"][1]["words"]
    # on a version where both are fixed, both are listed as passing there
    assert elsewhere["bug_elsewhere"] == ["bug A (megatron-core <0.17)", "bug B (megatron-core <0.17)"]


@pytest.mark.parametrize("entry,fragment", [
    ("expect: disagree, more_bugs: [{bug: b, beyond_bound: decoder.layers.9.mlp.router.weight}]",
     "more_bugs[0].beyond_bound 'decoder.layers.9.mlp.router.weight'"),
    ("expect: agree, more_bugs: [{bug: b, beyond_bound: decoder.layers.1.mlp.router.weight}]",
     "more_bugs is only meaningful with expect: disagree"),
])
def test_a_stated_bugs_place_is_checked_before_anything_runs(tmp_path, entry, fragment):
    pytest.importorskip("megatron.core")
    from test_cli_errors import GOOD

    from harness.errors import UsageError
    from harness.planning.cases import load_case
    case = tmp_path / "c.yaml"
    case.write_text(GOOD % ("Ett|ttmL", 2)
                    + f"cross_implementation: {{variant: base, megatron_versions: [{{versions: '<0.17', {entry}}}]}}\n")
    with pytest.raises(UsageError, match=re.escape(fragment)):
        load_case(case)


def test_a_layout_without_mtp_is_labelled_no_mtp():
    from harness.judging.results import CaseResult, VariantResult
    from harness.report.matrix import verdict_matrix

    def run(name, layout, depth, standalone=False):
        return VariantResult(name=name, layout=layout, pp=2, vpp=1, mtp_standalone=standalone, expect="bitwise",
                             verdict="pass", bitwise_equal=True, first_divergence=None, mtp_num_layers=depth)
    runs = [run("a", "Ett|tL", 0), run("b", "Ett|tmL", 1), run("c", "Ett|m|L", 1, True), run("d", "Ett|tmL", None)]
    result = CaseResult(case="c", case_path="c.yaml", baseline="a", variants=runs, elapsed_s=1.0, environment={},
                        command="bitparity verify c.yaml")
    rows = verdict_matrix(result, {i: f"card-{i}" for i in range(len(runs))})["rows"]
    assert [r["mtp"] for r in rows] == ["no MTP", "MTP with the loss", "MTP standalone"]   # d shares b's row


@pytest.mark.slow
@pytest.mark.megatron
def test_e3fe5508c9_alone_is_caught_at_the_last_decoder_layers_router(tmp_path):
    """Megatron-LM e3fe5508c9 (per-token seq aux loss 1/micro_batch_size too small) without MTP: on < 0.17 the
    check disagrees first, in dataflow order, at the last decoder layer's router (the word embedding is first in
    canonical order); with the fix planted in a copy of the installed megatron (its version unchanged, so the
    case still expects the bug) the two trainers agree, so the disagreement is that bug."""
    megatron_core = pytest.importorskip("megatron.core")
    from packaging.version import Version
    from planted import planted_megatron
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness", "verify", str(NO_MTP), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    x = json.loads((out / NO_MTP.stem / "summary.json").read_text())["cross_implementation"]
    if Version(megatron_core.__version__) >= Version("0.17"):
        assert proc.returncode == 0 and x["verdict"] == "pass" and x["measured"] == "pass", x["reason"]
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (x["verdict"], x["measured"]) == ("pass", "fail"), x["reason"]
    fb = x["first_beyond_bound"]
    assert (fb["kind"], fb["name"]) == ("grad", "decoder.layers.2.mlp.router.weight"), fb
    assert fb["canonical"]["name"] == EMB and x["farthest"]["kind"] == "grad"
    assert x["bugs"][0]["caught"] and "decoder.layers.2.mlp.router.weight" in x["bugs"][0]["words"]
    head = planted_megatron(tmp_path / "fixed", SEQ_AUX_FIX)
    proc = subprocess.run([sys.executable, "-m", "harness", "verify", str(NO_MTP), "--megatron-head", str(head),
                           "--out", str(tmp_path / "fixed-out")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    x = json.loads((tmp_path / "fixed-out" / NO_MTP.stem / "summary.json").read_text())["cross_implementation"]
    assert x["measured"] == "pass" and x["verdict"] == "fail", x["reason"]      # agree: the bug was the difference
