"""Run megatron-core's expert parallelism and MoE 1F1B overlap on a CPU-only torch over gloo: points E1, O1, O2,
O3 (on top of `compat`'s nine), applied in the rank when the run has EP > 1 or the overlap.

Same rules as `compat`: each point checks that the bug it works around is still in the installed megatron
(`compat._needed`, else recorded in `compat.NOT_NEEDED`) and that the code it patches is still the code it was
written for (`compat._require`); no point changes a computation.

* **E1** ``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)`` (the alltoall token dispatcher's split
  sizes, transformer/moe/token_dispatcher.py) converts only CUDA tensors; a CPU tensor stays a tensor, and
  ``all_to_all_single`` rejects tensor split sizes (TypeError): a CPU tensor is converted too.
* **O1** the overlap's stream handshake (pipeline_parallel/utils.py: ``stream_acquire_context`` /
  ``ScheduleNode``) calls ``event.wait(stream)``: point 4's inert event gets a ``wait``.
* **O2** ``torch.cuda.nvtx.range_push / range_pop / range`` around every scheduled node raise "NVTX functions
  not installed" on a CPU build of torch: no-ops there (markers for a profiler, nothing else).
* **O3** delayed weight gradients (``delay_wgrad_compute``): ``MLP.backward_dw`` calls ``backward_dw`` of both
  its linears, but the local spec's ``RowParallelLinear`` has none (megatron-core 0.16; ``ColumnParallelLinear``'s
  is a no-op, "Not supported - does nothing"): the same no-op.  So with the local (non-TE) specs the delayed
  wgrad delays nothing arithmetic: autograd computes every weight gradient as usual, and the flag exercises
  megatron's scheduling bookkeeping only.
* **B1** (bf16 on CPU, any parallelism): ``Float16OptimizerWithFloat16Params.__init__`` (optimizer/optimizer.py)
  sorts parameters by CUDA type names ('torch.cuda.BFloat16Tensor', ...) and rejects anything else: the same
  method, recompiled from megatron's own source with the CPU type names (nothing else changes).
"""
from __future__ import annotations

import contextlib
import functools
import textwrap

import torch

from . import compat

POINTS = ("E1", "O1", "O2", "O3")
BF16_POINTS = ("B1",)


def needed(parallel) -> bool:
    """Whether a run with these `ParallelConfig` settings needs `POINTS` (on CPU): EP > 1 or the MoE 1F1B
    overlap."""
    return parallel.expert_model_parallel_size > 1 or parallel.overlap_moe_expert_parallel_comm


def _nvtx_broken() -> bool:
    try:
        torch.cuda.nvtx.range_push("bitparity")
        torch.cuda.nvtx.range_pop()
    except (RuntimeError, AttributeError):
        return True
    return False


def apply() -> tuple:
    """Apply E1, O1, O2, O3 where their bug is present; returns those applied.  Call after `compat.apply`.

    Raises:
        compat.CompatError: a point's bug is there but the code it patches changed."""
    from megatron.core.pipeline_parallel import utils as putils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    applied = []
    # E1
    move = moe_utils.maybe_move_tensor_to_cpu
    if compat._needed("tensor.is_cuda" in compat._source(move), "E1",
                      "maybe_move_tensor_to_cpu converts CPU tensors too"):
        compat._require(getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None) is move, "E1",
                        "token_dispatcher.py no longer imports moe_utils.maybe_move_tensor_to_cpu by name")

        @functools.wraps(move)
        def move_cpu_too(tensor, as_numpy=False, record_stream=False):
            if torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy() if as_numpy else tensor
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = move_cpu_too
        applied.append("E1")
    # O1
    if compat._needed(".wait(" in compat._source(putils), "O1", "pipeline_parallel/utils.py waits on no event"):
        compat._InertStream.wait = lambda self, *args: None
        applied.append("O1")
    # O2
    if compat._needed(_nvtx_broken(), "O2", "torch.cuda.nvtx works in this torch build"):
        torch.cuda.nvtx.range_push = lambda *a, **k: None
        torch.cuda.nvtx.range_pop = lambda *a, **k: None
        torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.nvtx.mark = lambda *a, **k: None
        applied.append("O2")
    # O3
    if compat._needed(not hasattr(layers.RowParallelLinear, "backward_dw"), "O3",
                      "RowParallelLinear has backward_dw"):
        column = getattr(layers.ColumnParallelLinear, "backward_dw", None)
        compat._require(column is not None and "does nothing" in compat._source(column), "O3",
                        "ColumnParallelLinear.backward_dw is no longer the documented no-op")
        layers.RowParallelLinear.backward_dw = column
        applied.append("O3")
    return tuple(applied)


def apply_bf16() -> tuple:
    """B1: megatron's mixed-precision optimizer accepts CPU parameters.  Call after `compat.apply`, before the
    optimizer is built.

    Raises:
        compat.CompatError: the method no longer sorts parameters by exactly these type names."""
    from megatron.core.optimizer import optimizer as mopt

    cls = mopt.Float16OptimizerWithFloat16Params
    source = textwrap.dedent(compat._source(cls.__init__))
    if not compat._needed(compat.CUDA_TYPES[0][0] in source, "B1",
                          "Float16OptimizerWithFloat16Params no longer checks CUDA type names"):
        return ()
    compat._require(all(source.count(cuda) == 1 for cuda, _ in compat.CUDA_TYPES) and "super().__init__" in source, "B1",
                    "Float16OptimizerWithFloat16Params.__init__ no longer checks each type name once")
    compat.recompile(cls, "__init__", compat.CUDA_TYPES, mopt)
    return ("B1",)
