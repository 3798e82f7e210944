"""The reference trainer's AdamW (reference_impl/optimizer.py): the same bits on every CPU by construction.

Pinned here without a second machine: every element equals an op-by-op numpy fp32 evaluation of the formula
whose square root is taken in fp64 and rounded once (correct for sqrt: 53 >= 2*24 + 2 bits, so the double
rounding is innocuous), i.e. the update is the correctly rounded sequence of IEEE operations and nothing else.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reference_impl.optimizer import AdamW, sqrt_correctly_rounded

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g, dtype=torch.float64)
    # many binades, subnormals and zero included: where an approximate square root is most often off
    e = torch.randint(-140, 60, (n,), generator=g).double()
    out = (x * torch.pow(2.0, e)).float()
    out[:4] = torch.tensor([0.0, 1e-45, 2.0, 4.0])
    return out


def test_square_root_is_correctly_rounded():
    v = _values(1 << 18, 0)
    want = v.double().sqrt().float()        # one rounding of the exact fp64 root
    got = sqrt_correctly_rounded(v)
    assert got.dtype == torch.float32 and got.shape == v.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.arithmetic_free
def test_square_root_refuses_reduced_precision():
    with pytest.raises(TypeError, match="bfloat16"):
        sqrt_correctly_rounded(torch.ones(3, dtype=torch.bfloat16))


def _numpy_adamw(p, g, steps, wd):
    """The formula op by op in numpy fp32 (each op one IEEE rounding), sqrt via fp64."""
    lr, (b1, b2), eps = HP["lr"], HP["betas"], HP["eps"]
    f = np.float32
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t in range(1, steps + 1):
        gt = g[t - 1]
        if wd:
            p = p * f(1.0 - lr * wd)
        m = m * f(b1) + gt * f(1.0 - b1)
        v = v * f(b2) + (gt * gt) * f(1.0 - b2)
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
        root = np.sqrt(v.astype(np.float64)).astype(np.float32)
        denom = root / f(math.sqrt(bc2)) + f(eps)
        p = p - (m * f(lr / bc1)) / denom
    return p


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_update_is_the_ieee_sequence_of_the_formula(wd):
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(64, 48, generator=gen) * 0.02
    grads = [torch.randn(64, 48, generator=gen) * 10.0 ** float(-k) for k in (3, 5, 2)]
    grads[1][:8] = 0.0                          # rows that see no token: m, v stay 0, denom = eps
    p = torch.nn.Parameter(p0.clone())
    opt = AdamW([{"params": [p], "weight_decay": wd}], **HP)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _numpy_adamw(p0.numpy(), [g.numpy() for g in grads], len(grads), wd)
    assert np.array_equal(p.detach().numpy().view(np.int32), want.view(np.int32))
    assert int(opt.state[p]["step"]) == len(grads)


def test_it_is_adamw():
    """Up to rounding, the same update as torch.optim.AdamW (the formula, not a look-alike)."""
    gen = torch.Generator().manual_seed(2)
    p0, g = torch.randn(300, generator=gen), torch.randn(300, generator=gen) * 1e-2
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    a = AdamW([ours], weight_decay=0.1, **HP)
    b = torch.optim.AdamW([theirs], weight_decay=0.1, foreach=False, fused=False, **HP)
    for _ in range(3):
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    assert not torch.equal(ours, p0)


@pytest.mark.arithmetic_free
def test_param_groups_and_state_are_laid_out_as_torch_optims():
    """What the trainer, the checkpoint and the capture read: groups with the defaults filled in and a group's own
    values kept, tensors or groups accepted, ``state`` empty per parameter until its first update."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = AdamW([{"params": [a], "weight_decay": 0.1}, {"params": b}], **HP)
    assert [g["params"] for g in opt.param_groups] == [[a], [b]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == HP["lr"] and g["betas"] == HP["betas"] for g in opt.param_groups)
    assert opt.state[a] == {} and a in opt.state
    assert AdamW([a, b], **HP).param_groups[0]["params"] == [a, b]
    with pytest.raises(ValueError, match="group 1 repeats a parameter"):
        AdamW([{"params": [a, b]}, {"params": [b]}], **HP)
    with pytest.raises(ValueError, match="group 0 has no 'params'"):
        AdamW([{"lr": 1.0}], **HP)
