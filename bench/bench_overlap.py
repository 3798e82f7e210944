"""Benchmark: training step time of the smoke model with the 1F1B overlap on vs off (and with delayed weight
gradients), and with expert parallelism EP=1 vs EP=2, measured side by side in one run (interleaved A/B
repeats, median over steps after the first).  CPU numbers, no target: this shows what the node-by-node
execution and the expert all-to-all cost in the reference trainer (on a CPU nothing overlaps, so the
overlap can only cost; on GPUs Megatron hides the all-to-all behind the other microbatch's compute).

    python bench/bench_overlap.py [--steps 6] [--repeats 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.judging.trace import merge  # noqa: E402
from harness.running.runner import run_ranks  # noqa: E402
from trainerkit.config import ModelConfig, ParallelConfig, RunConfig, TrainingConfig  # noqa: E402

MODEL = ModelConfig(num_layers=4, moe_layer_freq="[0]*1+[1]*3", hidden_size=32, mtp_num_layers=1)
LAYOUT, PP = "Et|tt|t|mL", 2          # P=2 V=2, MTP with the loss (the smoke case's interleaved layout)
ARMS = {                               # name -> ParallelConfig overrides
    "plain": {},
    "overlap": {"overlap_moe_expert_parallel_comm": True},
    "overlap + delay_wgrad": {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True},
    "EP=2": {"expert_model_parallel_size": 2},
    "EP=2 + overlap": {"expert_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True},
}


def step_times(arm: str, steps: int, tmp: Path, tag: str) -> list[float]:
    cfg = RunConfig(model=MODEL, training=TrainingConfig(train_iters=steps, seq_length=16, micro_batch_size=2,
                                                         num_microbatches=4),
                    parallel=ParallelConfig(pipeline_model_parallel_layout=LAYOUT, pipeline_model_parallel_size=PP,
                                            **ARMS[arm]))
    out = run_ranks(cfg, tmp / tag, timeout_s=300)
    if not out.ok:
        sys.exit(f"bench_overlap: {arm} failed: {out.error}")
    trace = merge(tmp / tag, cfg.parallel.world_size)
    return [max(st.time_s.values()) for st in trace.steps[1:]]       # step 0 warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds over all arms")
    args = ap.parse_args()
    times: dict = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for arm in ARMS:
                times[arm] += step_times(arm, args.steps, Path(tmp), f"{r}-{len(times[arm])}-{arm.replace(' ', '')}")
    base = statistics.median(times["plain"])
    ep1 = base
    print(f"step time, smoke model, layout {LAYOUT} (P={PP}, V=2), {args.repeats} x {args.steps - 1} steps per arm:")
    for arm, ts in times.items():
        med = statistics.median(ts)
        ref, ref_name = (statistics.median(times["EP=2"]), "EP=2") if arm == "EP=2 + overlap" else (ep1, "plain")
        print(f"  {arm:<24} {med * 1e3:8.1f} ms   / {ref_name}: {med / ref:5.2f}")


if __name__ == "__main__":
    main()
