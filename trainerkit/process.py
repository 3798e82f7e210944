"""The rank-process lifecycle every trainer's worker follows, so no process outlives the harness.

Two launchers start ranks: the harness runner's forkserver (the worker module is imported there before any
fork, so the trainer's imports are paid once, not once per rank) and ``torchrun -m <worker> CONFIG RUN_DIR``.
The forkserver, every rank and (in the runner) torchrun ask the kernel for SIGKILL when their parent exits
(`die_with_parent`), so a harness killed by any signal, SIGKILL included, takes the whole tree with it.  A
forkserver would not exit on its own: every child it forks inherits the write end of its "alive" pipe, so
ranks stuck in a receive keep it, and it them, alive.

Import this module before anything slow: it reads the parent's pid at import time, to keep short the window
in which the parent can die unnoticed.
"""
from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import sys
from pathlib import Path
from typing import TextIO

PARENT_AT_IMPORT = os.getppid()         # torchrun worker: the torchrun agent; forkserver: the harness
IMPORTED_BY = os.getpid()               # forkserver ranks inherit this: the forkserver, i.e. their parent
#: the modules the harness's forkserver preloads, comma-separated (set by `harness.running.runner`, read by
#: `trainerkit.preload`, whose import does the preloading)
PRELOAD_ENV = "BITPARITY_FORKSERVER_PRELOAD"
#: the directory a trainer's library preload imports its library from (a megatron_path: a Megatron-LM checkout
#: or a planted copy); empty: the interpreter's own (set by `harness.running.runner`)
PRELOAD_SOURCE_ENV = "BITPARITY_FORKSERVER_SOURCE"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# loaded once here: die_with_parent also runs between fork and exec (the runner's torchrun preexec_fn)
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process as soon as its parent exits, whatever it dies of (prctl
    PR_SET_PDEATHSIG; strictly: when the parent's thread that forked this process exits; kept across exec).
    The request only covers deaths from now on, so if the parent is no longer `parent` (it died first and
    this process was re-parented), exit at once.  No-op off Linux.

    Raises OSError when prctl fails."""
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:
        os._exit(1)


def freeze_inherited() -> None:
    """In a process forked without exec (a rank of the forkserver or of ``--bitparity-nproc``): never let this
    process's garbage collector visit an object it inherited (``gc.freeze``: the generations' lists join the
    permanent one, a constant-time splice).  A collection writes into the header of every object it visits, and
    each such write copies the whole page the object shares with its parent (copy on write): measured on 2 cores,
    a 16-rank DeepSeek-V3 run of the reference trainer took 924,584 page faults, half of them in
    ``gc_collect_main`` (``perf record -e page-faults``), and 437,646 with this.  CPython's advice for fork
    without exec (the ``gc.freeze`` documentation) is the same.  Objects the process creates itself are
    collected as before; the inherited ones live as long as the process, which they would anyway."""
    gc.freeze()


def import_before_fork(names) -> None:
    """Import each module of `names` in this process, which ranks are forked from afterwards; one that fails to
    import, for whatever reason (a syntax error in a planted copy, a module a release lacks), is skipped: a rank
    that needs it imports it again and reports the real error as its own.  What the imports warn (megatron-core:
    "MimoModelConfig is experimental") is not shown: it reached the harness's terminal from its forkserver."""
    import importlib
    import warnings
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except (Exception, SystemExit):     # noqa: BLE001  the rank's error, not this process's
            pass


def forked_to_serve(parent: int) -> None:
    """In a forkserver forked from the harness `parent` (not a new interpreter, so this module may have been
    imported by the harness itself): take the values it reads at import as if imported here (`PARENT_AT_IMPORT`
    the harness, `IMPORTED_BY` this server, which its ranks then die with) and die with the harness.

    Raises OSError when prctl fails."""
    global PARENT_AT_IMPORT, IMPORTED_BY
    PARENT_AT_IMPORT, IMPORTED_BY = parent, os.getpid()
    die_with_parent(parent)


def imported_by_forkserver() -> bool:
    """True in multiprocessing's forkserver itself, which imports the worker modules as a preload
    (`harness.running.runner`); False in a rank it forked (whose stack also holds the forkserver's ``main``, below
    ``_serve_one``), which imports a worker that was not preloaded (a CUDA megatron-core run)."""
    fs = sys.modules.get("multiprocessing.forkserver")
    serve = getattr(fs, "_serve_one", None)
    frame, in_main = sys._getframe(), False
    while fs is not None and frame is not None:
        if serve is not None and frame.f_code is serve.__code__:
            return False
        in_main = in_main or frame.f_code is fs.main.__code__
        frame = frame.f_back
    return in_main


def guard_forkserver() -> None:
    """Call at the top of a worker module, before its slow imports.  In the forkserver: die with the harness
    (then ranks need only die with the forkserver) and ignore SIGINT: Ctrl-C reaches the whole process group;
    the forkserver ignores SIGINT itself, but only after its preload, so an early Ctrl-C would end it with a
    traceback instead of the harness's one line.  Ranks inherit it and are ended by the harness (and by their
    parent's death).  Elsewhere: nothing."""
    if imported_by_forkserver():
        die_with_parent(PARENT_AT_IMPORT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def enter_rank(rank: int, run_dir: str, forked: bool) -> TextIO:
    """First thing a rank does: die with the forkserver (`forked`: started by the runner's forkserver, not
    torchrun), send stdout/stderr to ``RUN_DIR/rank{r}.log`` (an uncaught exception leaves its traceback there)
    and dump every thread's Python stack there on SIGUSR1 (the watchdog asks before killing a hung rank).
    The process is named ``bitparity-r{rank}`` (``ps``, ``top``, ``pgrep bitparity``; Linux only).
    Returns the log file.  Exits quietly (code 1) if the run directory is gone: the harness was interrupted
    and removed it, so there is nothing to report to."""
    if forked and IMPORTED_BY != os.getpid():
        die_with_parent(IMPORTED_BY)
    if forked:
        freeze_inherited()
    if _LIBC is not None:       # prctl(PR_SET_NAME): the kernel keeps 15 bytes; a failure only loses the name
        _LIBC.prctl(_PR_SET_NAME, f"bitparity-r{rank}".encode()[:15], 0, 0, 0)
    try:
        log = open(Path(run_dir) / f"rank{rank}.log", "w", buffering=1)
    except FileNotFoundError:
        os._exit(1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    return log


#: Environment variables the harness hands to every forked rank as they are in the harness when the rank starts (a
#: forkserver keeps the environment it was started with): the MPS daemon's directories of ``verify --mps``
#: (harness/running/mps.py), so a rank reaches that daemon whenever the forkserver started.  None: unset.
RANK_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def rank_env() -> dict:
    """`RANK_ENV` as this process has them now (None where unset), for `launch`."""
    return {k: os.environ.get(k) for k in RANK_ENV}


def apply_env(env: dict) -> None:
    """Set this process's environment variables to `env`'s values; None unsets (as `rank_env` reads them)."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def launch(worker: str, rank: int, world_size: int, cfg_json: str, run_dir: str, store_path: str | None,
           env: dict | None = None) -> None:
    """Forkserver target: ``<worker>.rank_main(rank, world_size, cfg_json, run_dir, store_path)``, the worker
    module imported here (in the rank) so the harness never imports a trainer (megatron-core's import alone takes
    seconds); with the module preloaded in the forkserver this is a dictionary lookup.  `env` (`rank_env` of the
    harness) is applied first, before anything in the rank can start CUDA.

    A worker that cannot be imported (a syntax error anywhere below it: the forkserver's preload skipped it,
    `trainerkit.preload`) ends the rank with code 1 after `exit_cannot_import` has written why into its log, the
    rank's log opened here since ``rank_main`` never runs: otherwise the traceback went to the harness's
    terminal and the run's error read "(empty log)"."""
    import importlib
    apply_env(env or {})
    try:
        module = importlib.import_module(worker)
    except (Exception, SystemExit) as e:        # noqa: BLE001  a broken tree fails in many ways
        enter_rank(rank, run_dir, forked=store_path is not None)
        exit_cannot_import(worker, e)
    module.rank_main(rank, world_size, cfg_json, run_dir, store_path)


def cannot_import(module: str, e: BaseException) -> str:
    """One line for a failed import of `module`: ``cannot import reference_impl.worker: SyntaxError: invalid
    syntax (/x/reference_impl/train.py, line 152)``.  A SyntaxError's own str() names only the file's base
    name, and its traceback's last line neither file nor line: the full path says which copy is broken."""
    if isinstance(e, SyntaxError):
        what = f"{e.msg} ({e.filename}, line {e.lineno})"
    else:
        what = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"cannot import {module}: {type(e).__name__}" + (f": {what}" if what else "")


def exit_cannot_import(module: str, e: BaseException) -> None:
    """In a rank whose log is open (`enter_rank`): print `e`'s traceback, then `cannot_import`'s line last (the
    harness quotes a failed rank's last log line as the run's error, `harness.running.runner`), and exit with code 1."""
    import traceback
    traceback.print_exception(e)
    print(cannot_import(module, e), flush=True)
    sys.stdout.flush()
    raise SystemExit(1)


def torchrun_main(rank_main, argv: list[str] | None = None) -> None:
    """A worker's torchrun entry (``python -m <worker> CONFIG.json RUN_DIR``): die with the torchrun agent, take
    rank and world size from the environment (RANK, WORLD_SIZE; LOCAL_RANK picks the GPU), run
    ``rank_main(rank, world, config_json, run_dir, None)`` (None: rendezvous through env://)."""
    die_with_parent(PARENT_AT_IMPORT)
    cfg_path, run_dir = (argv if argv is not None else sys.argv[1:])[:2]
    rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(cfg_path).read_text(), run_dir, None)
