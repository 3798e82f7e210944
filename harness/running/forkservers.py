"""A forkserver of its own for each further megatron source of a case (``--megatron-base`` next to the head), and
the harness's own forkserver forked from the harness (`forked_spawn`) instead of a new interpreter.

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

import contextlib
import gc
import os
import signal
import sys
import threading
import traceback
import types
from multiprocessing import forkserver, popen_forkserver, resource_tracker, util
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


def ensure_running(start, fork: bool = False) -> None:
    """``start()`` (a forkserver's ``ensure_running``) with multiprocessing's resource tracker started first and
    SIGINT blocked meanwhile: the new interpreter inherits the mask through fork and exec, so a Ctrl-C while it
    still starts up (site, the preload imports) cannot end it with "Fatal Python error: init_import_site" and a
    traceback on the user's terminal (seen under load); it stays blocked there and in the ranks forked from it,
    which ignore SIGINT anyway (`trainerkit.process.guard_forkserver`) and are ended by the harness.  The
    harness's own Ctrl-C waits the few milliseconds of the spawn and arrives when the mask is restored.  (The
    resource tracker first: starting it unblocks SIGINT and SIGTERM in the calling thread.)

    `fork`: the server is this process forked (`forked_spawn`) where it can be (one thread), not a new
    interpreter: it keeps what this process has imported, so a preload this process has already imported (the
    megatron-core whose runs the harness validated) is not imported a second time."""
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with forked_spawn() if fork and forkable() else contextlib.nullcontext():
            start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def forkable() -> bool:
    """Whether a forkserver may be forked from this process: it runs one Python thread (a fork copies only the
    calling thread, and a lock another thread holds would stay taken in the copy for ever).  torch's import starts
    one native helper thread of its own, which a spawned forkserver also has when it forks the ranks."""
    return threading.active_count() == 1


@contextlib.contextmanager
def forked_spawn():
    """While inside, a forkserver that multiprocessing starts (``util.spawnv_passfds(exe, [..., "-c", code],
    fds)``, CPython 3.8-3.13) is this process forked, running ``code`` in the copy, instead of a new interpreter
    running it: CPython's own command and protocol, without the interpreter's start-up and the preload's imports
    that this process has done (megatron-core's: ~5 s of CPU on 2 cores, in every ``verify`` of a megatron case)."""
    real = util.spawnv_passfds

    def spawn(path, args, passfds):
        if len(args) < 2 or args[-2] != "-c":       # not the command this was written against: a new interpreter
            return real(path, args, passfds)
        return _fork_server(args[-1], passfds)

    util.spawnv_passfds = spawn
    try:
        yield
    finally:
        util.spawnv_passfds = real


def _fork_server(code: str, passfds) -> int:
    """Fork; in the child run the forkserver's `code` as the new interpreter would, then leave by ``os._exit``
    (never this process's atexit handlers, buffers or finalisers).  Returns the child's pid."""
    for stream in (sys.stdout, sys.stderr):         # what is buffered here would be written again by the copy
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        _become_server(parent, passfds)
        exec(compile(code, "<forkserver>", "exec"), {"__name__": "__forkserver__"})
        status = 0
    except SystemExit as e:                         # the forkserver's way out once the harness has gone
        status = e.code if isinstance(e.code, int) else 0
    except BaseException:                           # noqa: BLE001  its traceback, then the same exit
        traceback.print_exc()
    finally:
        os._exit(status)


def _become_server(parent: int, passfds) -> None:
    """What a new interpreter would start with: only the passed descriptors (and stdio) open, so no lock (the
    report directory's flock) or pipe of the harness stays held by the server; default signal handlers (SIGINT
    ignored, as `trainerkit.process.guard_forkserver` has it); the harness's objects never collected here (a
    collected file object would close a descriptor number the server has reused); and the values
    `trainerkit.process` read at its import as if it were imported here (the ranks die with this server, it
    with the harness)."""
    gc.freeze()
    low = 3
    for fd in sorted(set(passfds)):
        if fd > low:            # never an empty range (measured: closerange(0, 0) closes every descriptor)
            os.closerange(low, fd)
        low = max(low, fd + 1)
    os.closerange(low, max(low + 1, os.sysconf("SC_OPEN_MAX")))
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from trainerkit import process

    from . import interrupt
    interrupt.forget()
    process.forked_to_serve(parent)


def serves(source: Optional[str]) -> bool:
    """Whether the runs of `source` fork from a server of this module."""
    return source is not None and source in _SERVERS
