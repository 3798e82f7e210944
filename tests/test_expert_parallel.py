"""Expert parallelism (reference_impl/model/expert_parallel.py): EP = 1 and EP > 1 are bitwise equal.

* unit: the dispatch plan gives every expert exactly EP = 1's rows in EP = 1's order; names and replica tags;
* two gloo processes: TakeShard / AllToAll / GatherShards are exact (uneven and zero splits), and an MoE layer
  split over EP = 2 reproduces the EP = 1 layer bit for bit (output, input gradient, every gradient it
  holds, token counts), fp32 and bf16;
* end to end (one case, run once): EP = 2 / 4 vs EP = 1 on P = 1, P = 2 and P = 2 V = 2 layouts, with the
  1F1B overlap, megatron reductions without clipping and canonical reductions with clipping; resumes from an
  EP = 1 checkpoint under EP = 2 and back; megatron reductions with clipping may diverge only at the grad norm (the per-rank partial sums
  move); the planted fault ``ep_unsorted_dispatch`` is caught at step 0 where it moves a bit; EP
  replicas whose records differ fail the trace merge; bad EP sizes are one-line usage errors.
"""
import json
import math
import multiprocessing as mp
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli, verify_text_once
from test_cli_errors import _check_usage_error

from harness.judging.trace import TraceError, merge
from reference_impl.model import grouped
from reference_impl.model.expert_parallel import (
    ExpertParallel,
    PermuteRows,
    expert_counts,
    plan_dispatch,
    sort_chunks,
    unsort_chunks,
)
from reference_impl.model.moe import MoELayer
from trainerkit import names
from trainerkit.config import ModelConfig
from trainerkit.init import init_parameters

CFG = dict(hidden_size=32, num_moe_experts=8, moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=2)


# --- unit: the dispatch plan ---------------------------------------------------------------------------------

def _routing(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


def _ep1_rows(index, e):
    """Token ids each expert receives with EP = 1 (stable sort of the (token, k) rows by expert)."""
    t, k = index.shape
    order = torch.argsort(index.reshape(-1), stable=True)
    tokens = torch.arange(t).repeat_interleave(k)[order]
    return list(tokens.split(torch.bincount(index.reshape(-1), minlength=e).tolist()))


@pytest.mark.parametrize("ep_size", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_expert_gets_ep1_rows_in_ep1_order(ep_size, seed):
    e, k, t = 8, 2, 32
    index = _routing(t, e, k, seed)
    index[:4] = torch.tensor([0, 1])            # some experts take rows from several sources, one maybe none
    n = t // ep_size
    eps = [ExpertParallel(ep_size, r) for r in range(ep_size)]
    plans = [plan_dispatch(index, e, ep) for ep in eps]
    assert all(torch.equal(p.counts, plans[0].counts) for p in plans)        # identical on every EP rank
    # what each source sends: its shard's (token, k) rows sorted by expert, as token ids
    sent = [torch.arange(r * n, (r + 1) * n).repeat_interleave(k)[plans[r].order].float().unsqueeze(1)
            for r in range(ep_size)]
    for r, plan in enumerate(plans):
        assert sum(plan.in_splits) == n * k
        # the all-to-all: from every source its rows for rank r's experts, in source order
        received = torch.cat([s.split(plans[src].in_splits)[r] for src, s in enumerate(sent)])
        assert received.shape[0] == sum(plan.out_splits)
        rows, counts = sort_chunks(received, plan)
        inputs = rows.split(counts)
        expected = _ep1_rows(index, e)[r * (e // ep_size):(r + 1) * (e // ep_size)]
        assert [x.squeeze(1).long().tolist() for x in inputs] == [x.tolist() for x in expected]
        assert rows.is_contiguous() and all(x.is_contiguous() for x in inputs)
        assert torch.equal(unsort_chunks(inputs, plan), received)             # unsort inverts sort


@pytest.mark.parametrize("shape", [(0,), (1,), (64,), (4, 16), (2, 3, 5)])
def test_expert_counts_equal_bincount(shape):
    index = torch.randint(0, 8, shape, generator=torch.Generator().manual_seed(len(shape)))
    if index.numel():
        index.view(-1)[0] = 7                       # the last expert used, so a missing column would show
    got = expert_counts(index, 8)
    assert got.dtype == torch.int64 and got.shape == shape[:-1] + (8,)
    rows = index.reshape(math.prod(shape[:-1]), shape[-1])
    want = torch.stack([torch.bincount(r, minlength=8) for r in rows])
    assert torch.equal(got.reshape(-1, 8), want)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_permute_rows_backward_has_index_selects_bits(dtype, device):
    """`PermuteRows`' gather backward gives the bits of autograd's index_select backward (a scatter into zeros):
    -0.0 becomes +0.0 in both, NaN payloads come through alike, every other value unchanged."""
    g = torch.Generator().manual_seed(4)
    order = torch.randperm(12, generator=g)
    inverse = torch.argsort(order)
    x = torch.randn(12, 5, generator=g).to(dtype)
    grad = torch.randn(12, 5, generator=g).to(dtype)
    grad[0, 0], grad[1, 1], grad[2, 2] = -0.0, float("nan"), 0.0
    grad.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[3, 3] = -1       # a NaN with a payload
    order, inverse, x, grad = (t.to(device) for t in (order, inverse, x, grad))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = PermuteRows.apply(got, order, inverse)
    ref = want.index_select(0, order)
    assert torch.equal(out.view(bits), ref.view(bits))
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(got.grad.view(bits), want.grad.view(bits))
    assert (got.grad.view(bits) == 0).sum() == 2                                        # both zeros now +0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_moe_layer_reads_the_device_only_for_the_split_sizes(dtype):
    """EP = 1: the grouped path reads nothing to the host (the group offsets stay on the device); the per-expert
    loop reads the split sizes once per forward (Megatron's SequentialMLP reads them too).  The group mask, the
    aux loss's routed mask and the tokens per expert stay on the device (`id_mask`: with bincount and indexed
    stores there were 6 reads per forward, measured on an H200).  torch.cuda's sync debug mode warns at every
    synchronising call, from the Python line that made it.

    fp32 on CUDA: torch's ``_grouped_mm`` for fp32 reads its offsets itself on every call (2 reads per forward, 4
    per backward on an H100, torch 2.11; the bf16 kernel reads none), so there every read must come from a
    ``torch._grouped_mm`` line of `grouped` and none from this trainer's own code."""
    import linecache
    import warnings
    cfg = ModelConfig(**CFG)
    layer = MoELayer(cfg).cuda()
    init_parameters(layer, cfg, 5)
    layer.to(dtype)
    x = torch.randn(16, 2, cfg.hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    layer(x).sum().backward()                     # warm-up: lazy CUDA / cuBLAS initialisation
    torch.cuda.synchronize()

    def syncs(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (not the one-time "Synchronization debug mode is a prototype feature ..." notice)
        return out, [(w.filename, linecache.getline(w.filename, w.lineno).strip()) for w in caught
                     if str(w.message).startswith("called a synchronizing CUDA operation")]

    out, forward = syncs(lambda: layer(x))
    _, backward = syncs(lambda: out.sum().backward())
    if not grouped.use_grouped(x.view(-1, cfg.hidden_size), list(layer.experts.values())):
        assert (len(forward), len(backward)) == (1, 0), (forward, backward)
    elif dtype == torch.bfloat16:
        assert (forward, backward) == ([], [])
    else:
        mine = Path(grouped.__file__).resolve()
        assert all(Path(f).resolve() == mine and "torch._grouped_mm(" in line for f, line in forward + backward), \
            (forward, backward)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm (the loop reads)")
def test_ep1_moe_layer_never_reads_a_tensor_to_the_host(monkeypatch):
    """EP = 1 with grouped experts: the group offsets come from the plan's counts on the device, so neither the
    forward nor the backward turns a tensor into host numbers (on CUDA each would wait for the device).  The
    CPU run shows it: ``tolist`` / ``item`` / ``__int__`` raise while the layer runs."""
    cfg = ModelConfig(**CFG)
    layer = MoELayer(cfg)
    init_parameters(layer, cfg, 5)
    x = torch.randn(16, 2, cfg.hidden_size, requires_grad=True)

    def read(*_):
        raise AssertionError("a host read in the EP = 1 MoE layer")
    for name in ("tolist", "item", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    layer(x).sum().backward()
    monkeypatch.undo()
    assert x.grad is not None and layer.experts["0"].linear_fc1.weight.grad is not None


def test_planted_unsorted_dispatch_reorders_rows_only_with_ep():
    index = _routing(16, 8, 2, 3)
    plan = plan_dispatch(index, 8, ExpertParallel(2, 0), shuffle_sources=True)
    x = torch.arange(sum(plan.out_splits), dtype=torch.float32).unsqueeze(1)
    rows, counts = sort_chunks(x, plan)
    inputs = rows.split(counts)
    assert torch.equal(unsort_chunks(inputs, plan), x)                          # rows still go home
    good, good_counts = sort_chunks(x, plan_dispatch(index, 8, ExpertParallel(2, 0)))
    assert counts == good_counts and not torch.equal(rows, good)               # but experts see another order
    assert not plan_dispatch(index, 8, None, shuffle_sources=True).shuffle_sources


def test_local_experts_and_layer_keeps_global_names():
    assert ExpertParallel(4, 2).local_experts(8) == range(4, 6)
    with pytest.raises(ValueError):
        ExpertParallel(3, 0).local_experts(8)
    cfg = ModelConfig(**CFG)
    layer = MoELayer(cfg)
    layer.set_expert_parallel(ExpertParallel(2, 1))
    assert sorted(layer.experts) == ["4", "5", "6", "7"]
    assert "experts.5.linear_fc1.weight" in dict(layer.named_parameters())
    assert sorted(MoELayer(cfg, ExpertParallel(4, 0)).experts) == ["0", "1"]


def test_names_of_ep_replicas():
    assert names.expert_id("decoder.layers.3.mlp.experts.5.linear_fc2.weight") == 5
    assert names.expert_id("mtp.layers.0.transformer_layer.mlp.experts.7.linear_fc1.weight") == 7
    assert names.expert_id("decoder.layers.3.mlp.shared_experts.linear_fc1.weight") is None
    assert [names.ep_replica(r, e) for r, e in ((None, 0), ("mtp", 0), (None, 1), ("mtp", 3))] == \
        [None, "mtp", "ep1", "mtp.ep3"]
    assert [names.base_replica(r) for r in (None, "mtp", "ep1", "mtp.ep3")] == [None, "mtp", None, "mtp"]


# --- two gloo processes --------------------------------------------------------------------------------------

def _moe(cfg, dtype, ep=None):
    layer = MoELayer(cfg)
    init_parameters(layer, cfg, 3)
    layer.set_expert_parallel(ep)
    return layer.to(dtype)


def _worker(rank, world, store_path, out_path):
    """Runs in a spawned process: the collectives, then the EP = 2 MoE layer against EP = 1."""
    import torch.distributed as dist

    from reference_impl.model.expert_parallel import AllToAll, GatherShards, TakeShard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    ep = ExpertParallel.build(1, world, rank)
    res = {}
    # TakeShard / GatherShards: forward slices / concatenates, backward the exact transposes
    x = torch.arange(24, dtype=torch.float32).view(8, 3).requires_grad_()
    shard = TakeShard.apply(x, ep)
    res["take"] = torch.equal(shard, x.detach()[rank * 4:(rank + 1) * 4])
    full = GatherShards.apply(shard * (rank + 1), ep)
    res["gather"] = torch.equal(full, torch.cat([x.detach()[:4], 2 * x.detach()[4:]]))
    g = torch.linspace(-1, 1, 24).view(8, 3)
    full.backward(g)
    res["take_gather_grad"] = torch.equal(x.grad, torch.cat([g[:4], 2 * g[4:]]))
    # AllToAll with uneven and zero splits: rank 0 sends 3 rows to 0, 0 to 1; rank 1 sends 1 to 0, 2 to 1
    in_splits = [[3, 0], [1, 2]][rank]
    out_splits = [[3, 1], [0, 2]][rank]
    y = (torch.arange(sum(in_splits) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank).requires_grad_()
    z = AllToAll.apply(y, out_splits, in_splits, ep)
    rows0, rows1 = torch.arange(6.).view(3, 2), torch.arange(6.).view(3, 2) + 100
    res["a2a"] = torch.equal(z, [torch.cat([rows0, rows1[:1]]), rows1[1:]][rank])
    (z * (torch.arange(z.numel(), dtype=torch.float32).view_as(z) + 1)).sum().backward()
    expect = {0: torch.tensor([[1., 2], [3, 4], [5, 6]]), 1: torch.tensor([[7., 8], [1, 2], [3, 4]])}[rank]
    res["a2a_grad"] = torch.equal(y.grad, expect)
    # the MoE layer: EP = 2 against EP = 1, same input and output gradient on both ranks
    cfg = ModelConfig(**CFG, moe_aux_loss_coeff=1e-2)
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(7)
        x0 = torch.randn(16, 2, cfg.hidden_size, generator=gen).to(dtype)
        gy = torch.randn(16, 2, cfg.hidden_size, generator=gen).to(dtype)
        ref, mine = _moe(cfg, dtype), _moe(cfg, dtype, ep)
        xr, xm = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        yr, ym = ref(xr), mine(xm)
        yr.backward(gy)
        ym.backward(gy)
        rp = dict(ref.named_parameters())
        tag = str(dtype).replace("torch.", "")
        res[f"{tag}_out"] = torch.equal(yr, ym)
        res[f"{tag}_xgrad"] = torch.equal(xr.grad, xm.grad)
        res[f"{tag}_grads"] = [n for n, p in mine.named_parameters() if not torch.equal(p.grad, rp[n].grad)]
        res[f"{tag}_experts"] = sorted(mine.experts, key=int)
        res[f"{tag}_counts"] = torch.equal(ref.router.tokens_per_expert, mine.router.tokens_per_expert)
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(res))


def test_collectives_and_moe_layer_on_two_processes(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "store"), str(tmp_path / f"r{r}.json")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        res = json.loads((tmp_path / f"r{r}.json").read_text())
        for key in ("take", "gather", "take_gather_grad", "a2a", "a2a_grad"):
            assert res[key] is True, (r, key)
        for dtype in ("float32", "bfloat16"):
            assert res[f"{dtype}_experts"] == [str(e) for e in range(4 * r, 4 * r + 4)]
            assert res[f"{dtype}_out"] and res[f"{dtype}_xgrad"] and res[f"{dtype}_counts"], (r, dtype, res)
            assert res[f"{dtype}_grads"] == [], (r, dtype)


# --- end to end ------------------------------------------------------------------------------------------------

P2 = 'pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2'
P2V2 = 'pipeline_model_parallel_layout: "Et|tt|t|mL", pipeline_model_parallel_size: 2'
P1 = 'pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1'
CCLIP = "options: {reductions: canonical, clip_grad: 0.05}"
CASE = textwrap.dedent(f"""\
    name: ep
    timeout_s: 120
    model: {{num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}}
    training: {{train_iters: 2, seq_length: 16, num_microbatches: 4}}
    baseline: {{name: p2, {P2}}}
    variants:
      # megatron reductions, clipping off
      - {{name: p2-ep2, {P2}, expert_model_parallel_size: 2}}
      - {{name: p2v2-ep4, {P2V2}, expert_model_parallel_size: 4}}
      - {{name: p2v2-ep2-overlap, {P2V2}, expert_model_parallel_size: 2, overlap_moe_expert_parallel_comm: true,
         delay_wgrad_compute: true}}
      # P=1 sums its two embedding lookups' gradients per microbatch: a value-dependent rounding
      - {{name: p1, {P1}, expect: may_diverge, first_divergence: {{kind: grad,
                                                                   name: embedding.word_embeddings.weight}}}}
      - {{name: p1-ep2, {P1}, expert_model_parallel_size: 2, compare_to: p1}}
      - {{name: resume-ep2, {P2V2}, expert_model_parallel_size: 2, resume: {{variant: p2, after_step: 0}}}}
      - {{name: resume-from-ep2, {P2V2}, resume: {{variant: p2-ep2, after_step: 0}}}}
      # megatron reductions, clipping on: the experts' partial norms move to other ranks
      #   (whether a regrouped norm, or Adam's update of a rescaled gradient, moves a bit depends on the values)
      - {{name: clip/p2, {P2}, options: {{clip_grad: 0.05}}, expect: may_diverge,
         first_divergence: [{{kind: optimizer_state}}, {{kind: param}}]}}
      - {{name: clip/p2-ep2, {P2}, expert_model_parallel_size: 2, options: {{clip_grad: 0.05}}, compare_to: clip/p2,
         expect: may_diverge, first_divergence: {{kind: grad_norm}}}}
      # canonical reductions, clipping on: EP- and layout-invariant
      - {{name: cclip/p2, {P2}, {CCLIP}, expect: may_diverge,
         first_divergence: [{{kind: optimizer_state}}, {{kind: param}}]}}
      - {{name: cclip/p2-ep2, {P2}, expert_model_parallel_size: 2, {CCLIP}, compare_to: cclip/p2}}
      - {{name: cclip/p1-ep2, {P1}, expert_model_parallel_size: 2, {CCLIP}, compare_to: cclip/p2}}
      # planted fault: fails with EP = 2, inactive with EP = 1
      - {{name: unsorted, {P2}, expert_model_parallel_size: 2, inject: ep_unsorted_dispatch}}
      - {{name: unsorted-ep1, {P2}, inject: ep_unsorted_dispatch}}
    """)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    proc, out = verify_text_once(tmp_path_factory, "ep.yaml", CASE)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # the planted fault may fail, nothing else
    return out / "ep"


def _verdicts(report):
    return {v["name"]: v for v in json.loads((report / "summary.json").read_text())["variants"]}


EQUAL = ["p2-ep2", "p2v2-ep4", "p2v2-ep2-overlap", "p1-ep2", "resume-ep2", "resume-from-ep2", "cclip/p2-ep2",
         "cclip/p1-ep2", "unsorted-ep1"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", EQUAL)
def test_ep_is_bitwise_equal_to_ep1(report, variant):
    v = _verdicts(report)[variant]
    assert v["verdict"] == "pass" and v["bitwise_equal"] is True, v["reason"]


@pytest.mark.slow
def test_every_verdict_but_the_fault_passes(report):
    bad = {n: v["reason"] for n, v in _verdicts(report).items() if v["verdict"] != "pass"}
    assert set(bad) <= {"unsorted"}, bad


@pytest.mark.slow
def test_ep_trace_layout(report):
    trace = json.loads((report / "runs" / "p2-ep2" / "trace.json").read_text())
    assert trace["world_size"] == 4 and trace["expert_model_parallel_size"] == 2
    params = trace["params"]
    # global rank = pp_rank * EP + ep_rank; experts 0-3 on ep rank 0, 4-7 on ep rank 1, keyed by global id
    assert params["decoder.layers.1.mlp.experts.3.linear_fc1.weight"]["rank"] == 0
    assert params["decoder.layers.1.mlp.experts.4.linear_fc1.weight"]["rank"] == 1
    assert params["decoder.layers.3.mlp.experts.7.linear_fc2.weight"]["rank"] == 3
    assert params["decoder.layers.1.mlp.router.weight@ep1"]["rank"] == 1
    assert "embedding.word_embeddings.weight@mtp.ep1" in params
    assert not any("experts." in k and "shared" not in k and "@" in k for k in params)
    # EP = 1's canonical order keys
    base = json.loads((report / "runs" / "p2" / "trace.json").read_text())
    assert all(params[k]["order"] == meta["order"] for k, meta in base["params"].items())
    cmp = json.loads((report / "runs" / "p2-ep2" / "comparison.json").read_text())
    assert cmp["replica_status"]["consistent"] is True
    assert len(cmp["replica_status"]["replicas"]) > 50      # every non-expert parameter of ep rank 1


@pytest.mark.slow
def test_planted_unsorted_dispatch_is_caught_at_step_0(report):
    v = _verdicts(report)["unsorted"]
    fd = v["first_divergence"]
    # the fault only reorders the rows each expert's GEMMs see: hundreds of elements that may each round
    # differently; whether any does depends on the values and the BLAS (may differ, only here)
    if v["bitwise_equal"]:
        pytest.skip("the reordered expert GEMMs round alike on this machine: the fault has no effect here")
    assert v["verdict"] == "fail" and fd["step"] == 0, fd
    # which tensor comes first is value- and BLAS-dependent, so no name is asserted: most BLAS compute a GEMM row
    # independently of its position, so only the weight-gradient sums move (a routed expert's gradient);
    # MKL_CBWR=COMPATIBLE rounds a row by its position too, so an expert's forward output may move, and with it the
    # head's gradient (first in dataflow order) or a loss (measured on the CI machine: output_layer.weight)
    assert fd["kind"] in ("loss", "grad"), fd


@pytest.mark.slow
def test_replica_ranks_must_agree_with_ep_rank_0(report, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(report / "runs" / "p2-ep2", run)
    merge(run, 4)                                               # the real run merges
    lines = (run / "rank3.jsonl").read_text().splitlines()      # pp rank 1, ep rank 1: the loss stage replica
    step = json.loads(lines[2])
    step["losses"][1]["lm"]["hex"] = "0x00000000"
    lines[2] = json.dumps(step)
    (run / "rank3.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"rank 3 \(pp rank 1, ep rank 1\): losses at step 0 differs"):
        merge(run, 4)


@pytest.mark.slow
def test_activation_capture_with_ep(tmp_path):
    case = tmp_path / "act.yaml"
    case.write_text(textwrap.dedent(f"""\
        name: act
        capture: activations
        model: {{num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}}
        training: {{train_iters: 1, seq_length: 16, num_microbatches: 2}}
        baseline: {{name: p2, {P2}}}
        variants:
          - {{name: p2-ep2, {P2}, expert_model_parallel_size: 2}}
        """))
    proc = run_cli("verify", case, "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trace = json.loads((tmp_path / "act" / "runs" / "p2-ep2" / "trace.json").read_text())
    assert "0/decoder.layers.2.output" in trace["steps"][0]["activations"]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("change, fragment", [
    ("expert_model_parallel_size: 3", "num_moe_experts=8 is not divisible by expert_model_parallel_size=3"),
    ("expert_model_parallel_size: 4", "seq_length*micro_batch_size=6 is not divisible by expert_model_parallel_size=4"),
])
def test_bad_ep_size_is_one_line(tmp_path, cli, change, fragment):
    case = tmp_path / "case.yaml"
    case.write_text(textwrap.dedent(f"""\
        name: t
        model: {{num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}}
        training: {{train_iters: 1, seq_length: 6, micro_batch_size: 1, num_microbatches: 4}}
        baseline: {{name: base, {P2}}}
        variants:
          - {{name: v, {P2}, {change}}}
        """))
    out = tmp_path / "reports"
    _check_usage_error(cli("verify", case, "--out", out), out, str(case), "variant 'v'", fragment)
