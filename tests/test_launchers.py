"""The torchrun launch path (rank/world from the environment, gloo on CPU) produces traces bitwise equal to
the forkserver path."""
import json

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def _steps(report, variant):
    trace = json.loads((report / "smoke" / "runs" / variant / "trace.json").read_text())
    return [{k: v for k, v in s.items() if k != "time_s"} for s in trace["steps"]], trace["init"]


def test_torchrun_matches_fork(tmp_path):
    variant = "pp4-mtp-standalone"
    for launcher in ("fork", "torchrun"):
        proc = run_cli("verify", ROOT / "cases" / "smoke.yaml", "--only", variant, "--launcher", launcher,
                       "--out", tmp_path / launcher)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _steps(tmp_path / "fork", variant) == _steps(tmp_path / "torchrun", variant)
    summary = json.loads((tmp_path / "torchrun" / "smoke" / "summary.json").read_text())
    assert summary["environment"]["launcher"] == "torchrun"
