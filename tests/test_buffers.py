"""The routers' expert bias is a buffer, and every comparison reports it as one (kind ``buffer``).

It is traced apart from the parameters (``buffers`` in TRACE_FORMAT.md: no gradient, no optimizer state, not in
the inventory), but `harness.judging.compare` reported a difference there as kind ``param``: the report said "param"
for a tensor that is none, a case had to expect ``{kind: param, name: ...expert_bias}``, and a failing run whose
first difference was the bias re-ran both runs for ULP evidence that cannot exist (buffers are not dumped).
The unit tests build traces by hand; the end-to-end test plants a bias-update bug in a copy of the reference
trainer (tests/planted.py) and runs `bitparity verify`.
"""
import json
import textwrap

import pytest
from planted import planted_tree, run_planted

from harness.judging.compare import Difference, compare
from harness.judging.results import VariantResult
from harness.judging.signature import SignaturePlace, default_signature
from harness.judging.trace import StepTrace, Trace
from harness.planning.case_schema import ExpectedDivergence
from harness.report import family_heatmap_svg
from harness.report.chart_evidence import family_tables
from trainerkit import names

W = "decoder.layers.1.mlp.router.weight"
BIAS = "decoder.layers.1.mlp.router.expert_bias"
MTP_BIAS = "mtp.layers.0.transformer_layer.mlp.router.expert_bias"
META = {"key": W, "name": W, "replica": None, "shape": [2], "dtype": "float32", "family": "router",
        "weight_decay": True, "order": [1, 1], "rank": 0}


def _trace(param: str, bias: str, mtp_bias: str = "3" * 16) -> Trace:
    return Trace(format="bitparity-trace/2", params={W: META}, order=[W], init={W: "0" * 16},
                 steps=[StepTrace(step=0, grads={W: "a" * 16}, params={W: param},
                                  buffers={BIAS: bias, MTP_BIAS: mtp_bias})], world_size=1)


def test_a_buffer_difference_has_kind_buffer_and_its_own_counts():
    cmp = compare(_trace("1" * 16, "2" * 16), _trace("1" * 16, "f" * 16, "e" * 16))
    fd = cmp.first_divergence
    assert (fd.step, fd.kind, fd.name) == (0, "buffer", BIAS), fd
    assert fd.detail == f"buffer fingerprint {'2' * 16} vs {'f' * 16}"
    assert cmp.differences == [Difference(0, "buffer", BIAS), Difference(0, "buffer", MTP_BIAS)]
    assert cmp.family_mismatches["buffer"] == [{**{f: 0 for f in names.FAMILIES}, "router": 1, "mtp": 1}]
    assert sum(cmp.family_mismatches["param"][0].values()) == 0
    # a parameter that differs too comes first (parameters before buffers in walk order), as a param
    both = compare(_trace("1" * 16, "2" * 16), _trace("9" * 16, "f" * 16))
    assert (both.first_divergence.kind, both.first_divergence.name) == ("param", W)
    assert [d.kind for d in both.differences] == ["param", "buffer"]


def test_buffer_names_and_the_signature_of_an_expected_buffer_difference():
    assert names.is_buffer(BIAS) and names.is_buffer(MTP_BIAS) and names.is_buffer(BIAS + "@ep1")
    assert not names.is_buffer(W) and not names.is_buffer("output_layer.weight")
    places = default_signature([ExpectedDivergence(step=0, kind="buffer", name=BIAS)], 0, clipping=False)
    assert SignaturePlace(step=0, kind="buffer", name=BIAS) in places


def test_the_heatmap_shows_a_buffer_panel_only_when_a_buffer_differs():
    zero = {f: 0 for f in names.FAMILIES}
    v = VariantResult(name="v", layout="L", pp=2, vpp=1, mtp_standalone=False, expect="bitwise", verdict="fail",
                      bitwise_equal=False, first_divergence=None,
                      family_mismatches={"grad": [zero], "param": [zero], "buffer": [{**zero, "router": 1}]})
    assert [t["kind"] for t in family_tables(v)] == ["grad", "param", "buffer"]
    assert "buffer · 1 differing" in family_heatmap_svg(v)
    v.family_mismatches["buffer"] = [zero]
    assert [t["kind"] for t in family_tables(v)] == ["grad", "param"]


# P=1 with canonical reductions is bitwise equal to P=2 (cases/dsv3.yaml); the planted bug doubles the expert
# bias after its update at P=1 only, so step 0's losses, gradients and parameters stay equal and the buffers
# differ (rate * sign(mean - count) is non-zero for an unbalanced expert, tests/test_signature.py)
CASE = textwrap.dedent("""\
    name: buf
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 1, seq_length: 16, num_microbatches: 4, reductions: canonical}
    baseline: {name: pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp1, pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1}
      - {name: pp1-said, pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1,
         expect: diverge, first_divergence: {step: 0, kind: buffer}}
    """)
P1_ONLY_BIAS_RATE = {"reference_impl/train.py": [(
    "layer.router.update_expert_bias()",
    "layer.router.update_expert_bias(); layer.router.expert_bias.mul_(2.0 if "
    "cfg.parallel.pipeline_model_parallel_size == 1 else 1.0)")]}


@pytest.mark.slow
def test_a_bias_update_bug_is_reported_as_a_buffer(tmp_path):
    tree = planted_tree(tmp_path / "tree", P1_ONLY_BIAS_RATE)
    (tmp_path / "buf.yaml").write_text(CASE)
    proc = run_planted(tree, "verify", tmp_path / "buf.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    runs = {v["name"]: v for v in json.loads((tmp_path / "out/buf/summary.json").read_text())["variants"]}
    bitwise, said = runs["pp1"], runs["pp1-said"]
    fd = bitwise["first_divergence"]
    assert bitwise["verdict"] == "fail" and (fd["step"], fd["kind"]) == (0, "buffer"), bitwise
    assert fd["name"].endswith(".mlp.router.expert_bias"), fd
    # no ULP evidence is sought for a tensor no run dumps (it re-ran both runs for nothing)
    assert bitwise["ulp_evidence"] == [] and "collecting ULP evidence" not in proc.stdout, proc.stdout
    # a case states a buffer difference as kind buffer, and the run passes with it
    assert (said["verdict"], said["outcome"]) == ("pass", "differs as expected"), said
