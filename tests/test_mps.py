"""`bitparity verify --mps` and `--ranks-per-core`: the private MPS daemon's life (started, reached by the ranks'
environment, told to quit on every exit, nothing left behind) with a stand-in for ``nvidia-cuda-mps-control`` on
PATH, and the refusals (one line, exit 2, nothing written).  The real daemon's effect is measured on the GPU by
bench/bench_packing.py."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import UsageError
from harness.running import mps

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "smoke.yaml"


def _fake_tool(tmp_path, monkeypatch, start_exit: int = 0, start_hangs: bool = False) -> Path:
    """A ``nvidia-cuda-mps-control`` that logs what it is asked, with the pipe directory it was given; with
    `start_hangs` its ``-d`` forks a helper (pid in ``helper.pid``) and waits for it forever."""
    bin_dir, log = tmp_path / "bin", tmp_path / "mps.log"
    bin_dir.mkdir()
    tool = bin_dir / mps.TOOL
    hang = f"sleep 1000 & echo $! > {tmp_path / 'helper.pid'}; wait" if start_hangs else ":"
    tool.write_text(f"""#!/bin/sh
if [ "$1" = -d ]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {log}
  {hang}
  [ {start_exit} = 0 ] || {{ echo "An instance of this daemon is already running" >&2; exit {start_exit}; }}
else
  read line; echo "$line $CUDA_MPS_PIPE_DIRECTORY" >> {log}
fi
""")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return log


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_daemon_is_private_reaches_children_and_quits(tmp_path, monkeypatch):
    log = _fake_tool(tmp_path, monkeypatch)
    with mps.daemon():
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(pipe).is_dir() and Path(os.environ["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert log.read_text().splitlines() == [f"start {pipe}", f"quit {pipe}"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not Path(pipe).exists()


def test_daemon_quits_when_the_body_fails_and_restores_the_callers_environment(tmp_path, monkeypatch):
    log = _fake_tool(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/the/callers")
    with pytest.raises(KeyboardInterrupt), mps.daemon():
        raise KeyboardInterrupt
    assert log.read_text().splitlines()[-1].startswith("quit ")
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/the/callers"


def test_a_daemon_that_does_not_start_is_one_line(tmp_path, monkeypatch):
    _fake_tool(tmp_path, monkeypatch, start_exit=3)
    with pytest.raises(UsageError, match=r"exited 3: An instance of this daemon is already running"):
        with mps.daemon():
            pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_a_tool_that_hangs_is_killed_with_its_helpers(tmp_path, monkeypatch):
    _fake_tool(tmp_path, monkeypatch, start_hangs=True)
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 1)
    with pytest.raises(UsageError, match=r"-d did not answer within 1 s"):
        with mps.daemon():
            pass
    assert _gone(int((tmp_path / "helper.pid").read_text()))       # the tool's forked helper too
    assert not list(Path(tempfile.gettempdir()).glob("bitparity-mps-*"))


def test_a_killed_command_leaves_no_daemon(tmp_path, monkeypatch):
    """SIGKILL gives the command no chance to clean up: the watcher quits the daemon and removes its directory."""
    log = _fake_tool(tmp_path, monkeypatch)
    body = ("import os, signal; from harness.running import mps; cm = mps.daemon(); cm.__enter__(); "
            "print(os.environ['CUDA_MPS_PIPE_DIRECTORY'], flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", body], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9
    pipe = proc.stdout.strip()
    deadline = time.monotonic() + 20
    while Path(pipe).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(pipe).exists() and log.read_text().splitlines() == [f"start {pipe}", f"quit {pipe}"]


def test_no_tool_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="not on this machine's PATH"):
        with mps.daemon():
            pass


@pytest.mark.parametrize("args, words", [
    (["--mps"], "--mps: run 'pp2-mtp-with-loss' is on the cpu; MPS serves CUDA runs only"),
    (["--ranks-per-core", "0"], "--ranks-per-core 0: expected a number of ranks from 1 to 64"),
    (["--ranks-per-core", "65"], "--ranks-per-core 65: expected a number of ranks from 1 to 64"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, args, words):
    _fake_tool(tmp_path, monkeypatch)           # a daemon would start if the check came too late
    out = tmp_path / "reports"
    rc = main(["verify", str(SMOKE), "--out", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"bitparity: error: {words}"]
    assert not out.exists() and not (tmp_path / "mps.log").exists()


def test_every_forked_rank_gets_the_daemons_directories_whenever_the_forkserver_started(tmp_path, monkeypatch):
    """A forkserver keeps the environment it started with; `launch` applies the harness's `rank_env` in the rank
    before the worker is imported, set values and unset ones alike."""
    from trainerkit import process
    (tmp_path / "envprobe.py").write_text(
        "import os, pathlib\n"
        "def rank_main(rank, world, cfg_json, run_dir, store):\n"
        "    pathlib.Path(run_dir, 'env').write_text(repr([os.environ.get(k) for k in "
        "('CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_LOG_DIRECTORY')]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/stale/pipe")        # as a long-running forkserver might hold
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/stale/log")
    process.launch("envprobe", 0, 1, "{}", str(tmp_path), None,
                   {"CUDA_MPS_PIPE_DIRECTORY": "/daemon/pipe", "CUDA_MPS_LOG_DIRECTORY": None})
    assert (tmp_path / "env").read_text() == "['/daemon/pipe', None]"
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/now")
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    assert process.rank_env() == {"CUDA_MPS_PIPE_DIRECTORY": "/now", "CUDA_MPS_LOG_DIRECTORY": None}
