"""Divergence signatures (harness.judging.signature): an expected divergence may hide no second bug.

The planted bug is a real code change (tests/planted.py): the MTP loss scale doubled only where one chunk
holds the embedding and the loss (P=1).  P=1 is expected to differ in the embedding gradient (megatron
reductions: sum_mb (a+b) vs sum a + sum b); checking only the first divergence let the doubled MTP loss
through, the signature catches it."""
import json
import textwrap

import pytest
from planted import planted_tree, run_planted

from harness.judging.compare import Comparison, Difference
from harness.judging.results import FirstDivergence
from harness.judging.signature import SignaturePlace, default_signature, lines, matches, outside
from harness.planning.case_schema import ExpectedDivergence

EMB = "embedding.word_embeddings.weight"
CASE = textwrap.dedent("""\
    name: sig
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 2, seq_length: 16, num_microbatches: 4}
    baseline: {name: pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp4, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
      - {name: pp1, pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1,
         expect: may_diverge, first_divergence: {step: 0, kind: grad, name: embedding.word_embeddings.weight}}
    """)
P1_ONLY_BIAS_RATE = {"reference_impl/train.py": [(
    "layer.router.update_expert_bias()",
    "layer.router.update_expert_bias(); layer.router.expert_bias.mul_(2.0 if len(state.chunks) == 1 and "
    "cfg.parallel.pipeline_model_parallel_size == 1 else 1.0)")]}
P1_ONLY_MTP_SCALE = {"reference_impl/model/chunk.py": [(
    "self.cfg.mtp_loss_scaling_factor,",
    "self.cfg.mtp_loss_scaling_factor * (2.0 if self.has_embedding_input else 1.0),")]}


def _cmp(*diffs):
    fd = diffs[0]
    return Comparison(False, FirstDivergence(fd.step, fd.kind, fd.microbatch, fd.name), differences=list(diffs))


class _Spec:
    def __init__(self, first_divergence=None, signature=None, expect="may_diverge"):
        self.first_divergence, self.signature, self.expect = first_divergence, signature, expect


def test_default_signature_of_an_embedding_gradient():
    spec = _Spec([ExpectedDivergence(step=0, kind="grad", name=EMB)])
    inside = _cmp(Difference(0, "grad", EMB), Difference(0, "grad", EMB + "@mtp"), Difference(0, "param", EMB),
                  Difference(1, "loss", "lm", 0), Difference(1, "grad", "output_layer.weight"))
    assert outside(inside, spec, clipping=False) == []
    mtp = Difference(0, "grad", "mtp.layers.0.eh_proj.weight")
    other_update = Difference(0, "param", "output_layer.weight")
    assert outside(_cmp(Difference(0, "grad", EMB), mtp, other_update), spec, clipping=False) == [mtp, other_update]
    # with clipping the norm, and through the clip coefficient every update, may move at that step
    assert outside(_cmp(Difference(0, "grad", EMB), Difference(0, "grad_norm", "grad norm"), other_update),
                   spec, clipping=True) == []


def test_default_signature_of_a_loss_allows_the_whole_step():
    places = default_signature([ExpectedDivergence(kind="loss")], 1, clipping=False)
    assert all(any(matches(p, d) for p in places) for d in
               (Difference(1, "loss", "lm", 0), Difference(1, "grad", EMB), Difference(2, "param", EMB)))
    assert not any(matches(p, Difference(0, "grad", EMB)) for p in places)


def test_explicit_signature_replaces_the_default():
    spec = _Spec([ExpectedDivergence(kind="grad")], [SignaturePlace(step=0, family="embedding/head"),
                                                     SignaturePlace(from_step=1, kind="param")])
    router = Difference(0, "grad", "decoder.layers.1.mlp.router.weight")
    later_loss = Difference(1, "loss", "lm", 0)
    assert outside(_cmp(Difference(0, "grad", EMB), router, Difference(1, "param", EMB), later_loss),
                   spec, clipping=False) == [router, later_loss]


def test_lines_are_capped():
    out = lines([Difference(0, "grad", f"decoder.layers.{i}.mlp.router.weight") for i in range(25)])
    assert len(out) == 21 and out[-1] == "… and 5 more" and out[0] == "step 0 grad decoder.layers.0.mlp.router.weight"


@pytest.mark.arithmetic_free
def test_signature_names_are_checked(tmp_path, cli):
    bad = CASE.replace("first_divergence: {step: 0,", "signature: [{from_step: 5}], first_divergence: {step: 0,")
    (tmp_path / "bad.yaml").write_text(bad)
    proc = cli("verify", tmp_path / "bad.yaml", "--out", tmp_path)
    assert proc.returncode == 2 and "signature[0].from_step 5: the run has steps 0..1" in proc.stderr, proc.stderr


def _run(tmp_path, edits):
    tree = planted_tree(tmp_path / "tree", edits)
    (tmp_path / "sig.yaml").write_text(CASE)
    proc = run_planted(tree, "verify", tmp_path / "sig.yaml", "--out", tmp_path / "out")
    runs = {n: json.loads((tmp_path / f"out/sig/runs/{n}/comparison.json").read_text()) for n in ("pp4", "pp1")}
    assert runs["pp4"]["verdict"] == "pass", runs["pp4"]       # the planted changes are P=1-only
    return proc, runs["pp1"]


@pytest.mark.slow
def test_a_second_bug_behind_an_expected_divergence_fails(tmp_path):
    """P=1 doubles its expert-bias update: only buffers after the update differ, after the expected
    embedding gradient; the first-divergence check alone passes it."""
    proc, p1 = _run(tmp_path, P1_ONLY_BIAS_RATE)
    # the doubled bias differs by construction (rate * sign(...) is non-zero for an unbalanced expert)
    assert p1["verdict"] == "fail" and proc.returncode == 1, p1
    fd = p1["first_divergence"]
    if fd["kind"] == "grad":        # P=1's embedding gradient rounded apart (most machines; may differ, only here)
        assert fd["name"] == EMB and "differs outside its signature" in p1["reason"], p1
        assert any(line.startswith("step 0 buffer decoder.layers.") and line.endswith("mlp.router.expert_bias")
                   for line in p1["outside_signature"]), p1["outside_signature"]


@pytest.mark.slow
def test_a_wrong_mtp_loss_scale_behind_an_expected_divergence_fails(tmp_path):
    """P=1 doubles its MTP loss scale: in dataflow order the output head's gradient differs first (the MTP loss
    flows into it), not the expected embedding gradient; in canonical order the embedding came first and the
    bug passed."""
    proc, p1 = _run(tmp_path, P1_ONLY_MTP_SCALE)
    # the MTP layer's gradients are exactly twice the clean ones at P=1 (a power-of-two seed): certain
    assert p1["verdict"] == "fail" and proc.returncode == 1, p1
    assert p1["first_divergence"]["name"] == "output_layer.weight", p1["first_divergence"]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("signature, words", [
    ("[{step: 0, from_step: 1}]", "step and from_step together"),
    ("[{kind: grad_norm, name: embedding.word_embeddings.weight}]", "kind grad_norm has no parameter name"),
    ("[{name: embedding.word_embeddings.weight, family: router}]", "is of family 'embedding/head', not 'router'"),
    ("[{step: true}]", "signature.0.step"),
    ("[{kind: param, from_step: 1}]", "signature does not include first_divergence (grad embedding"),
])
def test_inconsistent_signatures_are_refused(tmp_path, cli, signature, words):
    bad = CASE.replace("first_divergence: {step: 0,", f"signature: {signature}, first_divergence: {{step: 0,")
    (tmp_path / "bad.yaml").write_text(bad)
    proc = cli("verify", tmp_path / "bad.yaml", "--out", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr


def test_the_issues_own_signature_is_accepted(tmp_path):
    """P=1: only the word embedding's gradient at step 0, then anything from step 1 (issue #14's example)."""
    ok = CASE.replace("first_divergence: {step: 0,", "signature: [{step: 0, kind: grad, name: "
                      "embedding.word_embeddings.weight}, {step: 0, kind: param, name: embedding.word_embeddings.weight},"
                      " {from_step: 1}], first_divergence: {step: 0,")
    (tmp_path / "ok.yaml").write_text(ok)
    from harness.planning.cases import load_case
    plan = load_case(tmp_path / "ok.yaml")
    assert len(plan.runs[-1].spec.signature) == 3
