"""Device placement and communication backend of one rank, chosen automatically and recorded.

* CPU: gloo, tensors sent as they are; between ranks forked on this host the pipeline's boundary tensors go over
  Unix sockets instead (`host_pipe`: gloo's CPU per message was several times the stage's work it moves).
* CUDA with at least one GPU per rank: NCCL, rank r on ``cuda:r`` (p2p and collectives on device).
* CUDA with fewer GPUs than ranks (several pipeline ranks share a GPU): NCCL refuses two ranks on one
  device ("invalid usage") and gloo cannot send CUDA tensors ("writev: Bad address"), so boundary tensors
  and collective operands are staged through pinned host memory and moved over gloo.

Bitwise: staging is a copy, so it moves no bit; a two-member all-reduce is ``a + b`` on every backend.
Expert parallelism adds groups of EP ranks (``model/expert_parallel.py``: all-to-all and all-gather, copies
only; between ranks forked on this host over `host_channel` sockets instead of gloo) and one pipeline per EP
column (`Transport.global_rank`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import host_channel, host_pipe

# cuBLAS needs a pinned workspace for deterministic GEMMs (must be set before the first cuBLAS call).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def cuda_determinism() -> dict:
    """Deterministic CUDA settings (applied before CUDA work); returns them for the manifest."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    return {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"], "deterministic_algorithms": True,
            "allow_tf32": False, "cudnn_deterministic": True, "cudnn_benchmark": False,
            "bf16_reduced_precision_reduction": False}


@dataclass
class Transport:
    """How this rank talks to the others.  ``staged``: CUDA tensors go through pinned host buffers (gloo).

    Expert parallelism: world = P x EP and global rank = pp_rank * EP + ep_rank (Megatron's rank order with
    TP = CP = 1, `model.expert_parallel`).  Schedules name peers by pipeline rank; `batch` sends to and
    receives from the peer pipeline rank's process of this rank's EP column (``peer * EP + ep_rank``), so
    the executor and the schedule know nothing of EP.
    """

    backend: str
    device: torch.device
    staged: bool
    settings: dict
    expert_model_parallel_size: int = 1
    ep_rank: int = 0
    #: the process group's store when every rank was forked on this host (the fork launcher), else None (torchrun)
    host_store: object = None
    timeout_s: float = 300.0
    #: the pipeline's boundary messages over host sockets (CPU ranks forked on this host), else None (torch.distributed)
    pipe: Optional[host_pipe.HostPipe] = None

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in this rank's EP column."""
        return pp_rank * self.expert_model_parallel_size + self.ep_rank

    @property
    def pipeline_size(self) -> int:
        """P: the world (P x EP ranks) over the EP size."""
        return dist.get_world_size() // self.expert_model_parallel_size

    @property
    def host_channel_store(self):
        """The store the EP groups' `host_channel` sockets rendezvous through, or None (torch.distributed's
        collectives): for CPU ranks forked on this host in a power-of-two EP group.  (CUDA ranks that share GPUs
        stage their operands through host memory too and could use it; they keep gloo until it is measured on a
        GPU machine.)"""
        usable = host_channel.usable(self.expert_model_parallel_size)
        return self.host_store if self.device.type == "cpu" and usable else None

    @property
    def description(self) -> str:
        """One line for logs and the manifest: which backend and placement this rank uses."""
        if self.device.type == "cpu":
            line = "gloo (cpu)"
        else:
            line = "gloo via pinned host memory (GPUs shared)" if self.staged else "nccl (one GPU per rank)"
        return line + ("; pipeline p2p over host sockets" if self.pipe is not None else "") + \
            ("; expert-parallel collectives over host sockets" if self.host_channel_store is not None else "")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=False).pin_memory() if self.staged else t

    def batch(self, sends: list, recv: Optional[tuple]):
        """Post queued sends [(tensor, peer, tag)] and at most one receive (shape, dtype, peer, tag) together
        (``batch_isend_irecv``, or `pipe`'s sockets); wait for the receive.  Peers are pipeline ranks
        (`global_rank` maps them into this rank's EP column).  Returns (received tensor on this device or None,
        send works to wait on before the sent tensors may be freed)."""
        if self.pipe is not None:
            works = [(self.pipe.send(t, self.global_rank(peer), tag), t) for t, peer, tag in sends]
            if recv is None:
                return None, works
            shape, dtype, peer, tag = recv
            return self.pipe.recv(shape, dtype, self.global_rank(peer), tag), works
        ops, keep = [], []
        for t, peer, tag in sends:
            h = self._host(t)
            keep.append(h)
            ops.append(dist.P2POp(dist.isend, h, self.global_rank(peer), tag=tag))
        buf = None
        if recv is not None:
            shape, dtype, peer, tag = recv
            buf = torch.empty(shape, dtype=dtype, device="cpu" if self.staged else self.device,
                              pin_memory=self.staged)
            ops.append(dist.P2POp(dist.irecv, buf, self.global_rank(peer), tag=tag))
        works = dist.batch_isend_irecv(ops) if ops else []
        if recv is not None:
            works[-1].wait()
            works = works[:-1]
            if self.staged:
                buf = buf.to(self.device)
        return buf, [(w, keep) for w in works]

    def all_reduce(self, t: torch.Tensor, group=None) -> None:
        """In-place SUM all-reduce (staged through host memory when needed)."""
        if not self.staged:
            dist.all_reduce(t, group=group)
            return
        h = t.cpu()
        dist.all_reduce(h, group=group)
        t.copy_(h)


def setup(device: str, rank: int, world_size: int, store, timeout_s: float,
          num_gpus: Optional[int] = None, expert_model_parallel_size: int = 1) -> Transport:
    """Initialise the process group for `device` ("cpu" | "cuda") and return this rank's `Transport`.

    rank, world_size: global (world = P x EP, rank = pp_rank * EP + ep_rank).  num_gpus: GPUs to spread the
    ranks over (rank r -> cuda:(r % num_gpus), LOCAL_RANK under torchrun); default all visible.  store: the
    fork launcher's FileStore (every rank on this host; kept as `Transport.host_store`), or None: ``env://``
    rendezvous (torchrun).
    Raises RuntimeError when CUDA is requested but unavailable.
    """
    timeout = timedelta(seconds=timeout_s)
    ep = dict(expert_model_parallel_size=expert_model_parallel_size, ep_rank=rank % expert_model_parallel_size,
              host_store=store, timeout_s=timeout_s)
    if device == "cpu":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        transport = Transport("gloo", torch.device("cpu"), False, {}, **ep)
        if store is not None:       # forked on this host: the boundaries go over sockets to the ring neighbours
            pp_rank = rank // expert_model_parallel_size
            peers = {transport.global_rank(p) for p in host_pipe.ring_neighbours(pp_rank, transport.pipeline_size)}
            if peers:
                transport.pipe = host_pipe.HostPipe.connect(store, "pipeline", rank, peers, timeout_s)
        return transport
    settings = cuda_determinism()
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda requested but torch.cuda.is_available() is False")
    gpus = min(num_gpus or torch.cuda.device_count(), torch.cuda.device_count())
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % gpus)
    torch.cuda.set_device(dev)
    staged = gpus < world_size
    backend = "gloo" if staged else "nccl"
    kwargs = {} if staged else {"device_id": dev}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    settings.update(gpus=gpus, gpu_name=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if not staged else None)
    return Transport(backend, dev, staged, settings, **ep)
