"""Ctrl-C (SIGINT) and SIGTERM stop the harness even where Python swallows the KeyboardInterrupt.

Python runs a signal handler between bytecodes of whatever the main thread executes; when that is a weakref
callback or a ``__del__`` (importlib's module-lock callback while torch is imported, for one), the raised
KeyboardInterrupt is printed as "Exception ignored in ..." and dropped, and the run carried on to the end with
exit 0 (seen once on CI: Ctrl-C 1 s after start).  So the interrupt is made sticky: the handler records it
before raising, and the harness's waiting loops call `check`, which raises it again.
"""
from __future__ import annotations

import signal
import sys

_received: int | None = None        # the signal number, once one arrived
_installed = False                  # this process is the harness and handles the signals


def in_rank_process() -> bool:
    """True in a process multiprocessing started for the harness (its forkserver, a rank): they import the
    console script again (the forkserver's and spawn's main-module fix-up) but are not the harness, so they must
    neither take over its signals nor print its "interrupted" line (a rank stopped while it still starts would
    otherwise write that line to the harness's terminal a second time)."""
    return "multiprocessing.forkserver" in sys.modules or "multiprocessing.spawn" in sys.modules and \
        sys.modules["multiprocessing"].current_process().name != "MainProcess"


def _on_signal(signum, frame):
    global _received
    _received = signum
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT and SIGTERM in this (the harness's main) thread.  SIGINT keeps SIG_IGN if it was
    ignored on entry (started with ``nohup`` or in the background by a shell without job control).
    Idempotent.  Does nothing in a process multiprocessing started (`in_rank_process`), which is decided at the
    first call (the harness imports multiprocessing's forkserver itself later on)."""
    global _installed
    if _installed or in_rank_process():
        return
    _installed = True
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def forget() -> None:
    """In a copy of the harness that is not the harness (a forkserver forked from it,
    `harness.running.forkservers.forked_spawn`): it neither handles the harness's signals nor reports them."""
    global _installed, _received
    _installed, _received = False, None


def installed() -> bool:
    """Whether `install` took the signals in this process (the harness; not its forkserver or ranks)."""
    return _installed


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT or SIGTERM arrived since `install`, whether or not the first
    KeyboardInterrupt got through.  Cheap: call it in every waiting loop."""
    if _received is not None:
        raise KeyboardInterrupt


def done() -> None:
    """The harness has its exit code and has written everything: a Ctrl-C from now on would arrive during the
    interpreter's shutdown, inside an atexit finalizer (multiprocessing's, reaping the forkserver, or torch's),
    and print that finalizer's traceback (seen once on CI: Ctrl-C as a run ended).  Ignore SIGINT for the rest
    of the process's life; SIGTERM still ends it.  Only for the process's own command line (`installed`)."""
    if _installed:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
