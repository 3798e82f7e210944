"""Cross-implementation comparison (harness/crossimpl.py): the reference trainer and megatron-core from identical
weights and data agree within a few ULPs, and a bug that is the same on every layout (so every layout
comparison passes) is caught there."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.crossimpl import scaled_ulp

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests" / "cases" / "megatron-small.yaml"


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
    assert x["first_beyond_bound"]["what"] == "grad"
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
    from harness.crossimpl import CrossImplementationSpec
    from harness.report import junit_xml, render_html, summary_dict
    from harness.results import CaseResult

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
