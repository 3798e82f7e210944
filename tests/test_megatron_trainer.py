"""The megatron-core trainer (megatron_trainer, ``trainer: megatron-core``) end to end, on megatron-core itself.

* verdicts: tests/cases/megatron-small.yaml (cases/megatron-dsv3.yaml cut to 4 layers, 2 steps) passes with
  the stated outcomes: bitwise across P, V and MTP placement; P=1 only at the embedding gradient; clipping
  on only at the grad norm;
* the trace contract: rank headers, global parameter names (and their metadata) identical to the reference
  trainer's for the same layouts, per-microbatch losses with MTP, the routers' expert_bias buffers, the
  manifest's trainer versions;
* the planted defects (megatron_trainer/faults.py) are caught where they break the embedding sync, and only
  there;
* the CPU compatibility layer (megatron_trainer/compat.py) is loud when megatron-core no longer looks like
  the versions it was written for;
* what megatron-core cannot run is a one-line usage error before anything runs.

Four CLI runs (the case, its layouts on the reference trainer, the case under each planted defect), each once
per module, and one subprocess for the compatibility layer: ~2 min on 2 cores.  Skipped without the
`megatron` extra (megatron-core not importable).
"""
import json
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, once, run_cli, verify_once, verify_text_once  # noqa: E402
from test_cli_errors import _check_usage_error  # noqa: E402

CASE = ROOT / "tests" / "cases" / "megatron-small.yaml"
BASELINE = "pp2-vpp2-mtp-with-loss"
STANDALONE = ("pp4-mtp-standalone", "pp4-mtp-only-stage")     # MTP on rank 2 of 4: not with the loss
STRUCTURAL = (BASELINE, *STANDALONE, "pp4-mtp-with-loss", "pp1")   # the layouts also run on the reference
P = {BASELINE: 2, "pp4-mtp-standalone": 4, "pp4-mtp-only-stage": 4, "pp4-mtp-with-loss": 4, "pp1": 1,
     "clip/pp2-vpp2-mtp-with-loss": 2, "clip/pp4-mtp-standalone": 4}
V = {BASELINE: 2, "clip/pp2-vpp2-mtp-with-loss": 2}
EMBEDDING = "embedding.word_embeddings.weight"
EXPERT_BIASES = {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.2.mlp.router.expert_bias",
                 "decoder.layers.3.mlp.router.expert_bias",
                 "mtp.layers.0.transformer_layer.mlp.router.expert_bias"}
TRAIN_ITERS, NUM_MICROBATCHES = 2, 4

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


def _read(proc, out, case):
    summary = out / case.stem / "summary.json"
    if not summary.exists():        # summary.json is named after the case's `name:`; both names are the stem
        raise AssertionError(proc.stdout + proc.stderr)
    return proc, {v["name"]: v for v in json.loads(summary.read_text())["variants"]}, out / case.stem


def _run_dir(report, name):
    return report / "runs" / name.replace("/", "_")


def _load(report, name, what="trace.json"):
    return json.loads((_run_dir(report, name) / what).read_text())


def _rank_records(report, name, rank):
    return [json.loads(line) for line in (_run_dir(report, name) / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    proc, out = verify_once(tmp_path_factory, CASE)
    return _read(proc, out, CASE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same layouts on the reference trainer (the case, with ``trainer: reference``)."""
    only = [a for name in STRUCTURAL if name != BASELINE for a in ("--only", name)]
    proc, out = verify_text_once(tmp_path_factory, "megatron-small-reference.yaml",
                                 f"extends: {CASE}\nname: megatron-small-reference\ntrainer: reference\n", *only)
    proc, verdicts, report = _read(proc, out, out / "megatron-small-reference.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(verdicts) == set(STRUCTURAL)
    return report


@pytest.fixture(scope="module", params=["skip_mtp_embedding_sync", "default_embedding_group"])
def injected(request, tmp_path_factory):
    only = [a for name in STRUCTURAL if name != BASELINE for a in ("--only", name)]
    proc, out = verify_once(tmp_path_factory, CASE, "--inject", request.param, *only)
    proc, verdicts, _ = _read(proc, out, CASE)
    return request.param, proc, verdicts


# --- 1. verdicts ------------------------------------------------------------------------------------------

def test_every_variant_passes_with_its_stated_outcome(megatron):
    proc, v, _ = megatron
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(v) == set(P), sorted(v)
    assert all(x["verdict"] == "pass" for x in v.values()), {n: x["reason"] for n, x in v.items()}
    for name, x in v.items():
        assert (x["pp"], x["vpp"], x["reductions"]) == (P[name], V.get(name, 1), "megatron"), name
    assert v[BASELINE]["outcome"] == "reference"
    # clipping off, P > 1: bitwise, wherever the MTP layer is
    for name in (*STANDALONE, "pp4-mtp-with-loss"):
        assert (v[name]["outcome"], v[name]["bitwise_equal"], v[name]["first_divergence"]) == ("equal", True, None)
        assert v[name]["replica_status"]["consistent"] is True
        assert v[name]["replica_status"]["replicas"] == [f"{EMBEDDING}@mtp"]
    assert v["pp4-mtp-standalone"]["mtp_standalone"] is True and v["pp4-mtp-only-stage"]["mtp_standalone"] is True
    assert v["pp4-mtp-with-loss"]["mtp_standalone"] is False
    # P = 1: one embedding takes both lookups' gradients per microbatch; may round apart, only there
    p1 = v["pp1"]
    if p1["bitwise_equal"]:
        assert p1["outcome"] == "equal" and p1["first_divergence"] is None
    else:
        assert p1["outcome"] == "differs only where allowed"
        assert (p1["first_divergence"]["kind"], p1["first_divergence"]["name"]) == ("grad", EMBEDDING)
    # clipping on: clipped vs unclipped differ by construction; two clipped layouts at most in the grad norm
    clipped = v["clip/pp2-vpp2-mtp-with-loss"]
    assert clipped["outcome"] == "differs as expected" and clipped["first_divergence"]["kind"] == "optimizer_state"
    assert clipped["first_divergence"]["step"] == 0
    pair = v["clip/pp4-mtp-standalone"]
    assert pair["compare_to"] == "clip/pp2-vpp2-mtp-with-loss"
    if pair["bitwise_equal"]:
        assert pair["outcome"] == "equal"
    else:
        assert pair["outcome"] == "differs only where allowed" and pair["first_divergence"]["kind"] == "grad_norm"


def test_clipping_triggers(megatron):
    """The clip pair is only a test of the grad norm if the norm is traced and the clip applies."""
    _, _, report = megatron
    for name in ("clip/pp2-vpp2-mtp-with-loss", "clip/pp4-mtp-standalone"):
        steps = _load(report, name)["steps"]
        assert all(s["grad_norm"] is not None and s["clipped"] is True for s in steps), name
    assert all(s["grad_norm"] is None for s in _load(report, BASELINE)["steps"])


# --- 2. the trace contract --------------------------------------------------------------------------------

HEADER = {"format", "rank", "world_size", "pp_rank", "ep_rank", "expert_model_parallel_size", "stages", "params",
          "reductions"}


@pytest.mark.parametrize("name", list(P))
def test_rank_traces(megatron, name):
    _, _, report = megatron
    p, v = P[name], V.get(name, 1)
    for rank in range(p):
        records = _rank_records(report, name, rank)
        assert [r["type"] for r in records] == ["header", "init", *["step"] * TRAIN_ITERS, "end"]
        header = records[0]
        assert HEADER <= set(header), HEADER - set(header)
        assert header["format"] == "bitparity-rank-trace/2" and header["trainer"] == "megatron-core"
        assert (header["rank"], header["pp_rank"], header["world_size"]) == (rank, rank, p)
        assert (header["ep_rank"], header["expert_model_parallel_size"]) == (0, 1)
        assert header["stages"] == [vp * p + rank for vp in range(v)]
        assert header["reductions"] == "megatron"
        for param in header["params"]:
            assert {"key", "name", "replica", "shape", "dtype", "family", "weight_decay", "order"} <= set(param)
        keys = [param["key"] for param in header["params"]]
        for record in records[1:-1]:
            assert set(record["params"]) == set(keys)
            if record["type"] == "step":
                assert set(record["grads"]) == set(keys)
                assert ("losses" in record) == (rank == p - 1)     # the loss stage only


@pytest.mark.parametrize("name", STRUCTURAL)
def test_global_names_match_the_reference_trainer(megatron, reference, name):
    """Same layout, same parameters under the same global names, on the same ranks, with the same metadata
    (shape, family, weight-decay group, canonical order, replica tag)."""
    _, _, report = megatron
    ours, theirs = _load(report, name), _load(reference, name)
    assert set(ours["params"]) == set(theirs["params"])
    assert ours["params"] == theirs["params"]
    assert ours["order"] == theirs["order"]
    assert ours["order"][0] == EMBEDDING and ours["order"][-1] == "output_layer.weight"
    assert (f"{EMBEDDING}@mtp" in ours["params"]) == (P[name] > 1)
    if f"{EMBEDDING}@mtp" in ours["params"]:
        replica = ours["params"][f"{EMBEDDING}@mtp"]
        assert (replica["name"], replica["replica"]) == (EMBEDDING, "mtp")
        mtp_rank = {"pp4-mtp-standalone": 2, "pp4-mtp-only-stage": 2}.get(name, P[name] - 1)
        assert replica["rank"] == mtp_rank and ours["params"][EMBEDDING]["rank"] == 0
    # both trainers initialise every parameter from the seed keyed by its global name
    assert ours["init"] == theirs["init"]
    for rank in range(P[name]):            # each rank's header, in whatever order the trainer lists them
        ours, theirs = (sorted(_rank_records(r, name, rank)[0]["params"], key=lambda x: x["key"])
                        for r in (report, reference))
        assert ours == theirs


@pytest.mark.parametrize("name", list(P))
def test_losses_and_buffers(megatron, name):
    _, _, report = megatron
    trace = _load(report, name)
    assert len(trace["steps"]) == TRAIN_ITERS
    for step in trace["steps"]:
        assert [x["microbatch"] for x in step["losses"]] == list(range(NUM_MICROBATCHES))
        for x in step["losses"]:
            assert re.fullmatch(r"0x[0-9a-f]{8}", x["lm"]["hex"]) and x["num_tokens"] > 0
            assert len(x["mtp"]) == 1 and re.fullmatch(r"0x[0-9a-f]{8}", x["mtp"][0]["hex"])
        assert step["lm_loss"] is not None
        assert set(step["buffers"]) == EXPERT_BIASES
    # the routers' expert_bias is updated once per step (finalize_model_grads), and traced after it
    assert trace["steps"][0]["buffers"] != trace["steps"][1]["buffers"]


def test_manifest_names_the_trainer(megatron, reference):
    from harness.planning.trainers import megatron_version
    from megatron_trainer import compat

    _, _, report = megatron
    for name in P:
        trainer = _load(report, name, "manifest.json")["trainer"]
        assert trainer["trainer"] == "megatron-core"
        assert trainer["megatron_core"] == megatron_version()       # of the megatron the ranks import
        assert trainer["megatron_compat"] == compat.VERSION
        assert trainer["megatron_compat_points"] == list(ALL_POINTS)                       # all, on CPU
        assert trainer["megatron_compat_checked_versions"] == [*compat.SUPPORTED, *compat.CHECKED_COMMITS]
    assert _load(reference, BASELINE, "manifest.json")["trainer"] == {"trainer": "reference"}


# --- 3. planted defects -----------------------------------------------------------------------------------

@pytest.mark.newest_megatron
def test_planted_defects_are_caught_at_the_embedding_sync(injected):
    """Both defects break the embedding sync between the first stage and the MTP stage: the first stage's
    embedding gradient misses the MTP stage's contribution (the first divergence) and the MTP stage's replica
    drifts from it (replica inconsistency), from step 0.

    skip_mtp_embedding_sync skips the all-reduce, so every P > 1 layout fails (each holds a replica on its
    MTP rank, with the loss or not); default_embedding_group puts the first and the *last* rank in the group,
    which is right only where the MTP layer is on the last rank (elsewhere the last rank, which holds no
    embedding, sums its output_layer.weight gradient, same shape, into the first stage's embedding gradient,
    and the MTP replica is never synced).  P = 1 has no replica and no all-reduce.  In dataflow order the output
    head, whose gradient the last rank sums with the embedding's, is the first tensor computed differently
    there; canonical order names the embedding."""
    fault, proc, v = injected
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert v[BASELINE]["verdict"] == "pass"                     # --inject spares the baseline
    broken = (*STANDALONE, "pp4-mtp-with-loss") if fault == "skip_mtp_embedding_sync" else STANDALONE
    for name in broken:
        assert v[name]["verdict"] == "fail", (name, v[name]["reason"])
        fd = v[name]["first_divergence"]
        if fault == "default_embedding_group":
            assert (fd["step"], fd["kind"], fd["name"]) == (0, "grad", "output_layer.weight"), name
            assert fd["canonical"].startswith(f"first in canonical order: grad {EMBEDDING} "), name
        else:
            assert fd == {"step": 0, "kind": "grad", "microbatch": None, "name": EMBEDDING, "ulp": None,
                          "canonical": None}, name
        status = v[name]["replica_status"]
        assert status["consistent"] is False and status["first_broken_step"] == 0, name
        assert status["detail"].startswith(f"{EMBEDDING}@mtp: gradient at step 0"), status["detail"]
    for name in set(STRUCTURAL) - {BASELINE, *broken}:
        assert v[name]["verdict"] == "pass", (name, v[name]["reason"])
    if fault == "default_embedding_group":
        assert v["pp4-mtp-with-loss"]["outcome"] == "equal"


# --- 4. the compatibility layer is loud -------------------------------------------------------------------

# One subprocess imports megatron-core once (~10 s), then forks a child per simulated change: each child
# changes megatron the way a newer release might, calls compat.apply(), and reports what it raised.  Nothing
# of it reaches this process.
COMPAT_PROBE = textwrap.dedent("""\
    import json, os, sys, types, warnings
    warnings.simplefilter("ignore")
    import torch
    import megatron.core
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.optimizer import optimizer
    from megatron_trainer import compat, source

    def takes_k_channels():
        init = dpa.DotProductAttention.__init__
        def new_init(self, *args, k_channels=None, v_channels=None, **kwargs):
            init(self, *args, **kwargs)
        dpa.DotProductAttention.__init__ = new_init

    def setup_without_cuda(self):
        pass

    CHANGES = {
        "none": lambda: None,
        "version": lambda: setattr(source, "megatron_source",
                                   lambda: {"version": "0.17.0", "commit": None, "path": "elsewhere"}),
        "1": lambda: delattr(mrandom.CudaRNGStatesTracker, "fork"),
        "2": takes_k_channels,
        "3": lambda: delattr(mla, "HAVE_TE"),
        "5": lambda: setattr(language_module.LanguageModule, "setup_embeddings_and_output_layer", setup_without_cuda),
        "6": lambda: setattr(schedules, "torch", types.ModuleType("torch")),
        "7": lambda: setattr(moe_utils, "te_general_gemm", None),
        "8": lambda: setattr(optimizer, "clip_grad_by_total_norm_fp32", lambda *a, **k: None),
    }
    original_cuda = torch.Tensor.cuda
    for change in sys.argv[1:]:
        device = "cuda" if change == "cuda" else "cpu"   # "cuda": the points a rank on a GPU applies
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                CHANGES.get(change, lambda: None)()
                result = {"raised": None, "applied": list(compat.apply(device)),
                          "expected": list(compat.points(device)), "not_needed": dict(compat.NOT_NEEDED)}
            except compat.CompatError as e:
                result = {"raised": "CompatError", "message": str(e)}
            except BaseException as e:
                result = {"raised": type(e).__name__, "message": str(e)}
            result["patched"] = torch.Tensor.cuda is not original_cuda
            os.write(w, json.dumps(result).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            print(json.dumps({change: json.loads(f.read())}))
        os.waitpid(pid, 0)
    """)

# a point whose patch target moved while its bug is still there: CompatError naming the point
MOVED = ("1", "6", "8")
ALL_POINTS = ("1", "2", "3", "4", "5", "6", "7", "8", "9")


def _not_needed_here() -> set:
    """The CPU points the installed megatron-core needs no more, per release line (measured; a version not listed
    fails here, so a new megatron gets its expectations written down, never skipped):
    0.16: 9 (is_inference_column_parallel_linear does not exist yet); 0.19: 3 and 7 (HAVE_TE is false and
    te_general_gemm defined without TE) and 9; 0.20 (main at compat.CHECKED_COMMITS): 3 and 7."""
    from harness.planning.trainers import megatron_version
    table = {"0.16": {"9"}, "0.19": {"3", "7", "9"}, "0.20": {"3", "7"}}
    line = ".".join((megatron_version() or "").split(".")[:2])
    if line not in table:
        pytest.fail(f"megatron-core {megatron_version()}: no compat expectations written for {line}.x")
    return table[line]
# a point whose bug megatron fixed: skipped, recorded in NOT_NEEDED, the other points still applied
FIXED = ("2", "3", "5", "7")
POINTS = MOVED + FIXED


@pytest.fixture(scope="module")
def compat_probe(tmp_path_factory):
    proc, _ = once(tmp_path_factory, ["compat-probe", *POINTS], lambda _: subprocess.run(
        [sys.executable, "-c", COMPAT_PROBE, "none", "cuda", "version", *POINTS], cwd=ROOT, capture_output=True,
        text=True, timeout=300))
    assert proc.returncode == 0, proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        out.update(json.loads(line))
    return out


@pytest.mark.arithmetic_free
def test_compat_applies_to_the_installed_megatron(compat_probe):
    base = _not_needed_here()
    none = compat_probe["none"]
    assert none["raised"] is None and none["expected"] == list(ALL_POINTS) and none["patched"] is True, none
    assert none["applied"] == [p for p in ALL_POINTS if p not in base] and set(none["not_needed"]) == base, none
    # on a GPU only the local-spec points (no CPU plumbing: Tensor.cuda stays megatron's)
    cuda = compat_probe["cuda"]
    assert cuda["raised"] is None and cuda["patched"] is False, cuda
    assert set(cuda["applied"]) == set(cuda["expected"]) - set(cuda["not_needed"]), cuda
    assert "2" in cuda["applied"] and not {"1", "4", "5", "6", "8"} & set(cuda["applied"])


@pytest.mark.arithmetic_free
def test_compat_refuses_another_megatron_version(compat_probe):
    result = compat_probe["version"]
    assert result["raised"] == "CompatError", result
    assert "megatron-core 0.17.0" in result["message"] and "0.16.x, 0.19.x and Megatron-LM main" in result["message"]
    assert "megatron_trainer/compat.py" in result["message"]
    assert result["patched"] is False           # refused before any point is applied


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("point", MOVED)
def test_compat_point_names_itself_when_megatron_changed(compat_probe, point):
    result = compat_probe[point]
    assert result["raised"] == "CompatError", result
    assert result["message"].startswith(f"megatron CPU compat point {point}: "), result["message"]
    assert "update megatron_trainer/compat.py" in result["message"]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("point", FIXED)
def test_compat_point_fixed_upstream_is_skipped_and_recorded(compat_probe, point):
    result, base = compat_probe[point], _not_needed_here()
    assert result["raised"] is None, result
    assert point not in result["applied"] and set(result["applied"]) == set(result["expected"]) - {point} - base
    assert set(result["not_needed"]) == {point} | base and result["not_needed"][point]
    assert result["patched"] is (point != "5")      # point 5 is the Tensor.cuda patch


# --- 5. what megatron-core cannot run: one line, exit 2, nothing written -----------------------------------

BAD = {
    "canonical": ("options: {reductions: canonical}", ["reductions: canonical"]),
    "ep2": ("expert_model_parallel_size: 2", ["expert_model_parallel_size 2 needs a data_parallel_size", "data parallelism"]),
    "overlap": ("overlap_moe_expert_parallel_comm: true",
                ["megatron-core rejects this run", "overlap_moe_expert_parallel_comm", "expert model parallelism"]),
    "reference-fault": ("inject: grad_bit_flip", ["unknown fault 'grad_bit_flip'", "skip_mtp_embedding_sync"]),
    # checkpoints are added by the harness after planning: a resume megatron cannot load is refused all the same
    "resume": ("resume: {variant: pp2-vpp2-mtp-with-loss, after_step: 0}, megatron: {use_distributed_optimizer: true}",
               ["resumes from 'pp2-vpp2-mtp-with-loss'", "the distributed optimizer and one without"]),
}


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("what", list(BAD))
def test_unsupported_runs_are_one_line_usage_errors(tmp_path, what):
    key, fragments = BAD[what]
    case = tmp_path / "case.yaml"
    case.write_text(f"extends: {CASE}\nvariants:\n  - {{name: bad, pipeline_model_parallel_layout: 'Et|t|t|tmL', "
                    f"pipeline_model_parallel_size: 2, {key}}}\n")
    out = tmp_path / "reports"
    _check_usage_error(run_cli("verify", case, "--out", out), out, str(case), "variant 'bad'",
                       "megatron-core", *fragments)


@pytest.mark.newest_megatron
@pytest.mark.arithmetic_free
def test_fuzz_plants_only_the_megatron_trainers_faults(tmp_path):
    """`bitparity fuzz --inject` on a megatron-core case knows the megatron trainer's faults, not the reference's
    (a reference fault there would be ignored by every run: 'no layout differed')."""
    out = tmp_path / "fz"
    _check_usage_error(run_cli("fuzz", CASE, "--inject", "grad_bit_flip", "--budget", "5s", "--out", out), out,
                       "--inject grad_bit_flip", "unknown fault 'grad_bit_flip'", "skip_mtp_embedding_sync")
