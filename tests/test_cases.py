"""Case files: anchors, `extends`, overrides, compare_to, --only closure."""
import pytest
from conftest import ROOT

from harness.errors import UsageError
from harness.planning.cases import load_case


def test_dsv3_matrix_plan():
    plan = load_case(ROOT / "cases" / "dsv3.yaml")
    par = [r.config.parallel for r in plan.runs]
    plain = [p for p in par if not p.overlap_moe_expert_parallel_comm and p.expert_model_parallel_size == 1]
    assert len(plain) == 20                     # 5 layouts x clipping off/on x megatron/canonical
    overlap = {r.spec.name: r.config.parallel for r in plan.runs if r.spec.name.startswith("overlap/")}
    assert len(overlap) == 4 and all(p.overlap_moe_expert_parallel_comm for p in overlap.values())
    assert overlap["overlap/pp16-vpp2-mtp-standalone"].delay_wgrad_compute
    by = {r.spec.name: r for r in plan.runs}
    assert by["canonical-clip/pp1-no-pipelining"].config.training.reductions == "canonical"
    assert by["canonical-clip/pp1-no-pipelining"].config.training.clip_grad == 0.05
    assert by["clip/pp8-vpp4-mtp-standalone"].layout.virtual_pipeline_model_parallel_size == 4
    assert by["pp16-vpp2-mtp-with-loss"].layout.mtp_standalone is False


def test_gpu_case_extends_dsv3():
    plan = load_case(ROOT / "cases" / "dsv3-gpu.yaml", overrides={"device": "cpu"})
    base = plan.runs[0].config
    assert (plan.name, base.model.hidden_size, base.model.num_layers, base.training.seq_length) == \
        ("dsv3-gpu", 256, 61, 128)
    assert base.params_dtype == "bfloat16"
    assert [r.spec.name for r in plan.runs] == [r.spec.name for r in load_case(ROOT / "cases" / "dsv3.yaml").runs]


def test_only_keeps_reference_runs():
    plan = load_case(ROOT / "cases" / "dsv3.yaml", only=["canonical-clip/pp1-no-pipelining"])
    assert [r.spec.name for r in plan.runs] == ["pp16-vpp2-mtp-standalone", "clip/pp16-vpp2-mtp-standalone",
                                                "canonical-clip/pp16-vpp2-mtp-standalone",
                                                "canonical-clip/pp1-no-pipelining"]


def test_extends_cycle_and_bad_compare_to(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(UsageError, match="cycle"):
        load_case(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text(
        "model: {num_layers: 4}\nbaseline: {name: b, pipeline_model_parallel_layout: 'Ett|ttmL', "
        "pipeline_model_parallel_size: 2}\nvariants:\n  - {name: v, pipeline_model_parallel_layout: 'Ett|ttmL', "
        "pipeline_model_parallel_size: 2, compare_to: nobody}\n")
    with pytest.raises(UsageError, match="compare_to 'nobody' is not a variant"):
        load_case(tmp_path / "c.yaml")
