"""Expert parallelism (EP): the routed experts of every MoE layer split over the EP ranks of a pipeline rank.

Ranks and groups (Megatron's ``parallel_state.initialize_model_parallel`` with TP = CP = ETP = 1 and order
``tp-cp-ep-dp-pp``): world = P x EP, **global rank = pp_rank * EP + ep_rank**; the EP group of pipeline rank p
is ``{p*EP, ..., p*EP + EP-1}``, the pipeline group of EP rank e is ``{e, e+EP, e+2EP, ...}``.  EP rank r owns
the experts with global ids ``[r*E/EP, (r+1)*E/EP)`` (``RankGenerator``'s expert grid / ``MoELayer``'s
``local_expert_indices``); parameter names keep the global id (``...mlp.experts.{e}...``), so the init keyed
by name, checkpoints and traces are unchanged.

**Deliberate deviation from Megatron.**  In Megatron the EP ranks are data-parallel replicas fed different
microbatches (EP group == DP group), so the dense gradients are all-reduced and every expert GEMM mixes the
tokens of several DP ranks: never bitwise equal to EP = 1.  Here the EP ranks of one pipeline rank receive
the *same* microbatches and compute all non-expert work redundantly (attention, norms, router, shared
expert, dense layers, embedding, head, losses); only the routed experts are split.  Then EP = 1 and EP > 1
are bitwise equal by construction:

* the router runs on all tokens on every EP rank: the top-k index, the probs, the seq aux loss and the
  expert-bias token counts (``Router.tokens_per_expert``) are identical everywhere, so the bias update needs
  no all-reduce (Megatron sums the counts over TP x DP x CP in ``finalize_model_grads``; here that sum would
  count every token EP times);
* each EP rank dispatches a contiguous shard of the microbatch's tokens (``TakeShard``: rank r takes
  tokens ``[r*T/EP, (r+1)*T/EP)``; ``RepeatRows`` makes its K (token, k) rows, with a fixed-order backward
  sum), sorted by expert (stable, so ascending token order per expert); after the all-to-all an expert
  receives source 0's rows, then source 1's, ... (``sort_chunks``) = exactly the rows, in the order, of
  EP = 1, contiguous: the same GEMM operands, the same bits, forward and backward (the weight gradient sums
  the same rows in the same order; `grouped` multiplies all local experts at once with the loop's bits);
* combine returns each row to its source (the reverse all-to-all), weights it by the top-k probs in a fixed
  order, and ``GatherShards`` all-gathers the shards so every EP rank again holds the whole [T, h] output.

Every collective here moves bits without arithmetic, and each autograd Function's backward is the exact
transpose (a copy, never a sum): ``TakeShard``'s backward all-gathers the shard gradients, ``AllToAll``'s is
the reverse all-to-all, ``GatherShards``' takes this rank's slice of the (replicated) output gradient.  All EP
ranks of a row run the same action list and graphs, so they issue these collectives in the same order.

Mirrors ``megatron/core/transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher``
(``preprocess`` -> ``input_splits`` / ``output_splits`` / ``num_global_tokens_per_local_expert``,
``token_dispatch`` = ``all_to_all``, ``dispatch_postprocess`` / ``combine_preprocess`` =
``sort_chunks_by_idxs``, ``token_combine`` = the reverse ``all_to_all``), ``moe/moe_utils.py``
(``permute``, ``sort_chunks_by_idxs``) and ``tensor_parallel/mappings.py`` (``_AllToAll``,
``gather_from_sequence_parallel_region``).  Megatron obtains the split sizes with an all-gather of the
per-rank counts; here every EP rank already holds the whole routing, so it computes the [EP, E] count matrix
locally (no communication, identical on every rank).

Transport: ``all_to_all_single`` (uneven and zero splits) and ``all_gather`` on the EP group: between CPU ranks
forked on this host over `reference_impl.host_channel` sockets (gloo costs ~0.3-0.45 ms of CPU per such
collective, several times the expert GEMMs it serves), else torch.distributed (gloo; the list form
``dist.all_to_all`` is not implemented by gloo; NCCL with one GPU per rank); CUDA tensors are staged through
host memory when the ranks share GPUs, exactly like the pipeline transport.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import host_channel


class ExpertParallel:
    """The EP group of one rank: ``size`` (EP), ``rank`` (ep rank within the group), ``group`` (a
    ``torch.distributed`` group of the EP ranks of this pipeline rank; None when size is 1) and ``staged``
    (CUDA tensors go through host memory for gloo).  ``ExpertParallel()`` is EP = 1: every operation is
    the identity and no collective is issued."""

    def __init__(self, size: int = 1, rank: int = 0, group=None, staged: bool = False,
                 channel: Optional[host_channel.HostChannel] = None):
        if not 0 <= rank < size:
            raise ValueError(f"ep rank {rank} outside EP size {size}")
        self.size, self.rank, self.group, self.staged, self.channel = size, rank, group, staged, channel

    @classmethod
    def build(cls, pipeline_model_parallel_size: int, expert_model_parallel_size: int, global_rank: int,
              staged: bool = False, host_store=None, timeout_s: float = 300.0) -> "ExpertParallel":
        """This rank's EP group, collectively: every rank creates every EP row's group in the same order
        (``dist.new_group`` is collective over the world), as ``parallel_state`` does.  EP = 1 creates none.
        `host_store` (`transport.Transport.host_channel_store`): the group's ranks are on this host and connect
        a `host_channel.HostChannel` through it; None: torch.distributed's collectives."""
        ep = expert_model_parallel_size
        pp_rank, ep_rank = divmod(global_rank, ep)
        mine = None
        if ep > 1:
            for p in range(pipeline_model_parallel_size):
                group = dist.new_group(list(range(p * ep, (p + 1) * ep)))
                if p == pp_rank:
                    mine = group
        channel = None
        if host_store is not None and ep > 1:
            channel = host_channel.HostChannel.connect(host_store, f"bitparity/ep-channel/{pp_rank}", ep_rank, ep,
                                                       timeout_s)
        return cls(ep, ep_rank, mine, staged, channel)

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank owns: ``[rank*E/EP, (rank+1)*E/EP)``."""
        if num_experts % self.size:
            raise ValueError(f"num_moe_experts={num_experts} is not divisible by expert_model_parallel_size={self.size}")
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def __repr__(self) -> str:
        return f"ExpertParallel(size={self.size}, rank={self.rank})"

    # --- collectives on the EP group (copies only) -----------------------------------------------------
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.staged else t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """cat over the EP ranks (ep rank order) of every rank's equally shaped `t`, along dim 0."""
        src = self._host(t.contiguous())
        parts = [torch.empty_like(src) for _ in range(self.size)]
        if self.channel is not None:
            self.channel.all_gather(parts, src)
        else:
            dist.all_gather(parts, src, group=self.group)
        return torch.cat(parts).to(t.device)

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single``: rows ``in_splits[j]`` of `x` (in order) go to EP rank j; the result holds
        ``out_splits[i]`` rows from EP rank i, in ep rank order."""
        src = self._host(x.contiguous())
        out = src.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if self.channel is not None:
            self.channel.all_to_all_single(out, src, out_splits, in_splits)
        else:
            dist.all_to_all_single(out, src, out_splits, in_splits, group=self.group)
        return out.to(x.device)


def ep_size(ep: Optional[ExpertParallel]) -> int:
    """The EP group's size; None is EP = 1."""
    return 1 if ep is None else ep.size


class TakeShard(torch.autograd.Function):
    """x [T, ...] (identical on every EP rank) -> this rank's contiguous shard [T/EP, ...] (rows
    ``[r*T/EP, (r+1)*T/EP)``, a copy).  Backward: all-gather the shard gradients -> [T, ...], exact.
    (The shard selection of Megatron's sequence-parallel ``scatter_to_sequence_parallel_region``.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ep: ExpertParallel):
        ctx.ep = ep
        n = x.shape[0] // ep.size
        return x[ep.rank * n:(ep.rank + 1) * n].clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.ep.all_gather(g), None


class GatherShards(torch.autograd.Function):
    """x [n, ...] (this rank's shard) -> [EP*n, ...], the shards of all EP ranks in ep rank order (Megatron's
    ``gather_from_sequence_parallel_region``).  Backward: this rank's rows of the output gradient (a copy);
    everything downstream is computed identically on every EP rank, so the output gradient is too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ep: ExpertParallel):
        ctx.ep, ctx.n = ep, x.shape[0]
        return ep.all_gather(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        r, n = ctx.ep.rank, ctx.n
        return g[r * n:(r + 1) * n].clone(), None


class AllToAll(torch.autograd.Function):
    """Rows of x [sum(in_splits), h] to the EP ranks: ``in_splits[j]`` rows to rank j; returns
    [sum(out_splits), h], ``out_splits[i]`` rows from rank i (Megatron's ``mappings._AllToAll``).
    Backward: the reverse all-to-all of the gradient (splits swapped), exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: ExpertParallel):
        ctx.splits, ctx.ep = (out_splits, in_splits), ep
        return ep.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(g, in_splits, out_splits, ctx.ep), None, None, None


class RepeatRows(torch.autograd.Function):
    """x [n, h] -> [n*k, h] with row ``i*k + j`` = x[i] (the (token, k) rows before the permutation; Megatron's
    ``permute`` indexes the tokens by the routing map).  Backward: ``g[i*k] + g[i*k+1] + ...`` added left to
    right in j order, the same bits for every n (``expand``'s backward is a sum whose order is up to the
    reduction kernel, which may depend on the shape, and the shape is n = T/EP here)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int):
        ctx.k = k
        return x.repeat_interleave(k, dim=0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        k = ctx.k
        rows = g.view(-1, k, g.shape[-1])
        out = rows[:, 0].clone()
        for j in range(1, k):
            out = out + rows[:, j]
        return out, None


class PermuteRows(torch.autograd.Function):
    """x [n, ...] -> x[order] (``index_select`` by a permutation; Megatron's ``permute`` / ``unpermute``).
    Backward: ``g[inverse] + 0.0``, the same bits as autograd's own ``index_select`` backward (``zeros.index_add_(
    order, g)``: each row receives one term, ``0.0 + g``, which turns -0.0 into +0.0; adding 0.0 afterwards does the
    same, and NaN payloads come through alike) without its scatter, which on CUDA under deterministic algorithms is
    a sort-based ``index_put_`` of about 0.6 ms of host time per call (measured on an H200).

    order, inverse [n] int64: a permutation and its inverse (`DispatchPlan`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse).add_(0.0), None, None


def take_shard(x: torch.Tensor, ep: Optional[ExpertParallel]) -> torch.Tensor:
    """`TakeShard`, or `x` itself when EP = 1."""
    return x if ep_size(ep) == 1 else TakeShard.apply(x, ep)


def gather_shards(x: torch.Tensor, ep: Optional[ExpertParallel]) -> torch.Tensor:
    """`GatherShards`, or `x` itself when EP = 1."""
    return x if ep_size(ep) == 1 else GatherShards.apply(x, ep)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               ep: Optional[ExpertParallel]) -> torch.Tensor:
    """`AllToAll`, or `x` itself when EP = 1."""
    return x if ep_size(ep) == 1 else AllToAll.apply(x, out_splits, in_splits, ep)


@dataclass
class DispatchPlan:
    """Routing metadata of one microbatch on one EP rank (integers, no gradient; identical in structure on
    every EP rank).

    ``order`` [Ts*K] int64: stable argsort of this shard's (token, k) rows by expert id (the permutation);
    ``inverse`` [Ts*K] int64: its inverse permutation (the argsort of a permutation, unique: any sort gives it);
    ``counts`` [EP, E] int64: rows of source shard i routed to expert e (computed from the full routing, so
    every EP rank holds the same matrix: Megatron all-gathers it); ``in_splits``: rows this rank sends to each
    EP rank (its experts' share of ``counts[rank]``); ``out_splits``: rows this rank receives from each EP
    rank; ``local_counts`` [EP][E/EP]: rows from source i for local expert j (``num_global_tokens_per_local_expert``);
    ``shuffle_sources``: the planted fault ``ep_unsorted_dispatch`` (only ever True with EP > 1).

    With EP = 1 the splits are the one shard's T*K rows, known without the counts, and ``local_counts`` is read from
    the device only when something asks for it: the grouped experts take their group offsets from ``counts`` on
    the device (`grouped.swiglu`), so an EP = 1 MoE layer never waits for the device (on CUDA).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    in_splits: list
    out_splits: list
    shuffle_sources: bool = False
    _local: Optional[list] = None

    @property
    def local_counts(self) -> list:
        """[EP][E/EP] host integers (see the class); with EP = 1 read from ``counts`` on first use."""
        if self._local is None:
            self._local = self.counts.tolist()
        return self._local


def id_mask(index: torch.Tensor, num_ids: int) -> torch.Tensor:
    """index [..., m] int64 ids in [0, n) -> mask [..., m, n] bool, ``mask[..., i, d] = index[..., i] == d`` (a
    one-hot by comparison; ids outside [0, n) get an all-false row).

    Why not ``one_hot`` / ``bincount`` / ``zeros()[rows, index] = 1``: on CUDA each waits for the device at
    every MoE layer and microbatch (one_hot and bincount read the index's min and max back to the host; the
    indexed store with a row and an index tensor synchronised too, in torch 2.11's sync debug mode on an
    H200); a comparison does not.  Memory: m x n bools per leading index."""
    return index.unsqueeze(-1) == torch.arange(num_ids, device=index.device)


def expert_counts(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows routed to each expert: index [..., m] int64 expert ids in [0, E) -> counts [..., E] int64, counted
    over the last dim (``torch.bincount`` per row, Megatron's ``tokens_per_expert``).  Integer sums of
    `id_mask`, exact in any order, no host synchronisation."""
    return id_mask(index, num_experts).sum(-2)


def plan_dispatch(index: torch.Tensor, num_experts: int, ep: Optional[ExpertParallel],
                  shuffle_sources: bool = False) -> DispatchPlan:
    """`DispatchPlan` of this EP rank from the full top-k index [T, K] (identical on every EP rank).

    ``shuffle_sources`` is the planted fault ``ep_unsorted_dispatch`` (reference_impl.faults): the
    received chunks are ordered by source in reverse, which breaks the per-expert token order when EP > 1.
    """
    size, rank = ep_size(ep), (0 if ep is None else ep.rank)
    t, k = index.shape
    n = t // size
    per_src = index.reshape(size, n * k)
    counts = expert_counts(per_src, num_experts)                                               # [EP, E]
    order = torch.argsort(per_src[rank], stable=True)
    el = num_experts // size
    if size == 1:       # nothing to exchange: no split size is needed on the host
        return DispatchPlan(order=order, inverse=torch.argsort(order), counts=counts, in_splits=[n * k],
                            out_splits=[n * k])
    # the split sizes are host integers (tensor.split, all_to_all): one device-to-host read of the [EP, E]
    # counts, the rest is integer arithmetic on the host (on CUDA each read is a wait for the device)
    host = counts.tolist()
    local = [row[rank * el:(rank + 1) * el] for row in host]                                  # [EP][El]
    return DispatchPlan(order=order, inverse=torch.argsort(order), counts=counts,
                        in_splits=[sum(host[rank][j * el:(j + 1) * el]) for j in range(size)],
                        out_splits=[sum(row) for row in local], shuffle_sources=shuffle_sources, _local=local)


def sort_chunks(received: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list]:
    """Received rows in [source][local expert] order -> (rows [T, h] in [local expert][source] order: each local
    expert's rows contiguous, source 0's then source 1's, ...; rows per local expert) (``dispatch_postprocess``'s
    ``sort_chunks_by_idxs``), one fresh tensor."""
    sizes = [c for row in plan.local_counts for c in row]
    chunks = received.split(sizes)
    size, el = len(plan.local_counts), len(plan.local_counts[0])
    sources = list(range(size))
    if plan.shuffle_sources:
        sources.reverse()
    counts = [sum(plan.local_counts[i][j] for i in sources) for j in range(el)]
    return torch.cat([chunks[i * el + j] for j in range(el) for i in sources]), counts


def unsort_chunks(outputs: list[torch.Tensor], plan: DispatchPlan) -> torch.Tensor:
    """Per local expert outputs (rows by source) -> rows in [source][local expert] order, ready for the
    reverse all-to-all (``combine_preprocess``'s ``sort_chunks_by_idxs``)."""
    size = len(plan.local_counts)
    sources = list(range(size))
    if plan.shuffle_sources:
        sources.reverse()
    pieces = []
    for j, out in enumerate(outputs):
        parts = out.split([plan.local_counts[i][j] for i in sources])
        pieces.append(dict(zip(sources, parts)))
    return torch.cat([pieces[j][i] for i in range(size) for j in range(len(outputs))])
