"""`--out` directories: bitparity deletes or replaces only what it wrote and marked, swaps a new report in
atomically, lets one `verify` at a time write a case, and escapes names in summary.md.

Runs are stubbed (`_stub_runs`) so that each verify takes a second, not a training run."""
from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from harness import report
from harness import verify as verify_mod
from harness.errors import UsageError
from harness.judging.results import CaseResult, FirstDivergence, VariantResult
from harness.planning.cases import load_case
from harness.running.runner import RunOutcome

MARKER = ".bitparity-report"
HOSTILE = ["<img src=x onerror=alert(1)>", "a|b||c", "``code`` `x`", "x\n\n<script>alert(1)</script>",
           "r\rn\r\nt\tv\x0bf\x0c", "esc\x1b[31mred\x1b[0m nul\x00 del\x7f c1\x85\x9b", "ls\u2028ps\u2029",
           "bidi\u202egnp.exe\u2066\u2069", "[click](javascript:alert(1))", "&lt;b&gt; &amp; & <", "back\\|slash\\",
           "![x](http://e/x.png) **b** _i_ ~s~"]


def _case(tmp_path: Path, name: str = "smoke") -> Path:
    """cases/smoke.yaml under another name, with the baseline and one variant."""
    text = (ROOT / "cases" / "smoke.yaml").read_text().replace("name: smoke", f"name: {name}", 1)
    text = text.split("  - name: pp2-vpp2-mtp-with-loss")[0]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def stub_runs(monkeypatch):
    """Replace the multi-process trainer by an instant failure (every variant ends as `error`); returns the
    list of run directories it was asked for, so tests can hook into a run (`hook`)."""
    calls: list = []

    def fake(config, run_dir, timeout, launcher, *a, **k):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        calls.append(Path(run_dir))
        if fake.hook:
            fake.hook(Path(run_dir))
        return RunOutcome(False, "stubbed run", 0.0)
    fake.hook, fake.calls = None, calls
    monkeypatch.setattr(verify_mod, "run_ranks", fake)
    return fake


def _verify(tmp_path: Path, out: Path, name: str = "smoke"):
    return verify_mod.verify(load_case(_case(tmp_path, name)), out, "test", progress=lambda s: None)


def _tree(root: Path) -> dict:
    """{relative path: bytes or 'dir'} of everything under root (hidden files included)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _old_report(final: Path) -> dict:
    final.mkdir(parents=True)
    (final / MARKER).write_text("bitparity-report/1\n")
    (final / "summary.json").write_text('{"old": true}')
    (final / "runs").mkdir()
    (final / "runs" / "OLD").write_text("old run")
    return _tree(final)


def _is_new_report(final: Path) -> bool:
    names = {p.name for p in final.iterdir()}
    return MARKER in names and set(report.REPORT_FILES) <= names and "OLD" not in str(_tree(final))


def _leftovers(out: Path, name: str = "smoke") -> list:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(f".{name}."))


# ------------------------------------------------------------------------ 1: never delete foreign folders

@pytest.mark.parametrize("which", ["final", "partial"])
def test_unmarked_directory_named_like_the_case_is_refused(tmp_path, stub_runs, which):
    out = tmp_path / "clone"
    victim = out / ("harness" if which == "final" else ".harness.partial")
    victim.mkdir(parents=True)
    (victim / "verify.py").write_text("precious source")
    before = _tree(out)
    with pytest.raises(UsageError, match=r"harness.*not.*bitparity"):
        _verify(tmp_path, out, "harness")
    assert _tree(out) == before            # nothing deleted, nothing written
    assert stub_runs.calls == []


def test_cli_refuses_unmarked_out_dir_with_one_line(tmp_path):
    out = tmp_path / "clone"
    (out / "harness").mkdir(parents=True)
    (out / "harness" / "cli.py").write_text("precious source")
    before = _tree(out)
    proc = run_cli("verify", _case(tmp_path, "harness"), "--out", out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "not written by bitparity" in proc.stderr
    assert _tree(out) == before


def test_marked_and_legacy_reports_are_replaced(tmp_path, stub_runs):
    out = tmp_path / "out"
    _verify(tmp_path, out)
    first = _tree(out / "smoke")
    assert (out / "smoke" / MARKER).read_text().startswith("bitparity-report/")
    _verify(tmp_path, out)                  # a marked report: replaced
    assert _is_new_report(out / "smoke") and _tree(out / "smoke") != {} and first
    # a report written before the marker existed: recognised by its summary.json, replaced
    (out / "smoke" / MARKER).unlink()
    _verify(tmp_path, out)
    assert _is_new_report(out / "smoke")
    assert _leftovers(out) == []


# ------------------------------------------------------------------------ 2: atomic replacement

def _fail_rename_of(monkeypatch, src_name: str):
    """os.rename / os.replace raise EIO when they move a path named `src_name`."""
    for fn in ("rename", "replace"):
        real = getattr(os, fn)

        def fake(src, dst, *a, _real=real, **k):
            if Path(src).name == src_name:
                raise OSError(errno.EIO, "injected", str(src))
            return _real(src, dst, *a, **k)
        monkeypatch.setattr(os, fn, fake)


FAILURES = ["move-new-in", "exchange", "delete-old", "fallback:move-old-aside", "fallback:move-new-in",
            "fallback:delete-old"]


@pytest.mark.parametrize("point", FAILURES)
def test_replacing_a_report_keeps_old_or_new_never_nothing(tmp_path, stub_runs, monkeypatch, point):
    out = tmp_path / "out"
    old = _old_report(out / "smoke")
    try:
        from harness.running import outdir
    except ImportError:                      # the code before harness.running.outdir: only "move-new-in" applies
        outdir = None
    if point == "move-new-in":               # whatever moves the new report in fails
        _fail_rename_of(monkeypatch, ".smoke.partial")
        if outdir:
            monkeypatch.setattr(outdir, "_exchange", lambda a, b: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    else:
        if point.startswith("fallback:"):
            monkeypatch.setattr(outdir, "_exchange", lambda a, b: False)   # renameat2 unavailable
        if point == "exchange":
            monkeypatch.setattr(outdir, "_exchange", lambda a, b: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
        if point == "fallback:move-old-aside":
            _fail_rename_of(monkeypatch, "smoke")
        if point == "fallback:move-new-in":
            _fail_rename_of(monkeypatch, ".smoke.partial")
        if point.endswith("delete-old"):
            real = outdir._remove

            def fail_on_old(path):
                if (Path(path) / "runs" / "OLD").exists():
                    raise OSError(errno.EIO, "injected", str(path))
                return real(path)
            monkeypatch.setattr(outdir, "_remove", fail_on_old)
    try:
        _verify(tmp_path, out)
        replaced = True
    except OSError:
        replaced = False
    final = out / "smoke"
    if point.endswith("delete-old"):         # the new report is in: only the old one's deletion failed
        assert replaced and _is_new_report(final)
    else:                                    # the error propagates and the complete old report stays
        assert not replaced and _tree(final) == old
    assert point.endswith("delete-old") or _leftovers(out) == []
    # whatever was left over (an old report that could not be deleted) goes on the next run
    monkeypatch.undo()
    monkeypatch.setattr(verify_mod, "run_ranks", stub_runs)
    _verify(tmp_path, out)
    assert _is_new_report(final) and _leftovers(out) == []


def test_interrupted_fallback_swap_is_recovered(tmp_path, stub_runs):
    """Killed between moving the old report aside and the new one in: the next run puts the old one back
    before it starts, so even a failing next run leaves a report."""
    out = tmp_path / "out"
    old = _old_report(out / ".smoke.old")
    stub_runs.hook = lambda run_dir: (_ for _ in ()).throw(RuntimeError("crash in the trainer"))
    with pytest.raises(RuntimeError):
        _verify(tmp_path, out)
    assert _tree(out / "smoke") == old and _leftovers(out) == []


def test_exchange_swaps_two_directories(tmp_path):
    from harness.running import outdir
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "in_a").touch(), (b / "in_b").touch()
    if not outdir._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) not available here")
    assert [p.name for p in a.iterdir()] == ["in_b"] and [p.name for p in b.iterdir()] == ["in_a"]


# ------------------------------------------------------------------------ 3: one writer per case

def _hold_lock(path: Path, pid: int = 4242) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"bitparity verify pid {pid}\n".encode())
    return fd


def test_second_verify_is_refused_and_leaves_the_first_alone(tmp_path, stub_runs):
    out = tmp_path / "out"
    out.mkdir()
    work = out / ".smoke.partial"            # the first writer's files
    work.mkdir()
    (work / MARKER).write_text("bitparity-report/1\n")
    (work / "runs").mkdir()
    (work / "runs" / "half-written").write_text("rank0")
    fd = _hold_lock(out / ".smoke.lock")
    try:
        before = _tree(out)
        with pytest.raises(UsageError, match=rf"^another bitparity verify is writing {re.escape(str(out / 'smoke'))}"
                                             r" \(pid 4242\)$"):
            _verify(tmp_path, out)
        assert _tree(out) == before and stub_runs.calls == []
    finally:
        os.close(fd)


def test_second_process_gets_exit_2_while_a_verify_runs(tmp_path, stub_runs):
    """A real second `bitparity verify` process, started while this process's verify is in a run."""
    out = tmp_path / "out"
    seen = []

    def second(run_dir):
        if not seen:
            seen.append(run_cli("verify", _case(tmp_path), "--out", out, timeout=120))
    stub_runs.hook = second
    _verify(tmp_path, out)
    proc = seen[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"bitparity: error: another bitparity verify is writing {out / 'smoke'} " \
                                  f"(pid {os.getpid()})"
    assert _is_new_report(out / "smoke") and _leftovers(out) == []


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_crash_leaves_no_partial_and_releases_the_lock(tmp_path, stub_runs, exc):
    out = tmp_path / "out"
    stub_runs.hook = lambda run_dir: (_ for _ in ()).throw(exc("boom"))
    with pytest.raises(exc):
        _verify(tmp_path, out)
    assert _leftovers(out) == [] and not (out / "smoke").exists()
    stub_runs.hook = None
    _verify(tmp_path, out)                   # the lock is free again
    assert _is_new_report(out / "smoke")


# ------------------------------------------------------------------------ 4: summary.md escaping

_UNESCAPED_PIPE = re.compile(r"(?<!\\)(?:\\\\)*\|")


@pytest.mark.parametrize("text", HOSTILE)
def test_md_cell_escapes_hostile_text(text):
    cell = report._md_cell(text)
    assert not re.search(r"[<>\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]", cell), repr(cell)
    assert not _UNESCAPED_PIPE.search(cell) and not re.search(r"(?<!\\)(?:\\\\)*`", cell), repr(cell)
    assert not re.search(r"&(?!amp;|lt;|gt;)", cell), repr(cell)   # every & starts one of our entities


def _hostile_result() -> CaseResult:
    def variant(name, verdict="pass", reason="ok", fd=None):
        return VariantResult(name=name, layout="Et|tm|L<b>", pp=2, vpp=1, mtp_standalone=True, expect="bitwise",
                             verdict=verdict, bitwise_equal=verdict == "pass", first_divergence=fd, reason=reason)
    base = HOSTILE[3] + " " + HOSTILE[0]
    vs = [variant(base)] + [variant(n) for n in HOSTILE]
    vs.append(variant("err", "error", reason="rank 1 died: <img src=x onerror=alert(1)> | `x`\nnext"))
    vs.append(variant("fd", "fail", fd=FirstDivergence(0, "grad", None, "w|<script>`\n")))
    return CaseResult(case="c<i>|", case_path="x.yaml", baseline=base, variants=vs, elapsed_s=1.0,
                      environment={}, command="")


def test_summary_md_with_hostile_names():
    result = _hostile_result()
    md = report.markdown_summary(result)
    assert not re.search(r"<|>|\x00|\x1b|\u2028|\u202e", md)
    lines = md.splitlines()
    assert lines == md.removesuffix("\n").split("\n")    # no \r, \v, \x85, \u2028 ... line breaks inside
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + len(result.variants)
    assert {len(_UNESCAPED_PIPE.findall(ln)) for ln in table} == {10}
    # the baseline is named once in the header line and marks its row, escaped like any cell
    header = next(ln for ln in lines if "baseline" in ln and not ln.startswith("|"))
    assert report._md_cell(result.baseline) in header
    assert sum("(baseline)" in ln for ln in table) == 1


def test_written_summary_md_is_escaped(tmp_path):
    report.write_report(_hostile_result(), tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "<img" not in md and "<script" not in md
