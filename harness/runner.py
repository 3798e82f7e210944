"""Runs one training run as a process group (one process per pipeline rank) under a watchdog.

Ranks are forked from a forkserver that has already imported torch and the trainer
(``set_forkserver_preload``), so a 16-rank run does not pay 16 torch imports.  The watchdog ends the run
as soon as any rank exits non-zero or the timeout passes, then terminates, kills and reaps every rank.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from reference_impl.config import RunConfig

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["reference_impl.worker"])


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


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]     # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(cfg: RunConfig, run_dir: Path, timeout_s: float) -> RunOutcome:
    """Start ``pipeline_model_parallel_size`` ranks for `cfg` writing into `run_dir` and wait for them."""
    from reference_impl.worker import rank_main

    world = cfg.parallel.pipeline_model_parallel_size
    run_dir.mkdir(parents=True, exist_ok=True)
    store = run_dir / "filestore"
    store.unlink(missing_ok=True)
    start = time.monotonic()
    procs = [_CTX.Process(target=rank_main, args=(r, world, cfg.model_dump_json(), str(run_dir), str(store)),
                          name=f"bitparity-rank{r}", daemon=True) for r in range(world)]
    error = None
    try:
        for p in procs:
            p.start()
        pending = {p.sentinel: r for r, p in enumerate(procs)}
        while pending and error is None:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                alive = sorted(pending.values())
                error = f"timeout after {timeout_s:.0f} s; ranks still running: {alive}\n" + \
                        "\n".join(f"rank {r}: {tail(run_dir / f'rank{r}.log', 1)}" for r in alive)
                break
            for sentinel in mp.connection.wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(sentinel)
                procs[r].join()
                code = procs[r].exitcode
                if code != 0:
                    log = tail(run_dir / f"rank{r}.log")
                    last = log.strip().splitlines()[-1] if log.strip() else "(empty log)"
                    error = f"rank {r} exited with code {code}: {last}\nlast lines of rank{r}.log:\n{log}"
                    break
    finally:
        _stop(procs)
        store.unlink(missing_ok=True)
    return RunOutcome(ok=error is None, error=error, elapsed_s=time.monotonic() - start)
