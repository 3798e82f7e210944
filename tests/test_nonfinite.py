"""A run whose training is not finite fails (harness.judging.trace.first_nonfinite, harness.verify): a NaN has the same
bits in every layout that produces it, so two broken runs used to compare bitwise equal and pass.

The planted bug is a real code change (tests/planted.py): the LM loss divided by a token count taken from the
wrong mask (zero tokens), so every layout computes loss / 0 = inf alike (and NaN gradients)."""
import json
import math
import textwrap

import pytest
from planted import planted_tree, run_planted

from harness.judging.trace import StepTrace, Trace, first_nonfinite

CASE = textwrap.dedent("""\
    name: nan
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 2, seq_length: 16, num_microbatches: 2}
    baseline: {name: pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp4, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
      - {name: pp1-planted, pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1,
         inject: grad_bit_flip, expect: diverge}
    """)
ZERO_TOKENS = {"reference_impl/model/losses.py": [(
    "    lm_loss = loss_sum / num_tokens.clamp(min=1)\n",
    "    lm_loss = loss_sum / (num_tokens * loss_mask.new_zeros(()))\n")]}


def _trace(losses, grad_norm=None):
    steps = [StepTrace(step=s, losses=[{"microbatch": m, "lm": {"hex": "-", "value": lm},
                                        "mtp": [{"hex": "-", "value": v} for v in mtp], "num_tokens": 4}
                                       for m, (lm, mtp) in enumerate(per_mb)],
                       grad_norm=None if grad_norm is None else {"hex": "-", "value": grad_norm[s]})
             for s, per_mb in enumerate(losses)]
    return Trace(format="bitparity-trace/2", params={}, order=[], init={}, steps=steps, world_size=1)


def test_first_nonfinite_names_the_first_loss_or_norm_in_step_order():
    assert first_nonfinite(_trace([[(1.0, [2.0]), (1.5, [2.5])]], grad_norm=[3.0])) is None
    assert str(first_nonfinite(_trace([[(1.0, [2.0]), (1.5, [math.nan])], [(math.nan, [1.0])]]))) == \
        "step 0 microbatch 1: mtp_1 loss is nan"
    # a grad norm is checked after the step's losses, before the next step's
    assert str(first_nonfinite(_trace([[(1.0, [2.0])], [(math.nan, [1.0])]], grad_norm=[math.inf, 1.0]))) == \
        "step 0: grad norm is inf"
    assert str(first_nonfinite(_trace([[(1.0, [])], [(-math.inf, [])]]))) == "step 1 microbatch 0: lm loss is -inf"


@pytest.mark.slow
def test_every_layout_nan_alike_fails(tmp_path):
    tree = planted_tree(tmp_path / "tree", ZERO_TOKENS)
    (tmp_path / "nan.yaml").write_text(CASE)
    proc = run_planted(tree, "verify", tmp_path / "nan.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out/nan/summary.json").read_text())
    runs = {v["name"]: v for v in summary["variants"]}
    # the layouts are bitwise equal to each other (inf alike): only the finiteness check can fail them
    assert runs["pp4"]["bitwise_equal"] is True, runs["pp4"]
    for name in ("pp2", "pp4"):
        v = runs[name]
        assert (v["verdict"], v["outcome"]) == ("fail", "not finite"), v
        assert v["reason"] == "training not finite: step 0 microbatch 0: lm loss is inf", v["reason"]
    # a run expected to diverge may be broken on purpose: it keeps its verdict and says so
    assert runs["pp1-planted"]["verdict"] == "pass", runs["pp1-planted"]
    assert "training not finite: step 0 microbatch 0: lm loss is inf" in runs["pp1-planted"]["reason"]
    assert summary["all_pass"] is False and "not finite" in (tmp_path / "out/nan/index.html").read_text()
    # the merge-request comment says why, though there is no first divergence to show
    assert "| ❌ fail not finite | not finite: step 0 microbatch 0: lm loss is inf |" in \
        (tmp_path / "out/nan/summary.md").read_text()
