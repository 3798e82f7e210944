"""A rank's local routed experts in two grouped matrix products per direction instead of one per expert.

``torch._grouped_mm`` multiplies each expert's rows of one [T, in] tensor by that expert's weight, the groups
given by the cumulative row counts; its output and both gradients (dx, dW) are the bits of the per-expert loop
``torch.cat([x_e @ W_e^T ...])`` under the reference's `linear.Linear` (``matmul(x, W.t())``, ``dx = g W``,
``dW = g^T x``), measured on CPU (torch 2.13) and on an H100 / H200 (torch 2.11), fp32 and bf16, experts with
zero, one and many rows (tests/test_grouped_experts.py pins it per dtype, device and shape class).  So the
grouping moves no bit: every layout, EP degree and device keeps the one path `use_grouped` picks from the model's
sizes, dtype and device alone.  Megatron's counterpart: ``moe/experts.py`` ``GroupedMLP`` / ``TEGroupedMLP``
(``moe_grouped_gemm``); the reference keeps one ``SwiGLUMLP`` module per expert (its parameters keep their global
names, ``...mlp.experts.{e}.linear_fc1.weight``) and only groups the arithmetic.

Under `linear.delayed_wgrad` (the 1F1B overlap's ``delay_wgrad_compute``) the weight gradients are stashed per
expert, as the loop stashes them, and computed by `linear.run_wgrad`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import linear


def use_grouped(x: torch.Tensor, experts: list) -> bool:
    """Whether this torch groups the experts of a layer with inputs like `x` [T, h] (a pure function of the
    device, dtype and sizes, so every layout and EP degree of a run takes the same path): ``torch._grouped_mm``
    exists and takes the dtype (fp32 or bf16, the ones measured; not fp64, which the oracle tests use); on CUDA
    also compute capability >= 9.0 and every GEMM dimension a multiple of 16 bytes (its alignment rule)."""
    if not experts or not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    size = x.element_size()
    fc1, fc2 = experts[0].linear_fc1.weight, experts[0].linear_fc2.weight
    return all(d * size % 16 == 0 for d in (*fc1.shape, *fc2.shape))


def swiglu(x: torch.Tensor, counts, experts: list) -> torch.Tensor:
    """Each expert's SwiGLU MLP (`common.SwiGLUMLP`) on its rows: x [T, h] holds the experts' rows one after the
    other (`counts[j]` rows for ``experts[j]``, zeros allowed); returns [T, h] in the same row order.  `counts`:
    host integers (a list) or an int64 tensor [E] on x's device (EP = 1: the dispatch plan's counts, never read to
    the host on the grouped path).  Grouped where `use_grouped`, else the per-expert loop (the same bits)."""
    if not use_grouped(x, experts):
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        return torch.cat([e(rows) for e, rows in zip(experts, x.split(sizes))])
    # the group offsets (cumulative row counts, int32) once for both products; from a device tensor no host read
    sizes = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64)
    offs = sizes.cumsum(0).to(device=x.device, dtype=torch.int32)
    h = _GroupedLinearFn.apply(x, offs, *[e.linear_fc1.weight for e in experts])
    gate, up = h.chunk(2, dim=-1)           # elementwise from here: the same bits as per expert
    return _GroupedLinearFn.apply(F.silu(gate) * up, offs, *[e.linear_fc2.weight for e in experts])


class _GroupedLinearFn(torch.autograd.Function):
    """y[rows of j] = x[rows of j] W_j^T.  x [T, in], offs [E] int32 (cumulative rows per weight, the last = T, on
    x's device), W_j [out, in] -> y [T, out]; backward dx = g W_j per group, dW_j = g_j^T x_j (or stashed per
    weight, `linear.delayed_wgrad`: the one place that needs the group sizes on the host)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor):
        stacked = torch.stack(weights)                                     # [E, out, in]
        ctx.save_for_backward(x, stacked, offs)
        ctx.weights = weights
        return torch._grouped_mm(x, stacked.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, stacked, offs = ctx.saved_tensors
        g = g.contiguous()                  # the kernel wants a dense output gradient (an expanded one raises)
        dx = torch._grouped_mm(g, stacked, offs=offs) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return (dx, None) + (None,) * len(ctx.weights)
        if linear._COLLECTOR is not None:   # delay_wgrad_compute: one stash per weight, as the loop's Linear
            sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            linear._COLLECTOR.extend(zip(ctx.weights, x.split(sizes), g.split(sizes)))
            return (dx, None) + (None,) * len(ctx.weights)
        dw = torch._grouped_mm(g.t(), x, offs=offs)                        # [E, out, in]
        return (dx, None) + tuple(dw.unbind(0))
