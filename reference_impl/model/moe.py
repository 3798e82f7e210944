"""DeepSeek-V3 MoE: sigmoid router with expert bias and group-limited top-k, shared expert,
deterministic sort-based permute / unpermute.

Mirrors Megatron's ``moe_utils.topk_routing_with_score_function`` / ``group_limited_topk`` and the
aux-loss-free bias update of ``finalize_model_grads`` (megatron-semantics §9).  Determinism: every
reduction has a fixed order, ties in top-k go to the lower index (stable sorts), token dispatch is a
permutation (index_select with unique indices), and no scatter_add / atomics are used.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .common import LossAutoScaler, SwiGLUMLP


def _topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken by the lower index on every path (stable descending sort)."""
    values, index = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], index[..., :k]


class Router(nn.Module):
    """Sigmoid router.  ``weight`` [E, h]; buffers ``expert_bias`` [E] fp32 (selection only) and
    ``tokens_per_expert`` [E] int64 (accumulated over all microbatches of a step)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_moe_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_moe_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, h] -> (scores [t, E] with grad, topk index [t, K] int64, probs [t, K] with grad)."""
        cfg = self.cfg
        scores = torch.sigmoid(torch.matmul(x.float(), self.weight.float().t()))
        select = scores.detach() + self.expert_bias if cfg.moe_router_enable_expert_bias else scores.detach()
        t, e, g = select.shape[0], cfg.num_moe_experts, cfg.moe_router_num_groups
        per_group = cfg.moe_router_topk // cfg.moe_router_group_topk
        group_scores = _topk_stable(select.view(t, g, e // g), per_group)[0].sum(-1)
        _, groups = _topk_stable(group_scores, cfg.moe_router_group_topk)
        keep = torch.zeros(t, g, dtype=torch.bool, device=x.device)
        keep[torch.arange(t, device=x.device).unsqueeze(1), groups] = True
        masked = select.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
        _, index = _topk_stable(masked, cfg.moe_router_topk)
        probs = scores.gather(1, index)
        if cfg.moe_router_topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        probs = probs * cfg.moe_router_topk_scaling_factor
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(index.reshape(-1), minlength=e)
        return scores, index, probs

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): ``bias += rate * sign(mean(count) - count)``,
        once per step from the counts of all microbatches, then reset the counts."""
        counts = self.tokens_per_expert.float()
        if self.cfg.moe_router_enable_expert_bias:
            self.expert_bias += self.cfg.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()


def seq_aux_loss(scores: torch.Tensor, index: torch.Tensor, s: int, b: int, cfg: ModelConfig) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 §2.1.2, eqs. 17-20), averaged over the b sequences.

    scores [s*b, E] (rows in [s, b] order), index [s*b, K].  ``alpha * sum_i f_i P_i`` with
    ``f_i = E/(K s) * #tokens of the sequence routed to i`` and ``P_i = mean_t s_it / sum_j s_jt``.
    """
    e, k = cfg.num_moe_experts, cfg.moe_router_topk
    normed = (scores / (scores.sum(-1, keepdim=True) + 1e-20)).view(s, b, e)
    routed = torch.zeros(s * b, e, device=scores.device)
    routed[torch.arange(s * b, device=scores.device).unsqueeze(1), index] = 1.0
    f = routed.view(s, b, e).sum(0) * (e / (k * s))          # [b, E]
    p = normed.mean(0)                                         # [b, E]
    return (f * p).sum(-1).mean() * cfg.moe_aux_loss_coeff


class MoELayer(nn.Module):
    """Routed experts (global ids 0..E-1) + one shared expert.  x [s, b, h] -> [s, b, h].

    ``aux_loss_scale`` is the backward seed of the seq aux loss (1/num_microbatches, Megatron's
    MoEAuxLossAutoScaler scale); it is set by the executor before each step.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = nn.ModuleDict({str(e): SwiGLUMLP(cfg.hidden_size, cfg.moe_ffn_hidden_size)
                                      for e in range(cfg.num_moe_experts)})
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size)
        self.aux_loss_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        t, k = s * b, self.cfg.moe_router_topk
        tokens = x.reshape(t, h)
        scores, index, probs = self.router(tokens)
        # Permute: stable sort of the (token, k) pairs by expert id, so each expert sees its tokens in
        # ascending token order, independent of how experts are placed.
        flat_expert = index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.cfg.num_moe_experts).tolist()
        permuted = tokens.unsqueeze(1).expand(t, k, h).reshape(t * k, h).index_select(0, order)
        outputs = [self.experts[str(e)](chunk) for e, chunk in enumerate(permuted.split(counts))]
        # Unpermute with the inverse permutation (unique indices: an exact gather, exact backward).
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(t * k, device=x.device)
        routed = torch.cat(outputs).index_select(0, inverse).view(t, k, h)
        probs = probs.to(routed.dtype)             # Megatron casts the fp32 router probs to the activation dtype
        combined = routed[:, 0] * probs[:, 0:1]
        for j in range(1, k):                      # fixed-order sum over the top-k
            combined = combined + routed[:, j] * probs[:, j:j + 1]
        out = (combined + self.shared_experts(tokens)).view(s, b, h)
        if self.cfg.moe_aux_loss_coeff > 0:
            out = LossAutoScaler.apply(out, seq_aux_loss(scores, index, s, b, self.cfg), self.aux_loss_scale)
        return out
