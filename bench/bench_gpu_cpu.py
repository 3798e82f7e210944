"""The same dsv3 runs on the GPU and on this machine's CPU cores, side by side in one process.

Issue #38's four-run table: `bitparity verify cases/dsv3.yaml` limited to four layouts (P = 16 standalone, the baseline;
P = 16 with the loss; P = 2 1F1B; P = 1), one run after another (``--jobs 1``), first with ``--device cuda``
(every rank on the one GPU, boundary tensors staged through pinned host memory over gloo), then on the CPU (one
core per rank).  The time of each run is the harness's own ``elapsed_s`` (start of its ranks to their last
trace record); both passes run the same code, data and steps, so only the device differs.  Each run's time is
split from its rank traces: ``steps_s`` (the slowest rank's steps, first to last, each step's own ``time_s``) and
the rest (``setup_s``: process start, CUDA or gloo set-up, model build, the first data, the report's reads), so a
GPU that loses in start-up and one that loses in its steps read differently.

    python3 bench/bench_gpu_cpu.py [--case cases/dsv3.yaml] [--out FILE]

Writes a JSON table (runs, seconds per device, cpu/gpu ratio; > 1: the GPU is faster) and prints it.  Needs a
CUDA device; exits 2 with one line without one, when a pass runs over --timeout or a run does not finish (nothing
written then).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _refuse import fail, out_file  # bench/, the script's own directory, is first on sys.path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["pp16-vpp2-mtp-with-loss", "pp2-1f1b-mtp-with-loss", "pp1-no-pipelining"]


def _steps_s(run_dir: Path) -> float:
    """The slowest rank's summed step times (s) in `run_dir`'s rank traces (``time_s`` of each step record)."""
    per_rank = []
    for trace in run_dir.glob("rank*.jsonl"):
        records = (json.loads(line) for line in trace.read_text().splitlines() if line.strip())
        per_rank.append(sum(r.get("time_s", 0.0) for r in records if r.get("type") == "step"))
    return max(per_rank, default=0.0)


def _run(case: str, device: str, out: Path, timeout: int) -> dict[str, tuple[float, float]]:
    """{run name: (elapsed_s, steps_s)} of the case's baseline and VARIANTS on `device`, one run after another."""
    cmd = [sys.executable, "-m", "harness", "verify", case, "--device", device, "--jobs", "1", "--out", str(out)]
    for v in VARIANTS:
        cmd += ["--only", v]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"the {device} pass took over --timeout {timeout} s; nothing written")
    summaries = list(out.glob("*/summary.json"))
    if not summaries:
        fail(f"{device}: no summary (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    summary = json.loads(summaries[0].read_text())
    unfinished = [v["name"] for v in summary["variants"] if v["elapsed_s"] is None]
    if unfinished:
        fail(f"{device}: {', '.join(unfinished)} did not finish (see `bitparity verify` on its own); nothing written")
    runs = summaries[0].parent / "runs"
    return {v["name"]: (v["elapsed_s"], _steps_s(runs / v["name"])) for v in summary["variants"]} | \
        {"_verdict_ok": summary["all_pass"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="cases/dsv3.yaml")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gpu_cpu.json")
    ap.add_argument("--timeout", type=int, default=280, help="seconds per device pass")
    args = ap.parse_args()
    out_file(args.out)
    import torch
    if not torch.cuda.is_available():
        fail("needs a CUDA device (none found); nothing measured")
    times, ok = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for device in ("cuda", "cpu"):
            t = _run(args.case, device, Path(tmp) / device, args.timeout)
            ok[device] = t.pop("_verdict_ok")
            times[device] = t
    rows = []
    for name, (cuda_s, cuda_steps) in times["cuda"].items():
        cpu_s, cpu_steps = times["cpu"][name]
        rows.append({"run": name, "cuda_s": round(cuda_s, 2), "cpu_s": round(cpu_s, 2),
                     "cpu_over_gpu": round(cpu_s / cuda_s, 2),
                     "cuda_steps_s": round(cuda_steps, 2), "cpu_steps_s": round(cpu_steps, 2),
                     "cuda_setup_s": round(cuda_s - cuda_steps, 2), "cpu_setup_s": round(cpu_s - cpu_steps, 2)})
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "case": args.case, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cpu_cores": os.cpu_count(), "all_pass": ok, "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'run':32s} {'cuda s':>8s} {'cpu s':>8s} {'cpu/gpu':>8s} {'cuda steps':>10s} {'cpu steps':>10s}")
    for r in rows:
        print(f"{r['run']:32s} {r['cuda_s']:8.2f} {r['cpu_s']:8.2f} {r['cpu_over_gpu']:8.2f} "
              f"{r['cuda_steps_s']:10.2f} {r['cpu_steps_s']:10.2f}")
    print(f"verdicts all pass: {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
