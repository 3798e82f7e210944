"""`harness.running.pool.run_packed`: runs side by side within a core budget, results in order, the first failure raised after
the others end; and `bitparity verify --jobs` gives the same bits whether the runs go side by side or one by one."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.running import pool, runner


def _tracking(budget_log: list, lock: threading.Lock, running: dict):
    def body(item):
        name, weight, seconds = item
        with lock:
            running[name] = weight
            budget_log.append((sum(running.values()), len(running)))
        time.sleep(seconds)
        with lock:
            del running[name]
        return name.upper()
    return body


def test_packs_within_the_budget_and_keeps_the_order():
    """Weights (rank counts) never exceed the budget together, an item heavier than the budget runs alone, light
    items fill the gaps, and results come back in the items' order."""
    items = [("a", 2, 0.2), ("b", 1, 0.1), ("c", 1, 0.1), ("d", 5, 0.1), ("e", 1, 0.05), ("f", 1, 0.05)]
    log, lock, running = [], threading.Lock(), {}
    out = pool.run_packed(items, lambda i: i[1], _tracking(log, lock, running), budget=3, jobs=8)
    assert out == ["A", "B", "C", "D", "E", "F"]
    assert max(w for w, _ in log) <= 5 and all(w <= 3 for w, n in log if n > 1)   # d (5 > 3) only ever alone
    assert max(n for _, n in log) >= 2                                              # something did run side by side


def test_jobs_one_is_one_after_another():
    log, lock, running = [], threading.Lock(), {}
    items = [(c, 1, 0.01) for c in "abcd"]
    assert pool.run_packed(items, lambda i: i[1], _tracking(log, lock, running), budget=4, jobs=1) == list("ABCD")
    assert max(n for _, n in log) == 1
    with pytest.raises(ValueError):
        pool.run_packed(items, lambda i: 1, lambda i: i, budget=4, jobs=0)


def test_first_failure_is_raised_after_the_running_ones_end_and_nothing_new_starts():
    started, finished = [], []

    def body(item):
        started.append(item)
        if item == 1:
            raise RuntimeError("run 1 broke")
        time.sleep(0.3)
        finished.append(item)
        return item

    with pytest.raises(RuntimeError, match="run 1 broke"):
        pool.run_packed([0, 1, 2, 3, 4], lambda i: 1, body, budget=2, jobs=2)
    assert set(started) >= {0, 1} and 4 not in started     # what was running finished; the rest never started
    assert set(finished) == set(started) - {1}


def test_verify_side_by_side_gives_the_bits_of_one_by_one(tmp_path, cli):
    """The smoke case with its runs packed (default) and with --jobs 1: every run's trace bitwise equal (each run
    is its own processes: running two at once moves no bit), the verdicts alike."""
    import json

    from harness.judging.compare import compare
    from harness.judging.trace import Trace
    outs = {}
    for jobs in ("1", None):
        out = tmp_path / f"jobs{jobs}"
        proc = cli("verify", "cases/smoke.yaml", "--out", out, *(["--jobs", jobs] if jobs else []))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs[jobs] = out / "smoke"
    summary = json.loads((outs["1"] / "summary.json").read_text())
    kept = sorted(p.parent.name for p in (outs["1"] / "runs").glob("*/trace.json"))
    assert kept and kept == sorted(p.parent.name for p in (outs[None] / "runs").glob("*/trace.json"))
    for name in kept:
        a, b = (Trace.load(outs[j] / "runs" / name / "trace.json") for j in ("1", None))
        assert compare(a, b).bitwise_equal and a.init == b.init, name
    assert [v["verdict"] for v in summary["variants"]] == \
        [v["verdict"] for v in json.loads((outs[None] / "summary.json").read_text())["variants"]]


@pytest.mark.parametrize("flags,words", [
    (["--jobs", "0"], "--jobs 0: expected a number of runs from 1 to 1024"),
    (["--jobs", "1025"], "--jobs 1025"),
    (["--timeout", "0"], "--timeout must be a positive number"),
])
def test_bad_flags_refused_before_anything_is_made(tmp_path, cli, flags, words):
    """A bad --jobs / --timeout is one line, exit 2, and nothing is made: not the report, not the directory that
    --write-golden would create."""
    proc = cli("verify", "cases/smoke.yaml", "--out", tmp_path / "out", *flags, "--write-golden", tmp_path / "g" / "a")
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "g").exists() and not (tmp_path / "out").exists()


def _exit_zero_children(count: int) -> list:
    """Start and reap `count` forkserver children that exit 0 at once, as `run_ranks` starts and reaps ranks;
    returns the exit codes read."""
    codes = []
    for _ in range(count):
        p = runner._CTX.Process(target=os._exit, args=(0,))
        with runner._CHILDREN:
            p.start()
        runner._reap(p)
        codes.append(runner._exitcode(p))
    return codes


def test_runs_side_by_side_read_their_own_ranks_exit_codes():
    # Process.start() polls every child of the process; a forkserver child's exit status can be read only once,
    # so two threads polling one child made the loser record 255 ("rank 3 exited with code 0" from fuzz runs two
    # at a time).  Four threads starting and reaping children as fast as they can: every code read must be 0.
    runner.preload([])
    with ThreadPoolExecutor(4) as ex:
        codes = [c for cs in ex.map(_exit_zero_children, [60] * 4) for c in cs]
    assert codes == [0] * 240
