"""Benchmark: the expert-parallel collectives and the pipeline boundary exchange of two ranks over gloo against the
host sockets of `reference_impl.host_channel` / `host_pipe`, side by side in one run (the same processes, the same
tensors, alternating rounds).

    python3 bench/bench_ep_channel.py [--iters 2000] [--rows 16] [--out FILE]

Per collective (``all_to_all_single`` with even splits, ``all_gather``; ``boundary``: each rank sends the other a
dsv3 stage boundary [s, b, h] = [16, 1, 32] fp32 and receives the other's, as `transport.Transport.batch` does
with ``batch_isend_irecv`` or `host_pipe.HostPipe`) and path: the CPU time of one rank's
process per call (``time.process_time``, every thread: gloo's work and event-loop threads included) and the wall
time per call, medians over rounds; then gloo / channel.  The tensors are a DeepSeek-V3 dsv3 MoE layer's: `--rows`
(token, k) rows of hidden 32 fp32 per peer (cases/dsv3.yaml: 16 tokens x top-2 over EP = 2).  Both ranks check
that each path delivered the same bytes (the channel's correctness has its own tests; this only guards the
numbers).  Measured on 2 AMD EPYC cores (torch 2.13): a2a ~300 vs ~90 us of CPU, all_gather ~550 vs ~60 us,
boundary ~170 vs ~20 us.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

ROUNDS = 5


def _rank(rank: int, store_path: str, iters: int, rows: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from reference_impl.host_channel import HostChannel
    from reference_impl.host_pipe import HostPipe
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    channel = HostChannel.connect(store, "bench", rank, 2, 60.0)
    pipe = HostPipe.connect(store, "bench-pipe", rank, {1 - rank}, 60.0)
    boundary = torch.randn(16, 1, 32, generator=torch.Generator().manual_seed(10 + rank))
    src = torch.randn(2 * rows, 32, generator=torch.Generator().manual_seed(rank))
    shard = src[:rows].contiguous()
    splits = [rows, rows]

    def a2a(path):
        out = torch.empty_like(src)
        (dist.all_to_all_single if path == "gloo" else channel.all_to_all_single)(out, src, splits, splits)
        return out

    def gather(path):
        parts = [torch.empty_like(shard) for _ in range(2)]
        if path == "gloo":
            dist.all_gather(parts, shard)
        else:
            channel.all_gather(parts, shard)
        return torch.cat(parts)

    def exchange(path):
        if path == "gloo":
            got = torch.empty_like(boundary)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, boundary, 1 - rank, tag=7),
                                            dist.P2POp(dist.irecv, got, 1 - rank, tag=7)])
            works[-1].wait()
            works[0].wait()
            return got
        sent = pipe.send(boundary, 1 - rank, 7)
        got = pipe.recv(boundary.shape, boundary.dtype, 1 - rank, 7)
        sent.wait()
        return got

    result: dict = {}
    for name, fn in (("all_to_all_single", a2a), ("all_gather", gather), ("boundary", exchange)):
        same = torch.equal(fn("gloo"), fn("channel"))
        times = {"gloo": [], "channel": []}
        for _ in range(ROUNDS):
            for path in ("gloo", "channel"):
                for _ in range(iters // 10):                         # warm-up of this round
                    fn(path)
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(iters):
                    fn(path)
                times[path].append(((time.process_time() - cpu) / iters * 1e6,
                                    (time.perf_counter() - wall) / iters * 1e6))
        row = {"same_bytes": same}
        for path, samples in times.items():
            row[f"{path}_cpu_us"] = round(statistics.median(c for c, _ in samples), 1)
            row[f"{path}_wall_us"] = round(statistics.median(w for _, w in samples), 1)
        row["cpu_ratio_gloo_over_channel"] = round(row["gloo_cpu_us"] / row["channel_cpu_us"], 2)
        result[name] = row
    channel.close()
    pipe.close()
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="calls per path and round (default 2000)")
    ap.add_argument("--rows", type=int, default=16, help="rows of hidden 32 per peer (default 16)")
    ap.add_argument("--out", help="write the JSON result to this file")
    args = ap.parse_args()
    out = out_file(args.out)
    if args.iters < 10 or args.rows < 1:
        fail(f"--iters {args.iters} / --rows {args.rows}: need at least 10 calls and 1 row")
    work = Path(tempfile.mkdtemp(prefix="bench-ep-channel-"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(work / "store"), args.iters, args.rows, str(work / f"r{r}.json")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs):
        print(f"bench_ep_channel: a rank failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    result = {"cpu": os.cpu_count(), "iters": args.iters, "rows": args.rows,
              "ranks": [json.loads((work / f"r{r}.json").read_text()) for r in range(2)]}
    for name, row in result["ranks"][0].items():
        print(f"{name:18s} gloo {row['gloo_cpu_us']:7.1f} us CPU ({row['gloo_wall_us']:7.1f} wall)   channel "
              f"{row['channel_cpu_us']:6.1f} us CPU ({row['channel_wall_us']:6.1f} wall)   "
              f"gloo/channel {row['cpu_ratio_gloo_over_channel']}x   same bytes: {row['same_bytes']}")
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
