"""Benchmark: per-layout cost of the forkserver runner (what `verify` and `fuzz` use) against the plain
multi-process launch (torchrun: fresh interpreters, torch imported per rank), measured side by side in one
run on the same smoke layouts; then a timed `bitparity fuzz` for layouts/minute (goal >= 20/min, i.e.
>= 200 layouts per 10 minutes on 2 cores)."""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.cases import load_case  # noqa: E402
from harness.runner import run_ranks  # noqa: E402
from harness.trace import merge  # noqa: E402

LAYOUTS = [("Ett|ttmL", 2), ("Et|tt|tm|L", 4), ("Et|tt|t|mL", 2), ("E|t|t|t|t||m|L", 4), ("Etttt|m|L", 3),
           ("E|tt|tt|mL", 4)]


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
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "harness", "fuzz", "cases/smoke.yaml", "--budget", "60s",
                               "--seed", "0", "--out", out], cwd=ROOT, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if "layouts/min" in l), proc.stderr.strip())
    print(f"bitparity fuzz, 60 s budget: {line}")


if __name__ == "__main__":
    main()
