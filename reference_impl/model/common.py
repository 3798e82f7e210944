"""Small building blocks: RMSNorm, RoPE, SwiGLU MLP, the identity loss-injection node, `Fanout` and
`roll_left`."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .linear import Linear


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim.

    Input/output [..., h] in the params dtype; the normalisation runs in fp32 (as TE/Apex fused norms) and
    is cast back before the weight multiply.  Parameter ``weight`` [h] initialised to ones.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(seq_len: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE tables (Su et al. 2021) for positions 0..seq_len-1: cos, sin of shape [s, 1, 1, dim/2], fp32.

    The angles are megatron's bit for bit: ``RotaryEmbedding.__init__`` / ``get_freqs_non_repeated``
    (megatron/core/models/common/embeddings/rotary_pos_embedding.py, rotary_percent 1, no interpolation)
    build ``inv_freq = 1 / base**(arange(0, dim, 2) / dim)`` and ``outer(arange(s), inv_freq)`` in fp32, and
    ``rope_utils._apply_rotary_pos_emb_bshd`` takes cos/sin of them in fp32 before casting to the activation
    dtype.  Megatron's table is ``cat(freqs, freqs)`` [s, 1, 1, dim]; its two halves are the same numbers,
    so half of it is kept here (`apply_rope` uses it on both halves).  The tables are always computed on the
    CPU, so every device and layout gets the same bits; equal to megatron's on the CPU (tests/
    test_mla_convention.py), while megatron on a GPU gets CUDA's pow/cos/sin, which differ in last bits.

    The same unshifted table serves the decoder and the MTP layers (megatron-semantics §2.3 step 3).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's MLA RoPE on the last dim of x [s, b, n, d] with tables [s, 1, 1, d/2] in x's dtype.

    ``rope_utils._apply_rotary_pos_emb_bshd`` with ``multi_latent_attention=True, rotary_interleaved=False,
    mscale=1``: first de-interleave ``[x0, x1, x2, ...] -> [x0, x2, ... | x1, x3, ...]`` (so the rotated pairs
    are adjacent dims (x_2i, x_2i+1), as in DeepSeek-V3's own complex-number RoPE), then rotate-half:
    ``x * cos + [-x2 | x1] * sin``.  The output stays de-interleaved, as in megatron: q and k get the same
    permutation, so q.k is unchanged.
    Bitwise equal to megatron's ``t * cos + _rotate_half(t) * sin`` (``a - b == a + (-b)`` in IEEE).
    """
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020) as Megatron's MLP with gated_linear_unit: ``fc2(silu(gate) * up)``.

    ``linear_fc1.weight`` [2f, h] (gate rows first, then up), ``linear_fc2.weight`` [h, f]; no biases.
    Input [t, h] or [s, b, h]; output of the same leading shape.
    """

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.linear_fc1 = Linear(hidden, 2 * ffn)
        self.linear_fc2 = Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class LossAutoScaler(torch.autograd.Function):
    """Identity on `output` whose backward also seeds ``d loss = scale`` (Megatron's MTPLossAutoScaler /
    MoEAuxLossAutoScaler): an auxiliary loss enters the graph without being added to the main loss.

    forward(output [any], loss [scalar], scale: float) -> output unchanged.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


class Fanout(torch.autograd.Function):
    """n aliases of x for n consumers, whose gradients are summed in index order: ``((g0 + g1) + g2) ...``.

    Floating-point addition is commutative but not associative: a tensor with three or more gradient
    contributions gets bits that depend on the order in which the autograd engine happens to deliver them,
    and that order differs between one whole-chunk backward and a node-by-node one (the 1F1B overlap
    schedule, `model/plan.py`).  Routing every such tensor through a Fanout fixes the order on both paths.
    Consumers that produce no gradient are skipped (no zeros are added, so -0.0 stays -0.0).

    forward(x [any], n: int) -> tuple of n views of x.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g if total is None else total + g
        return total, None


def fanout(x: torch.Tensor, n: int) -> tuple:
    """`Fanout.apply` when x needs a gradient, else n times x."""
    return Fanout.apply(x, n) if x.requires_grad else (x,) * n


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """Megatron's ``roll_tensor(shifts=-1, dims=-1)``: shift left by one along the last dim, zero the tail."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out
