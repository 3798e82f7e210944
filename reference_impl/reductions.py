"""Every reduction whose operands depend on which rank holds what, in one place, in two modes.

``megatron`` mirrors Megatron-LM (megatron-semantics §2.6, §6):
  * word-embedding gradient: each holder (first stage; MTP stage) accumulates its own uses over the
    microbatch loop, then the holders' ``main_grad`` are all-reduced (``_allreduce_word_embedding_grads``).
    On P=1 the one embedding takes both lookups' gradients inside each microbatch's backward, so P=1 adds
    ``sum_mb (a_mb + b_mb)`` where P>1 adds ``sum_mb a_mb + sum_mb b_mb``: not bitwise equal for M > 1;
  * grad norm (``get_grad_norm_fp32``): per-rank fp32 L2 norm of the local non-replica grads, squared,
    all-reduced over all ranks, square root.  The per-rank partial sums depend on the layout, so
    the norm (and, when clipping triggers, every parameter) differs in the last bits between layouts.
    With expert parallelism each logical parameter is still counted once (the routed experts are disjoint
    over the EP ranks; the replicated rest counts on EP rank 0 only, its ``ep{r}`` copies are replicas),
    but the experts' partial sums move to other ranks, so the norm is not EP-invariant either (in Megatron,
    too, the per-rank partial norms depend on which EP rank holds which experts).

``canonical`` gives results independent of the layout by construction:
  * word-embedding gradient: the MTP lookups always accumulate into their own replica, also on P=1 (the
    chunk keeps a separate ``mtp_embedding``), and ``first + mtp`` is added once after the microbatch loop.
    Why: the association order of the embedding's gradient terms is then the same for every layout;
  * grad norm: every rank computes per-parameter sums of squares in float64, all ranks all-gather them, and
    each adds them sequentially in the canonical global parameter order (replicas counted once), then
    takes the square root in float64.  Why: the operands and their order no longer depend on placement,
    so the clip coefficient, and the clipped update, are bit-identical for every layout and every EP size
    (the canonical order keys of the experts are those of EP = 1, `train.RankState`).

Identical in both modes, because they are already layout-invariant here:
  * reported lm loss: ``sum_mb loss_sum / sum_mb num_tokens`` added left to right in microbatch order on the
    loss stage (the one place every microbatch's loss lives);
  * expert-bias token counts and the seq aux loss: each MoE layer lives on one pipeline rank and counts all
    microbatches locally, integer sums are exact.  With expert parallelism the router runs on every token
    on every EP rank (`model.expert_parallel`), so the counts are already complete and identical on each
    EP rank: no all-reduce (Megatron sums them over TP x DP x CP because its EP ranks see different data;
    here that sum would count every token EP times);
  * a two-member all-reduce (embedding group {first, MTP}) is ``a + b`` on both ranks: IEEE addition is
    commutative.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from trainerkit import names

from . import faults


class EmbeddingSync:
    """Sums the word-embedding ``main_grad`` over its holders once per step (after the microbatch loop).

    Built collectively on every rank (``new_group`` is collective).  Holders: the first stage's embedding and
    the MTP stage's replica; when both are on this rank (canonical P=1) the sum is local, ``first + mtp``.
    With expert parallelism each EP column (the pipeline of EP rank e: global ranks ``pp * EP + e``) has its
    own pair, ``{first * EP + e, mtp * EP + e}`` (Megatron's embedding group per data-parallel replica);
    every rank creates every column's group, in column order.  `pp_rank`: this rank's pipeline rank.
    """

    def __init__(self, layout, pp_rank: int, params, transport, inject: Optional[str] = None):
        self.transport, self.inject = transport, inject
        # keyed by the replica tag without its EP part: None (first stage) and "mtp"
        self.local = {names.base_replica(replica): p for _, name, replica, p, _ in params if name == names.EMBEDDING}
        self.group = None
        if layout.mtp_stage is not None:
            pps = sorted({layout.rank_of(layout.embedding_stage)[0], layout.rank_of(layout.mtp_stage)[0]})
            if len(pps) == 2:
                ep_size = getattr(transport, "expert_model_parallel_size", 1)
                ep_rank = getattr(transport, "ep_rank", 0)
                for e in range(ep_size):
                    group = dist.new_group([pp * ep_size + e for pp in pps])
                    if e == ep_rank and pp_rank in pps:
                        self.group = group

    @torch.no_grad()
    def __call__(self) -> None:
        if not faults.syncs_embedding_replica(self.inject):
            return
        if len(self.local) == 2:
            first, mtp = self.local[None], self.local["mtp"]
            first.main_grad.add_(mtp.main_grad)
            mtp.main_grad.copy_(first.main_grad)
        elif self.group is not None:
            (p,) = self.local.values()
            self.transport.all_reduce(p.main_grad, group=self.group)


def grad_norm(mode: str, params, transport, inject: Optional[str] = None) -> torch.Tensor:
    """Global L2 norm of the non-replica ``main_grad`` s of all ranks (collective: every rank calls it).
    Each logical parameter counts once: replicas (``@mtp``, the ``@ep{r}`` copies) are left out.

    params: this rank's (key, name, replica, param, order) tuples.  Returns fp32 (megatron) or fp64
    (canonical) scalar tensor, identical on every rank.  `inject`: a planted fault (`reference_impl.faults`).
    """
    counted = lambda replica: replica is None or faults.norm_counts_replicas(inject)  # noqa: E731
    local = [(order, key, p.main_grad) for key, _, replica, p, order in params if counted(replica)]
    if mode == "megatron":
        norms = [torch.linalg.vector_norm(g) for _, _, g in local]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=transport.device)
        total = norm ** 2
        transport.all_reduce(total)
        return total.sqrt()
    sums = [(order, key, float(g.double().pow(2).sum())) for order, key, g in local]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    total = 0.0
    for _, _, sq in sorted(x for part in gathered for x in part):
        total += sq
    return torch.tensor(math.sqrt(total), dtype=torch.float64, device=transport.device)


@torch.no_grad()
def clip(norm: torch.Tensor, clip_grad: float, params) -> tuple[torch.Tensor, bool]:
    """Megatron's ``clip_grad_norm``: ``coeff = clip_grad / (norm + 1e-6)``; scale every grad (replicas too)
    by it when it is below 1.  Returns (coeff, clipped)."""
    coeff = clip_grad / (norm + 1e-6)
    clipped = bool(coeff < 1.0)
    if clipped:
        scale = coeff.float()
        for *_, p, _ in params:
            p.main_grad.mul_(scale)
    return coeff, clipped


def reported_lm_loss(outs) -> Optional[torch.Tensor]:
    """Megatron's reported lm loss: ``sum_mb loss_sum / sum_mb num_tokens``, added left to right."""
    if not outs:
        return None
    loss_sum, tokens = outs[0].lm_loss_sum, outs[0].num_tokens
    for o in outs[1:]:
        loss_sum, tokens = loss_sum + o.lm_loss_sum, tokens + o.num_tokens
    return loss_sum / tokens.clamp(min=1)
