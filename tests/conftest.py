import fcntl
import hashlib
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


def once(tmp_path_factory, key: list, run) -> tuple[subprocess.CompletedProcess, Path]:
    """``run(OUT)`` (returns a CompletedProcess, text mode), run once per pytest session whichever module or xdist
    worker asks first; the others wait on a file lock and get the same (CompletedProcess, OUT).  A module-scoped
    fixture runs once per worker that draws one of its tests, so a job read by several tests ran up to once per
    worker (the megatron cases: 60-90 s each on 2 cores).  Keyed by `key` (strings): the same job with other flags
    is another run.  The session's temporary directory is shared by its workers."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    digest = hashlib.sha1(json.dumps([str(k) for k in key]).encode()).hexdigest()[:16]
    out, record = shared / f"once-{digest}", shared / f"once-{digest}.json"
    with open(shared / f"once-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # released when the file closes, a crashed worker's too
        if not record.is_file():
            proc = run(out)
            record.write_text(json.dumps([proc.args, proc.returncode, proc.stdout, proc.stderr]))
        args, code, stdout, stderr = json.loads(record.read_text())
    return subprocess.CompletedProcess(args, code, stdout, stderr), out


def verify_once(tmp_path_factory, case, *args, timeout=900) -> tuple[subprocess.CompletedProcess, Path]:
    """``bitparity verify CASE ARGS --out OUT`` once per pytest session (`once`); tests only read a case's report."""
    return once(tmp_path_factory, ["verify", case, *args],
                lambda out: run_cli("verify", case, "--out", out, *args, timeout=timeout))


def verify_text_once(tmp_path_factory, filename: str, text: str, *args,
                     timeout=900) -> tuple[subprocess.CompletedProcess, Path]:
    """`verify_once` of a case given as YAML text: written to OUT/`filename`, its report in OUT/<case name>."""
    def run(out: Path) -> subprocess.CompletedProcess:
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(text)
        return run_cli("verify", out / filename, "--out", out, *args, timeout=timeout)
    return once(tmp_path_factory, ["verify-text", filename, text, *args], run)


def spawn_ranks(worker, tmp_path: Path, world: int, scenario: str) -> list[dict]:
    """Run ``worker(rank, world, store_path, out_path, scenario)`` in `world` spawned processes that rendezvous
    through one FileStore (as the fork launcher's ranks do); each writes a JSON dict to its out_path, returned in
    rank order.  A rank still alive after 120 s is killed and fails the test, as does a nonzero exit code."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, str(tmp_path / "store"), str(tmp_path / f"r{r}.json"),
                                              scenario)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{scenario}: a rank hung"
    assert [p.exitcode for p in procs] == [0] * world
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def refusal(case, **load_case_args) -> str:
    """The one line `load_case` refuses `case` with, in this process: what ``bitparity verify CASE`` prints after
    ``bitparity: error:``, exit 2, nothing written (the command treats every UsageError alike: test_cli_errors, and
    one command-line case per family of refusals, check that path).  A megatron case's refusal through the command
    line costs its own interpreter, torch and megatron (~3-5 s of CPU on 2 cores); here megatron is imported once
    per worker."""
    from harness.errors import UsageError
    from harness.planning.cases import load_case
    with pytest.raises(UsageError) as refused:
        load_case(case, **load_case_args)
    line = str(refused.value)
    assert "\n" not in line, line
    return line


def variants(report: Path) -> dict:
    """{variant name: its entry} of a case report directory's ``summary.json`` (``OUT/<case name>``)."""
    return {v["name"]: v for v in json.loads((Path(report) / "summary.json").read_text())["variants"]}


@pytest.fixture
def cli():
    return run_cli
