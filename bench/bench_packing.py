"""How many ranks one CPU core carries when a case's ranks share one GPU: the same runs packed 1, 2, 4 ranks per core,
with and without an MPS daemon, side by side in one process.

Issue #38 item 3: on the one-GPU machine every pipeline rank is a process with its own CUDA context; the pool
(`harness.running.pool`) counts a rank as one core, so a 16-rank run has the 16-core machine to itself.  A rank that
waits on a pipeline peer sleeps in gloo, so whether two 16-rank runs at once finish sooner than one after another
depends on how busy the ranks really are (the traces' ``cpu_s`` against the step's wall time: the cores the runs kept
busy) and on how the GPU time-slices the contexts (MPS serves every process through one context).

For each setting: ``bitparity verify CASE --only ... --ranks-per-core N`` (the baseline and the named variants), its
wall time, every run's ``elapsed_s``, the busy cores (all ranks' CPU seconds over the steps / the steps' wall time,
summed over the runs' step spans) and the verdicts.

    .venv/bin/python bench/bench_packing.py [--case cases/dsv3-gpu.yaml] [--only RUN ...] [--settings 1,2,4] [--mps]
            [--out FILE] [--timeout S]          # (python3 on the GPU machine: bench/gpu_session.sh packing)

Writes a JSON table and prints it.  Exits 2 with one line (nothing written) when a setting runs over --timeout or
leaves no summary; a setting whose runs fail is reported with its verdicts and errors, not hidden.  ``--mps``: every
setting again under ``bitparity verify --mps`` (`harness.running.mps`); where verify refuses it (no MPS here), the
table says why.  Every run's trace is compared with the same run's in the first setting (``bits_as_first_setting``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

from harness.errors import UsageError  # noqa: E402  (the repo root first)
from harness.judging.compare import compare  # noqa: E402
from harness.judging.trace import Trace  # noqa: E402
from harness.planning.cases import load_case  # noqa: E402

P16 = ["pp16-vpp2-mtp-with-loss", "canonical/pp16-vpp2-mtp-standalone", "canonical/pp16-vpp2-mtp-with-loss"]


def _setting(case: str, only: list[str], ranks_per_core: int, mps: bool, out: Path, timeout: int) -> dict:
    """One verify of the runs at `ranks_per_core` (under `--mps`): its wall time, per-run seconds, busy cores and
    the runs' traces (``_traces``, run name -> `Trace`, for the bits check); ``{"refused": line}`` where verify
    refuses `--mps` (exit 2: no MPS on this machine)."""
    cmd = [sys.executable, "-m", "harness", "verify", case, "--out", str(out), "--ranks-per-core", str(ranks_per_core)]
    for name in only:
        cmd += ["--only", name]
    start = time.monotonic()
    proc = subprocess.Popen(cmd + (["--mps"] if mps else []), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: verify then stops its ranks and quits its MPS daemon; SIGKILL only if it does not end
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        fail(f"--ranks-per-core {ranks_per_core}{' --mps' if mps else ''} took over --timeout {timeout} s; "
              "nothing written")
    wall = time.monotonic() - start
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
    if mps and proc.returncode == 2 and "--mps:" in last:
        return {"refused": last}
    summaries = list(out.glob("*/summary.json"))
    if not summaries:
        fail(f"verify --ranks-per-core {ranks_per_core} wrote no summary: {last}")
    summary = json.loads(summaries[0].read_text())
    cpu = steps = 0.0
    traces = {}
    for v in summary["variants"]:
        run_dir = summaries[0].parent / Path(v["detail_page"]).parent
        if (run_dir / "trace.json").exists():
            traces[v["name"]] = Trace.load(run_dir / "trace.json")
        timings = json.loads((run_dir / "manifest.json").read_text())["timings"]
        for wall_s, cpu_s in zip(timings["step_time_s"], timings.get("step_cpu_s", [])):
            if cpu_s is not None:
                cpu, steps = cpu + cpu_s, steps + wall_s
    return {"ranks_per_core": ranks_per_core, "mps": mps, "wall_s": round(wall, 1), "all_pass": summary["all_pass"],
            "runs": {v["name"]: v["elapsed_s"] and round(v["elapsed_s"], 2) for v in summary["variants"]},
            "errors": {v["name"]: v["reason"] for v in summary["variants"] if v["verdict"] == "error"},
            "busy_cores_in_steps": round(cpu / steps, 2) if steps else None, "_traces": traces}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="cases/dsv3-gpu.yaml")
    ap.add_argument("--only", action="append", help=f"variant to run beside the baseline (default: {', '.join(P16)})")
    ap.add_argument("--settings", default="1,2,4", help="ranks per core, comma separated (default 1,2,4)")
    ap.add_argument("--mps", action="store_true", help="also every setting under an MPS daemon")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/packing.json")
    ap.add_argument("--timeout", type=int, default=200, help="seconds per setting (default 200)")
    args = ap.parse_args()
    try:
        settings = [int(x) for x in args.settings.split(",")]
    except ValueError:
        fail(f"--settings {args.settings!r}: expected ranks per core as integers, e.g. 1,2,4")
    if not settings or any(not 1 <= n <= 64 for n in settings):
        fail(f"--settings {args.settings!r}: each must be from 1 to 64")
    if len(set(settings)) != len(settings):
        fail(f"--settings {args.settings!r}: a setting is named twice")
    if not args.timeout > 0:
        fail(f"--timeout {args.timeout}: expected a positive number of seconds")
    out_file(args.out)
    only = args.only or P16
    try:        # the case and its variants before any run (a verify per setting would say it late, and again)
        load_case(args.case, only=only)
    except UsageError as e:
        fail(str(e))
    rows, mps_note, first = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for mps in ([False, True] if args.mps else [False]):
            for n in settings:
                row = _setting(args.case, only, n, mps, Path(tmp) / f"{'mps' if mps else 'plain'}{n}", args.timeout)
                if "refused" in row:
                    mps_note = row["refused"]
                    break
                traces = row.pop("_traces")
                first = first or traces
                # the same run in every setting must carry the same bits: packing and MPS move none
                row["bits_as_first_setting"] = {name: compare(first[name], t).bitwise_equal
                                                for name, t in traces.items() if name in first}
                rows.append(row)
                print(json.dumps(row), flush=True)
    import torch
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "case": args.case, "runs": ["(baseline)", *only], "cpu_cores": len(os.sched_getaffinity(0)),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "mps_unavailable": mps_note or None, "settings": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'mps':>4s} {'ranks/core':>10s} {'wall s':>8s} {'busy cores':>10s}  verdicts  bits as the first setting")
    for r in rows:
        same = all(r["bits_as_first_setting"].values())
        print(f"{str(r['mps']):>4s} {r['ranks_per_core']:10d} {r['wall_s']:8.1f} {r['busy_cores_in_steps'] or 0:10.2f}  "
              f"{'pass' if r['all_pass'] else 'FAIL':8s}  {'equal' if same else 'DIFFER'}")
    if mps_note:
        print(f"MPS: {mps_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
