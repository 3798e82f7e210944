"""The forkserver runner (fast path used by verify and fuzz) produces traces bitwise equal to the plain
multi-process launch (torchrun: fresh processes, rank/world from the environment) on every smoke layout."""
import json

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def _steps(report, run_dir):
    trace = json.loads((report / "smoke" / run_dir / "trace.json").read_text())
    # the bits, not the clocks (time_s, the measured action times)
    return [{k: v for k, v in s.items() if k not in ("time_s", "actions")} for s in trace["steps"]], trace["init"]


def test_torchrun_matches_fork(tmp_path):
    for launcher in ("fork", "torchrun"):
        proc = run_cli("verify", ROOT / "cases" / "smoke.yaml", "--launcher", launcher, "--out", tmp_path / launcher)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # run directories: runs/<variant name made path-safe> (detail_page is runs/<dir>/index.html)
    variants = [v["detail_page"].rsplit("/", 1)[0]
                for v in json.loads((tmp_path / "fork" / "smoke" / "summary.json").read_text())["variants"]]
    assert len(variants) == 6 and "runs/canonical_pp1" in variants
    for v in variants:
        assert _steps(tmp_path / "fork", v) == _steps(tmp_path / "torchrun", v), v
    summary = json.loads((tmp_path / "torchrun" / "smoke" / "summary.json").read_text())
    assert summary["environment"]["launcher"] == "torchrun"
