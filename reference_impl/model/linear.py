"""A bias-free linear layer whose weight gradient can be computed later than its input gradient.

Megatron's ``delay_wgrad_compute`` (TE linears' ``backward_dw``, driven by the 1F1B overlap schedule's
``backward_dw`` callables in ``models/common/model_chunk_schedule_plan.py``): in the backward of a schedule
node the input gradient is computed at once, so the previous node (and the pipeline send) can go on, and the
weight gradient ``dW = g^T x`` runs afterwards.  Here `Linear` always computes both with the same two
matrix products; under `delayed_wgrad(collector)` it stashes ``(weight, x, g)`` instead of returning dW, and
`run_wgrad(collector)` computes and accumulates them later.  Each delayed weight gets exactly one
contribution per microbatch, so the delay moves when a gradient is computed, never its bits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

_COLLECTOR: Optional[list] = None      # set while a node's backward runs with its weight gradients delayed


class _LinearFn(torch.autograd.Function):
    """y = x W^T.  x [..., in], W [out, in] -> y [..., out]; backward dx = g W, dW = g_2d^T x_2d."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = torch.matmul(g, weight) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        if _COLLECTOR is not None:
            _COLLECTOR.append((weight, x, g))
            return dx, None
        return dx, _wgrad(weight, x, g)


def _wgrad(weight: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.matmul(g.reshape(-1, weight.shape[0]).t(), x.reshape(-1, weight.shape[1]))


# Function.apply's Python wrapper (default-argument binding, functorch's dead-wrapper unwrapping) costs about as
# much as the small matrix product it wraps, and a DeepSeek-V3 step makes ~22,000 of them per rank; outside a
# functorch transform it ends in this C entry point with the same arguments, so calling it directly builds the
# same graph node.
_APPLY = super(torch.autograd.Function, _LinearFn).apply


class Linear(nn.Linear):
    """`torch.nn.Linear` without bias (same parameter name ``weight`` [out, in] and init) whose backward
    honours `delayed_wgrad`.  Input [..., in] -> [..., out], any float dtype."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._are_functorch_transforms_active():
            return _LinearFn.apply(x, self.weight)
        return _APPLY(x, self.weight)


@contextmanager
def delayed_wgrad(collector: list):
    """While active, every `Linear` backward appends ``(weight, x, g)`` to `collector` instead of computing
    its weight gradient (Megatron's delay_wgrad_compute).  Not re-entrant."""
    global _COLLECTOR
    if _COLLECTOR is not None:
        raise RuntimeError("delayed_wgrad is already active")
    _COLLECTOR = collector
    try:
        yield collector
    finally:
        _COLLECTOR = None


@torch.no_grad()
def run_wgrad(collector: list) -> None:
    """Compute the stashed weight gradients in stash order and add them to ``weight.grad`` (as autograd's
    AccumulateGrad would); empties `collector`."""
    for weight, x, g in collector:
        dw = _wgrad(weight, x, g)
        weight.grad = dw if weight.grad is None else weight.grad + dw
    collector.clear()
