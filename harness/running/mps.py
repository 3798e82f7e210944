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
``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` (set in this process's environment before the forkserver or
torchrun starts, so every rank inherits them); other users of the GPU are not affected (default compute mode), and
the daemon is told to quit when the command ends, also on an error or Ctrl-C.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Iterator

from ..errors import UsageError

TOOL = "nvidia-cuda-mps-control"
#: MPS clients one GPU serves: NVIDIA's MPS documentation gives 48 client contexts per device for Volta and later;
#: 64 ranks on one H100 failed to start here (bench/results/packing_h100.json), so the pool keeps a command's
#: concurrent ranks within this.
CLIENTS_PER_GPU = 48
_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@contextmanager
def daemon() -> Iterator[None]:
    """Start a private MPS control daemon for the body; quit it and remove its directories afterwards.

    Raises:
        UsageError: the tool is not on PATH, or the daemon does not start (its exit status and last words)."""
    tool = shutil.which(TOOL)
    if tool is None:
        raise UsageError(f"--mps: {TOOL} is not on this machine's PATH (MPS ships with the NVIDIA driver)")
    root = tempfile.mkdtemp(prefix="bitparity-mps-")
    saved = {k: os.environ.get(k) for k in _ENV}
    env = dict(os.environ)
    for key, sub in zip(_ENV, ("pipe", "log")):
        os.makedirs(os.path.join(root, sub))
        env[key] = os.path.join(root, sub)
    try:
        started = subprocess.run([tool, "-d"], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(root, ignore_errors=True)
        raise UsageError(f"--mps: {TOOL} -d did not start: {e}") from None
    if started.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        words = (started.stderr or started.stdout).strip().splitlines()
        raise UsageError(f"--mps: {TOOL} -d exited {started.returncode}" + (f": {words[-1]}" if words else ""))
    os.environ.update({k: env[k] for k in _ENV})
    try:
        yield
    finally:
        try:
            subprocess.run([tool], input="quit\n", env=env, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass            # a daemon that will not quit dies with the machine; nothing of ours waits on it
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)
