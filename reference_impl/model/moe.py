"""DeepSeek-V3 MoE: sigmoid router with expert bias and group-limited top-k, shared expert,
deterministic sort-based permute / unpermute.

Mirrors Megatron's ``moe_utils.topk_routing_with_score_function`` / ``group_limited_topk`` and the
aux-loss-free bias update of ``finalize_model_grads`` (megatron-semantics §9).  Determinism: every
reduction has a fixed order, ties in top-k go to the lower index (stable sorts), token dispatch is a
permutation (index_select with unique indices), and no scatter_add / atomics are used.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainerkit.config import ModelConfig

from . import grouped
from .common import LossAutoScaler, SwiGLUMLP, fanout
from .expert_parallel import (
    ExpertParallel,
    PermuteRows,
    RepeatRows,
    all_to_all,
    ep_size,
    expert_counts,
    gather_shards,
    id_mask,
    plan_dispatch,
    sort_chunks,
    take_shard,
    unsort_chunks,
)


def _sort_stable(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending sort along the last dim, equal values in ascending index order (stable), so the top-k of
    any prefix breaks ties by the lower index on every path.  (Megatron uses ``torch.topk``, whose tie order is
    unspecified: on CPU it does not prefer the lower index.)"""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken by the lower index on every path (stable descending sort)."""
    values, index = _sort_stable(x)
    return values[..., :k], index[..., :k]


def boundary_ties(sorted_values: torch.Tensor, k: int) -> torch.Tensor:
    """Number of rows (int64 scalar) whose top-k *set* a tie decides: the k-th and (k+1)-th largest values are
    equal, so the tie-break alone picks which of them is selected.

    sorted_values [t, n], each row in descending order (`_sort_stable`); 1 <= k.  k >= n: there is no (k+1)-th
    value, so no row can tie (0).  Ties among the top k (or among the rest) are not counted: they change only the
    order of the selected ones, never the set.  (That order reaches the bits only through the fixed-order top-K
    combine sum, and only for K > 2: a sum of two terms commutes.)"""
    if k >= sorted_values.shape[-1]:
        return torch.zeros((), dtype=torch.int64, device=sorted_values.device)
    return (sorted_values[..., k - 1] == sorted_values[..., k]).sum()


def group_limited_topk(select: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-K selection (DeepSeek-V3 §2.1.2, eq. 16 with the node limit; Megatron
    ``moe_utils.group_limited_topk``, called from ``topk_routing_with_score_function``).

    select [t, E] fp32 (the selection scores: sigmoid scores + expert bias) -> (index [t, K] int64, the selected
    experts in descending score order; ties [2] int64 = [tokens tied at the top-K boundary, tokens tied at the
    group boundary], `boundary_ties`).  Group score = sum of the top-(K/group_topk) selection scores of each of
    the G groups (E/G consecutive experts); keep the top group_topk groups; top-K of the selection scores with
    the other groups' experts at -inf.  Ties go to the lower group / expert index (stable sorts), on every path.
    The tie counts are read from the sorted values the selection used: no selected bit depends on them."""
    t, e, g = select.shape[0], cfg.num_moe_experts, cfg.moe_router_num_groups
    per_group = cfg.moe_router_topk // cfg.moe_router_group_topk
    group_scores = _topk_stable(select.view(t, g, e // g), per_group)[0].sum(-1)          # [t, G]
    group_sorted, group_order = _sort_stable(group_scores)                                 # [t, G] each
    keep = id_mask(group_order[:, :cfg.moe_router_group_topk], g).any(-2)                  # [t, G]
    masked = select.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
    masked_sorted, order = _sort_stable(masked)                                             # [t, E] each
    ties = torch.stack([boundary_ties(masked_sorted, cfg.moe_router_topk),
                        boundary_ties(group_sorted, cfg.moe_router_group_topk)])
    return order[:, :cfg.moe_router_topk], ties


class Router(nn.Module):
    """Sigmoid router.  ``weight`` [E, h]; buffers ``expert_bias`` [E] fp32 (selection only),
    ``tokens_per_expert`` [E] int64 (accumulated over all microbatches of a step) and ``tied_tokens`` [2]
    int64 (tokens whose selection a tie decided: [top-k boundary, group boundary], accumulated over the
    microbatches of a step; `take_ties` reads and resets it).  ``tied_tokens`` is a diagnostic: it is not
    persistent (not in ``state_dict``), not fingerprinted, and no computed bit depends on it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_moe_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_moe_experts, dtype=torch.int64))
        self.register_buffer("tied_tokens", torch.zeros(2, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, h] -> (scores [t, E] fp32 with grad, top-k expert index [t, K] int64, probs [t, K] fp32)."""
        scores, index = self.route(x)
        return scores, index, self.probs(scores, index)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, h] -> (scores [t, E] fp32 with grad, top-k expert index [t, K] int64); counts the tokens per
        expert for the bias update and the tokens whose selection a tie decided (``tied_tokens``).  The
        selection is `group_limited_topk` on ``scores + expert_bias`` (detached: the bias only selects).  The
        routing weights come from `probs`, a separate step so the scores can be fanned out to it and to the
        aux loss."""
        cfg = self.cfg
        scores = torch.sigmoid(torch.matmul(x.float(), self.weight.float().t()))
        select = scores.detach() + self.expert_bias if cfg.moe_router_enable_expert_bias else scores.detach()
        index, ties = group_limited_topk(select, cfg)
        with torch.no_grad():
            self.tokens_per_expert += expert_counts(index.reshape(-1), cfg.num_moe_experts)
            self.tied_tokens += ties
        return scores, index

    def take_ties(self) -> dict[str, int]:
        """``{"topk": n, "group": n}``: the tokens since the last call whose top-K expert set / kept-group set a
        tie decided (`boundary_ties`), summed over microbatches; resets the counts (called once per step)."""
        topk, group = self.tied_tokens.tolist()
        self.tied_tokens.zero_()
        return {"topk": topk, "group": group}

    def probs(self, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Top-k routing weights [t, K] fp32: the selected scores, normalised over the K (if K > 1) and
        scaled by ``moe_router_topk_scaling_factor``."""
        probs = scores.gather(1, index)
        if self.cfg.moe_router_topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        return probs * self.cfg.moe_router_topk_scaling_factor

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): ``bias += rate * sign(mean(count) - count)``,
        once per step from the counts of all microbatches, then reset the counts."""
        counts = self.tokens_per_expert.float()
        if self.cfg.moe_router_enable_expert_bias:
            self.expert_bias += self.cfg.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()


def seq_aux_loss(scores: torch.Tensor, s: int, b: int, cfg: ModelConfig) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 §2.1.2, eqs. 17-20), averaged over the b sequences.

    scores [s*b, E] (rows in [s, b] order).  ``alpha * sum_i f_i P_i`` with ``f_i = E/(K s) * #tokens of the
    sequence whose top-K of the normalised scores s'_t contains i`` (eq. 18: the plain top-K of the affinities,
    without the expert bias and without the group limit that the routing uses; Megatron's
    ``moe_utils.compute_routing_scores_for_aux_loss``) and ``P_i = mean_t s'_it``.  Ties go to the lower index.
    (Counting the routed experts instead, biased and group-limited, differs from Megatron by millions of ULP
    in the router gradients once the group limit bites: found by the cross-implementation check.)
    """
    e, k = cfg.num_moe_experts, cfg.moe_router_topk
    normed_rows = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    normed = normed_rows.view(s, b, e)
    _, index = _topk_stable(normed_rows.detach(), k)
    routed = id_mask(index, e).any(-2).float()                # [s*b, E]: 1.0 where routed, else +0.0
    f = routed.view(s, b, e).sum(0) * (e / (k * s))          # [b, E]
    p = normed.mean(0)                                         # [b, E]
    return (f * p).sum(-1).mean() * cfg.moe_aux_loss_coeff


class MoELayer(nn.Module):
    """Routed experts (global ids 0..E-1) + one shared expert.  x [s, b, h] -> [s, b, h].

    The forward is four steps, the nodes of Megatron's 1F1B overlap schedule
    (``models/gpt/fine_grained_callables.py``): `pre_dispatch` (router, aux loss, shared expert, permute),
    `dispatch` (the expert-parallel all-to-all; nothing with EP=1), `experts_compute` (each local expert on
    its tokens) and `combine` (the reverse all-to-all, un-permute, top-k weighted sum, all-gather of the
    EP shards, + shared).  They pass tensors in a state dict (keys ``moe.*``); `forward` runs them back to
    back.  ``aux_loss_scale`` is the backward seed of the seq aux loss (1/num_microbatches, Megatron's
    MoEAuxLossAutoScaler scale), set before each step.

    Expert parallelism (`expert_parallel.ExpertParallel`, ``ep``; None = EP 1): only the local experts
    ``experts.{e}`` (global ids ``[r*E/EP, (r+1)*E/EP)``) exist; everything else is computed redundantly on
    every EP rank, and each EP rank dispatches its contiguous shard of the tokens (bitwise equal to EP 1, see
    `expert_parallel`).  `set_expert_parallel` switches a layer built for EP 1 to an EP group.
    """

    def __init__(self, cfg: ModelConfig, ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.cfg = cfg
        self.ep = ep
        self.router = Router(cfg)
        local = range(cfg.num_moe_experts) if ep is None else ep.local_experts(cfg.num_moe_experts)
        self.experts = nn.ModuleDict({str(e): SwiGLUMLP(cfg.hidden_size, cfg.moe_ffn_hidden_size) for e in local})
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size)
        self.aux_loss_scale = 1.0
        self.unsorted_dispatch = False       # planted fault ep_unsorted_dispatch (reference_impl.faults)

    def set_expert_parallel(self, ep: Optional[ExpertParallel], unsorted_dispatch: bool = False) -> None:
        """Use EP group `ep` (None: EP 1): drop the experts other EP ranks own.  `unsorted_dispatch` plants
        the fault ``ep_unsorted_dispatch``."""
        self.ep, self.unsorted_dispatch = ep, unsorted_dispatch
        keep = {str(e) for e in (range(self.cfg.num_moe_experts) if ep is None
                                 else ep.local_experts(self.cfg.num_moe_experts))}
        missing = keep - set(self.experts)
        if missing:
            raise ValueError(f"experts {sorted(missing, key=int)} are not built in this layer")
        for e in [e for e in self.experts if e not in keep]:
            del self.experts[e]

    def pre_dispatch(self, st: dict, x: torch.Tensor) -> None:
        """x [s, b, h] (the pre-MLP-normed hidden) -> st: ``moe.permuted`` [n·K, h] (the (token, k) rows of
        this EP rank's token shard, n = s·b/EP, sorted by expert id, stable: each expert sees its tokens in
        ascending token order, independent of where experts live), ``moe.probs`` [n, K] fp32 (the shard's
        rows of the top-k weights, carrying the aux loss, as Megatron attaches it in the router),
        ``moe.shared`` [s·b, h], ``moe.meta`` (s, b, `expert_parallel.DispatchPlan`).  The router, the aux
        loss and the shared expert see all s·b tokens on every EP rank."""
        s, b, h = x.shape
        t, k = s * b, self.cfg.moe_router_topk
        to_router, to_shared, to_permute = fanout(x.reshape(t, h), 3)
        scores, index = self.router.route(to_router)
        if self.cfg.moe_aux_loss_coeff > 0:
            to_probs, to_aux = fanout(scores, 2)
            probs = self.router.probs(to_probs, index)
            probs = LossAutoScaler.apply(probs, seq_aux_loss(to_aux, s, b, self.cfg), self.aux_loss_scale)
        else:
            probs = self.router.probs(scores, index)
        plan = plan_dispatch(index, self.cfg.num_moe_experts, self.ep, self.unsorted_dispatch)
        tokens = take_shard(to_permute, self.ep)                       # [n, h]
        st["moe.shared"] = self.shared_experts(to_shared)
        st["moe.permuted"] = PermuteRows.apply(RepeatRows.apply(tokens, k), plan.order, plan.inverse)
        st["moe.probs"] = take_shard(probs, self.ep)
        st["moe.meta"] = (s, b, plan)

    def dispatch(self, st: dict) -> None:
        """Expert-parallel token all-to-all (Megatron's ``token_dispatch``): ``moe.permuted`` becomes the rows
        this EP rank's experts receive, [source][local expert] order.  EP = 1: nothing to send."""
        plan = st["moe.meta"][2]
        st["moe.permuted"] = all_to_all(st["moe.permuted"], plan.out_splits, plan.in_splits, self.ep)

    def experts_compute(self, st: dict) -> None:
        """``moe.permuted`` -> ``moe.expert_out`` (same rows, same order): each local expert on its rows, source
        0's then source 1's ... (= EP 1's rows in EP 1's order), all local experts in grouped matrix products
        (`grouped.swiglu`: the bits of one expert at a time).  EP = 1: the permuted rows as they are, the group
        sizes from the plan's device counts (no host read)."""
        plan = st["moe.meta"][2]
        if ep_size(self.ep) == 1:
            # one source: the rows are already in expert order and the counts stay on the device
            experts = [self.experts[str(e)] for e in range(self.cfg.num_moe_experts)]
            st["moe.expert_out"] = grouped.swiglu(st.pop("moe.permuted"), plan.counts[0], experts)
            return
        rows, counts = sort_chunks(st.pop("moe.permuted"), plan)
        first = self.ep.local_experts(self.cfg.num_moe_experts).start
        out = grouped.swiglu(rows, counts, [self.experts[str(first + j)] for j in range(len(counts))])
        st["moe.expert_out"] = unsort_chunks(out.split(counts), plan)

    def combine(self, st: dict) -> torch.Tensor:
        """The reverse all-to-all (Megatron's ``token_combine``), un-permute ``moe.expert_out`` (the inverse
        permutation: an exact gather with an exact backward), weight by the top-k probs in a fixed order,
        all-gather the EP shards, add the shared expert; returns [s, b, h]."""
        s, b, plan = st.pop("moe.meta")
        k, h = self.cfg.moe_router_topk, self.cfg.hidden_size
        rows = all_to_all(st.pop("moe.expert_out"), plan.in_splits, plan.out_splits, self.ep)
        routed = PermuteRows.apply(rows, plan.inverse, plan.order).view(-1, k, h)
        probs = st.pop("moe.probs").to(routed.dtype)    # Megatron casts the fp32 router probs to the activation dtype
        combined = routed[:, 0] * probs[:, 0:1]
        for j in range(1, k):                      # fixed-order sum over the top-k
            combined = combined + routed[:, j] * probs[:, j:j + 1]
        return (gather_shards(combined, self.ep) + st.pop("moe.shared")).view(s, b, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st: dict = {}
        self.pre_dispatch(st, x)
        self.dispatch(st)
        self.experts_compute(st)
        return self.combine(st)
