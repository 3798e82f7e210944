"""Runs one training run as a process group (one process per rank: P x EP of them) under a watchdog.

Ranks are forked from a forkserver that has already imported torch and the trainer
(``set_forkserver_preload``, through `trainerkit.preload`), so a 16-rank run does not pay 16 torch imports; a
trainer that cannot be imported (a syntax error) is then each run's ``error``, its reason the import error's
line, not a dead forkserver.  The watchdog ends the run
as soon as any rank exits non-zero or the timeout passes, then terminates, kills and reaps every rank; on a
timeout it first asks every stuck rank where it waits (`_stacks`), under either launcher.  Should the harness
itself die (any signal, SIGKILL included), the forkserver, torchrun and every rank die with it
(`trainerkit.process.die_with_parent`).
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path
from typing import Optional

from trainerkit.config import DEFAULT_TRAINER, RunConfig

from ..planning import trainers
from . import forkservers, interrupt

_CTX = mp.get_context("forkserver")
# the launch entry point of each trainer (`harness.planning.trainers.REGISTRY`): a module with rank_main(...) (forkserver)
# and main() (torchrun -m)
WORKERS = {name: t.worker for name, t in trainers.REGISTRY.items()}
#: the forkserver's only preload, which imports the modules `_set_preload` names and skips any that fails: a
#: module that cannot be imported (a syntax error) is then each rank's error, not the forkserver's death
#: (multiprocessing catches only ImportError there)
PRELOAD_GUARD = "trainerkit.preload"


def _set_preload(modules: list[str], source: Optional[str] = None) -> None:
    """Have a forkserver started from now on import `modules` (through `PRELOAD_GUARD`, which reads them from
    the environment the forkserver inherits: the variables stay set, read only by the preload modules), a
    trainer's library from `source` (a directory; None: the interpreter's own)."""
    from trainerkit.process import PRELOAD_ENV, PRELOAD_SOURCE_ENV
    os.environ[PRELOAD_ENV] = ",".join(modules)
    os.environ[PRELOAD_SOURCE_ENV] = source or ""
    _CTX.set_forkserver_preload([PRELOAD_GUARD])


_set_preload([WORKERS[DEFAULT_TRAINER]])
# Runs go side by side in threads (harness.running.pool).  A forkserver child's exit status is read from its sentinel
# once, by whichever poll() comes first, and Process.start() polls *every* child of the process (multiprocessing's
# _cleanup): two threads polling one child race for those bytes and the loser records 255 (seen as "rank 3 exited
# with code 0" from fuzz runs two at a time).  So every start / poll / join of a rank process holds this lock;
# waiting for a rank to end (its sentinel) does not.
_CHILDREN = threading.Lock()


def _exitcode(p) -> Optional[int]:
    """`p.exitcode` under `_CHILDREN` (None while it runs)."""
    with _CHILDREN:
        return p.exitcode


def _reap(p, timeout: Optional[float] = None) -> bool:
    """Wait up to `timeout` s (None: for ever) for rank process `p` to end, then join it; True when it ended."""
    if not mp.connection.wait([p.sentinel], timeout):
        return False
    with _CHILDREN:
        p.join()
    return True


def preload(configs) -> None:
    """Have the forkserver import the workers of these runs' trainers before it forks ranks (call before the
    first run: a forkserver already running keeps its preload, and its ranks then import the trainer
    themselves).  megatron-core itself (`megatron_trainer.preload`) unless a run is on CUDA (importing megatron
    initialises CUDA, which a forked rank then cannot use): each ``megatron_path`` (the interpreter's own, or a
    checkout or planted copy put first on the server's path, as each rank would) in a forkserver of its own, the
    second one's and further (``--megatron-base``) from `forkservers`.  A megatron the ranks import themselves
    costs each rank its import (~4 s of CPU on 2 cores, and a planted copy has no byte code to reuse), a 16-rank
    run ~1 CPU-minute."""
    configs = list(configs)
    names = (DEFAULT_TRAINER, *sorted({c.trainer for c in configs} - {DEFAULT_TRAINER}))
    modules = [WORKERS[t] for t in names]
    # megatron_path as written, never mapped to None: None is what the forkserver's *own* path imports (CPython's
    # forkserver imports its preload before it takes the harness's sys.path), not the head --megatron-head put first
    # on the harness's (`planning.sources.use_head`); `megatron_trainer.preload` puts a named directory first
    sources = {c.megatron_path for c in configs if trainers.runs_megatron(c.trainer)}
    source, holds_mine = None, False
    on_cuda = any(c.device == "cuda" for c in configs)
    if sources and not on_cuda:
        libraries = modules + [trainers.entry(t).library_preload for t in names if trainers.entry(t).library_preload]
        # the megatron this process imports (the interpreter's own, None, or the --megatron-head it activated) in
        # multiprocessing's forkserver, which is then this process forked (`_start_forkserver`); every further
        # source (--megatron-base next to the head) in a forkserver of its own.  Should one not start, its runs
        # fork from the module's forkserver, which then must hold no megatron (each of their ranks imports its
        # own, as before there were servers per source)
        mine = {c.megatron_path for c in configs if trainers.runs_megatron(c.trainer) and trainers.imported_here(c)}
        first, *others = sorted(sources, key=lambda s: (s is not None, s not in mine, s or ""))
        from trainerkit.process import PRELOAD_ENV, PRELOAD_SOURCE_ENV
        if all(forkservers.start(other, {PRELOAD_ENV: ",".join(libraries), PRELOAD_SOURCE_ENV: other},
                                 [PRELOAD_GUARD]) for other in others):
            modules, source, holds_mine = libraries, first, first in mine
    _set_preload(modules, source)
    # the server is this process forked (`forkservers.forked_spawn`) unless this process has imported a megatron the
    # preload would not import (another directory's, or one the server must not hold), or the runs are on CUDA:
    # validating them asked torch for the devices (`planning.cases.load_case`), and torch's device query marks a
    # process whose forks can never use CUDA ("Cannot re-initialize CUDA in forked subprocess" in every rank); a
    # new interpreter starts clean
    _start_forkserver(fork=not on_cuda and ("megatron" not in sys.modules or holds_mine))


def _start_forkserver(fork: bool = False) -> None:
    """Start the forkserver unless it runs; `fork`: as this process forked (see `preload`), else a new interpreter.
    Started here, in the calling (main) thread: the forkserver asks to die with its parent (PR_SET_PDEATHSIG),
    which the kernel applies to the *thread* that forked it, so one started by a run's worker thread
    (harness.running.pool) would be killed when that thread ends, and the next run would find it gone."""
    forkservers.ensure_running(forkserver.ensure_running, fork=fork)


def in_forkserver(fn, timeout_s: float = 60.0):
    """``fn()`` in a child of the forkserver, its (picklable) result back; None when the child fails, dies or
    takes over `timeout_s` seconds (it is then ended and reaped).  For what needs torch (`harness.running.arithmetic`):
    the forkserver has imported it for the ranks, so the child answers in milliseconds where the harness would
    spend ~1.3 s of CPU importing torch itself, and it answers for the interpreter the ranks are forked from.
    `fn` must be importable by name (a module-level function).  Call from the main thread, after `preload` (a
    forkserver started here has the default preload, the reference trainer's)."""
    _start_forkserver()
    receive, send = _CTX.Pipe(duplex=False)
    child = _CTX.Process(target=_answer, args=(fn, send), name="bitparity-facts", daemon=True)
    try:
        with _CHILDREN:
            child.start()
        send.close()
        return receive.recv() if receive.poll(timeout_s) else None
    except (EOFError, OSError):     # the child died before it answered
        return None
    finally:
        receive.close()
        _stop([child])


def _answer(fn, send) -> None:
    try:
        result = fn()
    except Exception:       # noqa: BLE001  the caller has its own way; never a traceback on the user's terminal
        result = None
    send.send(result)
    send.close()


@dataclass
class RunOutcome:
    """ok: every rank exited 0.  error: one paragraph naming the failing rank and its last log lines."""

    ok: bool
    error: Optional[str]
    elapsed_s: float


def tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a text file ('' if missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stacks(pids: dict[int, int], run_dir: Path) -> str:
    """Ask hung ranks ({rank: pid}) for their Python stacks (SIGUSR1 -> faulthandler into the rank log) and
    return the innermost frames of each, so a timeout says where every rank waits."""
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)
    lines = []
    for r in sorted(pids):
        frames = [l.strip() for l in tail(run_dir / f"rank{r}.log", 60).splitlines() if l.strip().startswith("File ")]
        where = frames[0] if frames else "(no stack)"
        lines.append(f"rank {r} waits in: {where}")
    return "\n".join(lines)


_VICTIM = ("Connection closed by peer", "remote worker", "Connection reset by peer")


def _root_cause(procs, first: int, run_dir: Path) -> str:
    """Error text of the rank that failed on its own: peers of a crashed rank fail too ("Connection closed
    by peer"), sometimes sooner; wait a moment and prefer a rank whose last log line is not such a symptom."""
    time.sleep(0.5)
    failed = [first] + [r for r, p in enumerate(procs) if r != first and _exitcode(p) not in (None, 0)]
    logs = {r: tail(run_dir / f"rank{r}.log") for r in failed}
    last = {r: (logs[r].strip().splitlines() or ["(empty log)"])[-1] for r in failed}
    r = next((r for r in failed if not any(v in last[r] for v in _VICTIM)), first)
    code = _exitcode(procs[r])
    # the watchdog has not killed anything yet: a SIGKILL now came from outside, usually the OOM killer
    why = " (SIGKILL from outside the harness: most likely out of memory; see dmesg)" if code == -signal.SIGKILL else ""
    return f"rank {r} exited with code {code}{why}: {last[r]}\nlast lines of rank{r}.log:\n{logs[r]}"


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]     # started ones only
    for p in procs:
        with _CHILDREN:
            if p.is_alive():
                p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        if not _reap(p, max(0.0, deadline - time.monotonic())):
            with _CHILDREN:
                p.kill()
            _reap(p)


# how a rank fails when another rank died first: the collective or p2p it waited in breaks
_CONSEQUENCE = re.compile(r"gloo|Connection closed by peer|DistBackendError|NCCL|Timed out|timed out|Broken pipe")


def _first_failure(run_dir: Path, world: int) -> str:
    """'rank r: <last line>' of the rank whose traceback is the root cause, else '': the first rank whose log
    ends in a traceback that is not a broken collective (torchrun ends every rank; the ones that waited on the
    dead rank fail too, often first in rank order), or the first traceback at all."""
    failed = []
    for r in range(world):
        log = tail(run_dir / f"rank{r}.log", 400)      # a deep megatron traceback is longer than what is shown
        if "Traceback" in log:
            failed.append((r, "\n".join(log.splitlines()[-40:]), log.strip().splitlines()[-1]))
    r, log, last = next((f for f in failed if not _CONSEQUENCE.search(f[2])), failed[0] if failed else (None,) * 3)
    return f"rank {r}: {last}\nlast lines of rank{r}.log:\n{log}" if r is not None else ""


def descendants(root: int) -> list[int]:
    """Pids of the running (not zombie) descendants of process `root`, from /proc (Linux; no psutil)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        try:
            _, rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)
            if rest.split()[0] != "Z":
                children.setdefault(int(rest.split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue                                        # not a process, or gone meanwhile
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _torchrun_ranks(agent: int) -> dict[int, int]:
    """{rank: pid} of the workers under the torchrun process `agent`: its descendants whose environment holds
    RANK (torchrun sets it)."""
    ranks = {}
    for pid in descendants(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[int(rank)] = pid
    return ranks


def _wait_checking(proc: subprocess.Popen, deadline: float) -> int:
    """`proc`'s exit code, waiting until `deadline` (time.monotonic()) in slices of at most 1 s, so that an
    interrupt Python swallowed still ends the wait (harness.running.interrupt).  Raises subprocess.TimeoutExpired."""
    while True:
        interrupt.check()
        try:
            return proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise


def run_torchrun(cfg: RunConfig, run_dir: Path, timeout_s: float) -> RunOutcome:
    """Launch the ranks with ``torchrun --standalone --nproc-per-node P*EP`` (one process per rank, rank and
    world from the environment, local rank r on ``cuda:r``) under the same watchdog.  torchrun dies with the
    harness (and its workers with it, `reference_impl.worker.main`)."""
    from trainerkit.process import die_with_parent

    world = cfg.parallel.world_size
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(cfg.model_dump_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", WORKERS[cfg.trainer], str(cfg_path), str(run_dir)]
    start = time.monotonic()
    with open(run_dir / "torchrun.log", "w") as log:
        harness = os.getpid()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(harness))
        try:
            code = _wait_checking(proc, start + timeout_s)
            error = None if code == 0 else (f"torchrun exited with code {code}; " +
                                            (_first_failure(run_dir, world) or tail(run_dir / "torchrun.log")))
        except subprocess.TimeoutExpired:
            pids = _torchrun_ranks(proc.pid)
            error = (f"timeout after {timeout_s:g} s (torchrun); ranks still running: {sorted(pids)}\n"
                     + _stacks(pids, run_dir))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return RunOutcome(ok=error is None, error=error, elapsed_s=time.monotonic() - start)


def run_ranks(cfg: RunConfig, run_dir: Path, timeout_s: float, launcher: str = "fork") -> RunOutcome:
    """Start the ``P x EP`` ranks of `cfg` (global rank = pp_rank * EP + ep_rank) writing into `run_dir` and
    wait for them.

    launcher: "fork" (forkserver children, default) or "torchrun" (`run_torchrun`)."""
    if launcher == "torchrun":
        return run_torchrun(cfg, run_dir, timeout_s)
    from trainerkit.process import launch, rank_env

    world = cfg.parallel.world_size
    run_dir.mkdir(parents=True, exist_ok=True)
    store = run_dir / "filestore"
    store.unlink(missing_ok=True)
    start = time.monotonic()
    env = rank_env()
    source = cfg.megatron_path if trainers.runs_megatron(cfg.trainer) else None
    process = (functools.partial(forkservers.SourceProcess, megatron_source=source) if forkservers.serves(source)
               else _CTX.Process)
    procs = [process(target=launch, args=(WORKERS[cfg.trainer], r, world, cfg.model_dump_json(), str(run_dir), str(store),
                                               env), name=f"bitparity-rank{r}", daemon=True) for r in range(world)]
    error = None
    try:
        with _CHILDREN:
            for p in procs:
                p.start()
        pending = {p.sentinel: r for r, p in enumerate(procs)}
        while pending and error is None:
            interrupt.check()
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                alive = sorted(pending.values())
                error = (f"timeout after {timeout_s:g} s; ranks still running: {alive}\n"
                         + _stacks({r: procs[r].pid for r in alive}, run_dir))
                break
            for sentinel in mp.connection.wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(sentinel)
                _reap(procs[r])
                code = _exitcode(procs[r])
                if code != 0:
                    error = _root_cause(procs, r, run_dir)
                    break
    finally:
        _stop(procs)
        store.unlink(missing_ok=True)
    return RunOutcome(ok=error is None, error=error, elapsed_s=time.monotonic() - start)
