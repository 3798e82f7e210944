"""The reference's routed experts in grouped matrix products (reference_impl/model/grouped.py, ``torch._grouped_mm``)
give the bits of one expert at a time (the per-expert loop of `common.SwiGLUMLP` over `linear.Linear`): the output,
the input gradient and every expert's weight gradient, per dtype (fp32, bf16), device (CPU; CUDA where there is
one) and shape class (an expert with no rows, one row, many rows; sizes of the dsv3 cases and odd ones), with the
weight gradients delayed (`linear.delayed_wgrad`) too.  A grouping that hands rows to the wrong expert fails the
same comparison (planted)."""
from __future__ import annotations

import pytest
import torch

from reference_impl.model import grouped, linear
from reference_impl.model.common import SwiGLUMLP

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = {            # (hidden, ffn, rows per expert)
    "dsv3-small": (32, 16, [3, 0, 1, 12]),
    "dsv3": (64, 32, [17, 5, 0, 40, 1, 9, 0, 22]),
    "one-expert": (32, 16, [7]),
    "odd": (24, 40, [2, 9, 0, 5]),       # CUDA: not a multiple of 16 bytes in bf16 -> the loop, same bits anyway
}


def _experts(hidden: int, ffn: int, n: int, dtype, device, seed: int = 0) -> list:
    torch.manual_seed(seed)
    out = []
    for _ in range(n):
        e = SwiGLUMLP(hidden, ffn).to(device=device, dtype=dtype)
        with torch.no_grad():
            for p in e.parameters():
                p.normal_(0.0, 0.3)
        out.append(e)
    return out


def _run(fn, experts, x, g, delayed: bool):
    """(output, dx, [dW of every expert parameter]) of `fn` on fresh copies of `x`'s leaf."""
    for e in experts:
        e.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    if delayed:
        stash: list = []
        with linear.delayed_wgrad(stash):
            y.backward(g)
        linear.run_wgrad(stash)
    else:
        y.backward(g)
    return y.detach(), x.grad, [p.grad for e in experts for p in e.parameters()]


def _bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16 if a.element_size() == 2
                                                                            else torch.int32),
                                                                     b.view(torch.int16 if b.element_size() == 2
                                                                            else torch.int32))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm (the loop runs)")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("delayed", [False, True], ids=["wgrad", "delayed-wgrad"])
@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_grouped_experts_give_the_bits_of_the_loop(device, dtype, shape, delayed, counts_on):
    """Also with the counts as a device tensor (EP = 1's dispatch plan: no host read)."""
    hidden, ffn, counts = SHAPES[shape]
    experts = _experts(hidden, ffn, len(counts), dtype, device)
    x = torch.randn(sum(counts), hidden, device=device).to(dtype)
    g = torch.randn(sum(counts), hidden, device=device).to(dtype)
    given = counts if counts_on == "host" else torch.tensor(counts, device=device)
    loop = _run(lambda t: torch.cat([e(r) for e, r in zip(experts, t.split(counts))]), experts, x, g, delayed)
    mine = _run(lambda t: grouped.swiglu(t, given, experts), experts, x, g, delayed)
    assert _bits_equal(loop[0], mine[0]) and _bits_equal(loop[1], mine[1])
    assert all(_bits_equal(a, b) for a, b in zip(loop[2], mine[2]))


def test_the_path_is_a_function_of_the_model_and_the_device():
    experts = _experts(32, 16, 2, torch.float32, "cpu")
    assert grouped.use_grouped(torch.empty(3, 32), experts) == hasattr(torch, "_grouped_mm")
    assert not grouped.use_grouped(torch.empty(3, 32), [])
    assert not grouped.use_grouped(torch.empty(3, 32, dtype=torch.float64), experts)     # the fp64 oracle: the loop


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_rows_handed_to_the_wrong_expert_are_caught():
    """Planted: the counts of two experts swapped (the grouping's offsets wrong) - the comparison above fails."""
    hidden, ffn, counts = SHAPES["dsv3-small"]
    experts = _experts(hidden, ffn, len(counts), torch.float32, "cpu")
    x, g = torch.randn(sum(counts), hidden), torch.randn(sum(counts), hidden)
    loop = _run(lambda t: torch.cat([e(r) for e, r in zip(experts, t.split(counts))]), experts, x, g, False)
    wrong = [counts[1], counts[0]] + counts[2:]
    planted = _run(lambda t: grouped.swiglu(t, wrong, experts), experts, x, g, False)
    assert not _bits_equal(loop[0], planted[0])
