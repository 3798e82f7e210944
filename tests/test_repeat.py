"""`repeat: n` is a run-to-run control: identical runs must be bitwise equal; a nondeterministic trainer is
reported as nondeterminism, apart from layout effects."""
import json
import textwrap

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_repeat_control(tmp_path):
    case = tmp_path / "rep.yaml"
    case.write_text(textwrap.dedent("""\
        name: rep
        model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
        training: {train_iters: 2, seq_length: 16, num_microbatches: 4}
        baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
        variants:
          - {name: clean, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4, repeat: 2}
          - {name: flaky, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4, repeat: 2,
             inject: nondeterministic_grad, expect: diverge}
        """))
    proc = run_cli("verify", case, "--out", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    runs = tmp_path / "rep" / "runs"
    clean = json.loads((runs / "clean" / "comparison.json").read_text())
    flaky = json.loads((runs / "flaky" / "comparison.json").read_text())
    assert clean["verdict"] == "pass" and clean["run_to_run"]["deterministic"] is True
    assert flaky["verdict"] == "fail" and flaky["reason"].startswith("run-to-run nondeterminism")
    assert flaky["run_to_run"]["first_divergence"]["kind"] == "grad"
    assert flaky["run_to_run"]["first_divergence"]["name"] == \
        "decoder.layers.3.self_attention.linear_q_down_proj.weight"
