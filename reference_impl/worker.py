"""Process entry point of one rank (world = P x EP; global rank = pp_rank * EP + ep_rank).

Two launchers: the harness runner's forkserver calls `rank_main` (this module is imported there before any
fork, so torch is imported once, not once per rank); ``torchrun ... -m reference_impl.worker CONFIG RUN_DIR``
runs `main`, which takes rank and world size from the environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) and maps local rank r to ``cuda:r``.

No process outlives the harness (`trainerkit.process`: the lifecycle every trainer's worker follows).
"""
from __future__ import annotations

import os
from pathlib import Path

from trainerkit import process

process.guard_forkserver()      # before the slow imports below

# imported once here, pre-fork, not in every rank: numpy.random for the token data (trainerkit.data); sympy through
# symbolic_shapes, which torch.autograd.backward imports (~0.5 s of CPU) whenever it is handed an output gradient,
# as every pipeline stage but the last is
import numpy.random  # noqa: F401
import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from trainerkit.config import RunConfig

from .train import train
from .transport import setup


def deterministic_torch() -> None:
    """torch's deterministic algorithms, without filling every new tensor's memory first: under
    ``use_deterministic_algorithms`` torch writes NaN into each ``empty`` allocation
    (``torch.utils.deterministic.fill_uninitialized_memory``) in case an operation reads memory it did not
    write; every operation of this trainer writes all it reads (the collectives' and receives' buffers are
    filled whole), so the fills change no bit (goldens, and old-vs-new traces of the dsv3 runs), and on CUDA
    they were ~120 of the ~540 kernel launches of an MoE layer's forward and backward (measured on an H200).

    The switch is ATen's own flag (``at::Context::setDeterministicAlgorithms``, which every kernel consults and
    ``torch.are_deterministic_algorithms_enabled`` reads): the public ``torch.use_deterministic_algorithms`` sets
    it too, but first imports ``torch._inductor.config`` to set inductor's flag of the same name, which only code
    compiled by inductor reads (this trainer compiles nothing).  That import is torch._dynamo and inductor, ~2-4 s
    of CPU on 2 cores (about as much as torch's own import): once per `bitparity verify` in the forkserver that
    preloads this module, and once per rank under torchrun.  A torch without the private setter takes the public
    function."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = False


def rank_main(rank: int, world_size: int, cfg_json: str, run_dir: str, store_path: str | None) -> None:
    """Initialise the process group (gloo or NCCL, `transport.setup`) through a FileStore, run `train`, write
    ``rank{r}.jsonl``; stdout/stderr go to ``rank{r}.log`` (an uncaught exception leaves its traceback there
    and exit code 1).  `rank`, `world_size`: global (P x EP ranks).  A rank forked by the forkserver dies
    with it (`trainerkit.process.enter_rank`)."""
    process.enter_rank(rank, run_dir, forked=store_path is not None)
    cfg = RunConfig.model_validate_json(cfg_json)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(cfg.training.num_threads)
    deterministic_torch()
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
    """torchrun entry: ``python -m reference_impl.worker CONFIG.json RUN_DIR`` (`trainerkit.process.torchrun_main`)."""
    process.torchrun_main(rank_main, argv)


if __name__ == "__main__":
    main()
