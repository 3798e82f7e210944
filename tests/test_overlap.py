"""Megatron's 1F1B overlap (overlap_moe_expert_parallel_comm, delay_wgrad_compute): the schedule (merged FB
actions), the node-by-node plans (reference_impl/model/plan.py), bitwise equality with the plain schedules,
a planted defect caught at the right first divergence, and the case loader's one-line refusals."""
import json
import textwrap

import pytest
import torch
from conftest import run_cli, verify_text_once

from reference_impl.model.chunk import Microbatch, StageChunk
from reference_impl.model.linear import Linear, delayed_wgrad, run_wgrad
from reference_impl.model.plan import ChunkPlan, run_combined
from trainerkit.config import ModelConfig
from trainerkit.init import init_parameters
from trainerkit.layout import PipelineLayout
from trainerkit.schedule import ScheduleError, build_schedule, compute_order, grid, simulate, timeline

# --- schedule -------------------------------------------------------------------------------------------------


def _layout(text, pp, layers=8):
    return PipelineLayout.from_string(text, pp, layers, 1)


def test_p1_overlap_pairs_the_next_forward_with_the_previous_backward():
    assert compute_order(1, 1, 4, 0, overlap=True) == [
        ("F", 0, 0), ("FB", (0, 1), (0, 0)), ("FB", (0, 2), (0, 1)), ("FB", (0, 3), (0, 2)), ("B", 0, 3)]
    assert compute_order(1, 1, 1, 0, overlap=True) == [("F", 0, 0), ("B", 0, 0)]


def test_interleaved_overlap_matches_megatron_order():
    """P=2 V=2 M=4: warmup gains one microbatch; steady pairs F(k+W) with B(k) (megatron combined_1f1b)."""
    lists = build_schedule(_layout("Et|tt|ttt|ttmL", 2), 4, 8, 1, 16, overlap=True)
    rows = grid(lists).splitlines()
    assert rows[0].split("|", 1)[1].split() == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "F0.3+B2.0", "F2.2+B2.1",
                                                "F2.3+B0.0", "B0.1", "B2.2", "B2.3", "B0.2", "B0.3"]
    assert rows[1].split("|", 1)[1].split() == ["F1.0", "F1.1", "F3.0", "F3.1+B3.0", "F1.2+B3.1", "F1.3+B1.0",
                                                "F3.2+B1.1", "F3.3+B3.2", "B3.3", "B1.2", "B1.3"]


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 8), (3, 2, 6), (4, 2, 4), (4, 3, 8), (2, 4, 4)])
def test_overlap_schedules_simulate_and_never_pair_one_chunk_microbatch(pp, vpp, m):
    stages = pp * vpp
    layout = _layout("|".join(["Et"] + ["t"] * (stages - 2) + ["tmL"]), pp, stages)
    lists = build_schedule(layout, m, 8, 1, 16, overlap=True)
    simulate(lists)
    merged = [a for actions in lists for a in actions if a.op == "FB"]
    assert merged and all((a.stage, a.microbatch) != (a.b_stage, a.b_microbatch) for a in merged)
    plain = [p for actions in build_schedule(layout, m, 8, 1, 16) for a in actions if a.op in ("F", "B")
             for p in a.parts()]
    over = [p for actions in lists for a in actions if a.op in ("F", "B", "FB") for p in a.parts()]
    assert sorted(plain) == sorted(over)           # the same work, reordered
    cells, _ = timeline(lists)
    assert sum(c.end - c.start for c in cells) == pytest.approx(3 * stages * m)


@pytest.mark.arithmetic_free
def test_simulator_rejects_a_pair_of_the_same_chunk_and_microbatch():
    """Without Megatron's extra warmup microbatch the last rank would pair F and B of one (chunk, mb)."""
    from trainerkit.schedule import Action
    lists = [[Action("FB", 0, 0, b_stage=0, b_microbatch=0), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ScheduleError, match="one chunk and microbatch"):
        simulate(lists)
    lists = [[Action("F", 0, 0), Action("FB", 0, 1, b_stage=0, b_microbatch=1), Action("B", 0, 0)]]
    with pytest.raises(ScheduleError):
        simulate(lists)


@pytest.mark.arithmetic_free
def test_overlap_needs_vpp_when_pipelined():
    with pytest.raises(ScheduleError, match="interleaved layout"):
        build_schedule(_layout("Etttt|ttttmL", 2), 4, 8, 1, 16, overlap=True)


# --- plans (one process, P = 1) ---------------------------------------------------------------------------------

CFG = ModelConfig(num_layers=4, moe_layer_freq="[0]*1+[1]*3", hidden_size=32, mtp_num_layers=1)


def _p1_grads(order: str, delay: bool = False) -> dict:
    """Train one step of 4 microbatches on the P=1 chunk: "plain" (F B per microbatch, one graph each) or
    "overlap" (F0, F1+B0, F2+B1, F3+B2, B3 node by node); returns {name: grad}."""
    layout = PipelineLayout.from_string("Et*4mL", 1, 4, 1)
    chunk = StageChunk(CFG, layout, 0, 4)
    init_parameters(chunk, CFG, seed=1)
    g = torch.Generator().manual_seed(3)
    mbs = [Microbatch(torch.randint(0, CFG.vocab_size, (2, 16), generator=g),
                      torch.randint(0, CFG.vocab_size, (2, 16), generator=g), torch.ones(2, 16), m)
           for m in range(4)]
    for layer in chunk.moe_layers():
        layer.aux_loss_scale = 0.25
    overlap = order == "overlap"
    plans = [ChunkPlan(chunk, None, mb, torch.float32, overlap, delay) for mb in mbs]
    grads: dict = {}

    def flush():
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                grads[name] = grads.get(name, 0) + p.grad
                p.grad = None
    if not overlap:
        for plan in plans:
            plan.forward()
            plan.backward()
            flush()
    else:
        run_combined(plans[0], None, None)
        for m in range(1, 4):
            run_combined(plans[m], plans[m - 1], None)
            flush()
        run_combined(None, plans[3], None)
        flush()
    return grads


def test_node_by_node_equals_one_graph_bitwise():
    plain, over, delayed = _p1_grads("plain"), _p1_grads("overlap"), _p1_grads("overlap", delay=True)
    assert plain.keys() == over.keys() == delayed.keys() and len(plain) > 50
    for name in plain:
        assert torch.equal(plain[name], over[name]), name
        assert torch.equal(plain[name], delayed[name]), name


@pytest.mark.arithmetic_free
def test_plan_nodes_must_run_in_order():
    layout = PipelineLayout.from_string("Et*4mL", 1, 4, 1)
    chunk = StageChunk(CFG, layout, 0, 4)
    mb = Microbatch(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16))
    plan = ChunkPlan(chunk, None, mb, torch.float32, overlap=True)
    with pytest.raises(RuntimeError, match="out of order"):
        plan.forward_node(2)
    plan.forward()
    with pytest.raises(RuntimeError, match="out of order"):
        plan.backward_node(0)


def test_delayed_wgrad_moves_the_weight_gradient_not_its_bits():
    lin = Linear(8, 4)
    x = torch.randn(3, 5, 8, requires_grad=True)
    lin(x).square().sum().backward()
    want_w, want_x = lin.weight.grad.clone(), x.grad.clone()
    lin.weight.grad, x.grad = None, None
    stash: list = []
    with delayed_wgrad(stash):
        lin(x).square().sum().backward()
    assert lin.weight.grad is None and len(stash) == 1 and torch.equal(x.grad, want_x)
    run_wgrad(stash)
    assert torch.equal(lin.weight.grad, want_w) and not stash
    ref = torch.nn.Linear(8, 4, bias=False)
    ref.weight.data.copy_(lin.weight.data)
    assert torch.equal(ref(x), lin(x))


# --- end to end: overlap on vs off, every kind of chunk, a planted defect ---------------------------------------

PLAIN = {
    "with-loss": ('"Et|t|tt|mL"', 2),            # chunk 0: no MoE layer; chunk 1: one; chunk 2: two; MTP + loss
    "standalone": ('"E|t|t|t|t||m|L"', 4),       # empty chunks, one MoE layer per chunk, standalone MTP
    "odd": ('"Et|ttt||mL"', 2),                  # three MoE layers in one chunk, an empty chunk
    "p1": ('"Et*4mL"', 1),
}


def _variants() -> str:
    lines = []
    for name, (layout, pp) in PLAIN.items():
        expect = (", expect: may_diverge, first_divergence: {kind: grad, name: embedding.word_embeddings.weight}"
                  if pp == 1 else "")       # P=1 sums the two embedding uses in another order: may round apart
        lines.append(f"  - {{name: {name}, pipeline_model_parallel_layout: {layout}, "
                     f"pipeline_model_parallel_size: {pp}, compare_to: base{expect}}}")
        lines.append(f"  - {{name: {name}-overlap, pipeline_model_parallel_layout: {layout}, "
                     f"pipeline_model_parallel_size: {pp}, overlap_moe_expert_parallel_comm: true, "
                     f"compare_to: {name}}}")
    lines.append('  - {name: with-loss-overlap-delay, pipeline_model_parallel_layout: "Et|t|tt|mL", '
                 'pipeline_model_parallel_size: 2, overlap_moe_expert_parallel_comm: true, '
                 'delay_wgrad_compute: true, compare_to: with-loss}')
    lines.append('  - {name: standalone-overlap-delay, pipeline_model_parallel_layout: "E|t|t|t|t||m|L", '
                 'pipeline_model_parallel_size: 4, overlap_moe_expert_parallel_comm: true, '
                 'delay_wgrad_compute: true, compare_to: standalone}')
    lines.append('  - {name: planted, pipeline_model_parallel_layout: "Et|t|tt|mL", pipeline_model_parallel_size: 2, '
                 'overlap_moe_expert_parallel_comm: true, compare_to: with-loss, inject: overlap_skips_final_norm, '
                 'expect: diverge, first_divergence: {step: 0, kind: loss, name: lm}}')
    lines.append('  - {name: planted-plain, pipeline_model_parallel_layout: "Et|t|tt|mL", pipeline_model_parallel_size: 2, '
                 'compare_to: with-loss, inject: overlap_skips_final_norm}')
    return "\n".join(lines)


CASE = textwrap.dedent("""\
    name: overlap
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3", hidden_size: 32, mtp_num_layers: 1}
    training: {train_iters: 2, seq_length: 16, micro_batch_size: 2, num_microbatches: 4}
    capture: activations
    baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
    """) + _variants() + "\n"


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    proc, out = verify_text_once(tmp_path_factory, "overlap.yaml", CASE)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    variants = {v["name"]: v for v in json.loads((out / "overlap" / "summary.json").read_text())["variants"]}
    # the timelines live on each run's detail page (runs/<variant>/index.html)
    proc.html = (out / "overlap" / "index.html").read_text() + \
        "".join(p.read_text() for p in sorted((out / "overlap" / "runs").glob("*/index.html")))
    return variants, proc


@pytest.mark.slow
def test_report_names_the_schedule_and_draws_merged_cells(summary):
    variants, proc = summary
    assert variants["with-loss-overlap-delay"]["schedule"] == "interleaved · overlap + delayed wgrad"
    assert variants["with-loss"]["schedule"] == "interleaved" and variants["p1-overlap"]["schedule"] == \
        "no pipelining · overlap"
    assert 'class="cell FB merged' in proc.html and "merged forward | backward" in proc.html


@pytest.mark.slow
def test_overlap_on_equals_off_bitwise_on_every_chunk_kind(summary):
    variants, proc = summary
    assert proc.returncode == 0, proc.stdout
    for name in PLAIN:
        for v in (f"{name}-overlap",) + ((f"{name}-overlap-delay",) if f"{name}-overlap-delay" in variants else ()):
            assert variants[v]["verdict"] == "pass" and variants[v]["bitwise_equal"], v


@pytest.mark.slow
def test_planted_overlap_defect_is_caught_at_the_first_loss_and_localised(summary):
    variants, _ = summary
    planted = variants["planted"]
    assert planted["verdict"] == "pass"        # it diverges, as its expectation says
    first = planted["first_divergence"]
    assert (first["step"], first["kind"], first["name"], first["microbatch"]) == (0, "loss", "lm", 0), first
    assert "localised: final norm output" in planted["reason"], planted["reason"]
    assert variants["planted-plain"]["bitwise_equal"]  # the defect lives on the overlapped path only


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("variant,message", [
    ('{name: v, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2, '
     'overlap_moe_expert_parallel_comm: true}', "needs an interleaved layout"),
    ('{name: v, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2, '
     'delay_wgrad_compute: true}', "delay_wgrad_compute needs overlap_moe_expert_parallel_comm"),
])
def test_impossible_overlap_configs_are_one_line_errors(tmp_path, variant, message):
    case = CASE.split("variants:")[0] + "variants:\n  - " + variant + "\n"
    (tmp_path / "bad.yaml").write_text(case)
    proc = run_cli("verify", tmp_path / "bad.yaml", "--out", tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.arithmetic_free
def test_overlap_restrictions_on_the_model():
    from trainerkit.config import overlap_problem
    assert overlap_problem(CFG, True, True) is None
    assert "at most one MTP layer" in overlap_problem(CFG.model_copy(update={"mtp_num_layers": 2}), True, False)
    dense_last = CFG.model_copy(update={"moe_layer_freq": "[1]*3+[0]*1"})
    assert "MoE layer inside the MTP layer" in overlap_problem(dense_last, True, False)


@pytest.mark.slow
def test_reproduce_command_repeats_a_fault_planted_from_the_command_line(tmp_path):
    proc = run_cli("verify", "cases/overlap-ep.yaml", "--only", "standalone-overlap", "--inject",
                   "overlap_skips_final_norm", "--out", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    runs = tmp_path / "overlap-ep" / "runs"
    command = json.loads((runs / "standalone-overlap" / "manifest.json").read_text())["command"]
    assert command.endswith("--inject overlap_skips_final_norm")
    assert "--inject" not in json.loads((runs / "base" / "manifest.json").read_text())["command"]  # clean baseline
