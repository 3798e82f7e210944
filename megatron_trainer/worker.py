"""Process entry point of one megatron-core rank (world = P; TP = CP = EP = DP = 1).

The same two launchers and lifecycle as every trainer (`trainerkit.process`): the harness runner's forkserver
calls `rank_main` (this module is imported there once, before any fork; megatron-core too, through
`megatron_trainer.preload`, when every run of the case imports the same one), and
``torchrun ... -m megatron_trainer.worker CONFIG RUN_DIR`` runs `main`.  A run that names its megatron
(``RunConfig.megatron_path``) has it put first on sys.path before megatron is imported (`source.activate`).

torch.compile off in every rank (``torch._dynamo.config.disable``, what ``TORCH_COMPILE_DISABLE=1`` sets; the
forkserver has imported torch before this module, so the variable alone would come too late): megatron wraps its
fused helpers in ``torch.compile``, which costs 7-20 s in a rank's first step and gives the same bits as eager.
The compatibility layer (`compat`: all eight points on CPU, the local-spec points on CUDA) is applied in the
rank before anything is built.
"""
from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

from trainerkit import process

process.guard_forkserver()      # before the slow imports below
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (is|are) not installed.*")

import torch
import torch._dynamo.config
import torch._inductor.config  # noqa: F401  use_deterministic_algorithms imports it (~2 s): pay once, pre-fork
import torch.distributed as dist

from trainerkit.config import RunConfig

from . import source


def rank_main(rank: int, world_size: int, cfg_json: str, run_dir: str, store_path: str | None) -> None:
    """Initialise the process group through a FileStore (gloo on CPU, NCCL on CUDA), run megatron-core's
    training (`train.train`), write ``rank{r}.jsonl``; stdout/stderr go to ``rank{r}.log``."""
    started = time.perf_counter()
    process.enter_rank(rank, run_dir, forked=store_path is not None)
    cfg = RunConfig.model_validate_json(cfg_json)
    source.activate(cfg.megatron_path)      # before anything imports megatron
    try:        # megatron and the adapter: a broken one is the run's error, its line last in the log
        from . import compat
        from .train import train
    except (Exception, SystemExit) as e:        # noqa: BLE001  a broken tree fails in many ways
        process.exit_cannot_import("megatron_trainer.train", e)

    torch._dynamo.config.disable = True
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(cfg.training.num_threads)
    torch.use_deterministic_algorithms(True)
    if world_size != cfg.parallel.world_size:
        raise RuntimeError(f"world size {world_size} but the run needs P = {cfg.parallel.world_size} ranks")
    if cfg.device == "cuda":
        # deterministic cuBLAS (use_deterministic_algorithms demands it), before CUDA initialises
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    points = compat.apply(device.type)
    par = cfg.parallel
    from . import compat_hybrid, compat_tp
    points += compat_tp.apply() if compat_tp.needed(par.sequence_parallel) else ()
    points += compat_hybrid.apply() if compat_hybrid.needed(cfg.model_class) else ()
    if device.type == "cpu":
        from . import compat_distopt, compat_overlap
        points += (compat_overlap.apply() if compat_overlap.needed(par) else ()) + (
            compat_overlap.apply_bf16() if cfg.params_dtype == "bfloat16" else ()) + (
            compat_distopt.apply() if compat_distopt.needed(cfg.megatron) else ())
    store = dist.FileStore(store_path, world_size) if store_path else None   # None: env:// (torchrun)
    kwargs = {"store": store} if store is not None else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=cfg.rank_timeout_s), **kwargs)
    try:
        import megatron.core
        print(f"rank {rank}/{world_size} pid {os.getpid()}: torch {torch.__version__}, megatron-core "
              f"{megatron.core.__version__}, compat layer {compat.VERSION} points {','.join(points)}"
              f"{'; not needed: ' + '; '.join(f'{p} ({why})' for p, why in compat.NOT_NEEDED.items()) if compat.NOT_NEEDED else ''}, "
              f"threads {torch.get_num_threads()}, {backend} on {device}")
        train(cfg, rank, Path(run_dir) / f"rank{rank}.jsonl", device, started)
        print(f"rank {rank}: done")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: ``python -m megatron_trainer.worker CONFIG.json RUN_DIR`` (`trainerkit.process.torchrun_main`)."""
    process.torchrun_main(rank_main, argv)


if __name__ == "__main__":
    main()
