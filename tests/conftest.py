import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the report tests' fixtures (result, html, dsv3), shared by tests/test_report_*.py
pytest_plugins = ["report_cases"]


def run_cli(*args, cwd=ROOT, timeout=600, env=None):
    """Run ``python -m harness ARGS`` (`env`: variables added to this process's environment); returns the
    CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=None if env is None else {**os.environ, **env})


def variants(report: Path) -> dict:
    """{variant name: its entry} of a case report directory's ``summary.json`` (``OUT/<case name>``)."""
    return {v["name"]: v for v in json.loads((Path(report) / "summary.json").read_text())["variants"]}


@pytest.fixture
def cli():
    return run_cli
