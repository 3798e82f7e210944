"""Megatron-LM's own training loop, unmodified, with the bitparity capture installed from outside
(``python -m megatron_trainer.pretrain``), on CPU over gloo: two layouts bitwise equal with clipping off (Megatron-LM
PR #2136's check (2)), and a planted change in megatron (the MTP loss scale, a real source edit in a copy of the
installed megatron) caught by ``bitparity compare`` at step 0's first gradient, the losses still equal.

The training script is bitparity's stand-in for ``pretrain_gpt.py`` on the installed wheel (megatron-core >= 0.17
ships ``megatron.training``; 0.16.1's pretrain takes another signature, skipped there); with
``BITPARITY_MEGATRON_LM=<checkout>`` the checkout's own ``pretrain_gpt.py`` runs too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, once
from planted import planted_megatron

megatron_core = pytest.importorskip("megatron.core")
from packaging.version import Version

# the demo's five jobs are set up by the first test that asks (the others wait for it): pytest's 300 s per test is
# too short for that on a loaded 2-core machine (measured 293 s beside CI)
pytestmark = [pytest.mark.megatron, pytest.mark.timeout(900),
              pytest.mark.skipif(Version(megatron_core.__version__) < Version("0.17"),
                                 reason="megatron-core < 0.17: the wheel has no pretrain(config container) loop")]

STANDIN = ROOT / "megatron_trainer" / "standin" / "pretrain_gpt.py"
ARGS_FILE = ROOT / "cases" / "pretrain" / "tiny-moe-mtp.args"
LAYOUTS = {"a": "Et|tmL", "b": "Ett|mL"}        # MTP after the last decoder layer / in a stage without decoder layers


def tiny_args() -> list[str]:
    return [w for line in ARGS_FILE.read_text().splitlines() if not line.lstrip().startswith("#")
            for w in line.split()]


def pretrain(out: Path, layout: str | None, script: Path = STANDIN, env: dict | None = None, nproc: int = 2,
             extra: tuple = (), bitparity: tuple = ("--bitparity-init", "7"),
             torchrun: bool = False) -> subprocess.CompletedProcess:
    """The tiny job under `layout` (None: no ``--pipeline-model-parallel-layout``, e.g. a HybridModel job's
    pattern in `extra`), its ranks forked by ``--bitparity-nproc`` (half the CPU of torchrun's interpreters:
    one import of torch and megatron per job; the demo's jobs run under torchrun and
    `test_the_fork_launcher_gives_torchruns_bits` compares the two)."""
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                 "-m", "megatron_trainer.pretrain"] if torchrun else
                ["-m", "megatron_trainer.pretrain", "--bitparity-nproc", str(nproc)])
    cmd = [sys.executable, *launcher, "--bitparity-out", str(out), *bitparity, str(script), *tiny_args(),
           "--pipeline-model-parallel-size", str(nproc),
           *(["--pipeline-model-parallel-layout", layout] if layout else []), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def compare(tmp_path: Path, a: Path, b: Path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, "-m", "harness", "compare", str(a), str(b), "--out", str(tmp_path / "rep"),
                        "--name", b.name, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = tmp_path / "rep" / b.name / "summary.json"
    return r, (json.loads(summary.read_text()) if summary.is_file() else {})


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``make capture-demo`` as the README gives it (torchrun, 2 ranks): layouts a and b, the job stopped at
    iteration 2 under b and resumed under a, the HybridModel migration, each compared with layout a.  Its traces
    and reports are read by the tests below, so CI runs those five jobs once (the demo was a CI step of its own
    until 2026-12-07, ~90 s)."""
    venv = Path(sys.prefix)

    def make_demo(root: Path) -> subprocess.CompletedProcess:
        # -o: the venv this test runs in is the demo's; make must not rebuild it under a running suite
        return subprocess.run(
            ["make", "--no-print-directory", "-o", str(venv / ".bitparity-run"), "capture-demo", f"VENV={venv}",
             "MEGATRON_LM=", "ARGS=", f"CAPTURE_DIR={root / 'capture'}", f"CAPTURE_REPORTS={root / 'reports'}"],
            cwd=ROOT, capture_output=True, text=True, timeout=1200,
            env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")})

    r, root = once(tmp_path_factory, ["capture-demo", venv], make_demo)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root


def demo_summary(demo: Path, name: str) -> dict:
    """The demo's `bitparity compare` summary `name` (capture-demo, capture-demo-resume, capture-demo-migration)."""
    return json.loads((demo / "reports" / name / "summary.json").read_text())


@pytest.fixture(scope="module")
def layout_a(demo):
    """The tiny job at layout a, from scratch to the end (read by the layout, migration and resume tests)."""
    return demo / "capture" / "layout-a"


def test_two_layouts_bitwise_and_a_planted_mtp_loss_scale_caught(tmp_path, demo, layout_a):
    a, planted = layout_a, tmp_path / "planted"
    header = json.loads((a / "rank1.jsonl").read_text().splitlines()[0])
    assert header["settings"]["training_loop"] == "megatron.training.pretrain"
    assert header["settings"]["pipeline_model_parallel_layout"] is not None
    assert any(p["name"].startswith("mtp.layers.0.") for p in header["params"])
    summary = demo_summary(demo, "capture-demo")       # layout a against layout b
    assert [v["layout"] for v in summary["variants"]] == [LAYOUTS["a"], LAYOUTS["b"]], summary["variants"]
    assert summary["variants"][1]["outcome"] == "equal", summary["variants"][1]

    # the MTP loss scale doubled in a copy of the installed megatron, imported first by the planted run
    tree = planted_megatron(tmp_path / "megatron-planted", {"megatron/core/transformer/multi_token_prediction.py": [
        ("mtp_loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers",
         "mtp_loss_scale = 2 * config.mtp_loss_scaling_factor / config.mtp_num_layers")]})
    r = pretrain(planted, LAYOUTS["b"], env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}",
                                             "BITPARITY_MEGATRON_UNCHECKED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(tree) in (planted / "rank0.jsonl").read_text().splitlines()[0]    # the planted megatron ran
    r, summary = compare(tmp_path, a, planted)
    assert r.returncode == 1, r.stdout + r.stderr
    v = summary["variants"][1]
    fd = v["first_divergence"]
    # the forward is untouched (losses equal); the MTP loss enters the backward through the shared output layer
    assert (fd["step"], fd["kind"], fd["name"]) == (0, "grad", "output_layer.weight"), fd
    ga, gp = (json.loads((tmp_path / "rep" / planted.name / "runs" / n / "trace.json").read_text())["steps"][0]
              for n in (a.name, planted.name))
    assert ga["losses"] == gp["losses"]
    assert any(ga["grads"][k] != gp["grads"][k] for k in ga["grads"] if k.startswith("mtp.layers.0."))
    # stated as the expected divergence (step 0's gradients: the whole backward of the MTP loss) it passes; the
    # output layer's gradient alone is not all that moved (the signature check names what else did)
    r, _ = compare(tmp_path, a, planted, "--expect", "diverge", "--first-divergence", "step=0,kind=grad")
    assert r.returncode == 0, r.stdout + r.stderr
    r, _ = compare(tmp_path, a, planted, "--expect", "diverge", "--first-divergence",
                   "step=0,kind=grad,name=output_layer.weight")
    assert r.returncode == 1 and "differs outside its signature" in r.stdout, r.stdout + r.stderr


def test_the_fork_launcher_gives_torchruns_bits(tmp_path, demo, layout_a):
    """``--bitparity-nproc 2`` (ranks forked after one import of megatron) against the demo's torchrun job, same
    layout: every step bitwise; each rank's trace says which rank of which world it was."""
    forked = tmp_path / "forked"
    r = pretrain(forked, LAYOUTS["a"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("compat points") == 1         # prepared once, in the launcher, not once per rank
    for rank in (0, 1):
        header = json.loads((forked / f"rank{rank}.jsonl").read_text().splitlines()[0])
        assert (header["rank"], header["world_size"]) == (rank, 2), header
    r, summary = compare(tmp_path, layout_a, forked)
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["variants"][1]["outcome"] == "equal", summary["variants"][1]


def test_the_distributed_optimizer_traces_shards_that_compare_with_plain_ddp(tmp_path):
    """DP = 2 (4 ranks at P = 2): megatron's distributed optimizer with both overlaps against plain DDP, in
    Megatron-LM's own loop.  Each rank traces its ranges of the gradients, masters and Adam moments as partial
    records; `bitparity compare` composes them and finds the runs bitwise equal (a + b commutes: DP = 2)."""
    plain, sharded = tmp_path / "plain", tmp_path / "distopt"
    dp2 = ("--pipeline-model-parallel-size", "2")
    for out, extra in ((plain, dp2), (sharded, (*dp2, "--use-distributed-optimizer", "--overlap-grad-reduce",
                                                 "--overlap-param-gather"))):
        r = pretrain(out, LAYOUTS["a"], nproc=4, extra=extra)
        assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (sharded / "rank1.jsonl").read_text().splitlines()]
    assert records[0]["data_parallel_size"] == 2 and all("shard" in p for p in records[0]["params"])
    step = next(rec for rec in records if rec["type"] == "step")
    assert all(isinstance(v, dict) and v["partial"] == "fp64v2"
               for part in ("grads", "params", "exp_avg", "exp_avg_sq") for v in step[part].values())
    r, summary = compare(tmp_path, plain, sharded)
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["variants"][1]["outcome"] == "equal", summary["variants"][1]


def test_tensor_and_sequence_parallel_with_the_distributed_optimizer_two_layouts_bitwise(tmp_path):
    """TP = 2 + SP (expert TP = 2: Megatron-LM's default) with the distributed optimizer and both overlaps, P = 2,
    4 ranks, in Megatron-LM's own loop: every TP slice and the optimizer's ranges within it are partial records,
    the norms @tp1 replicas; `bitparity compare` finds the two layouts bitwise equal (PR #2136's check 2 at TP = 2)."""
    tp = ("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--use-distributed-optimizer",
          "--overlap-grad-reduce", "--overlap-param-gather")
    runs = {name: tmp_path / f"tp2-{name}" for name in LAYOUTS}
    for name, out in runs.items():
        r = pretrain(out, LAYOUTS[name], nproc=4, extra=tp)
        assert r.returncode == 0, r.stderr[-3000:]
    header = json.loads((runs["a"] / "rank1.jsonl").read_text().splitlines()[0])
    assert header["tensor_model_parallel_size"] == 2 and header["tp_rank"] == 1
    shards = {p["key"]: p["shard"] for p in header["params"] if "shard" in p}
    assert any(s["dim"] is not None and "within" in s for s in shards.values()), shards
    assert any(p["key"].endswith("input_layernorm.weight@tp1") for p in header["params"])
    r, summary = compare(tmp_path, runs["a"], runs["b"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["variants"][1]["outcome"] == "equal", summary["variants"][1]


def test_a_pretrain_hybrid_job_is_bitwise_its_pretrain_gpt_job(demo):
    """The migration in the user's own jobs: pretrain_hybrid.py (the stand-in on the wheel) with the pattern of
    layout a's blocks, compared with pretrain_gpt.py's layout-a job: every step bitwise."""
    log = (demo / "capture" / "hybrid.log").read_text()
    assert "compat points" in log and ",H1" in log.split("compat points")[1].split(";")[0]
    run = demo_summary(demo, "capture-demo-migration")["variants"][1]
    assert run["outcome"] == "equal" and run["layout"] == "hybrid +E|+E/+E [Et|tmL]", run


def test_a_job_stopped_and_resumed_under_another_layout_compares_by_iteration(tmp_path, demo, layout_a):
    """Megatron-LM's own --save / --load: the job saves at iteration 2 and exits (--exit-interval), a new job loads
    it under the other layout and trains iteration 3; its capture goes to ``iter0000002/`` of the same directory,
    and `bitparity compare` stitches the two by iteration: bitwise with the job that never stopped, the loaded
    state included.  Resumed with ``--no-load-optim`` (Megatron-LM's flag: Adam's state left behind) it fails at
    the load, naming the optimizer state, before any parameter moves."""
    full, stopped, ckpt = layout_a, demo / "capture" / "resumed", demo / "capture" / "resumed-ckpt"
    assert (stopped / "rank0.jsonl").is_file() and (stopped / "iter0000002" / "rank0.jsonl").is_file()
    summary = demo_summary(demo, "capture-demo-resume")
    assert summary["variants"][1]["outcome"] == "equal", summary["variants"][1]
    trace = json.loads((demo / "reports" / "capture-demo-resume" / "runs" / "resumed" / "trace.json").read_text())
    assert [st["step"] for st in trace["steps"]] == [0, 1, 2] and [x["step"] for x in trace["resumed"]] == [1]
    assert trace["resumed"][0]["exp_avg"] and trace["resumed"][0]["params"]
    lost = tmp_path / "lost"
    r = pretrain(lost, LAYOUTS["a"], extra=("--load", str(ckpt), "--no-load-optim"), bitparity=())
    assert r.returncode == 0, r.stderr[-3000:]
    r, summary = compare(tmp_path, full, lost)
    assert r.returncode == 1, r.stdout + r.stderr
    fd = summary["variants"][1]["first_divergence"]
    assert (fd["step"], fd["kind"]) == (1, "optimizer_state"), fd


@pytest.mark.skipif(not os.environ.get("BITPARITY_MEGATRON_LM"), reason="BITPARITY_MEGATRON_LM names no checkout")
def test_the_checkouts_own_pretrain_gpt_matches_the_stand_in(tmp_path):
    script = Path(os.environ["BITPARITY_MEGATRON_LM"]) / "pretrain_gpt.py"
    r = pretrain(tmp_path / "checkout", LAYOUTS["b"], script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    r = pretrain(tmp_path / "standin", LAYOUTS["b"])
    assert r.returncode == 0, r.stderr[-3000:]
    r, _ = compare(tmp_path, tmp_path / "checkout", tmp_path / "standin")
    assert r.returncode == 0, r.stdout + r.stderr


def test_refusals_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_trainer.pretrain", "--bitparity-out", str(tmp_path / "o"),
                        str(tmp_path / "nope.py")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("nope.py: no such training script"), r.stderr
    r = subprocess.run([sys.executable, "-m", "megatron_trainer.pretrain", str(STANDIN)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--bitparity-out" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # a rank that holds part of each sequence (CP): refused before megatron starts, one line, exit 2
    for flags, words in ((["--context-parallel-size=4"], "--context-parallel-size 4 is not supported"),
                         (["--context-parallel-size", "2"], "--context-parallel-size 2 is not supported")):
        r = subprocess.run([sys.executable, "-m", "megatron_trainer.pretrain", "--bitparity-out",
                            str(tmp_path / "o"), str(STANDIN), *tiny_args(), *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "o").exists()            # refused before anything is made
    # the fork launcher: a rank count below 1, or under torchrun (which already started the ranks)
    for flags, env, words in ((["--bitparity-nproc", "0"], {}, "--bitparity-nproc 0: the number of ranks must be >= 1"),
                              (["--bitparity-nproc", "2"], {"WORLD_SIZE": "2"}, "run it without torchrun")):
        r = subprocess.run([sys.executable, "-m", "megatron_trainer.pretrain", *flags, "--bitparity-out",
                            str(tmp_path / "o"), str(STANDIN), *tiny_args()], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, **env})
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # a script that trains nothing with megatron's loop: said, not a silent success without a trace
    (tmp_path / "hello.py").write_text("print('hello')\n")
    r = subprocess.run([sys.executable, "-m", "megatron_trainer.pretrain", "--bitparity-out", str(tmp_path / "h"),
                        str(tmp_path / "hello.py")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ran no megatron training step" in r.stderr, r.stdout + r.stderr
