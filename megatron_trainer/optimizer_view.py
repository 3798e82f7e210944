"""What megatron's optimizer does with each parameter, read from the optimizer megatron built: the tensor it
updates (the parameter itself, its fp32 master in bf16 runs, or under the distributed optimizer this DP rank's
fp32 shard of it), whether it decays it, and which part of the parameter a distributed-optimizer rank owns.

The trainer traces what the optimizer updates (TRACE_FORMAT.md: ``params`` are the values after the step), so a
bf16 run's fingerprints are its fp32 masters' and a distributed-optimizer run's are partial records of the
shards, composed by the merge into the same fingerprint as the whole tensor (`trainerkit.fingerprint_shard`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainerkit import names
from trainerkit.fingerprint_shard import Shard
from trainerkit.names import OPTIMIZER_STATES


@dataclass(frozen=True)
class OwnedRange:
    """The part of a parameter a distributed-optimizer rank updates: elements ``start:end`` of the flattened
    parameter (megatron's ``DistributedOptimizer._get_model_param_range_map(param)["param"]``), and ``main``, the
    fp32 tensor [end - start] the optimizer steps (``shard_fp32_from_float16_groups`` for a bf16 parameter, for
    an fp32 one ``shard_fp32_groups``: a view of the parameter's own storage)."""

    start: int
    end: int
    main: torch.Tensor
    #: the global ranks that share out this parameter's ranges (the optimizer's ``data_parallel_group``: the whole
    #: DP or expert-DP group, or with ``num_distributed_optimizer_instances`` > 1 one instance of it)
    group: tuple = ()

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """The owned elements of a tensor shaped like the parameter (its ``main_grad``), flat [end - start]."""
        return whole.view(-1)[self.start:self.end]


def chained(optimizer) -> list:
    """The optimizers inside megatron's ``ChainedOptimizer`` (dense and expert parameters), or [optimizer]."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def owned_ranges(optimizer) -> dict:
    """{id(model param): `OwnedRange`} for every parameter of which megatron's distributed optimizer
    (``megatron/core/optimizer/distrib_optimizer.py``: the grad buffer split evenly over the DP group, each rank
    stepping the parameters' elements in its part) gives this rank a non-empty range; {} for megatron's other
    optimizers.  A parameter this rank owns none of is absent: another DP rank steps it."""
    out = {}
    for opt in chained(optimizer):
        if not hasattr(opt, "_get_model_param_range_map"):
            continue
        group = tuple(torch.distributed.get_process_group_ranks(opt.data_parallel_group))
        for models, mains in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                              (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(models, mains):
                for p, main in zip(model_group, main_group):
                    r = opt._get_model_param_range_map(p)["param"]
                    if r.end > r.start:
                        out[id(p)] = OwnedRange(int(r.start), int(r.end), main, group)
    return out


def is_distributed(optimizer) -> bool:
    """Whether megatron's `optimizer` (or one inside its ``ChainedOptimizer``) is the distributed optimizer: its
    ranks step ranges of the parameters, and a rank may own none of them (`owned_ranges` then empty)."""
    return any(hasattr(opt, "_get_model_param_range_map") for opt in chained(optimizer))


def master_params(optimizer, ranges: dict | None = None) -> dict:
    """{id(model param): the fp32 tensor megatron's optimizer steps for it} where that is not the parameter
    itself: the mixed-precision optimizer's fp32 master (bf16 runs, ``fp32_from_float16_groups``), the
    distributed optimizer's fp32 shard (`owned_ranges`, or `ranges` when the caller has them); empty for the
    plain fp32 optimizer."""
    out = {}
    for opt in chained(optimizer):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
            for p, main in zip(model_group, main_group):
                out[id(p)] = main
    out.update({k: r.main for k, r in (owned_ranges(optimizer) if ranges is None else ranges).items()})
    return out


def weight_decay_groups(optimizer) -> dict:
    """{id(what the optimizer steps): whether megatron's optimizer decays it}: the weight decay its parameter
    group actually applies (set by the OptimizerParamScheduler from the group's wd_mult)."""
    return {id(p): group["weight_decay"] > 0 for group in optimizer.param_groups for p in group["params"]}


def optimizer_view(optimizer, params: list, ranges: dict | None = None) -> tuple[dict, dict]:
    """What megatron's optimizer does with each of `params` (GlobalParam): ({id(param): what it steps} where that
    is not the parameter, `master_params`; {id(param): weight decay on}, from the group of what it steps,
    `weight_decay_groups`; a parameter no group holds — frozen in a user's model, or under the distributed
    optimizer owned by another DP rank — is not decayed here).  `ranges`: `owned_ranges`, when the caller has
    them."""
    masters = master_params(optimizer, ranges)
    decay = weight_decay_groups(optimizer)
    return masters, {id(gp.param): decay.get(id(masters.get(id(gp.param), gp.param)), False) for gp in params}


def _state_by_id(optimizer) -> dict:
    """{id(tensor stepped): its torch optimizer state} over megatron's (chained) optimizers."""
    state: dict = {}
    for opt in chained(optimizer):
        inner = getattr(opt, "optimizer", None)
        state.update({id(p): st for p, st in getattr(inner, "state", {}).items()})
    return state


def adam_states(optimizer, values: list) -> dict:
    """{"exp_avg" | "exp_avg_sq": [tensor per entry of `values`]}: Adam's moments of each tensor megatron's
    optimizer steps (`values`: the fp32 masters, ranges or parameters, as `master_params` names them), read from
    the torch optimizer inside each of megatron's optimizers (``.optimizer.state``, keyed by the tensor it
    steps); {} before the first step or for an optimizer without these states.

    Raises:
        KeyError: a tensor of `values` that has moments in none of them after a step (a frozen parameter
            would be absent from `values`)."""
    state = _state_by_id(optimizer)
    if not state or not all(name in st for st in state.values() for name in OPTIMIZER_STATES):
        return {}
    return {name: [state[id(v)][name] for v in values] for name in OPTIMIZER_STATES}


@dataclass
class Traced:
    """What a rank traces of the parameters megatron's optimizer steps: ``params`` (`model.GlobalParam`: every
    parameter, or under the distributed optimizer those this DP rank owns a range of, tagged by its optimizer
    instance, `_instance_replica`) with their trace ``keys``, ``masters`` ({id(param): what the optimizer steps}
    where that is not the parameter, `master_params`), ``decay`` ({id(param): weight decay on}) and ``ranges``
    ({id(param): `OwnedRange`}), ``sharded`` (the distributed optimizer: a rank traces its ranges only, and
    may own none).  The megatron trainer and the capture in Megatron-LM's own loop (`pretrain_hooks`) both trace
    through it."""

    params: list
    keys: list
    masters: dict
    decay: dict
    ranges: dict
    sharded: bool = False

    def values(self) -> list:
        """What the optimizer updates, per traced parameter: the fp32 master in bf16, the parameter itself in
        fp32, this rank's fp32 range under the distributed optimizer."""
        return [self.masters.get(id(gp.param), gp.param) for gp in self.params]

    def grads(self) -> list:
        """The gradients the optimizer steps with, per traced parameter: ``main_grad`` after
        ``finalize_model_grads``; under the distributed optimizer only this rank's range of it is reduced (the
        reduce-scatter), so only that range, flat."""
        return [self.ranges[id(gp.param)].of(gp.param.main_grad) if self.sharded else gp.param.main_grad
                for gp in self.params]

    def shards(self) -> list:
        """Where each traced tensor sits in its global parameter (`Shard`): the distributed optimizer's flat range
        (within this rank's TP slice of a TP-split parameter), the TP slice without it, None for a whole one."""
        return [_range_shard(gp, self.ranges[id(gp.param)]) if self.sharded else gp.shard for gp in self.params]

    def states(self, optimizer) -> dict:
        """Adam's moments of `values` (`adam_states`): {} before the first step."""
        return adam_states(optimizer, self.values())

    def loaded_states(self, optimizer) -> dict:
        """Adam's moments of `values` right after a checkpoint load, for the trace's ``resumed`` record: a tensor
        the optimizer holds no state for (a load that left it out, Megatron-LM's ``--no-load-optim``) has Adam's
        initial moments, zeros, so that the load is judged, not skipped."""
        state = _state_by_id(optimizer)
        return {name: [state.get(id(v), {}).get(name, torch.zeros_like(v)) for v in self.values()]
                for name in OPTIMIZER_STATES}


def _range_shard(gp, r: OwnedRange) -> Shard:
    """The `Shard` of the distributed optimizer's range `r` of `gp`: a flat range of the parameter, or of its
    tensor-parallel slice (`model.GlobalParam.shard`), which is what megatron's grad buffer holds."""
    if gp.shard is None:
        return Shard(tuple(gp.param.shape), None, r.start)
    tp = gp.shard
    return Shard(tp.global_shape, tp.dim, tp.offset, tp.slices(gp.param.shape[tp.dim]), (r.start, r.end))


def traced(optimizer, params: list) -> Traced:
    """`Traced` of this rank's `params` (`model.global_parameters`) under megatron's built `optimizer`.  Under the
    distributed optimizer each DP rank steps (and traces) its own range of a parameter under the key of the copy
    its optimizer instance holds; the merge adds the ranges' partial fingerprints up to that copy's."""
    ranges, sharded = owned_ranges(optimizer), is_distributed(optimizer)
    masters, decay = optimizer_view(optimizer, params, ranges)
    if sharded:
        params = [replace(gp, replica=_instance_replica(gp, ranges[id(gp.param)].group))
                  for gp in params if id(gp.param) in ranges]
    return Traced(params, [names.replica_key(gp.name, gp.replica) for gp in params], masters, decay, ranges, sharded)


def _instance_replica(gp, group: tuple) -> str | None:
    """The replica tag of a distributed-optimizer rank's range of `gp`, sharded over the global ranks `group`.
    The copies of a parameter are held by its DP group (routed experts: expert-DP); each optimizer group among
    them steps one whole copy.  One group (megatron's default): the parameter's own key, no @dp / @edp replica.
    Several (``num_distributed_optimizer_instances`` > 1; or a parameter megatron put in another group than its
    copies span, as megatron-core < 0.17 did with experts at TP > 1, ETP = 1, EP = 1): the copy whose group's
    first member is DP (expert-DP) rank d is tagged ``dp{d}`` (``edp{d}``) like plain DDP's replicas, and the
    harness checks that the copies stay equal."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    expert = names.expert_id(gp.name) is not None
    copies = dist.get_process_group_ranks(ps.get_expert_data_parallel_group() if expert
                                          else ps.get_data_parallel_group())
    first = min(copies.index(r) for r in group if r in copies)
    return names.ep_replica(names.base_replica(gp.replica), first, "edp" if expert else "dp")
