"""Device placement and communication backend of one rank, chosen automatically and recorded.

* CPU: gloo, tensors sent as they are.
* CUDA with at least one GPU per rank: NCCL, rank r on ``cuda:r`` (p2p and collectives on device).
* CUDA with fewer GPUs than ranks (several pipeline ranks share a GPU): NCCL refuses two ranks on one
  device ("invalid usage") and gloo cannot send CUDA tensors ("writev: Bad address"), so boundary tensors
  and collective operands are staged through pinned host memory and moved over gloo.

Bitwise: staging is a copy, so it moves no bit; a two-member all-reduce is ``a + b`` on every backend.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

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
    """How this rank talks to the others.  ``staged``: CUDA tensors go through pinned host buffers (gloo)."""

    backend: str
    device: torch.device
    staged: bool
    settings: dict

    @property
    def description(self) -> str:
        """One line for logs and the manifest: which backend and placement this rank uses."""
        if self.device.type == "cpu":
            return "gloo (cpu)"
        return "gloo via pinned host memory (GPUs shared)" if self.staged else "nccl (one GPU per rank)"

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=False).pin_memory() if self.staged else t

    def batch(self, sends: list, recv: Optional[tuple]):
        """Post queued sends [(tensor, peer, tag)] and at most one receive (shape, dtype, peer, tag) together
        (``batch_isend_irecv``); wait for the receive.  Returns (received tensor on this device or None,
        send works to wait on before the sent tensors may be freed)."""
        ops, keep = [], []
        for t, peer, tag in sends:
            h = self._host(t)
            keep.append(h)
            ops.append(dist.P2POp(dist.isend, h, peer, tag=tag))
        buf = None
        if recv is not None:
            shape, dtype, peer, tag = recv
            buf = torch.empty(shape, dtype=dtype, device="cpu" if self.staged else self.device,
                              pin_memory=self.staged)
            ops.append(dist.P2POp(dist.irecv, buf, peer, tag=tag))
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
          num_gpus: Optional[int] = None) -> Transport:
    """Initialise the process group for `device` ("cpu" | "cuda") and return this rank's `Transport`.

    num_gpus: GPUs to spread the ranks over (rank r -> cuda:(r % num_gpus), LOCAL_RANK under torchrun);
    default all visible.  store None: ``env://`` rendezvous (torchrun).
    Raises RuntimeError when CUDA is requested but unavailable.
    """
    timeout = timedelta(seconds=timeout_s)
    if device == "cpu":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        return Transport("gloo", torch.device("cpu"), False, {})
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
    return Transport(backend, dev, staged, settings)
