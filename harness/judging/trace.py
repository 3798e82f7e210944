"""Merge the per-rank JSONL traces of one run into one canonical, layout-independent trace.

Input: ``rank{r}.jsonl`` in format ``bitparity-rank-trace/2`` (documented in `trainerkit.capture`).
Output (`Trace`, saved as ``trace.json``): parameters keyed by global name (``name@replica`` for replicas),
ordered canonically (embedding, decoder layers by global id, final norm, MTP depths, head; within a layer in
module order), with per-step losses, grad norm, grad / param / buffer fingerprints and router tie counts.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from trainerkit import names
from trainerkit.config import ranks_per_stage
from trainerkit.names import OPTIMIZER_STATES

RANK_FORMAT = "bitparity-rank-trace/2"
FORMAT = "bitparity-trace/2"


class TraceError(Exception):
    """A rank trace is missing, truncated, or inconsistent with the others."""


@dataclass
class StepTrace:
    """One training step of a merged run: losses per microbatch, grad norm and clip coefficient, the
    fingerprints of every gradient, parameter, buffer and (capture: activations) in-step tensor, and the router
    tie counts (a diagnostic, not compared)."""

    step: int
    losses: list = field(default_factory=list)       # per microbatch: {microbatch, lm, mtp, num_tokens}
    lm_loss: Optional[dict] = None                   # {hex, value}
    grad_norm: Optional[dict] = None
    clip_coeff: Optional[dict] = None
    clipped: Optional[bool] = None                   # clipping triggered (coeff < 1); None when off
    grads: dict = field(default_factory=dict)        # key -> fingerprint hex
    params: dict = field(default_factory=dict)
    # Adam's moments after the update, key -> fingerprint ({} in a trace written before they were traced)
    exp_avg: dict = field(default_factory=dict)
    exp_avg_sq: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    time_s: dict = field(default_factory=dict)       # rank -> seconds
    cpu_s: dict = field(default_factory=dict)        # rank -> CPU seconds of its process (None: not recorded)
    activations: dict = field(default_factory=dict)  # "<mb>/<global key>" -> fingerprint (capture: activations)
    boundaries: dict = field(default_factory=dict)   # "<F|B>/<sender stage>/<mb>/<send|recv>" -> fingerprint
    # router global name -> {"topk": n, "group": n}: tokens of the step whose selection a tie decided (optional
    # in the rank trace: {} for trainers that do not record it, e.g. megatron-core)
    router_ties: dict = field(default_factory=dict)
    # measured compute actions per pp rank (EP rank 0's): {"<pp rank>": [{op, stage, microbatch, start_s, end_s}]};
    # {} when the trainer records none (megatron-core; CUDA)
    actions: dict = field(default_factory=dict)
    # megatron's MoE 1F1B overlap, per global rank: {"<rank>": {merged, forward_only, backward_only,
    # backward_dw}} (megatron_trainer/coverage.py); {} when the run has no overlap
    overlap: dict = field(default_factory=dict)


@dataclass
class Trace:
    """A merged, layout-independent run trace (``bitparity-trace/2``, see TRACE_FORMAT.md)."""

    format: str
    params: dict                                     # key -> {name, replica, shape, dtype, family, ...}
    order: list                                      # keys in canonical order
    init: dict                                       # key -> fingerprint of the initial value
    steps: list                                      # [StepTrace]
    world_size: int
    expert_model_parallel_size: int = 1              # EP
    data_parallel_size: int = 1                      # DP (megatron-core); world_size = P x max(TP x DP, EP)
    tensor_model_parallel_size: int = 1              # TP (megatron-core)
    # per resume from a checkpoint, in step order: what the run loaded before its next step ({step: the
    # checkpoint's step, params, exp_avg, exp_avg_sq, buffers: key -> fingerprint}); [] for a run never resumed
    resumed: list = field(default_factory=list)

    @property
    def pipeline_model_parallel_size(self) -> int:
        """P, from the world size and the other parallel sizes (`trainerkit.config.ParallelConfig.world_size`)."""
        return self.world_size // ranks_per_stage(self.tensor_model_parallel_size, self.data_parallel_size,
                                                  self.expert_model_parallel_size)

    def shapes(self) -> dict:
        """{key: global shape} of the parameters (what a sharded run's dumps are put together into)."""
        return {k: meta["shape"] for k, meta in self.params.items()}

    def save(self, path: Path) -> None:
        """Write as JSON (``trace.json``)."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "Trace":
        """Read a ``trace.json`` written by `save`."""
        raw = json.loads(path.read_text())
        raw["steps"] = [StepTrace(**s) for s in raw["steps"]]
        return cls(**raw)


_TYPES = ("header", "init", "resumed", "step", "end")


def _record(path: Path, n: int, line: str) -> dict:
    """Line `n` of a rank trace as its record: a JSON object of a known ``type``, a step record with an int
    ``step`` and mappings of fingerprints; else a TraceError naming the file and line."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise TraceError(f"{path}:{n}: not JSON ({e.msg}; a cut-off or corrupted trace)") from None
    if not isinstance(rec, dict) or rec.get("type") not in _TYPES:
        raise TraceError(f"{path}:{n}: not a trace record (a JSON object with type {'/'.join(_TYPES)})")
    if rec["type"] in ("step", "resumed") and (not isinstance(rec.get("step"), int) or not all(
            isinstance(rec.get(k, {}), dict) for k in ("grads", "params", "buffers", *OPTIMIZER_STATES))):
        raise TraceError(f"{path}:{n}: malformed step record (step number or fingerprint maps)")
    return rec


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        raise TraceError(f"missing rank trace {path}")
    with path.open(encoding="utf-8", errors="replace") as f:
        records = [_record(path, n, line) for n, line in enumerate(f, start=1) if line.strip()]
    if not records or records[0].get("type") != "header" or records[0].get("format") != RANK_FORMAT:
        raise TraceError(f"{path}: not a {RANK_FORMAT} trace")
    if records[-1].get("type") != "end":
        raise TraceError(f"{path}: truncated (no end record)")
    return records


def _same(rank: int, header: dict, step: int, what: str, ours, theirs) -> None:
    """An EP replica rank's record must equal EP rank 0's (they compute the same tensors)."""
    if ours != theirs:
        raise TraceError(f"rank {rank} (pp rank {header.get('pp_rank')}, ep rank {header.get('ep_rank')}): {what} "
                         f"at step {step} differs from ep rank 0's copy (expert-parallel replicas must compute "
                         "identically)")


def _router_order(router: str) -> tuple:
    """Canonical order of a router global name (``decoder.layers.1.mlp.router``): its weight's order key; a name
    the canonical naming does not know sorts after the known ones, by name."""
    try:
        return (0, names.order_key(router + ".weight"), "")
    except ValueError:
        return (1, (), router)


def _align_actions(actions: dict) -> None:
    """Measured action times are one host's monotonic clock in every rank: make them seconds from the step's
    first compute action on any rank, so the ranks line up."""
    starts = [a["start_s"] for items in actions.values() for a in items]
    t0 = min(starts, default=0.0)
    for items in actions.values():
        for a in items:
            a["start_s"], a["end_s"] = a["start_s"] - t0, a["end_s"] - t0


def merge(run_dir: Path, world_size: int) -> Trace:
    """Read ``rank0..rank{world_size-1}.jsonl`` from `run_dir` and merge them.

    Expert parallelism (world = P x EP, global rank = pp_rank * EP + ep_rank): the ranks of EP rank > 0
    trace their own experts under the global names and their copies of everything else under replica keys
    (``name@ep1``, checked by `harness.judging.compare.replica_status`); their losses, buffers (expert bias), grad
    norm, activations, boundary fingerprints and router tie counts must equal EP rank 0's, else the merge
    fails naming the rank (they never overwrite EP rank 0's records silently).  ``router_ties`` (optional) is
    merged by router name like the buffers: each router lives on one pipeline rank.

    Data parallelism (megatron-core, world = P x DP, global rank = pp_rank * DP + dp_rank): DP rank d trains
    its own microbatches, so the loss rank of each DP rank adds its ``losses`` (keyed by global microbatch
    ``m * DP + d``; the merged list is in global microbatch order; the reported ``lm_loss``, over the global
    batch, must be the same on every DP rank); its
    dense parameters are ``@dp{d}`` replicas (routed experts ``@edp{k}`` on expert-data-parallel rank k), and
    its buffers, grad norm and clip coefficient must equal DP rank 0's like an EP replica's.

    Sharded tensors (TRACE_FORMAT.md "Sharded tensors"): a key that several ranks declare with a ``shard`` has
    a partial fingerprint record on each; their sum is the whole tensor's fingerprint (`_combine_shards`).

    Raises:
        TraceError: a rank trace is missing, truncated or corrupted (a line that is not a trace record, named by
            file:line), two ranks hold the same unsharded key, a sharded key's partials do not tile it, an EP or DP replica's
            records differ from EP / DP rank 0's, or the ranks disagree on the number of steps.
    """
    params, owner, init, steps = {}, {}, {}, {}
    resumed: dict = {}
    partials: dict = {}         # (step | "init", part, key) -> a sharded tensor's partial records, all ranks
    ep_size = dp_size = tp_size = 1
    for rank in range(world_size):
        records = _read(run_dir / f"rank{rank}.jsonl")
        header = records[0]
        ep_size = header.get("expert_model_parallel_size", 1)
        dp_size = header.get("data_parallel_size", 1)
        tp_size = header.get("tensor_model_parallel_size", 1)
        own_data = header.get("dp_rank", 0) > 0         # other microbatches than DP rank 0's
        # EP / DP / TP rank 0 of this pipeline rank merged before it (a TP rank > 0 records no losses: TP rank
        # 0's are the group's)
        replica = own_data or header.get("ep_rank", 0) > 0 or header.get("tp_rank", 0) > 0
        for meta in header["params"]:
            key = meta["key"]
            shard = meta.get("shard")
            if key in params and not (shard and "shards" in params[key]):
                raise TraceError(f"parameter {key} is held by ranks {owner[key]} and {rank}")
            if key not in params:
                params[key] = {**{k: v for k, v in meta.items() if k != "shard"}, "rank": rank}
                params[key].update({"shards": []} if shard else {})
                owner[key] = rank
            if shard:
                params[key]["shards"].append({**shard, "rank": rank})
        for rec in records[1:-1]:
            if rec["type"] == "init":
                _take(init, rec["params"], partials, ("init", "params"))
                continue
            if rec["type"] == "resumed":
                _merge_resumed(resumed, rec, partials, rank, header, replica)
                continue
            st = steps.setdefault(rec["step"], StepTrace(step=rec["step"]))
            for part in ("grads", "params", *OPTIMIZER_STATES):
                _take(getattr(st, part), rec.get(part, {}), partials, (rec["step"], part))
            if replica:
                step = rec["step"]
                for part, what in (("buffers", "buffer"), ("activations", "activation"), ("boundaries", "boundary"),
                                   ("router_ties", "router tie count")):
                    mine, first = rec.get(part, {}), getattr(st, part)
                    for k, v in mine.items():
                        _same(rank, header, step, f"{what} {k}", v, first.get(k))
                if "losses" in rec and own_data:
                    st.losses = st.losses + rec["losses"]
                    _same(rank, header, step, "reported lm loss", rec["lm_loss"], st.lm_loss)
                elif "losses" in rec:
                    _same(rank, header, step, "losses", (rec["losses"], rec["lm_loss"]), (st.losses, st.lm_loss))
                _same(rank, header, step, "grad norm", (rec["grad_norm"], rec["clip_coeff"]),
                      (st.grad_norm, st.clip_coeff))
            else:
                st.buffers.update(rec["buffers"])
                if "losses" in rec:
                    st.losses, st.lm_loss = rec["losses"], rec["lm_loss"]
                st.grad_norm, st.clip_coeff, st.clipped = rec["grad_norm"], rec["clip_coeff"], rec.get("clipped")
                st.activations.update(rec.get("activations", {}))
                st.boundaries.update(rec.get("boundaries", {}))
                st.router_ties.update(rec.get("router_ties", {}))
                if rec.get("actions"):
                    st.actions[str(header.get("pp_rank", rank))] = rec["actions"]
            if rec.get("overlap") is not None:
                st.overlap[str(rank)] = rec["overlap"]
            st.time_s[str(rank)] = rec["time_s"]
            st.cpu_s[str(rank)] = rec.get("cpu_s")
    counts = {len(st.time_s) for st in steps.values()}
    if counts and counts != {world_size}:
        raise TraceError(f"ranks disagree on the number of steps in {run_dir}")
    _combine_shards(partials, params, init, steps, resumed)
    order = sorted(params, key=lambda k: (params[k]["order"], params[k]["replica"] or ""))
    for st in steps.values():       # canonical router order (by the router weight's key), whatever the layout
        st.losses = sorted(st.losses, key=lambda x: x.get("microbatch", 0))
        st.router_ties = dict(sorted(st.router_ties.items(), key=lambda kv: _router_order(kv[0])))
        _align_actions(st.actions)
    return Trace(format=FORMAT, params=params, order=order, init=init,
                 steps=[steps[k] for k in sorted(steps)], world_size=world_size, expert_model_parallel_size=ep_size,
                 data_parallel_size=dp_size, tensor_model_parallel_size=tp_size, resumed=[resumed] if resumed else [])


def _merge_resumed(resumed: dict, rec: dict, partials: dict, rank: int, header: dict, replica: bool) -> None:
    """A rank's ``resumed`` record into `resumed` (the run's loaded state): every rank's parameters and moments,
    the buffers from EP / DP / TP rank 0 (a replica rank's must equal them).

    Raises:
        TraceError: ranks name different checkpoint steps, or a replica rank loaded other buffers."""
    if resumed.setdefault("step", rec["step"]) != rec["step"]:
        raise TraceError(f"rank {rank}: resumed from step {rec['step']}, another rank from step {resumed['step']}")
    for part in ("params", *OPTIMIZER_STATES):
        _take(resumed.setdefault(part, {}), rec.get(part, {}), partials, ("resumed", part))
    mine, first = rec.get("buffers", {}), resumed.setdefault("buffers", {})
    for k, v in mine.items():
        if replica:
            _same(rank, header, rec["step"], f"loaded buffer {k}", v, first.get(k))
        else:
            first[k] = v


def _take(into: dict, fingerprints: dict, partials: dict, where: tuple) -> None:
    """A record's ``{key: fingerprint}`` into `into`; a sharded tensor's partial records (dicts) are kept in
    `partials` until every rank is read."""
    for key, v in fingerprints.items():
        if isinstance(v, dict):
            partials.setdefault(where + (key,), []).append(v)
        else:
            into[key] = v


def _combine_shards(partials: dict, params: dict, init: dict, steps: dict, resumed: dict) -> None:
    """Each sharded tensor's fingerprint from its ranks' partial records (`trainerkit.fingerprint_shard`,
    TRACE_FORMAT.md "Sharded tensors"): the same fingerprint as the whole tensor's.

    Raises:
        TraceError: the partials do not tile the tensor (a shard missing, held twice, outside the tensor), or
            a rank holds fewer shards than the header says, naming step, part, key and ranks."""
    if not partials:
        return
    from trainerkit import fingerprint_shard  # here, for sharded runs only: it imports torch

    for (step, part, key), recs in partials.items():
        where = f"{step if step in ('init', 'resumed') else f'step {step}'} {part} {key}"
        meta = params.get(key)
        if meta is None or "shards" not in meta:
            raise TraceError(f"{where}: a partial fingerprint for a parameter no rank declared sharded")
        if len(recs) != len(meta["shards"]):
            raise TraceError(f"{where}: {len(recs)} partial fingerprints for the {len(meta['shards'])} shards "
                             f"of ranks {[s['rank'] for s in meta['shards']]}")
        try:
            value = fingerprint_shard.fingerprint_of(recs)
        except fingerprint_shard.ShardError as e:
            raise TraceError(f"{where} (ranks {[s['rank'] for s in meta['shards']]}): {e}") from None
        into = init if step == "init" else resumed[part] if step == "resumed" else getattr(steps[step], part)
        into[key] = value


def check_losses(trace: Trace, num_microbatches: int, mtp_num_layers: int) -> None:
    """The trace contract on losses: every step has one record per microbatch, in order, each with
    `mtp_num_layers` MTP losses (a trainer that drops them would otherwise compare equal to itself).

    Raises:
        TraceError: naming the step and what is missing."""
    for st in trace.steps:
        mbs = [x.get("microbatch") for x in st.losses]
        if mbs != list(range(num_microbatches)):
            raise TraceError(f"step {st.step}: losses for microbatches {mbs}, expected 0..{num_microbatches - 1}")
        for x in st.losses:
            if len(x.get("mtp", [])) != mtp_num_layers:
                raise TraceError(f"step {st.step} microbatch {x['microbatch']}: {len(x.get('mtp', []))} MTP losses, "
                                 f"expected mtp_num_layers = {mtp_num_layers}")


@dataclass(frozen=True)
class NonFinite:
    """The first NaN / inf of a run: step, global microbatch (None for the grad norm), what (``lm``,
    ``mtp_1``..``mtp_D``, ``grad norm``) and the value; ``str()`` gives the words."""

    step: int
    microbatch: Optional[int]
    name: str
    value: float

    def __str__(self) -> str:
        if self.microbatch is None:
            return f"step {self.step}: {self.name} is {self.value}"
        return f"step {self.step} microbatch {self.microbatch}: {self.name} loss is {self.value}"


def first_nonfinite(trace: Trace) -> Optional[NonFinite]:
    """Where a run's training stopped being finite: the first NaN / inf loss (per microbatch: lm, then MTP depth
    1..D) or grad norm, in step order (``str()``: ``'step 0 microbatch 1: lm loss is nan'`` / ``'step 2: grad
    norm is inf'``); None when every loss and grad norm is finite.

    A NaN has the same bits in every layout that produces it, so two broken runs would compare bitwise equal and
    pass: the harness fails such a run instead, as Megatron-LM refuses to train on one
    (``megatron/training/training.py``: ``check_for_nan_in_loss_and_grad``; the optimizer skips a step whose
    grad norm is not finite).  Values are read from the trace's ``value`` fields (fp32 losses, fp32 / fp64 grad
    norm); a missing grad norm (a trainer that reports none) is not checked."""
    for st in trace.steps:
        for rec in st.losses:
            named = [("lm", rec.get("lm"))] + [(f"mtp_{d}", x) for d, x in enumerate(rec.get("mtp", []), start=1)]
            for name, x in named:
                if x is not None and not math.isfinite(x["value"]):
                    return NonFinite(st.step, rec["microbatch"], name, x["value"])
        if st.grad_norm is not None and not math.isfinite(st.grad_norm["value"]):
            return NonFinite(st.step, None, "grad norm", st.grad_norm["value"])
    return None


def overlap_coverage(trace: Trace, overlap: bool) -> dict:
    """What megatron's MoE 1F1B overlap ran (``overlap`` records): ``{"merged": {rank: [per step]},
    "backward_dw": {rank: [per step]}, "warning": str | None}``; the warning names the first rank and step that
    merged no forward+backward step although the run asks for the overlap (that rank tested nothing of it).
    ``{}`` when the run has no overlap records."""
    ranks = sorted({r for st in trace.steps for r in st.overlap}, key=int)
    if not ranks:
        return {"merged": {}, "backward_dw": {}, "warning": "the run asks for the overlap but recorded none"} \
            if overlap else {}
    cov = {k: {r: [st.overlap.get(r, {}).get(k, 0) for st in trace.steps] for r in ranks}
           for k in ("merged", "backward_dw")}
    idle = next(((r, st.step) for st in trace.steps for r in ranks if st.overlap.get(r, {}).get("merged", 0) == 0),
                None)
    cov["warning"] = (f"rank {idle[0]} merged no forward+backward step at step {idle[1]} (it ran the overlap "
                      "schedule's actions one at a time): more microbatches make every rank merge") if idle else None
    return cov
