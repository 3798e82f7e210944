"""Multi-GPU check and benchmark: the same layouts with one pipeline rank per GPU (NCCL p2p) and with all
ranks sharing one GPU (staged over gloo) must give bit-identical traces; records step time per layout and
placement, and the capture-overhead ratio (full capture / losses-only) of the one-rank-per-GPU runs.

Run on a machine with >= 2 GPUs:  python bench/bench_placements.py cases/dsv3-gpu.yaml VARIANT [VARIANT...]
Writes bench/results/multi_gpu.json (date, device, torch, commands, numbers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.judging.trace import merge  # noqa: E402
from harness.planning.cases import load_case  # noqa: E402
from harness.running.runner import run_ranks  # noqa: E402


def _run(cfg, run_dir: Path, launcher: str):
    out = run_ranks(cfg, run_dir, 900, launcher)
    if not out.ok:
        raise SystemExit(f"{run_dir.name} failed: {out.error}")
    trace = merge(run_dir, cfg.parallel.world_size)
    steps = [{k: v for k, v in vars(s).items() if k != "time_s"} for s in trace.steps]
    times = [max(s.time_s.values()) for s in trace.steps[1:]]
    return steps, statistics.median(times) if times else float("nan"), out.elapsed_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("case")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--launcher", default="torchrun", choices=("fork", "torchrun"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multi_gpu.json"))
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    plan = load_case(args.case, only=args.variants, overrides={"device": "cuda"})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in (r for r in plan.runs if r.spec.name in args.variants):
            pp = run.layout.pipeline_model_parallel_size
            if pp > gpus:
                print(f"skip {run.spec.name}: P={pp} > {gpus} GPUs")
                continue
            row = {"variant": run.spec.name, "layout": run.layout.text, "pp": pp}
            results = {}
            for tag, update in (("per_gpu", {"num_gpus": pp}), ("shared", {"num_gpus": 1}),
                                ("per_gpu_losses_only", {"num_gpus": pp, "capture": "losses"})):
                cfg = run.config.model_copy(update=update)
                launcher = args.launcher if tag != "shared" else "fork"
                steps, step_s, wall = _run(cfg, Path(tmp) / f"{run.spec.name.replace('/', '_')}-{tag}", launcher)
                results[tag] = steps
                row[f"step_s_{tag}"], row[f"wall_s_{tag}"] = step_s, wall
            row["bitwise_equal_placements"] = results["per_gpu"] == results["shared"]
            row["capture_overhead_ratio"] = row["step_s_per_gpu"] / row["step_s_per_gpu_losses_only"]
            rows.append(row)
            print(f"{run.spec.name:<32} P={pp} one-GPU-per-rank {row['step_s_per_gpu'] * 1e3:7.1f} ms/step, "
                  f"shared {row['step_s_shared'] * 1e3:7.1f} ms/step, bitwise equal: {row['bitwise_equal_placements']}, "
                  f"capture overhead {row['capture_overhead_ratio']:.3f}")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpus": gpus,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": " ".join(["python", "bench/bench_placements.py", *sys.argv[1:]]), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"results in {args.out}")
    if not all(r["bitwise_equal_placements"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
