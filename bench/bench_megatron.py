"""Benchmark: what one megatron-core run costs on CPU, part by part, against the reference trainer, side by side in
one session (interleaved A/B repeats).  The case's P=4 V=2 layout (cases/megatron-dsv3.yaml), 2 steps.

Per run: wall time from the harness (rank start to exit), ``setup_s`` inside the ranks (process group, parallel
state, model build and init, DDP, optimizer; slowest rank), the first step and the later steps (slowest rank).
Launchers: the harness's forkserver with megatron-core preloaded (what ``bitparity verify`` does) and
``torchrun`` (every rank imports torch and megatron itself).  Goal from the megatron-core issue: under 10 s per
such run (the prototype took 17-33 s).

    python bench/bench_megatron.py [--repeats 3] [--out bench/results/megatron_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from harness.judging.trace import merge  # noqa: E402
from harness.running import runner  # noqa: E402
from trainerkit.config import RunConfig  # noqa: E402

LAYOUT, PP = "Et|t|t|t|t|t|t|mL", 4


def config(trainer: str) -> RunConfig:
    case = yaml.safe_load((ROOT / "cases" / "megatron-dsv3.yaml").read_text())
    return RunConfig.model_validate({
        "model": case["model"], "training": {**case["training"], "train_iters": 2}, "trainer": trainer,
        "parallel": {"pipeline_model_parallel_layout": LAYOUT, "pipeline_model_parallel_size": PP}})


def one_run(cfg: RunConfig, run_dir: Path, launcher: str) -> dict:
    out = runner.run_ranks(cfg, run_dir, 600, launcher)
    if not out.ok:
        raise SystemExit(f"{cfg.trainer} ({launcher}) failed: {out.error}")
    trace = merge(run_dir, PP)
    headers = [json.loads((run_dir / f"rank{r}.jsonl").read_text().splitlines()[0]) for r in range(PP)]
    setup = max((h.get("setup_s") or 0.0) for h in headers) or None
    steps = [max(st.time_s.values()) for st in trace.steps]
    return {"wall_s": out.elapsed_s, "setup_s": setup, "first_step_s": steps[0], "later_step_s": steps[1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "megatron_cpu.json")
    args = ap.parse_args()
    arms = [("megatron-core", "fork"), ("reference", "fork"), ("megatron-core", "torchrun")]
    runner.preload([config("megatron-core")])
    results: dict = {f"{t} / {l}": [] for t, l in arms}
    with tempfile.TemporaryDirectory(prefix="bench-megatron-") as tmp:
        for rep in range(args.repeats + 1):            # repeat 0 warms the forkserver (its imports)
            for trainer, launcher in arms:
                r = one_run(config(trainer), Path(tmp) / f"{trainer}-{launcher}-{rep}", launcher)
                if rep:
                    results[f"{trainer} / {launcher}"].append(r)
                print(f"  rep {rep} {trainer:14s} {launcher:8s} wall {r['wall_s']:5.1f} s  setup "
                      f"{r['setup_s'] or 0:4.1f} s  first step {r['first_step_s']:.2f} s  later "
                      f"{statistics.median(r['later_step_s']):.2f} s", flush=True)
    summary = {}
    for arm, runs in results.items():
        summary[arm] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                        "setup_s": statistics.median(r["setup_s"] for r in runs) if runs[0]["setup_s"] else None,
                        "first_step_s": statistics.median(r["first_step_s"] for r in runs),
                        "later_step_s": statistics.median(x for r in runs for x in r["later_step_s"])}
    mc, ref = summary["megatron-core / fork"], summary["reference / fork"]
    report = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "cpus": __import__("os").cpu_count(), "torch": __import__("torch").__version__,
              "megatron_core": __import__("importlib.metadata").metadata.version("megatron-core"),
              "layout": LAYOUT, "pipeline_model_parallel_size": PP, "train_iters": 2, "repeats": args.repeats,
              "median": summary,
              "ratios": {"megatron / reference wall": mc["wall_s"] / ref["wall_s"],
                         "megatron / reference later step": mc["later_step_s"] / ref["later_step_s"],
                         "torchrun / forkserver wall (megatron)": summary["megatron-core / torchrun"]["wall_s"]
                         / mc["wall_s"]},
              "goal": "megatron-core P=4 V=2 2-step run under 10 s (forkserver)",
              "goal_met": mc["wall_s"] < 10.0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for arm, s in summary.items():
        print(f"{arm:26s} wall {s['wall_s']:5.1f} s  setup {s['setup_s'] or 0:4.1f} s  first step "
              f"{s['first_step_s']:.2f} s  later steps {s['later_step_s']:.2f} s")
    print(f"goal (< 10 s per run, forkserver): {'met' if report['goal_met'] else 'NOT met'}; written to {args.out}")


if __name__ == "__main__":
    main()
