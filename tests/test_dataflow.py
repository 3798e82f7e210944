"""Localisation in dataflow order (harness.judging.compare): the first divergence is the first tensor *computed*
differently, gradients in backward order, with the canonical-order view kept as a second line.

Both planted bugs are real code changes (tests/planted.py) of the kind measured in issue #14, and both are
certain by construction: a power-of-two scale of one backward seed, and a gradient buffer left un-zeroed."""
import json
import textwrap

import pytest
from planted import planted_tree, run_planted

CASE = textwrap.dedent("""\
    name: flow
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 2, seq_length: 16, num_microbatches: 4}
    baseline: {name: pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp2-vpp2, pipeline_model_parallel_layout: "Et|tt|t|mL", pipeline_model_parallel_size: 2}
    """)
EMB = "embedding.word_embeddings.weight"
# the aux loss's backward seed divided by V as well: halved on an interleaved layout
AUX_SCALE_BY_V = {"reference_impl/train.py": [(
    "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches)",
    "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches) / self.layout.virtual_pipeline_model_parallel_size")]}
# with several chunks per rank the last one is never zeroed (an off-by-one over the chunk list): its
# gradients carry step 0's into step 1
STALE_LAST_CHUNK = {"reference_impl/train.py": [(
    "            for *_, p, _ in state.params:\n                p.master.grad = None\n                p.main_grad.zero_()\n",
    "            stale = {id(q) for q in list(state.chunks.values())[-1].parameters()} if len(state.chunks) > 1 else set()\n"
    "            for *_, p, _ in state.params:\n                p.master.grad = None\n"
    "                if id(p) not in stale:\n                    p.main_grad.zero_()\n")]}


def _first(tmp_path, edits):
    tree = planted_tree(tmp_path / "tree", edits)
    (tmp_path / "flow.yaml").write_text(CASE)
    proc = run_planted(tree, "verify", tmp_path / "flow.yaml", "--out", tmp_path / "out")
    cmp = json.loads((tmp_path / "out/flow/runs/pp2-vpp2/comparison.json").read_text())
    assert proc.returncode == 1 and cmp["verdict"] == "fail", cmp
    return cmp["first_divergence"]


@pytest.mark.slow
def test_a_v_dependent_aux_loss_scale_is_named_at_the_last_moe_router(tmp_path):
    fd = _first(tmp_path, AUX_SCALE_BY_V)
    # backward reaches the MTP layer's MoE first (it runs after the decoder); its experts see the same output
    # gradient, so the router is the first tensor computed differently.  Canonical order named the embedding.
    assert (fd["step"], fd["kind"], fd["name"]) == (0, "grad", "mtp.layers.0.transformer_layer.mlp.router.weight"), fd
    assert fd["canonical"].startswith(f"first in canonical order: grad {EMB} "), fd


@pytest.mark.slow
def test_a_stale_chunk_gradient_is_named_in_that_chunk(tmp_path):
    fd = _first(tmp_path, STALE_LAST_CHUNK)
    # pp rank 1's last chunk is stage 3 "mL" (the MTP layer, the embedding's MTP replica, the output head):
    # its gradients at step 1 add step 0's; the word embedding differs only through the replica sum
    assert (fd["step"], fd["kind"], fd["name"]) == (1, "grad", "output_layer.weight"), fd
    assert fd["canonical"].startswith(f"first in canonical order: grad {EMB} "), fd
