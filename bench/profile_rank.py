"""Where a single-rank run's time goes: one variant of a case (P = 1: no pipelining, world of one) trained in this
process under torch.profiler, the rank's own `train` as the harness would run it (issue #25: "profile first").

    python3 bench/profile_rank.py cases/dsv3-gpu.yaml pp1-no-pipelining [--out DIR] [--steps N]

Writes ``profile_<variant>.json`` to DIR: wall time of each step (time.perf_counter around the whole `train`
call, start-up included), the top operators by self CPU time and by self device time, and the counts of the
host synchronisations (``aten::item`` / ``aten::_local_scalar_dense`` / ``cudaStreamSynchronize`` /
``cudaMemcpy*``: each one a host wait for the device) and of kernel launches.  Also prints the tables.

Measured: on 2 CPU cores, cases/dsv3.yaml pp1-no-pipelining, 1 step: 5.6 s, 1,741 ``aten::item`` per step,
69,120 ``aten::mm`` (per-expert loops).  Under the CUDA profiler the dsv3-gpu P = 1 run did not finish 3 steps in
500 s on the H200 (76 s without it): profile one step there (``--steps 1``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("variant")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, help="override train_iters")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from harness.planning.cases import load_case
    from reference_impl.train import train
    from reference_impl.transport import setup
    from reference_impl.worker import deterministic_torch

    plan = load_case(args.case, only=[args.variant])
    run = next(r for r in plan.runs if r.spec.name == args.variant)
    cfg = run.config
    if args.steps:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"train_iters": args.steps})})
    if cfg.parallel.world_size != 1:
        raise SystemExit(f"{args.variant}: {cfg.parallel.world_size} ranks; this profiles a world of one (P = 1)")
    deterministic_torch()
    torch.set_num_threads(cfg.training.num_threads)
    work = Path(tempfile.mkdtemp())
    store = dist.FileStore(str(work / "store"), 1)
    transport = setup(cfg.device, 0, 1, store, cfg.rank_timeout_s, cfg.num_gpus, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        train(cfg, 0, work / "rank0.jsonl", transport)
    wall = time.perf_counter() - start
    dist.destroy_process_group()
    steps = [json.loads(x) for x in (work / "rank0.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["type"] == "step"]
    events = prof.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def rows(key):
        top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:args.rows]
        return [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": getattr(e, device_key, 0) / 1e3} for e in top]
    syncs = {e.key: e.count for e in events if e.key in ("aten::item", "aten::_local_scalar_dense",
                                                         "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaMemcpyAsync", "cudaMemcpy", "aten::nonzero")}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    result = {"case": args.case, "variant": args.variant, "device": cfg.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if cfg.device == "cuda" else None,
              "wall_s": wall, "step_time_s": [s["time_s"] for s in steps], "host_syncs": syncs,
              "kernel_launches": launches, "top_self_cpu": rows("self_cpu_time_total"),
              "top_self_device": rows(device_key) if cfg.device == "cuda" else []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{args.variant}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("wall_s", "step_time_s", "host_syncs", "kernel_launches")}))
    sort = "self_cuda_time_total" if cfg.device == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cfg.device == "cuda":
        print(events.table(sort_by=sort, row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
