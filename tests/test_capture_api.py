"""The public capture API (`trainerkit.capture.RankCapture`) and `bitparity compare DIR_A DIR_B` on traces
written through it by a tiny two-rank "training loop" in this test (no megatron needed): what a user's own job
writes, compared like verify's runs; directories that cannot be compared refused in one line, exit 2."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from trainerkit import names
from trainerkit.capture import CaptureClock, CaptureError, RankCapture, float64_scalar, microbatch_losses, param_entry

NAMES = [["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
          "decoder.layers.0.self_attention.linear_qkv.bias"],
         ["decoder.layers.1.mlp.linear_fc1.weight", "decoder.final_layernorm.weight", "output_layer.weight"]]


def _write(out, steps=2, bump=None, world=2, hidden=4, first=0, loaded_bump=None):
    """A two-stage run: rank r holds NAMES[r]; `bump` = (step, name) adds 1 ULP-ish to that parameter's
    gradient (a planted difference).  `first` > 0: a job resumed after step first - 1 (its ``resumed`` record,
    then steps first..steps-1); `loaded_bump`: a parameter whose loaded value is 1 ULP off."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tensors = [{n: torch.randn(hidden, hidden) if not n.endswith(("bias", "norm.weight")) else torch.randn(hidden)
                for n in ns} for ns in NAMES]
    for rank in range(world):
        params = [param_entry(n, n, None, t, t.ndim >= 2, strict=False) for n, t in tensors[rank].items()]
        cap = RankCapture(out / f"rank{rank}.jsonl", {"rank": rank, "world_size": world, "pp_rank": rank,
                                                      "stages": [rank], "params": params, "reductions": "megatron",
                                                      "trainer": "megatron-core"})
        values = list(tensors[rank].values())
        cap.initial(values)
        for step in range(steps):
            if step < first:        # trained before the checkpoint: by the job that saved it
                values = [v - 0.1 * (v * 0.5) for v in values]
                continue
            if step == first and first > 0:
                loaded = [torch.nextafter(v, torch.full_like(v, float("inf"))) if n == loaded_bump else v
                          for n, v in zip(tensors[rank], values)]
                cap.resumed(first - 1, loaded, {}, {})
            cap.begin_step(step)
            grads = [v * 0.5 for v in values]
            if bump and bump[0] == step:
                for (n, v), g in zip(tensors[rank].items(), grads):
                    if n == bump[1]:
                        g.view(-1)[0] = torch.nextafter(g.view(-1)[0], torch.tensor(float("inf")))
            cap.grads(grads)
            values = [v - 0.1 * g for v, g in zip(values, grads)]
            cap.params(values)
            cap.set(**{"grad_norm": float64_scalar(1.5), "clip_coeff": float64_scalar(2.0), "clipped": False})
            if rank == world - 1:
                lm = [(torch.tensor(10.0 + step), torch.tensor(8))]
                cap.set(losses=microbatch_losses(lm, [], 0), lm_loss={"hex": "0x3fa00000", "value": 1.25})
            cap.end_step(0.01)
        cap.close()
    return out


def test_a_stopped_and_resumed_job_is_stitched_by_iteration_and_its_load_is_judged(tmp_path, cli):
    """A job that stopped after step 1 (rank traces in b/) and went on from its checkpoint (b/iter0000002/, as
    `trainerkit.capture.segment_dir` names it): compared with the job that never stopped, stitched by iteration, and
    the loaded state judged at the step it was saved after."""
    full = _write(tmp_path / "full", steps=3)
    _write(tmp_path / "b", steps=2)
    _write(tmp_path / "b" / "iter0000002", steps=3, first=2)
    proc = cli("compare", full, tmp_path / "b", "--out", tmp_path / "rep", "--name", "stitched")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trace = json.loads((tmp_path / "rep" / "stitched" / "runs" / "b" / "trace.json").read_text())
    assert [st["step"] for st in trace["steps"]] == [0, 1, 2] and [r["step"] for r in trace["resumed"]] == [1]
    # the resumed segment alone lines up with the full job's last step
    proc = cli("compare", full, tmp_path / "b" / "iter0000002", "--out", tmp_path / "rep", "--name", "alone")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a load that got one parameter 1 ULP off fails at the step it was saved after, naming it
    off = NAMES[1][0]
    _write(tmp_path / "c", steps=2)
    _write(tmp_path / "c" / "iter0000002", steps=3, first=2, loaded_bump=off)
    proc = cli("compare", full, tmp_path / "c", "--out", tmp_path / "rep", "--name", "off")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fd = json.loads((tmp_path / "rep" / "off" / "summary.json").read_text())["variants"][1]["first_divergence"]
    assert (fd["step"], fd["kind"], fd["name"]) == (1, "param", off), fd


def test_rank_capture_writes_the_trace_format(tmp_path):
    out = _write(tmp_path / "a")
    records = [json.loads(x) for x in (out / "rank1.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records] == ["header", "init", "step", "step", "end"]
    assert records[0]["format"] == "bitparity-rank-trace/2"
    assert set(records[2]["grads"]) == set(NAMES[1]) == set(records[2]["params"])
    assert records[2]["losses"][0] == {"microbatch": 0, "lm": {"hex": "0x3fa00000", "value": 1.25},   # 10 / 8
                                       "num_tokens": 8, "mtp": []}
    # a name bitparity's models do not have still gets a family and a canonical place after the known ones
    meta = {p["name"]: p for p in json.loads((out / "rank0.jsonl").read_text().splitlines()[0])["params"]}
    bias = meta["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert bias["family"] == "attention" and bias["order"][:2] == [1, 0] and bias["order"][2] > 10 ** 9


def test_capture_clock_counts_only_what_runs_inside_capture(monkeypatch):
    """Host seconds inside ``capture()`` are summed per step and nothing outside is; on a process without CUDA
    there are no device fields (no event was recorded).  ``cpu_s`` is the process CPU time from `begin_step` to
    `end_step`.  Fake clocks make the sums exact."""
    ticks = iter(range(100))
    monkeypatch.setattr("trainerkit.capture.time.perf_counter", lambda: float(next(ticks)))
    cpu = iter([0.0, 10.0, 10.5, 20.0])          # construction, begin_step, end_step, the second begin_step
    monkeypatch.setattr("trainerkit.capture.time.process_time", lambda: next(cpu))
    clock = CaptureClock()
    clock.begin_step()
    with clock.capture():              # 0 -> 1
        pass
    next(ticks)                        # time outside capture: not counted
    with clock.capture():              # 3 -> 4
        pass
    timing = clock.end_step()
    assert clock.host_s == 2.0
    if not torch.cuda.is_initialized():
        assert timing.fields() == {"capture_s": 2.0, "cpu_s": 0.5}
    clock.begin_step()
    assert clock.host_s == 0.0


def test_reference_steps_carry_capture_time(tmp_path):
    """The reference trainer's step records carry ``capture_s`` (host seconds in its capture calls, a part of
    ``time_s``), measured in the rank."""
    from harness.planning.cases import load_case
    from harness.running.runner import run_ranks
    cfg = load_case("cases/smoke.yaml", only=["pp1"]).runs[-1].config
    assert run_ranks(cfg, tmp_path / "run", 300).ok
    steps = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()
             if '"type":"step"' in x]
    assert steps and all(0 < s["capture_s"] < s["time_s"] for s in steps)


def test_rank_capture_misuse_and_writer_failure(tmp_path, monkeypatch):
    t = torch.zeros(2, 2)
    cap = RankCapture(tmp_path / "rank0.jsonl", {"params": [param_entry("x", "output_layer.weight", None, t, True)]})
    with pytest.raises(RuntimeError, match="no open step"):
        cap.grads([t])
    cap.begin_step(0)
    with pytest.raises(ValueError, match="2 tensors for the header's 1 parameters"):
        cap.grads([t, t])
    from trainerkit import capture
    monkeypatch.setattr(capture.TraceWriter, "write", lambda self, record: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(CaptureError, match="disk full"):   # at the first call after the writer thread failed
        cap.grads([t])
        cap.end_step(0.0)
        cap.close()


def test_names_not_strict():
    with pytest.raises(ValueError):
        names.order_key("decoder.layers.0.self_attention.linear_qkv.weight")
    assert names.family("something.else", strict=False) == names.OTHER
    a = names.order_key("embedding.position_embeddings.weight", strict=False)
    assert a > names.order_key(names.EMBEDDING) and a < names.order_key("decoder.layers.0.input_layernorm.weight")


def test_compare_equal_and_planted_difference(tmp_path, cli):
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    r = cli("compare", a, b, "--out", tmp_path / "rep")
    assert r.returncode == 0, r.stderr
    assert "pass (equal)" in r.stdout
    summary = json.loads((tmp_path / "rep" / "compare-a-b" / "summary.json").read_text())
    assert summary["variants"][1]["verdict"] == "pass"
    c = _write(tmp_path / "c", bump=(1, "decoder.layers.1.mlp.linear_fc1.weight"))
    r = cli("compare", a, c, "--out", tmp_path / "rep")
    assert r.returncode == 1
    v = json.loads((tmp_path / "rep" / "compare-a-c" / "summary.json").read_text())["variants"][1]
    fd = v["first_divergence"]
    assert (fd["step"], fd["kind"], fd["name"]) == (1, "grad", "decoder.layers.1.mlp.linear_fc1.weight")
    for name in ("index.html", "junit.xml", "summary.md"):
        assert (tmp_path / "rep" / "compare-a-c" / name).is_file()
    # stated as expected: passes, and only there
    r = cli("compare", a, c, "--out", tmp_path / "rep", "--name", "expected", "--expect", "diverge",
            "--first-divergence", "step=1,kind=grad,name=decoder.layers.1.mlp.linear_fc1.weight")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("compare", a, c, "--out", tmp_path / "rep", "--name", "elsewhere", "--expect", "diverge",
            "--first-divergence", "step=0,kind=grad")
    assert r.returncode == 1 and "elsewhere than expected" in r.stdout


def _lines(path):
    return path.read_text().splitlines()


@pytest.mark.parametrize("breakage, words", [
    ("missing rank", "rank1.jsonl is missing"),
    ("truncated", "truncated (no end record)"),
    ("stray rank", "rank2.jsonl: beyond the world size 2"),
    ("huge world", "rank2.jsonl is missing (999999998 of 1000000000 ranks"),
    ("null line", "rank1.jsonl:3: not a trace record"),
    ("garbage line", "rank0.jsonl:2: not JSON"),
    ("fifo", "rank1.jsonl: not a regular file"),
    ("other command", "rank1.jsonl: another training command line than rank0.jsonl's"),
    ("other model", "other model: embedding.word_embeddings.weight has shape [4, 4] in A, [6, 6] in B"),
    ("other step count", "other steps: A has 2 steps (steps 0..1), B 1 (step 0)"),
    ("not a trace", "rank0.jsonl: not a bitparity rank trace"),
    ("mixed runs", "header says rank 1 of 3, rank0.jsonl says world size 2"),
    ("empty", "no rank traces"),
])
def test_compare_refuses_what_cannot_be_compared(tmp_path, cli, breakage, words):
    a = _write(tmp_path / "a")
    b = tmp_path / "b"
    if breakage == "other step count":
        _write(b, steps=1)
    elif breakage == "other model":
        _write(b, hidden=6)
    elif breakage == "empty":
        b.mkdir()
    else:
        shutil.copytree(a, b)
    if breakage == "missing rank":
        (b / "rank1.jsonl").unlink()
    elif breakage == "truncated":
        (b / "rank0.jsonl").write_text("\n".join(_lines(b / "rank0.jsonl")[:-2]) + "\n")
    elif breakage == "stray rank":
        shutil.copy(b / "rank1.jsonl", b / "rank2.jsonl")
    elif breakage == "not a trace":
        (b / "rank0.jsonl").write_text("hello\n")
    elif breakage == "huge world":           # a header may claim anything: no list of that size is built
        lines = _lines(b / "rank0.jsonl")
        header = json.loads(lines[0])
        header["world_size"] = 10 ** 9
        (b / "rank0.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    elif breakage == "null line":
        lines = _lines(b / "rank1.jsonl")
        (b / "rank1.jsonl").write_text("\n".join(lines[:2] + ["null"] + lines[2:]) + "\n")
    elif breakage == "garbage line":
        lines = _lines(b / "rank0.jsonl")
        (b / "rank0.jsonl").write_text("\n".join(lines[:1] + ['{"type": "init", "par'] + lines[2:]) + "\n")
    elif breakage == "fifo":                  # would block a reader forever
        (b / "rank1.jsonl").unlink()
        os.mkfifo(b / "rank1.jsonl")
    elif breakage == "other command":
        for r in (0, 1):
            lines = _lines(b / f"rank{r}.jsonl")
            header = json.loads(lines[0])
            header["settings"] = {"argv": ["pretrain_gpt.py", "--clip-grad", str(r)]}
            (b / f"rank{r}.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    elif breakage == "mixed runs":
        lines = _lines(b / "rank1.jsonl")
        header = json.loads(lines[0])
        header["world_size"] = 3
        (b / "rank1.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    r = cli("compare", a, b, "--out", tmp_path / "rep")
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "rep").exists() or not any((tmp_path / "rep").iterdir())


D = ["--expect", "diverge", "--first-divergence"]


@pytest.mark.parametrize("args, words", [
    (["--expect", "may_diverge"], "--expect may_diverge needs --first-divergence"),
    (["--first-divergence", "kind=grad"], "--first-divergence with --expect bitwise"),
    (D + ["kind=gradient"], "--first-divergence 'kind=gradient': kind:"),
    (D + ["step"], "'step' is not key=value"),
    (D + ["kind=grad,color=red"], "unknown key 'color'"),
    (D + ["kind=grad,step=-1"], "step: Input should be greater than or equal to 0"),
    (D + ["kind=grad,step=0,step=5"], "step given twice"),
    (D + ["kind=grad,step=x"], "step must be an integer"),
    (["--name", ".."], "--name '..': letters, digits"),
    (["--name", "x/y"], "--name 'x/y': letters, digits"),
    (["--name", "a\nb"], "letters, digits"),
])
def test_compare_refuses_bad_options(tmp_path, cli, args, words):
    a = _write(tmp_path / "a")
    r = cli("compare", a, a, "--out", tmp_path / "rep", *args)
    assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "rep").exists()


def test_compare_checks_out_before_saying_a_verdict(tmp_path, cli):
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    (tmp_path / "afile").write_text("")
    r = cli("compare", a, b, "--out", tmp_path / "afile")
    assert r.returncode == 2 and "--out" in r.stderr and "PASS" not in r.stdout, r.stdout + r.stderr
    r = cli("compare", a, a, "--out", tmp_path / "rep")       # allowed, but said
    assert r.returncode == 0 and "same directory" in r.stderr
