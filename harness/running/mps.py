"""An MPS control daemon of the command's own, for runs whose ranks share one GPU (``bitparity verify --mps``).

Without MPS every rank process has its own CUDA context and the GPU time-slices between them: a 16-rank pipeline on
one GPU keeps ~4 of the machine's cores busy (the traces' ``cpu_s``) while its ranks wait for their turn on the
device.  Under NVIDIA's Multi-Process Service the ranks' kernels go through one server and run side by side
(measured on an H100, `bench/bench_packing.py`, four 16-rank dsv3-gpu runs: 111 s one after another, 88 s under MPS,
63 s under MPS two runs at a time; bench/results/packing_h100.json).

Bitwise: MPS changes where kernels wait, not which kernels run (the device reports the same properties, so cuBLAS
and the other libraries choose by the same shapes and limits; no active-thread percentage is set).  The benchmark
compares each setting's traces with the plain run's.

The daemon is private: its pipe and log directories are a fresh temporary directory, passed to the ranks through
``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``, set in this process's environment: torchrun's ranks inherit
them, and the runner hands them to every forked rank at its start (`trainerkit.process.rank_env`), however long the
forkserver has been running; other users of the GPU are not affected (default compute mode), and
the daemon is told to quit when the command ends, also on an error or Ctrl-C; if the command is killed outright
(SIGKILL), a small watcher process of its own session notices (its pipe from the command closes) and quits it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator, Optional

from trainerkit.process import RANK_ENV, apply_env, rank_env

from ..errors import UsageError

TOOL = "nvidia-cuda-mps-control"
#: MPS clients one GPU serves: NVIDIA's MPS documentation gives 48 client contexts per device for Volta and later;
#: 64 ranks on one H100 failed to start here (bench/results/packing_h100.json), so the pool keeps a command's
#: concurrent ranks within this.
CLIENTS_PER_GPU = 48
START_TIMEOUT_S = 30
QUIT_TIMEOUT_S = 20


# The watcher: a process of its own session that holds the read end of a pipe whose write end only this process
# has.  EOF means this process ended; if the daemon's directory is still there, it ended without cleaning up
# (SIGKILL, a crash): the watcher quits the daemon and removes the directory.
# It runs with the daemon's environment, so the tool it calls reaches that daemon.
_WATCHER = """
import os, shutil, subprocess, sys
tool, root = sys.argv[1], sys.argv[2]
sys.stdin.buffer.read()
if os.path.isdir(root):
    try:
        subprocess.run([tool], input=b"quit\\n", capture_output=True, timeout=60, start_new_session=True)
    except Exception:
        pass
    shutil.rmtree(root, ignore_errors=True)
"""


def _call(tool: str, args: list, env: dict, stdin: Optional[str], timeout: float) -> tuple[int, str]:
    """(exit status, stderr or stdout) of the tool in a process group of its own; on a timeout or an interrupt the
    whole group is killed (a forked helper of the tool included) and the exception goes on."""
    proc = subprocess.Popen([tool, *args], env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return proc.returncode, (err or out).strip()


@contextmanager
def daemon() -> Iterator[None]:
    """Start a private MPS control daemon for the body; quit it and remove its directories afterwards (on an error
    or an interrupt too; if this process is killed, a watcher process does it).

    Raises:
        UsageError: the tool is not on PATH, or the daemon does not start or answer within 30 s (its exit status
            and last words)."""
    tool = shutil.which(TOOL)
    if tool is None:
        raise UsageError(f"--mps: {TOOL} is not on this machine's PATH (MPS ships with the NVIDIA driver)")
    root = tempfile.mkdtemp(prefix="bitparity-mps-")
    saved = rank_env()
    env = dict(os.environ)
    for key, sub in zip(RANK_ENV, ("pipe", "log")):
        os.makedirs(os.path.join(root, sub))
        env[key] = os.path.join(root, sub)
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, tool, root], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            status, words = _call(tool, ["-d"], env, None, START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UsageError(f"--mps: {TOOL} -d did not answer within {START_TIMEOUT_S} s") from None
        except OSError as e:
            raise UsageError(f"--mps: {TOOL} -d did not start: {e.strerror}") from None
        if status != 0:
            last = words.splitlines()[-1] if words else ""
            raise UsageError(f"--mps: {TOOL} -d exited {status}" + (f": {last}" if last else ""))
        os.environ.update({k: env[k] for k in RANK_ENV})
        try:
            yield
        finally:
            try:
                _call(tool, [], env, "quit\n", QUIT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass        # its group is killed; a daemon that still will not quit dies with the machine
    finally:
        apply_env(saved)
        shutil.rmtree(root, ignore_errors=True)
        watcher.stdin.close()           # EOF: the directory is gone, so the watcher just ends
        watcher.wait()
