"""`megatron_trainer.fork_launch` (``--bitparity-nproc``): ranks forked from one process get torchrun's environment;
the first rank that fails ends the job with its status and the others are ended and reaped, never left running;
a signal to the launcher ends every rank.  (The bits of a forked Megatron-LM job against torchrun's:
tests/test_pretrain_capture.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT

pytestmark = pytest.mark.arithmetic_free


def _launcher(tmp_path, body: str, nproc: int = 3) -> subprocess.Popen:
    """A launcher process whose ranks run `body` (Python, with `rank` = int(RANK) and `out` = tmp_path), its
    exit status printed as its last line."""
    script = tmp_path / "launch.py"
    script.write_text("\n".join([
        "import os, sys, time",
        "from pathlib import Path",
        "from megatron_trainer.fork_launch import launch",
        f"out = Path({str(tmp_path)!r})",
        "def body():",
        "    rank = int(os.environ['RANK'])",
        textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
        "    return 0",
        f"print('status', launch({nproc}, body), flush=True)", ""]))
    return subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """The launcher's (stdout, stderr); past `timeout` its whole session is killed (a broken launcher must not
    outlive the test) and the timeout raised."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:            # a zombie has ended (its parent reaps it)
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_every_rank_gets_torchruns_environment(tmp_path):
    proc = _launcher(tmp_path, """
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        (out / f"env{rank}.json").write_text(__import__("json").dumps({k: os.environ[k] for k in keys}))
    """)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 0 and stdout.split()[-1] == "0", stdout + stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == \
        {("3", "3", "127.0.0.1", envs[0]["MASTER_PORT"])}
    assert int(envs[0]["MASTER_PORT"]) > 0


def test_the_store_is_the_launchers_and_listens_before_any_rank_runs(tmp_path):
    """The launcher hosts the job's TCPStore, as torchrun's agent does (every rank a client:
    ``TORCHELASTIC_USE_AGENT_STORE``), so no other job on the host can take its port between the pick and rank 0's
    bind (CI: rank 0's store failed with EADDRINUSE while other tests ran).  Each rank finds it listening before it
    does anything, and it is a TCPStore the ranks share."""
    proc = _launcher(tmp_path, """
        import socket
        from datetime import timedelta
        import torch.distributed as dist
        socket.create_connection(("127.0.0.1", int(os.environ["MASTER_PORT"])), timeout=10).close()
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 3, is_master=False,
                              timeout=timedelta(seconds=60))
        store.set(f"rank{rank}", os.environ["TORCHELASTIC_USE_AGENT_STORE"])
        (out / f"seen{rank}.txt").write_text(",".join(store.get(f"rank{r}").decode() for r in range(3)))
    """)
    stdout, stderr = _finish(proc, timeout=120)
    assert proc.returncode == 0 and stdout.split()[-1] == "0", stdout + stderr
    assert [(tmp_path / f"seen{r}.txt").read_text() for r in range(3)] == ["True,True,True"] * 3


def test_a_failing_rank_ends_the_job_and_the_others_are_reaped(tmp_path):
    """Rank 1 exits 3 while ranks 0 and 2 would run for ever (rank 2 ignoring SIGTERM): the launcher returns 3
    within its grace period and no rank is left."""
    proc = _launcher(tmp_path, """
        (out / f"pid{rank}").write_text(str(os.getpid()))
        if rank == 2:
            import signal
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 1:
            while not all((out / f"pid{r}").exists() for r in (0, 2)):
                time.sleep(0.01)
            return 3
        time.sleep(600)
    """)
    start = time.monotonic()
    stdout, stderr = _finish(proc)
    assert stdout.split()[-1] == "3", stdout + stderr
    assert time.monotonic() - start < 30
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert not any(_alive(p) for p in pids), pids


def test_a_rank_that_raises_fails_the_job_with_its_traceback(tmp_path):
    proc = _launcher(tmp_path, """
        if rank == 0:
            raise RuntimeError("planted in rank 0")
        time.sleep(600)
    """, nproc=2)
    stdout, stderr = _finish(proc)
    assert stdout.split()[-1] == "1" and "RuntimeError: planted in rank 0" in stderr, stdout + stderr


def test_sigterm_to_the_launcher_ends_every_rank(tmp_path):
    proc = _launcher(tmp_path, """
        (out / f"pid{rank}").write_text(str(os.getpid()))
        time.sleep(600)
    """, nproc=2)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = _finish(proc)
    assert stdout.split()[-1] == str(128 + signal.SIGTERM), stdout + stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(_alive(p) for p in pids), pids


def test_nproc_below_one_is_refused():
    from megatron_trainer.fork_launch import launch
    with pytest.raises(ValueError, match="nproc 0 must be >= 1"):
        launch(0, lambda: 0)
