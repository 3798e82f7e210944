"""The long profile (`--train-iters`, `make verify-long`): a bug that shows only after a few updates.

Planted (a real code change, tests/planted.py): a standalone MTP stage routes with a stale (zero) copy of its
router's expert bias.  At step 0 every bias is zero, so nothing can differ there (certain by construction);
later the live bias moves by ``moe_router_bias_update_rate`` per step and a top-k choice flips once the bias
outweighs a score gap.  When that happens depends on the values (measured here: step 5 with rate 2e-5; may
differ, only here), which is why three steps are too few."""
import json
import textwrap

import pytest
from planted import planted_tree, run_planted

CASE = textwrap.dedent("""\
    name: long
    timeout_s: 300
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3", hidden_size: 32, moe_router_bias_update_rate: 0.00002}
    training: {train_iters: 3, seq_length: 16, micro_batch_size: 2, num_microbatches: 4}
    baseline: {name: pp2-mtp-with-loss, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp4-mtp-standalone, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
    """)
STALE_BIAS_ON_STANDALONE_MTP = {
    "reference_impl/model/chunk.py": [(
        "            self.mtp = MTPBlock(cfg, moe=bool(moe[-1]))\n",
        "            self.mtp = MTPBlock(cfg, moe=bool(moe[-1]))\n"
        "            for m in self.mtp.modules() if not self.has_loss else ():\n"
        "                m.stale_bias = True\n")],
    "reference_impl/model/moe.py": [(
        "select = scores.detach() + self.expert_bias if",
        "select = scores.detach() + (torch.zeros_like(self.expert_bias) if getattr(self, 'stale_bias', False) "
        "else self.expert_bias) if")],
}


def _run(tree, case, out, iters):
    proc = run_planted(tree, "verify", case, "--train-iters", str(iters), "--out", out)
    return proc, json.loads((out / "long/runs/pp4-mtp-standalone/comparison.json").read_text())


@pytest.mark.slow
def test_the_long_profile_catches_a_bug_that_three_steps_miss(tmp_path):
    tree = planted_tree(tmp_path / "tree", STALE_BIAS_ON_STANDALONE_MTP)
    (tmp_path / "long.yaml").write_text(CASE)
    proc, long = _run(tree, tmp_path / "long.yaml", tmp_path / "long8", 8)
    assert proc.returncode == 1 and long["verdict"] == "fail", long
    fd = long["first_divergence"]
    assert fd["step"] >= 1, fd          # every bias is zero at step 0: nothing can differ there
    print(f"first divergence with 8 steps: step {fd['step']} {fd['kind']} {fd['name']}")
    if fd["step"] >= 3:                 # then the default three steps are bitwise equal: deterministic runs
        proc, short = _run(tree, tmp_path / "long.yaml", tmp_path / "long3", 3)
        assert proc.returncode == 0 and short["bitwise_equal"] is True, short


@pytest.mark.arithmetic_free
def test_train_iters_is_validated(tmp_path, cli):
    (tmp_path / "long.yaml").write_text(CASE.replace("pipeline_model_parallel_size: 4}",
                                                     "pipeline_model_parallel_size: 4, expect: may_diverge, "
                                                     "first_divergence: {step: 2, kind: loss}}"))
    proc = cli("verify", tmp_path / "long.yaml", "--train-iters", "0", "--out", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--train-iters must be" in proc.stderr, proc.stderr
    proc = cli("verify", tmp_path / "long.yaml", "--train-iters", "2", "--out", tmp_path)
    # the flag caused the conflict: the line names it first
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("bitparity: error: --train-iters 2: ") and \
        "first_divergence.step 2: the run has steps 0..1" in proc.stderr, proc.stderr
    # a mistake of the case file itself is not blamed on the flag
    (tmp_path / "bad.yaml").write_text(CASE.replace("pipeline_model_parallel_size: 4}",
                                                    "pipeline_model_parallel_size: 4, inject: nope}"))
    proc = cli("verify", tmp_path / "bad.yaml", "--train-iters", "2", "--out", tmp_path)
    assert proc.returncode == 2 and "--train-iters" not in proc.stderr and "unknown fault 'nope'" in proc.stderr
    assert not (tmp_path / "long").exists() and not (tmp_path / "bad").exists()
