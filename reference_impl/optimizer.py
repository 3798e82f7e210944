"""AdamW whose every element is the same on every CPU and GPU: one IEEE-754 operation per kernel, and a square
root that is correctly rounded by construction.

Why not ``torch.optim.AdamW``: its update takes ``exp_avg_sq.sqrt()``, and torch's CPU ``sqrt`` on fp32 / fp64
is MKL's vector math (VML), which is not correctly rounded and rounds differently on Intel and AMD CPUs, under
``ATEN_CPU_CAPABILITY=default`` and ``MKL_CBWR=COMPATIBLE`` alike (measured: 205,190 of 2^20 random fp32 values
off the correctly rounded result on an AMD EPYC; the smoke goldens recorded on an Intel Xeon differ from an AMD
run in every weight-decayed matrix after the first update, while every gradient agrees).  ``lerp_`` /
``addcmul_`` / ``addcdiv_`` are fused kernels that the AVX2 / AVX-512 builds contract into FMA, so they depend
on the ATen CPU capability too.

Here each kernel is one of ``*``, ``+``, ``-``, ``/`` (IEEE-754 correctly rounded on every conforming device,
and one operation per element leaves the compiler nothing to contract), and the square root is numpy's on the
CPU (the hardware ``sqrtss`` / ``sqrtps`` family, correctly rounded by IEEE-754 §5.4.1 on every x86-64 CPU) and
torch's on CUDA (``sqrtf`` is correctly rounded unless built with ``-use_fast_math``, which torch is not).  So
the update is a function of its inputs alone.

The arithmetic is Loshchilov & Hutter's AdamW (Algorithm 2, decoupled weight decay) with Adam's bias
correction (Kingma & Ba, Algorithm 1), the same formula as ``torch.optim.AdamW`` and Megatron's CPU fallback
(``megatron/core/optimizer/__init__.py`` takes ``torch.optim.AdamW`` without Transformer Engine / Apex):

    p   ← p · (1 − lr·wd)
    m   ← β1·m + (1 − β1)·g
    v   ← β2·v + (1 − β2)·g²
    p   ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)

The two differ from torch's in rounding only (torch forms m with ``lerp`` and the last line with
``addcdiv``), which the cross-implementation check reports as parameter ULPs, not as a failure.
"""
from __future__ import annotations

import collections
import math

import numpy as np
import torch


def sqrt_correctly_rounded(t: torch.Tensor) -> torch.Tensor:
    """Elementwise square root of `t` (any shape, fp32 or fp64), correctly rounded (IEEE-754 §5.4.1).

    CPU: numpy's ``np.sqrt`` on a zero-copy view (hardware square root); CUDA: ``torch.sqrt``.

    Raises:
        TypeError: `t` is not fp32 / fp64 (bf16 master weights do not exist here: masters are fp32).
    """
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sqrt_correctly_rounded: {t.dtype} (fp32 or fp64 only)")
    if t.device.type != "cpu":
        return torch.sqrt(t)
    src = t.detach().contiguous()
    return torch.from_numpy(np.sqrt(src.numpy()))


class AdamW:
    """AdamW over fp32 master weights, single tensor at a time (each parameter's update depends only on its
    own tensors).  State per parameter, as ``torch.optim.AdamW`` names it (checkpoints keep these names):
    ``step`` (0-dim fp32 tensor, steps taken), ``exp_avg`` and ``exp_avg_sq`` (the parameter's shape, fp32).

    ``param_groups`` and ``state`` are laid out as ``torch.optim.Optimizer``'s: `params` is an iterable of
    tensors or of dicts with ``params`` and overrides of the defaults; group keys ``lr``, ``betas`` (β1, β2),
    ``eps``, ``weight_decay`` (per group: 0 for norms); ``state[p]`` a dict, empty until p's first update.

    Why not derive from ``torch.optim.Optimizer``: this class uses nothing of it but those two containers, and its
    ``add_param_group`` imports ``torch._dynamo`` on first call (``torch._disable_dynamo``): ~2-4 s of CPU on 2
    cores in every rank, since the forkserver no longer preloads dynamo (`worker.deterministic_torch`).

    Raises:
        ValueError: a tensor in two param groups, or a group without ``params``.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups: list[dict] = []
        seen: set[int] = set()
        for i, group in enumerate(groups):
            if "params" not in group:
                raise ValueError(f"AdamW: param group {i} has no 'params'")
            tensors = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
            if any(id(p) in seen for p in tensors):
                raise ValueError(f"AdamW: param group {i} repeats a parameter of an earlier group")
            seen.update(id(p) for p in tensors)
            self.param_groups.append({**defaults, **group, "params": tensors})
        self.state: collections.defaultdict = collections.defaultdict(dict)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a ``.grad``.  The scalars (bias corrections, decay factor) are
        Python doubles formed by ``*``, ``-``, ``/`` and ``math.sqrt`` only, so the same on every machine; each
        enters a kernel as one fp32 value."""
        if closure is not None:
            raise ValueError("AdamW.step: closures are not supported")
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                _update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
                        lr, beta1, beta2, eps, wd)


def _update(p, g, m, v, t: int, lr: float, beta1: float, beta2: float, eps: float, wd: float) -> None:
    if wd != 0:
        p.mul_(1.0 - lr * wd)
    m.mul_(beta1).add_(torch.mul(g, 1.0 - beta1))
    v.mul_(beta2).add_(torch.mul(g, g).mul_(1.0 - beta2))
    step_size = lr / (1.0 - _power(beta1, t))
    denom = sqrt_correctly_rounded(v).div_(math.sqrt(1.0 - _power(beta2, t))).add_(eps)
    p.sub_(torch.mul(m, step_size).div_(denom))


def _power(beta: float, t: int) -> float:
    """beta ** t by repeated IEEE multiplication: libm's ``pow`` is not correctly rounded and picks its code by
    CPU feature (glibc's ifunc variants), so ``beta ** t`` is not certain to agree across machines."""
    out = 1.0
    for _ in range(t):
        out *= beta
    return out
