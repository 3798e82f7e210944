"""The expectation vocabulary of a case file (`expect` / `first_divergence`): every place it allows must be
one a run of this model can produce, or the case is refused with one line before anything runs — a place
that can never match would pass silently wherever the run happens to be bitwise equal."""
import textwrap

import pytest

from harness.errors import UsageError
from harness.planning.cases import load_case

CASE = textwrap.dedent("""\
    name: t
    model: {{num_layers: 4, moe_layer_freq: "[0]*1+[1]*3", mtp_num_layers: 1}}
    training: {{train_iters: 2, seq_length: 8, num_microbatches: 4, clip_grad: 0.05}}
    baseline: {{name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}}
    variants:
      - {{name: v, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4, {expect}}}
    """)


def _load(tmp_path, expect):
    path = tmp_path / "t.yaml"
    path.write_text(CASE.format(expect=expect))
    return load_case(path)


@pytest.mark.parametrize("expect", [
    "expect: may_diverge, first_divergence: {kind: grad_norm, max_ulp: 4}",
    "expect: may_diverge, first_divergence: {step: 1, kind: loss, name: mtp_1, microbatch: 3}",
    "expect: may_diverge, first_divergence: [{kind: grad, name: embedding.word_embeddings.weight@mtp}, {kind: grad_norm}]",
    "expect: diverge, first_divergence: {kind: buffer, name: decoder.layers.3.mlp.router.expert_bias}",
    "expect: diverge, first_divergence: {kind: buffer, name: mtp.layers.0.transformer_layer.mlp.router.expert_bias}",
    "expect: diverge, first_divergence: {kind: inventory, name: mtp.layers.0.eh_proj.weight}",
    "expect: diverge",
    "expect: diverge, replica_drift: {name: embedding.word_embeddings.weight@mtp, step: 1}",
    "replica_drift: [{name: embedding.word_embeddings.weight@mtp}, {name: embedding.word_embeddings.weight@ep1}]",
])
def test_places_a_run_can_produce_are_accepted(tmp_path, expect):
    wants = _load(tmp_path, expect).runs[1].spec.first_divergence
    assert wants is None or isinstance(wants, list)


@pytest.mark.parametrize("expect, message", [
    ("expect: may_diverge", "needs first_divergence"),
    ("expect: may_diverge, first_divergence: []", "empty list"),
    ("expect: diverge, first_divergence: []", "empty list"),
    ("first_divergence: {kind: grad}", "only meaningful with expect: may_diverge or diverge"),
    ("expect: may_diverge, first_divergence: {kind: grad, max_ulp: 1}", "max_ulp applies to kind loss or grad_norm"),
    ("expect: may_diverge, first_divergence: {kind: grad, step: 2}", "step 2: the run has steps 0..1"),
    ("expect: may_diverge, first_divergence: {kind: loss, microbatch: 4}", "microbatch 4: the run has microbatches 0..3"),
    ("expect: may_diverge, first_divergence: {kind: loss, name: mtp_2}", "'mtp_2': a loss is one of"),
    ("expect: may_diverge, first_divergence: {kind: grad_norm, name: norm}", "named 'grad norm'"),
    ("expect: may_diverge, first_divergence: {kind: grad, name: no.such.param}", "is not a parameter name"),
    ("expect: may_diverge, first_divergence: {kind: grad, name: decoder.layers.4.mlp.router.weight}",
     "names decoder layer 4, but the model has 4"),
    ("expect: may_diverge, first_divergence: [{kind: grad_norm}, {kind: param, name: mtp.layers.1.enorm.weight}]",
     "first_divergence[1].name 'mtp.layers.1.enorm.weight' names MTP layer 1"),
    ("expect: diverge, first_divergence: {kind: grad, name: embeddings}", "is not a parameter name"),
    ("replica_drift: {name: embedding.word_embeddings.weight}", "a replica is named with its tag"),
    ("replica_drift: {name: no.such.param@mtp}", "replica_drift.name 'no.such.param@mtp' is not a parameter"),
    ("replica_drift: {name: embedding.word_embeddings.weight@mtp, step: 2}", "replica_drift.step 2: the run has"),
    ("replica_drift: []", "replica_drift is an empty list"),
    ("replica_drift: [{name: x@mtp}, {name: embedding.word_embeddings.weight}]", "replica_drift[0].name 'x@mtp'"),
    ("replica_drift: {name: embedding.word_embeddings.weight@mtp, when: 1}", "replica_drift"),
    # the expert bias is a buffer: it differs as kind buffer (harness.judging.compare), never as a param or a grad
    ("expect: diverge, first_divergence: {kind: param, name: decoder.layers.3.mlp.router.expert_bias}",
     "is a buffer (the router's expert bias: no gradient, not a parameter), not kind param: write kind: buffer"),
    ("expect: may_diverge, first_divergence: {kind: grad, name: decoder.layers.1.mlp.router.expert_bias}",
     "not kind grad: write kind: buffer"),
    ("expect: diverge, first_divergence: {kind: buffer, name: decoder.layers.3.mlp.router.weight}",
     "kind buffer names a router's expert bias"),
    ("expect: diverge, first_divergence: {kind: buffer, name: decoder.layers.4.mlp.router.expert_bias}",
     "names decoder layer 4, but the model has 4"),
])
def test_places_that_can_never_match_are_refused(tmp_path, expect, message):
    with pytest.raises(UsageError, match=None) as info:
        _load(tmp_path, expect)
    line = str(info.value)
    assert "\n" not in line and "variant 'v'" in line and message in line, line
