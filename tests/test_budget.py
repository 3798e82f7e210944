"""`bitparity verify --budget` (harness.planning.budget): a case stopped by its time budget still ends with a report.

Once the budget is spent no run starts (each is an error, "not run: ..."), a run in flight is stopped at it (its
watchdog is capped by what is left; "stopped: ..."), and every finished run is compared and reported as usual.
The clock is `harness.planning.budget._clock`, moved by hand here: no test depends on how fast this machine runs.
"""
import json
import xml.etree.ElementTree as ET

import pytest
from conftest import ROOT, run_cli

from harness import cli
from harness import verify as verify_mod
from harness.errors import UsageError
from harness.planning import budget
from harness.planning.budget import Deadline, parse_budget
from harness.running.runner import RunOutcome

SMOKE = str(ROOT / "cases" / "smoke.yaml")        # timeout_s 180; baseline pp2-mtp-with-loss


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("10m", 600), ("1h", 3600), ("2.5", 2.5)])
def test_parse_budget(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "0s", "-1m", "nan", "inf", "1e400", "8d", "169h"])
def test_bad_budgets_are_usage_errors(text):
    with pytest.raises(UsageError, match="--budget"):
        parse_budget(text)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(budget, "_clock", lambda: now[0])
    return now


def test_deadline_caps_timeouts_and_is_spent(clock):
    """A run is given the time left less budget.STOP_S (what stopping it takes), so it has ended by the deadline."""
    d = Deadline("30s")
    assert budget.STOP_S == 6
    assert d.cap(180) == 24 and d.cap(10) == 10 and not d.spent()
    clock[0] += 23.5
    assert d.cap(180) == pytest.approx(0.5)
    clock[0] += 1
    assert d.spent() and d.cap(180) == 0 and d.words() == "the --budget of 30s"
    assert Deadline("30s", start=clock[0] - 20).cap(180) == pytest.approx(4)     # counted from `start`
    unlimited = Deadline(None)
    clock[0] += 1e9
    assert not unlimited.spent() and unlimited.cap(180) == 180


def _verify(tmp_path, *flags):
    out = tmp_path / "out"
    rc = cli.main(["verify", SMOKE, "--out", str(out), "--jobs", "1", "--only", "pp4-mtp-standalone", *flags])
    summary = json.loads((out / "smoke" / "summary.json").read_text())
    budget_flag = flags[flags.index("--budget") + 1] if "--budget" in flags else None
    assert summary["environment"].get("budget") == budget_flag          # the report says a budget applied
    return rc, {v["name"]: v for v in summary["variants"]}, out / "smoke"


def _recording_runs(monkeypatch, after_each):
    """Wrap the runner: record each run's watchdog timeout, then call `after_each(outcome)`, whose return value
    replaces the outcome."""
    timeouts = []
    real = verify_mod.run_ranks

    def run_ranks(cfg, run_dir, timeout, launcher):
        timeouts.append(timeout)
        return after_each(real(cfg, run_dir, timeout, launcher))
    monkeypatch.setattr(verify_mod, "run_ranks", run_ranks)
    return timeouts


def test_budget_spent_before_any_run_still_writes_the_report(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(budget, "_clock", lambda: clock.__setitem__(0, clock[0] + 1) or clock[0])  # 1 s per look
    timeouts = _recording_runs(monkeypatch, lambda outcome: outcome)
    rc, runs, report = _verify(tmp_path, "--budget", "0.5s")
    assert rc == 1 and timeouts == []
    assert {v["verdict"] for v in runs.values()} == {"error"}
    assert all(v["reason"].startswith("not run: the --budget of 0.5s was spent before it could start")
               for v in runs.values()), runs
    assert (report / "index.html").is_file()
    assert "not run: the --budget" in (report / "summary.md").read_text()
    assert "error error" not in (report / "summary.md").read_text()        # the verdict once, not as outcome too
    assert ET.parse(report / "junit.xml").getroot().get("errors") == "2"


def test_budget_spent_during_the_first_run_keeps_its_verdict(tmp_path, clock, monkeypatch):
    def late(outcome):
        clock[0] += 3600            # the budget runs out while the baseline finishes
        return outcome
    timeouts = _recording_runs(monkeypatch, late)
    rc, runs, report = _verify(tmp_path, "--budget", "30s")
    assert timeouts == [24]         # the watchdog is capped by the budget less STOP_S (the case's timeout_s: 180)
    base, other = runs["pp2-mtp-with-loss"], runs["pp4-mtp-standalone"]
    assert base["verdict"] == "pass" and base["outcome"] == "reference"
    assert other["verdict"] == "error" and other["reason"].startswith("not run: the --budget of 30s"), other
    assert rc == 1 and (report / "runs").is_dir()


def test_a_run_cut_by_the_budget_says_so(tmp_path, clock, monkeypatch):
    def cut(outcome):
        clock[0] += 24              # the watchdog fired at the capped timeout
        return RunOutcome(False, "timeout after 24 s; ranks still running: [0, 1]", 24.0)
    _recording_runs(monkeypatch, cut)
    rc, runs, _ = _verify(tmp_path, "--budget", "30s")
    assert runs["pp2-mtp-with-loss"]["reason"] == \
        "stopped: the --budget of 30s ran out; the run had been given 24.0 s of it"
    assert runs["pp4-mtp-standalone"]["reason"].startswith("not run:")
    assert rc == 1


@pytest.mark.parametrize("own", ["rank 1 exited with code 1: boom", "timeout after 5 s; ranks still running: [0]"])
def test_a_runs_own_failure_is_not_blamed_on_the_budget(tmp_path, clock, monkeypatch, own):
    """A crash, or the run's own --timeout (shorter than what the budget left), keeps its own words."""
    def fails(outcome):
        clock[0] += 3600
        return RunOutcome(False, own, 5.0)
    _recording_runs(monkeypatch, fails)
    rc, runs, _ = _verify(tmp_path, "--budget", "1h", *(["--timeout", "5"] if own.startswith("timeout") else []))
    assert runs["pp2-mtp-with-loss"]["reason"] == own and rc == 1


def test_without_a_budget_nothing_changes(tmp_path, monkeypatch):
    timeouts = _recording_runs(monkeypatch, lambda outcome: outcome)
    rc, runs, _ = _verify(tmp_path)
    assert rc == 0 and timeouts == [180, 180]
    assert {v["verdict"] for v in runs.values()} == {"pass"}


def test_repeats_the_budget_leaves_no_time_for_are_an_error(tmp_path, clock, monkeypatch):
    """A run-to-run control (``repeat: 2``) whose repeat cannot start is unchecked, not "deterministic"."""
    case = tmp_path / "smoke.yaml"
    case.write_text((ROOT / "cases" / "smoke.yaml").read_text().replace(
        "    pipeline_model_parallel_layout: \"Et|tt|tm|L\"\n",
        "    pipeline_model_parallel_layout: \"Et|tt|tm|L\"\n    repeat: 2\n"))
    count = [0]

    def after(outcome):
        count[0] += 1
        if count[0] == 2:           # the variant's first run: the budget runs out before its repeat
            clock[0] += 3600
        return outcome
    timeouts = _recording_runs(monkeypatch, after)
    out = tmp_path / "out"
    rc = cli.main(["verify", str(case), "--out", str(out), "--jobs", "1", "--only", "pp4-mtp-standalone",
                   "--budget", "30s"])
    runs = {v["name"]: v for v in json.loads((out / "smoke" / "summary.json").read_text())["variants"]}
    assert len(timeouts) == 2 and rc == 1
    assert runs["pp2-mtp-with-loss"]["verdict"] == "pass"
    assert runs["pp4-mtp-standalone"]["verdict"] == "error"
    assert runs["pp4-mtp-standalone"]["reason"] == \
        "run to run not checked: repeat 2 not run: the --budget of 30s was spent before it could start", \
        runs["pp4-mtp-standalone"]


def test_runs_left_undone_are_not_golden_differences(tmp_path):
    """--golden with runs the budget left undone: the golden check is 'unchecked' for them, not 'fail' ("not bitwise
    equal" would read as moved bits).  A budget below budget.STOP_S lets no run start, on any machine; a process of
    its own, for the goldens' arithmetic (the Makefile's GOLDEN_ENV, read by torch when it starts)."""
    out = tmp_path / "out"
    proc = run_cli("verify", SMOKE, "--out", out, "--golden", ROOT / "goldens" / "smoke", "--train-iters", "8",
                   "--budget", "1s", env={"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"})
    golden = json.loads((out / "smoke" / "summary.json").read_text())["golden"]
    assert proc.returncode == 1 and golden["verdict"] == "unchecked", (proc.stderr, golden)
    assert golden["detail"].startswith("6 of 6 run(s) did not complete, not checked"), golden
