"""A forkserver of its own for each further megatron source of a case (``--megatron-base`` next to the head).

multiprocessing keeps one forkserver per process, and a forkserver imports one megatron: whichever directory
is first on its path when it starts (`megatron_trainer.preload`).  Megatron-LM PR #2136's first check runs the
same layouts on two sources (the merge request and its target branch), so one forkserver serves the runs of one
source and every rank of the other imported megatron itself (~4-8 s of CPU per rank on 2 cores: 12 imports for
a two-run case on two sources, 32 for a 16-rank pair).  Here each further source gets a
`multiprocessing.forkserver.ForkServer` instance of its own, started with that source in the preload's
environment, and the runs of that source fork their ranks from it: each megatron is imported once per
``bitparity verify``.

The ranks are ordinary multiprocessing processes (`SourceProcess`: a ForkServerProcess whose Popen asks the
source's server instead of the module's); pickled by reference into the server, so this module stays light
(multiprocessing only).  A server that cannot start, or a source the preload cannot import, only costs the
imports again: each rank activates its source itself (`megatron_trainer.source.activate`, which refuses a rank
that finds another megatron already imported) and reports what fails as the run's error.
"""
from __future__ import annotations

import os
import signal
import types
from multiprocessing import forkserver, popen_forkserver, resource_tracker
from multiprocessing.context import ForkServerProcess
from typing import Optional

#: source (the ``megatron_path`` of its runs, as written) -> its forkserver; filled in the harness's main thread
#: before any run starts (`start`), read by the runs' threads
_SERVERS: dict[str, forkserver.ForkServer] = {}


def _launch_via(server: forkserver.ForkServer) -> types.FunctionType:
    """CPython's own ``popen_forkserver.Popen._launch`` (3.8-3.13: pickle the process, ask the forkserver for a
    child, read its pid) with the module forkserver it names replaced by `server`: no copy of its body to drift
    from the interpreter's."""
    via = types.SimpleNamespace(connect_to_new_process=server.connect_to_new_process,
                                read_signed=forkserver.read_signed)
    code = popen_forkserver.Popen._launch
    return types.FunctionType(code.__code__, {**vars(popen_forkserver), "forkserver": via}, code.__name__,
                              code.__defaults__, code.__closure__)


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        _launch_via(_SERVERS[process_obj.megatron_source])(self, process_obj)


class SourceProcess(ForkServerProcess):
    """A rank forked by the forkserver of `megatron_source` (`start` must have started it)."""

    def __init__(self, *args, megatron_source: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.megatron_source = megatron_source

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


def start(source: str, env: dict[str, str], preload: list[str]) -> bool:
    """Start the forkserver of `source` (a no-op when it runs), importing `preload` with `env` set in the
    environment it inherits.  Main thread only, before the runs start: the environment is this process's for
    the instant of the spawn.  Returns whether it runs."""
    server = _SERVERS.get(source)
    if server is None:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(preload)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ensure_running(server.ensure_running)
    except OSError:
        return False
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _SERVERS[source] = server
    return True


def ensure_running(start) -> None:
    """``start()`` (a forkserver's ``ensure_running``) with multiprocessing's resource tracker started first and
    SIGINT blocked meanwhile: the new interpreter inherits the mask through fork and exec, so a Ctrl-C while it
    still starts up (site, the preload imports) cannot end it with "Fatal Python error: init_import_site" and a
    traceback on the user's terminal (seen under load); it stays blocked there and in the ranks forked from it,
    which ignore SIGINT anyway (`trainerkit.process.guard_forkserver`) and are ended by the harness.  The
    harness's own Ctrl-C waits the few milliseconds of the spawn and arrives when the mask is restored.  (The
    resource tracker first: starting it unblocks SIGINT and SIGTERM in the calling thread.)"""
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def serves(source: Optional[str]) -> bool:
    """Whether the runs of `source` fork from a server of this module."""
    return source is not None and source in _SERVERS
