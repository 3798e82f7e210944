"""Benchmark: one Megatron-LM training job with the bitparity capture, its ranks started by torchrun against
``--bitparity-nproc`` (forked after one import of torch and megatron, `megatron_trainer.fork_launch`), side by side
in one session (interleaved repeats), and the two traces compared bit for bit.

The job: `cases/pretrain/tiny-moe-mtp.args` on the stand-in ``pretrain_gpt.py``, layout ``Et|tmL``, 2 ranks over
gloo (what ``make capture-demo`` runs).  Per launcher: wall seconds and the CPU seconds of the whole process tree
(user + system of the reaped children); medians over `--repeats`.  Needs megatron-core >= 0.17 (``megatron.training``:
``make bench PY=3.12``); on an older one it says so and exits 0 without measuring.

    python bench/bench_pretrain_launch.py [--repeats 3] [--out bench/results/pretrain_launch_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

SCRIPT = ROOT / "megatron_trainer" / "standin" / "pretrain_gpt.py"
ARGS = ROOT / "cases" / "pretrain" / "tiny-moe-mtp.args"
LAYOUT, NPROC = "Et|tmL", 2


def _job(launcher: str, out: Path) -> dict:
    """One job; {wall_s, cpu_s} (the children's user + system seconds)."""
    args = [w for line in ARGS.read_text().splitlines() if not line.lstrip().startswith("#") for w in line.split()]
    start = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC), "-m",
              "megatron_trainer.pretrain"] if launcher == "torchrun" else
             ["-m", "megatron_trainer.pretrain", "--bitparity-nproc", str(NPROC)])
    cmd = [sys.executable, *start, "--bitparity-out", str(out), "--bitparity-init", "7", str(SCRIPT), *args,
           "--pipeline-model-parallel-size", str(NPROC), "--pipeline-model-parallel-layout", LAYOUT]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(f"bench_pretrain_launch: the {launcher} job failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        raise SystemExit(1)
    return {"wall_s": round(wall, 2),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "pretrain_launch_cpu.json"))
    a = p.parse_args()
    if a.repeats < 1:
        fail(f"--repeats {a.repeats}: must be >= 1")
    out = out_file(a.out)
    try:
        import megatron.training  # noqa: F401
    except ImportError:
        print("bench_pretrain_launch: megatron-core here has no megatron.training (< 0.17): not measured "
              "(make bench PY=3.12)")
        return 0
    rows: dict[str, list[dict]] = {"torchrun": [], "fork": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for launcher in rows:                # interleaved: the box's drift falls on both alike
                rows[launcher].append(_job(launcher, Path(tmp) / f"{launcher}{i}"))
                print(launcher, i, rows[launcher][-1], flush=True)
        cmp = subprocess.run([sys.executable, "-m", "harness", "compare", str(Path(tmp) / "torchrun0"),
                              str(Path(tmp) / "fork0"), "--out", str(Path(tmp) / "rep")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("wall_s", "cpu_s")} for k, v in rows.items()}
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "job": f"{ARGS.relative_to(ROOT)} layout {LAYOUT}, {NPROC} ranks", "repeats": rows, "median": med,
              "cpu_torchrun_over_fork": round(med["torchrun"]["cpu_s"] / med["fork"]["cpu_s"], 2),
              "bitwise_equal": cmp.returncode == 0}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median: torchrun {med['torchrun']}, fork {med['fork']}; CPU torchrun / fork "
          f"{result['cpu_torchrun_over_fork']}x; traces bitwise equal: {result['bitwise_equal']}")
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
