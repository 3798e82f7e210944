"""Ctrl-C (SIGINT) and SIGTERM stop the harness even where Python swallows the KeyboardInterrupt.

Python runs a signal handler between bytecodes of whatever the main thread executes; when that is a weakref
callback or a ``__del__`` (importlib's module-lock callback while torch is imported, for one), the raised
KeyboardInterrupt is printed as "Exception ignored in ..." and dropped, and the run carried on to the end with
exit 0 (seen once on CI: Ctrl-C 1 s after start).  So the interrupt is made sticky: the handler records it
before raising, and the harness's waiting loops call `check`, which raises it again.
"""
from __future__ import annotations

import signal

_received: int | None = None        # the signal number, once one arrived


def _on_signal(signum, frame):
    global _received
    _received = signum
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT and SIGTERM in this (the harness's main) thread.  SIGINT keeps SIG_IGN if it was
    ignored on entry (started with ``nohup`` or in the background by a shell without job control).
    Idempotent."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT or SIGTERM arrived since `install`, whether or not the first
    KeyboardInterrupt got through.  Cheap: call it in every waiting loop."""
    if _received is not None:
        raise KeyboardInterrupt

