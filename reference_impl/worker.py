"""Process entry point of one rank (world = P x EP; global rank = pp_rank * EP + ep_rank).

Two launchers: the harness runner's forkserver calls `rank_main` (this module is imported there before any
fork, so torch is imported once, not once per rank); ``torchrun ... -m reference_impl.worker CONFIG RUN_DIR``
runs `main`, which takes rank and world size from the environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) and maps local rank r to ``cuda:r``.

No process outlives the harness: the forkserver, every rank and (in the runner) torchrun ask the kernel for
SIGKILL when their parent exits (`die_with_parent`), so a harness killed by any signal, SIGKILL included,
takes the whole tree with it.  A forkserver would not exit on its own: every child it forks inherits the
write end of its "alive" pipe, so ranks stuck in a receive keep it, and it them, alive.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
from pathlib import Path

# Read before the slow imports below, to keep short the window in which the parent can die unnoticed.
_PARENT_AT_IMPORT = os.getppid()        # torchrun worker: the torchrun agent; forkserver: the harness
_IMPORTED_BY = os.getpid()              # forkserver ranks inherit this: the forkserver, i.e. their parent
_PR_SET_PDEATHSIG = 1
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


def _imported_by_forkserver() -> bool:
    """True in multiprocessing's forkserver, which imports this module as a preload (`harness.runner`)."""
    fs = sys.modules.get("multiprocessing.forkserver")
    frame = sys._getframe()
    while fs is not None and frame is not None:
        if frame.f_code is fs.main.__code__:
            return True
        frame = frame.f_back
    return False


if _imported_by_forkserver():
    die_with_parent(_PARENT_AT_IMPORT)   # then ranks need only die with the forkserver
    # Ctrl-C reaches the whole process group; the forkserver ignores SIGINT itself, but only after its
    # preload (this import of torch): ignore it now, so an early Ctrl-C ends the harness with one line, not
    # with this process's traceback.  Ranks inherit it and are ended by the harness (and their parent's death).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import torch
import torch._inductor.config  # noqa: F401  use_deterministic_algorithms imports it (~2 s): pay once, pre-fork
import torch.distributed as dist

from .config import RunConfig
from .train import train
from .transport import setup


def rank_main(rank: int, world_size: int, cfg_json: str, run_dir: str, store_path: str | None) -> None:
    """Initialise the process group (gloo or NCCL, `transport.setup`) through a FileStore, run `train`, write
    ``rank{r}.jsonl``; stdout/stderr go to ``rank{r}.log`` (an uncaught exception leaves its traceback there
    and exit code 1).  `rank`, `world_size`: global (P x EP ranks).  A rank forked by the forkserver dies
    with it (`die_with_parent`)."""
    if store_path is not None and _IMPORTED_BY != os.getpid():
        die_with_parent(_IMPORTED_BY)
    try:
        log = open(Path(run_dir) / f"rank{rank}.log", "w", buffering=1)
    except FileNotFoundError:       # the harness already removed the run (interrupted): nothing to report to
        os._exit(1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # the harness watchdog sends SIGUSR1 before killing a hung rank: every thread's Python stack goes to the log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    cfg = RunConfig.model_validate_json(cfg_json)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(cfg.training.num_threads)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(store_path, world_size) if store_path else None   # None: env:// (torchrun)
    ep = cfg.parallel.expert_model_parallel_size
    if world_size != cfg.parallel.world_size:
        raise RuntimeError(f"world size {world_size} but the run needs P x EP = {cfg.parallel.world_size} ranks")
    transport = setup(cfg.device, rank, world_size, store, cfg.rank_timeout_s, cfg.num_gpus, ep)
    try:
        where = f" (pp rank {rank // ep}, ep rank {rank % ep})" if ep > 1 else ""
        print(f"rank {rank}/{world_size}{where} pid {os.getpid()}: torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}, {transport.description} on {transport.device}")
        train(cfg, rank, Path(run_dir) / f"rank{rank}.jsonl", transport)
        print(f"rank {rank}: done")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: ``python -m reference_impl.worker CONFIG.json RUN_DIR``; dies with the torchrun agent."""
    die_with_parent(_PARENT_AT_IMPORT)
    cfg_path, run_dir = (argv if argv is not None else sys.argv[1:])[:2]
    rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(cfg_path).read_text(), run_dir, None)


if __name__ == "__main__":
    main()
