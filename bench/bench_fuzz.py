"""Benchmark: per-layout cost of the forkserver runner (what `verify` and `fuzz` use) against the plain
multi-process launch (torchrun: fresh interpreters, torch imported per rank), measured side by side in one
run on the same smoke layouts; then timed `bitparity fuzz` runs for layouts/minute, one layout at a time
(``--jobs 1``) and side by side (the default, one per core), alternated, same seed and budget, so that machine
noise (+-15-30 % from one minute to the next on a shared 2-core box) falls on both; the rows go to
``bench/results/fuzz_cpu.json``."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.judging.trace import merge  # noqa: E402
from harness.planning.cases import load_case  # noqa: E402
from harness.running.arithmetic import cpu_model  # noqa: E402
from harness.running.runner import run_ranks  # noqa: E402

LAYOUTS = [("Ett|ttmL", 2), ("Et|tt|tm|L", 4), ("Et|tt|t|mL", 2), ("E|t|t|t|t||m|L", 4), ("Etttt|m|L", 3),
           ("E|tt|tt|mL", 4)]
ROUNDS, BUDGET = 2, "60s"           # timed fuzz runs per --jobs setting, alternated


def measure(launcher: str, tmp: Path) -> list[tuple[float, float]]:
    base = load_case(ROOT / "cases" / "smoke.yaml").runs[0].config
    rows = []
    for i, (text, pp) in enumerate(LAYOUTS):
        cfg = base.model_copy(update={"parallel": base.parallel.model_copy(
            update={"pipeline_model_parallel_layout": text, "pipeline_model_parallel_size": pp})})
        t0 = time.monotonic()
        out = run_ranks(cfg, tmp / f"{launcher}{i}", 300, launcher)
        wall = time.monotonic() - t0
        if not out.ok:
            sys.exit(f"bench: {launcher} {text} failed: {out.error}")
        compute = sum(max(s.time_s.values()) for s in merge(tmp / f"{launcher}{i}", pp).steps)
        rows.append((wall, compute))
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        res = {launcher: measure(launcher, Path(tmp)) for launcher in ("fork", "torchrun")}
    print(f"{'layout':<18} {'P':>2} | {'fork wall':>9} {'startup':>8} {'compute':>8} | "
          f"{'torchrun wall':>13} {'startup':>8} {'compute':>8}")
    for (text, pp), (fw, fc), (tw, tc) in zip(LAYOUTS, res["fork"], res["torchrun"]):
        print(f"{text:<18} {pp:>2} | {fw:9.2f} {fw - fc:8.2f} {fc:8.2f} | {tw:13.2f} {tw - tc:8.2f} {tc:8.2f}")
    fork, plain = (statistics.median(w for w, _ in res[k]) for k in ("fork", "torchrun"))
    print(f"median wall per layout: fork {fork:.2f} s, torchrun {plain:.2f} s -> {plain / fork:.1f}x faster; "
          f"{60 / fork:.0f} vs {60 / plain:.0f} layouts/min")
    rows = [fuzz_rate(jobs) for _ in range(ROUNDS) for jobs in (1, None)]
    for row in rows:
        print(f"bitparity fuzz --jobs {row['jobs'] or 'default'}, {BUDGET} budget: {row['layouts']} layouts "
              f"= {row['per_minute']:.0f}/min")
    one, packed = (statistics.median(r["per_minute"] for r in rows if r["jobs"] == j) for j in (1, None))
    print(f"fuzz: side by side {packed:.0f}/min vs one at a time {one:.0f}/min -> {packed / one:.2f}x")
    out = ROOT / "bench" / "results" / "fuzz_cpu.json"
    out.write_text(json.dumps({"machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
                               "case": "cases/smoke.yaml", "budget": BUDGET, "seed": 0, "runs": rows,
                               "median_per_minute": {"jobs_1": one, "default": packed}}, indent=1) + "\n")


def fuzz_rate(jobs) -> dict:
    """One timed `bitparity fuzz cases/smoke.yaml` (seed 0): {jobs, layouts, per_minute}; jobs None: default."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "harness", "fuzz", "cases/smoke.yaml", "--budget", BUDGET,
                               "--seed", "0", "--out", out] + ([] if jobs is None else ["--jobs", str(jobs)]),
                              cwd=ROOT, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if "layouts/min" in l), None)
    if line is None:
        sys.exit(f"bench: fuzz --jobs {jobs} failed: {proc.stderr.strip() or proc.stdout[-500:]}")
    return {"jobs": jobs, "layouts": int(line.split("tried ")[1].split()[0]),
            "per_minute": float(line.split("= ")[1].split()[0])}


if __name__ == "__main__":
    main()
