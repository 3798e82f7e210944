"""Benchmark: one MoE layer's routed experts, forward + backward, as grouped matrix products
(`reference_impl.model.grouped.swiglu`, ``torch._grouped_mm``) against the per-expert loop they replace, measured
side by side in one process (interleaved A/B repeats, median), with the bits checked equal on every repeat.
Shapes: the dsv3 cases' MoE layer (hidden 64, expert ffn 32, 16 experts) and a wider one.  No target: the ratio is
what the grouping saves per layer and microbatch (CPU here; on a GPU the saving is launches).

    python bench/bench_grouped.py [--repeats 20] [--device cpu|cuda] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reference_impl.model import grouped  # noqa: E402
from reference_impl.model.common import SwiGLUMLP  # noqa: E402

SHAPES = {"dsv3 MoE layer (h 64, ffn 32, 16 experts, 256 rows)": (64, 32, 16, 256),
          "wider (h 256, ffn 512, 16 experts, 512 rows)": (256, 512, 16, 512)}


def _once(fn, x, g, experts, sync) -> tuple[float, torch.Tensor]:
    for e in experts:
        e.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    sync()
    t0 = time.perf_counter()
    y = fn(x)
    y.backward(g)
    sync()
    return time.perf_counter() - t0, y.detach()


def measure(hidden: int, ffn: int, n_experts: int, rows: int, repeats: int, device: str, dtype) -> dict:
    torch.manual_seed(0)
    experts = [SwiGLUMLP(hidden, ffn).to(device=device, dtype=dtype) for _ in range(n_experts)]
    counts = torch.multinomial(torch.ones(n_experts), rows, replacement=True).bincount(minlength=n_experts).tolist()
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    g = torch.randn(rows, hidden, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def loop(t):
        return torch.cat([e(r) for e, r in zip(experts, t.split(counts))])

    def group(t):
        return grouped.swiglu(t, counts, experts)

    times = {"loop": [], "grouped": []}
    for _ in range(repeats):
        for name, fn in (("loop", loop), ("grouped", group)):
            dt, y = _once(fn, x, g, experts, sync)
            times[name].append(dt)
            if name == "loop":
                ref = y
            elif not torch.equal(ref, y):
                raise SystemExit("grouped and loop differ: the benchmark measures nothing comparable")
    med = {k: statistics.median(v[1:]) * 1e6 for k, v in times.items()}
    return {"loop_us": round(med["loop"], 1), "grouped_us": round(med["grouped"], 1),
            "speedup": round(med["loop"] / med["grouped"], 2), "grouped_path": grouped.use_grouped(x, experts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {"device": args.device, "torch": torch.__version__, "threads": 1, "results": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for label, shape in SHAPES.items():
            r = measure(*shape, args.repeats, args.device, dtype)
            out["results"][f"{label}, {str(dtype).split('.')[-1]}"] = r
            print(f"{label:55s} {str(dtype).split('.')[-1]:9s} loop {r['loop_us']:9.1f} us  grouped "
                  f"{r['grouped_us']:9.1f} us  x{r['speedup']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
