"""Process entry point of one pipeline rank (started by the harness runner, one process per rank).

Imported by the runner's forkserver before any fork, so torch is imported once, not once per rank.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch._inductor.config  # noqa: F401  use_deterministic_algorithms imports it (~2 s): pay once, pre-fork
import torch.distributed as dist

from .config import RunConfig
from .train import train
from .transport import setup


def rank_main(rank: int, world_size: int, cfg_json: str, run_dir: str, store_path: str) -> None:
    """Initialise the process group (gloo or NCCL, `transport.setup`) through a FileStore, run `train`, write ``rank{r}.jsonl``; stdout/stderr go to
    ``rank{r}.log`` (an uncaught exception leaves its traceback there and exit code 1)."""
    log = open(Path(run_dir) / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    cfg = RunConfig.model_validate_json(cfg_json)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(cfg.training.num_threads)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(store_path, world_size)
    transport = setup(cfg.device, rank, world_size, store, cfg.rank_timeout_s, cfg.num_gpus)
    try:
        print(f"rank {rank}/{world_size} pid {os.getpid()}: torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}, {transport.description} on {transport.device}")
        train(cfg, rank, Path(run_dir) / f"rank{rank}.jsonl", transport)
        print(f"rank {rank}: done")
    finally:
        dist.destroy_process_group()
