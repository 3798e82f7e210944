"""GPU benchmark: what the capture costs inside the rank, measured with CUDA events (issue #25).

Every step record of a CUDA rank carries ``step_device_s`` (device seconds from the step's first CUDA event to its
last) and ``capture_device_s`` (device seconds between the two events around each capture call: the fingerprint
kernels of every fp32 ``main_grad`` and every fp32 master weight, where the loop queued them), plus the host
seconds inside the capture calls (``capture_s``) and the step's host seconds (``time_s``);
`trainerkit.capture.CaptureClock` records them in the rank.  This runs a ~1.35B-parameter DeepSeek-V3-structured
model in bf16 on one GPU (P = 1, full capture) and reports capture / step on the device and on the host, step 0
(warm-up, kernel compilation) left out.  Goal: <= 1 % on the device.

Whole-step wall times A/B (full capture vs losses only), which this script measured before, vary by +-25 % from
step to step on the lent machine, far more than the effect: the events measure the capture itself.

    python bench/bench_gpu_capture.py [--steps 5] [--out bench/results/gpu_capture.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.running.runner import run_ranks  # noqa: E402
from trainerkit.config import ModelConfig, ParallelConfig, RunConfig, TrainingConfig  # noqa: E402

MODEL_1B = ModelConfig(vocab_size=256, hidden_size=2048, num_layers=8, moe_layer_freq="[0]*1+[1]*7",
                       num_attention_heads=16, q_lora_rank=1024, kv_lora_rank=512, qk_head_dim=128,
                       qk_pos_emb_head_dim=64, v_head_dim=128, ffn_hidden_size=8192, num_moe_experts=16,
                       moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=1408, moe_router_topk=4,
                       moe_router_num_groups=4, moe_router_group_topk=2, mtp_num_layers=1)
GOAL = 0.01


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_capture.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_capture: needs a CUDA device (none found); nothing measured")
    training = TrainingConfig(train_iters=args.steps, seq_length=1024, micro_batch_size=1, num_microbatches=4)
    cfg = RunConfig(model=MODEL_1B, training=training, device="cuda", params_dtype="bfloat16", capture="full",
                    rank_timeout_s=900, parallel=ParallelConfig(pipeline_model_parallel_layout="Et*8mL",
                                                                pipeline_model_parallel_size=1))
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(cfg, Path(tmp) / "run", timeout_s=900)
        if not out.ok:
            sys.exit(f"bench_gpu_capture: the run failed: {out.error}")
        records = [json.loads(x) for x in (Path(tmp) / "run" / "rank0.jsonl").read_text().splitlines()]
    header = records[0]
    n_params = sum(int(torch.tensor(p["shape"]).prod()) for p in header["params"])
    steps = [r for r in records if r["type"] == "step"][1:]               # step 0 warms up
    if not steps or "step_device_s" not in steps[0]:
        sys.exit("bench_gpu_capture: the step records carry no device times (CaptureClock saw no CUDA)")
    dev = [r["capture_device_s"] / r["step_device_s"] for r in steps]
    host = [r["capture_s"] / r["time_s"] for r in steps]
    rows = [{k: r[k] for k in ("step", "time_s", "capture_s", "step_device_s", "capture_device_s")} for r in steps]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "cuda": torch.version.cuda, "parameters": n_params,
              "tensors_fingerprinted_per_step": 2 * len(header["params"]),
              "bytes_fingerprinted_per_step": 2 * 4 * n_params,            # fp32 main_grad + fp32 master
              "layout": cfg.parallel.pipeline_model_parallel_layout, "params_dtype": cfg.params_dtype,
              "seq_length": training.seq_length, "num_microbatches": training.num_microbatches,
              "goal_device_ratio": GOAL, "device_ratio_median": statistics.median(dev), "device_ratio_max": max(dev),
              "host_ratio_median": statistics.median(host), "steps": rows}
    for r in rows:
        print(f"step {r['step']}: device {r['step_device_s'] * 1e3:8.1f} ms, capture {r['capture_device_s'] * 1e3:6.2f} ms"
              f" ({r['capture_device_s'] / r['step_device_s']:.3%});  host {r['time_s'] * 1e3:8.1f} ms, capture"
              f" {r['capture_s'] * 1e3:6.2f} ms ({r['capture_s'] / r['time_s']:.3%})")
    print(f"{n_params / 1e9:.2f} B parameters: capture / step on the device {statistics.median(dev):.3%} (median; "
          f"max {max(dev):.3%}; goal <= {GOAL:.0%}), host {statistics.median(host):.3%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
