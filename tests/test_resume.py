"""Checkpoint save at step k and resume, under the same layout and under another P/V (checkpoints use global
parameter names): the resumed steps are bitwise equal to the uninterrupted run, optimizer state and expert
bias included; a resume that drops the optimizer state is caught at the load (the checkpoint's step)."""
import json
import textwrap

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_resume_across_layouts(tmp_path):
    case = tmp_path / "res.yaml"
    case.write_text(textwrap.dedent("""\
        name: res
        model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
        training: {train_iters: 3, seq_length: 16, num_microbatches: 4}
        baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
        variants:
          - {name: same-layout, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2,
             resume: {variant: base, after_step: 0}}
          - {name: p4-vpp2, pipeline_model_parallel_layout: "E|t|t|t|t||m|L", pipeline_model_parallel_size: 4,
             resume: {variant: base, after_step: 0}}
          - {name: lost-adam-state, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4,
             resume: {variant: base, after_step: 0}, inject: reset_optimizer_on_resume, expect: diverge,
             first_divergence: {step: 0, kind: optimizer_state}}
        """))
    proc = run_cli("verify", case, "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = tmp_path / "res" / "runs"
    for v in ("same-layout", "p4-vpp2"):
        trace = json.loads((runs / v / "trace.json").read_text())
        assert [s["step"] for s in trace["steps"]] == [1, 2]          # resumed after step 0
        assert json.loads((runs / v / "comparison.json").read_text())["verdict"] == "pass"
    assert list((runs / "base" / "checkpoint-step0").glob("ckpt_rank*.safetensors"))
    lost = json.loads((runs / "lost-adam-state" / "comparison.json").read_text())
    assert lost["verdict"] == "pass" and (lost["first_divergence"]["step"], lost["first_divergence"]["kind"]) == (0, "optimizer_state")
