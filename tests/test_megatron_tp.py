"""Tensor + sequence parallelism in the megatron trainer (cases/megatron-proxy.yaml: Megatron's DeepSeek-V3 proxy
configuration at tiny size; megatron_trainer.model.tp_shards, megatron_trainer.compat_tp,
trainerkit.fingerprint_shard):

* the case passes with its stated outcomes on the installed megatron-core: layouts at TP = 2 bitwise (PR #2136's
  check 2), the distributed optimizer bitwise with plain DDP, the 1F1B overlap bitwise, TP = 1 may differ only
  as stated; on < 0.17 the expert replicas drift as Megatron-LM cd4afffa64 says;
* its runs really were sharded both ways: TP slices (two pieces for a gated fc1) and distributed-optimizer
  ranges within them are partial records, the norms are @tp1 replicas checked bitwise, TP rank 1 records no
  losses;
* planted, each caught: a TP slice fingerprinted at the wrong offset (bitparity's own code) is a trace error
  naming the key and the ranks; a norm's gradient not all-reduced over the TP ranks (a megatron copy) makes
  the TP copies of the norms train apart from step 0;
* bad TP input is one line, exit 2.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, refusal, run_cli, variants, verify_once  # noqa: E402
from planted import planted_megatron, planted_tree, run_planted  # noqa: E402

CASE = ROOT / "cases" / "megatron-proxy.yaml"
FINALIZE = "megatron/core/distributed/finalize_model_grads.py"

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


def _summary(out):
    return variants(out / "megatron-proxy")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    proc, out = verify_once(tmp_path_factory, CASE)
    return proc, _summary(out), out / "megatron-proxy" / "runs"


def test_the_proxy_case_passes_with_its_stated_outcomes(proxy):
    proc, v, _ = proxy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert all(x["verdict"] == "pass" for x in v.values()), {k: (x["verdict"], x["reason"]) for k, x in v.items()}
    for name in ("proxy-p4-mtp-with-loss", "proxy-p4v2-plain-ddp", "proxy-p4v2-1f1b-overlap"):
        assert v[name]["outcome"] == "equal", (name, v[name]["outcome"])
    assert "TP=2 SP" in proc.stdout


def test_tp_2_is_within_its_ulp_bound_of_tp_1_and_says_so(proxy):
    """The case's cross_implementation with `against`: megatron-core at TP = 2 vs TP = 1, one trainer's two runs
    at step 0, every loss and gradient within the stated bound (measured: losses 1 ULP, gradients 5e4 ULP at
    tensor scale; the bound 2^19)."""
    proc, _, runs = proxy
    cross = json.loads((runs.parent / "summary.json").read_text())["cross_implementation"]
    assert cross["verdict"] == "pass", cross["reason"]
    assert cross["trainers"] == ["proxy-p4v2-mtp-standalone", "proxy-p4v2-tp1"], cross["trainers"]
    assert cross["headline"]["loss_max_ulp"] <= 16 and cross["headline"]["tensors"] > 100, cross["headline"]
    assert "proxy-p4v2-mtp-standalone vs proxy-p4v2-tp1" in proc.stdout


@pytest.mark.newest_megatron
@pytest.mark.parametrize("against, fragment", [
    ("nope", "against: 'nope' is not a variant"),
    ("proxy-p4v2-mtp-standalone", "is the variant itself"),
])
def test_a_bad_against_is_one_line(tmp_path, against, fragment):
    (tmp_path / "bad.yaml").write_text(f"extends: {CASE}\nname: bad\ncross_implementation: "
                                       f"{{variant: proxy-p4v2-mtp-standalone, against: {against}, step: 0}}\n")
    proc = run_cli("verify", tmp_path / "bad.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


def _headers(run_dir):
    return [json.loads(f.read_text().splitlines()[0]) for f in sorted(run_dir.glob("rank*.jsonl"))]


def test_tp_slices_and_their_distributed_optimizer_ranges_are_partials_and_norms_are_tp_replicas(proxy):
    _, _, runs = proxy
    headers = _headers(runs / "proxy-p4v2-mtp-standalone")
    assert len(headers) == 16 and {h["tensor_model_parallel_size"] for h in headers} == {2}
    shards = {p["key"]: p["shard"] for h in headers for p in h["params"] if "shard" in p}
    fc1 = shards["decoder.layers.0.mlp.linear_fc1.weight"]          # [gate_r; up_r] within the TP x DP range
    assert fc1["dim"] == 0 and len(fc1["pieces"]) == 2 and "within" in fc1, fc1
    assert shards["decoder.layers.0.self_attention.linear_proj.weight"]["dim"] == 1
    keys = {p["key"] for h in headers for p in h["params"]}
    assert "decoder.layers.0.input_layernorm.weight@tp1" in keys
    assert "decoder.layers.1.mlp.router.weight@tp1" in keys
    trace = json.loads((runs / "proxy-p4v2-mtp-standalone" / "trace.json").read_text())
    assert all(isinstance(fp, str) for st in trace["steps"] for fp in st["grads"].values())
    assert len(trace["steps"][0]["losses"]) == 8          # 4 microbatches x DP 2, once per TP group
    status = json.loads((runs / "proxy-p4v2-mtp-standalone" / "comparison.json").read_text())["replica_status"]
    assert status["consistent"] and any(k.endswith("@tp1") for k in status["replicas"]), status


def test_the_expert_gradient_bug_of_megatron_core_before_0_17_is_caught_as_replica_drift(proxy):
    import megatron.core
    from packaging.version import Version
    _, v, _ = proxy
    run = v["expert-tp-bug/proxy-p4v2-ep1"]
    if Version(megatron.core.__version__) < Version("0.17"):
        assert not run["replica_status"]["consistent"], run["replica_status"]
        assert run["replica_status"]["replica"].endswith("experts.0.linear_fc1.weight@edp1"), run["replica_status"]
    else:
        assert run["replica_status"]["consistent"], run["replica_status"]


# tp_shards places rank r's slice at offset 0 instead of r x part: two TP ranks claim the same elements
_OFFSET = ("            out[id(weight)] = Shard(shape, dim, rank * part, ((rank * part, part),))",
           "            out[id(weight)] = Shard(shape, dim, 0, ((0, part),))")


@pytest.mark.newest_megatron
def test_a_tp_slice_at_the_wrong_offset_is_a_trace_error_naming_key_and_ranks(tmp_path):
    tree = planted_tree(tmp_path / "tree", {"megatron_trainer/model.py": [_OFFSET]})
    proc = run_planted(tree, "verify", CASE, "--out", tmp_path / "out", "--only", "proxy-p4-mtp-with-loss",
                       timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    run = _summary(tmp_path / "out")["proxy-p4-mtp-with-loss"]
    assert run["verdict"] == "error" and "held by two shards" in run["reason"], run["reason"]
    assert "ranks [" in run["reason"] and "weight" in run["reason"], run["reason"]


# finalize_model_grads drops the all-reduce over the TP group of the sequence-parallel parameters' gradients (the
# norms, the routers): each TP rank steps its copy with its own half of the sequence's gradient
_TP_REDUCE = "            torch.distributed.all_reduce(coalesced, op=all_reduce_op, group=tp_group)\n"
_TP_REDUCE_DROPPED = "            pass  # planted: the TP all-reduce of the norms' gradients is gone\n"


@pytest.mark.newest_megatron
def test_a_norm_gradient_not_reduced_over_tp_makes_the_tp_copies_drift_at_step_0(tmp_path):
    head = planted_megatron(tmp_path / "mlm", {FINALIZE: [(_TP_REDUCE, _TP_REDUCE_DROPPED)]})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--megatron-head", head, "--only",
                   "proxy-p4-mtp-with-loss", timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    run = _summary(tmp_path / "out")["proxy-p4-mtp-with-loss"]
    status = run["replica_status"]
    assert run["verdict"] == "fail" and not status["consistent"], run
    assert status["first_broken_step"] == 0 and status["replica"].endswith("@tp1"), status
    assert "gradient at step 0" in status["detail"], status


@pytest.mark.newest_megatron
@pytest.mark.parametrize("variant, fragment", [
    ({"sequence_parallel": True}, "sequence_parallel splits activations over the tensor-parallel ranks"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 2,
      "expert_model_parallel_size": 2, "data_parallel_size": 2}, "does not run over gloo"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "trainer": "reference"},
     "the reference trainer holds every matrix whole"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1,
      "expert_model_parallel_size": 8}, "does not divide tensor_model_parallel_size x data_parallel_size"),
])
def test_bad_tensor_parallel_input_is_one_line(tmp_path, variant, fragment):
    assert fragment in refusal(_bad_tp_case(tmp_path, variant))


@pytest.mark.newest_megatron
def test_bad_tensor_parallel_input_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    case = _bad_tp_case(tmp_path, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                   "expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2,
                                   "data_parallel_size": 2})
    proc = run_cli("verify", case, "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not run over gloo" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "bad").exists()


def _bad_tp_case(tmp_path, variant: dict):
    fields = {"name": "bad", "pipeline_model_parallel_layout": "Et|t|t|t|t|tmL", "pipeline_model_parallel_size": 2,
              **variant}
    (tmp_path / "bad.yaml").write_text(
        f"extends: {CASE}\nname: bad\nvariants:\n  - {json.dumps(fields)}\n")
    return tmp_path / "bad.yaml"


@pytest.mark.newest_megatron
@pytest.mark.parametrize("variant, model, fragment", [
    ({"sequence_parallel": False}, {}, "needs sequence_parallel: true"),
    ({"options": {"seq_length": 7}}, {}, "training.seq_length=7 is not a multiple of tensor_model_parallel_size"),
    ({}, {"vocab_size": 257}, "model.vocab_size=257 is not a multiple of tensor_model_parallel_size=2"),
    ({}, {"ffn_hidden_size": 63}, "model.ffn_hidden_size=63"),
    ({"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 1}, {"moe_ffn_hidden_size": 15},
     "model.moe_ffn_hidden_size=15 is not a multiple of expert_tensor_parallel_size=2"),
    ({}, {"moe_shared_expert_intermediate_size": 15}, "model.moe_shared_expert_intermediate_size=15"),
])
def test_sizes_tensor_parallelism_cannot_split_are_one_line_before_any_rank(tmp_path, variant, model, fragment):
    """Found by a fresh user: each of these passed validation and then failed in megatron's ranks."""
    fields = {"name": "bad", "pipeline_model_parallel_layout": "Et|t|t|t|t|tmL", "pipeline_model_parallel_size": 2,
              "tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1,
              "expert_model_parallel_size": 2, "data_parallel_size": 2, **variant}
    (tmp_path / "bad.yaml").write_text(f"extends: {CASE}\nname: bad\nmodel: {json.dumps(model)}\n"
                                       f"variants:\n  - {json.dumps(fields)}\n")
    assert fragment in refusal(tmp_path / "bad.yaml")


def test_optimizer_instances_are_checked_against_the_expert_grid_of_tp():
    """Expert-DP under TP is TP x DP / (ETP x EP) (megatron's expert grid): at TP 2, DP 2, EP 2, ETP 1 it is 2,
    so two distributed-optimizer instances fit; three divide neither group."""
    from harness.planning.cases import load_case
    from megatron_trainer.options import _distributed_optimizer_problem
    cfg = next(r.config for r in load_case(CASE).runs if r.spec.name == "proxy-p4v2-mtp-standalone")
    assert cfg.parallel.expert_data_parallel_size == 2
    two, three = ({**cfg.megatron, "num_distributed_optimizer_instances": n} for n in (2, 3))
    assert _distributed_optimizer_problem(cfg.model_copy(update={"megatron": two})) is None
    assert "does not divide data_parallel_size 2" in _distributed_optimizer_problem(
        cfg.model_copy(update={"megatron": three}))
