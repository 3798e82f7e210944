"""Runs of a case side by side, as many at once as the machine's cores carry.

Each run is P x EP processes (one per rank), and on a small model every rank is bound by per-op host work, not by
arithmetic: a single-rank run keeps one core busy, a 16-rank run all of them.  So the runs of a case are packed by
their rank counts into the cores this process may use (`cores`): a run starts as soon as its ranks fit beside the
ones already running (a run larger than the whole budget runs alone), taken in plan order, a later small run
filling a gap an earlier large one cannot.  On the one-GPU machine (16 cores) the single-rank runs of
``cases/dsv3-gpu.yaml`` go eight at a time; on 2 cores two single-rank runs share the machine.

Bitwise: every run is its own processes with its own thread count, kernels and inputs, so running two at once
moves no bit (CPU kernels do not look at the load; CUDA kernels are chosen by shape, not by what else runs).  Only
wall time and the order of the progress lines change.
"""
from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

from . import interrupt

T = TypeVar("T")
R = TypeVar("R")


def cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def run_packed(items: Sequence[T], weight: Callable[[T], int], body: Callable[[T], R], budget: int,
               jobs: int) -> list[R]:
    """``[body(item) for item in items]``, with up to `jobs` bodies running at once in threads while the sum of
    their weights (a run's rank count) stays within `budget` (cores); an item heavier than the budget runs alone.
    Items start in order, except that a lighter later item may start while an earlier one waits for room.

    Returns the results in the items' order.  The first exception of a body is raised once every started body
    has returned (no rank outlives this call: each body's own runner reaps its ranks); bodies not yet started
    then never start.  Ctrl-C (`harness.running.interrupt`) reaches the bodies through their own waiting loops.

    Raises:
        ValueError: jobs or budget < 1."""
    if jobs < 1 or budget < 1:
        raise ValueError(f"jobs {jobs} and budget {budget} must be >= 1")
    if jobs == 1:
        return [body(item) for item in items]
    weights = [min(weight(item), budget) for item in items]
    results: dict[int, R] = {}
    pending = list(range(len(items)))
    running: dict[Future, tuple[int, int]] = {}
    error: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="bitparity-run") as pool:
        try:
            while (pending and not error) or running:
                used = sum(w for _, w in running.values())
                while pending and not error and len(running) < jobs:
                    fits = next((i for i in pending if used + weights[i] <= budget), None)
                    if fits is None:
                        break
                    pending.remove(fits)
                    running[pool.submit(body, items[fits])] = (fits, weights[fits])
                    used += weights[fits]
                done, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
                interrupt.check()
                for f in done:
                    i, _ = running.pop(f)
                    try:
                        results[i] = f.result()
                    except BaseException as e:          # noqa: BLE001  re-raised below, after the others end
                        error.append(e)
        except BaseException:
            # interrupted: the bodies notice the same interrupt in their own loops; wait for them to reap
            while running:
                done, _ = wait(list(running), timeout=1.0)
                for f in done:
                    running.pop(f)
            raise
    if error:
        raise error[0]
    return [results[i] for i in range(len(items))]

