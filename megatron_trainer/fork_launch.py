"""``--bitparity-nproc N``: a training script's N ranks on this host, forked from one process that has already
imported torch and megatron, instead of torchrun starting N interpreters that import them each.

Why: a CPU job of the capture's size (`cases/pretrain/tiny-moe-mtp.args`, 2-4 ranks, 3 steps) spends most of its
time importing: ~7 s of CPU per rank for torch + ``megatron.training`` (which imports HF transformers for its
tokenizers) and ~3 s for torchrun's own torch, against a few seconds of training.  Forked ranks share the
parent's imports and its compatibility points (`pretrain`: applied before the fork, so every rank runs the same
patched megatron).  Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; megatron's ``initialize_megatron`` reads them through
``torch.distributed``'s env:// rendezvous), so the script cannot tell the difference; the bits are those of a
torchrun job (tests/test_pretrain_capture.py compares them).  As torchrun's agent does, the launcher hosts the
job's TCPStore itself (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client) on a port the kernel gives it, after
the ranks are forked (its server thread is not copied into them); the port reaches them through a pipe.  A port
picked free and left for rank 0 to bind can be taken meanwhile by another job on the host (seen on CI: rank 0's
store failed with EADDRINUSE while other tests ran).

CPU only: a process that has imported megatron has initialised CUDA on a GPU machine, and a forked child cannot
use it (`pretrain` refuses the flag there, one line).  Like torchrun, the first rank that fails ends the job: the
others get SIGTERM, then SIGKILL after `GRACE_S`, and every child is reaped; each child dies with this process
(``PR_SET_PDEATHSIG``), so a killed launcher leaves no rank behind.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Callable

from trainerkit.process import die_with_parent, freeze_inherited

#: seconds the other ranks get to end after SIGTERM once one rank failed
GRACE_S = 5.0
#: where the job's store listens (one host: the ranks are this process's children)
_HOST = "127.0.0.1"


def _rank(rank: int, nproc: int, port_pipe: int, parent: int, body: Callable[[], int]) -> None:
    """The child: torchrun's variables (the store's port read from `port_pipe` once the launcher hosts it), die
    with the launcher, run `body`, exit with its code (never returns)."""
    code = 1
    try:
        die_with_parent(parent)
        freeze_inherited()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with os.fdopen(port_pipe, "rb") as pipe:
            port = pipe.readline().strip()
        if not port.isdigit():      # the launcher could not host the store: it ends the job itself
            os._exit(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=_HOST, MASTER_PORT=port.decode(),
                          TORCHELASTIC_USE_AGENT_STORE="True")
        code = body()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:      # noqa: BLE001  a rank's traceback goes to its stderr, as under torchrun
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _host_store(nproc: int):
    """The job's TCPStore server on the loopback, on a port the kernel picks (torchrun's agent store)."""
    from datetime import timedelta

    import torch.distributed as dist
    return dist.TCPStore(_HOST, 0, nproc, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)


def launch(nproc: int, body: Callable[[], int]) -> int:
    """Fork `nproc` ranks that each run ``body()`` (their exit status: its return value) and wait for them.

    Returns 0 when every rank exited 0, else the first failing rank's status (a rank killed by a signal: 128 +
    the signal, as a shell says it).  A SIGINT / SIGTERM to the launcher ends the ranks the same way and
    returns 128 + that signal.  Every child is reaped before this returns.

    Raises:
        ValueError: nproc < 1."""
    if nproc < 1:
        raise ValueError(f"nproc {nproc} must be >= 1")
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    stopped: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: stopped.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    ranks: dict[int, int] = {}
    ports: list[int] = []       # the write end of each rank's port pipe
    try:
        for r in range(nproc):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                for fd in (*ports, write):
                    os.close(fd)
                _rank(r, nproc, read, parent, body)
            os.close(read)
            ports.append(write)
            ranks[pid] = r
        store = _host_store(nproc)
        for fd in ports:
            os.write(fd, f"{store.port}\n".encode())
        return _wait(ranks, stopped)
    finally:
        for fd in ports:
            try:
                os.close(fd)
            except OSError:
                pass
        _end(ranks)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def _wait(ranks: dict[int, int], stopped: list[int]) -> int:
    """Reap ranks as they end; the first non-zero status (or a signal to the launcher) ends the wait."""
    while ranks:
        if stopped:
            return 128 + stopped[0]
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        if ranks.pop(pid, None) is None:
            continue
        code = _status(wait_status)
        if code != 0:
            return code
    return 0


def _end(ranks: dict[int, int]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after `GRACE_S`, reap all (empties `ranks`)."""
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while ranks:
        for pid in list(ranks):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                ranks.pop(pid)
        if ranks and time.monotonic() > deadline:
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = float("inf")
        if ranks:
            time.sleep(0.05)
