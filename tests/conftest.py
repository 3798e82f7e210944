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


def pytest_collection_modifyitems(config, items):
    """Tests that share a module-scoped fixture (a case run once, read by several tests) go to one xdist worker
    (``--dist loadgroup``, the Makefile's test targets): under xdist's default each worker that draws one of them
    runs the fixture again (measured: the proxy case's 74 s twice in one test-megatron run).  Every other test is
    still handed out one by one."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = any(defs and defs[-1].scope == "module" and name in item.fixturenames
                     for name, defs in (info.name2fixturedefs.items() if info else ()))
        if shared:      # one group per module: a test reading two of its fixtures joins the others of both
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
