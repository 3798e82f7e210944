"""Benchmark: wall time of `bitparity verify` on the DeepSeek-V3 case (target <= 120 s on 2 cores) and on the
smoke case, measured side by side in one run, printed with the per-variant split."""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 120.0


def run(case: str, out: Path) -> tuple[float, dict]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "verify", case, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode not in (0, 1):
        sys.exit(f"bench: verify {case} failed: {proc.stderr.strip()}")
    name = Path(case).stem
    return wall, json.loads((out / name / "summary.json").read_text())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(case, *run(case, Path(tmp))) for case in ("cases/smoke.yaml", "cases/dsv3.yaml")]
    for case, wall, summary in rows:
        print(f"{case}: {wall:.1f} s wall ({len(summary['variants'])} runs)")
        for v in summary["variants"]:
            print(f"    {v['name']:<28} P={v['pp']:<2} V={v['vpp']}  {v['elapsed_s']:6.1f} s  {v['verdict']}")
    dsv3 = rows[1][1]
    print(f"dsv3 wall / target: {dsv3:.1f} / {TARGET_S:.0f} s = {dsv3 / TARGET_S:.2f}"
          f" ({'within' if dsv3 <= TARGET_S else 'OVER'} target)")


if __name__ == "__main__":
    main()
