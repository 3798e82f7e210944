"""Bitwise comparison of two canonical traces and localisation of the first divergence; structural checks.

Structural checks, before any number: the parameter inventory (`inventory_diff`: global name, shape,
dtype, weight-decay group of every parameter) must equal the reference run's, else the first divergence is
``inventory`` at step 0; and, within each run, every replica must match its original (`replica_status`).

Walk order = dataflow order, the order in which one training step computes its numbers: steps ascending;
within a step, losses (the forward: microbatches ascending; lm then mtp_1..mtp_D; then the reported lm loss)
before gradients in *backward* order (the reverse of the canonical parameter order: output head, MTP depths
from the last, final norm, decoder layers from the last, embedding; within a layer the MLP before the
attention, routed experts before their router) before the grad norm (when both runs clip) before Adam's
moments after the update (kind ``optimizer_state``, canonical order: the update computes them before the
parameter; a clipped gradient or a lost moment shows here first) before parameters after the optimizer step
(canonical order), then the buffers after their update (the routers' expert bias, kind
``buffer``: state that is not a parameter, `trainerkit.names.is_buffer`).  The first difference in
that order is the first divergence: the first tensor computed differently.  Gradients accumulate over all
microbatches before they are captured, so within a step this is the layer where a backward difference
starts; with ``capture: activations`` `harness.judging.localise` goes down to one microbatch and one layer input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainerkit import names
from trainerkit.names import OPTIMIZER_STATES

from .results import FAMILIES, FirstDivergence
from .trace import StepTrace, Trace
from .ulp import ulp_distance


@dataclass
class Comparison:
    """bitwise_equal: every compared bit equal.  family_mismatches: {"grad"|"optimizer_state"|"param"|"buffer":
    [{family: count}] per step}.
    inventory: one line per parameter whose inventory entry differs (`inventory_diff`), canonical order."""

    bitwise_equal: bool
    first_divergence: Optional[FirstDivergence]
    family_mismatches: dict = field(default_factory=dict)
    inventory: list = field(default_factory=list)
    grad_norm_ulps: list = field(default_factory=list)   # per step: |ulp distance| or None
    differences: list = field(default_factory=list)      # every `Difference`, in walk order


@dataclass(frozen=True)
class Difference:
    """One place where two runs differ: a loss (`name` lm / mtp_k, with its microbatch), a gradient or a
    parameter after the update or a buffer after its own (kind ``param`` / ``buffer``; `name` the trace key), the
    grad norm, an inventory entry."""

    step: int
    kind: str
    name: str
    microbatch: Optional[int] = None


#: Inventory fields that must agree between two runs (besides presence): a different value trains a
#: different model (shape, dtype) or optimises it differently (the optimizer's weight-decay group).
INVENTORY_FIELDS = ("shape", "dtype", "weight_decay")


def inventory_diff(base: Trace, other: Trace) -> list[str]:
    """Differences between the parameter inventories of two runs, one line per key, in canonical order.

    A parameter (non-replica key) held by only one run is a difference; so is a key held by both whose
    shape, dtype or weight-decay group differ.  A replica that only one layout needs (P=1 megatron has no
    ``@mtp`` copy) is not a difference, but a replica both hold is compared like any parameter.
    """
    def position(k):
        meta = base.params.get(k) or other.params[k]
        return meta["order"], meta["replica"] or ""
    lines = []
    for k in sorted(set(base.params) | set(other.params), key=position):
        b, o = base.params.get(k), other.params.get(k)
        if b is None or o is None:
            if (b or o)["replica"] is None:
                lines.append(f"{k}: only in the {'baseline' if o is None else 'variant'}")
            continue
        fields = [f"{f} {b.get(f)!r} (baseline) vs {o.get(f)!r}" for f in INVENTORY_FIELDS if b.get(f) != o.get(f)]
        if fields:
            lines.append(f"{k}: " + ", ".join(fields))
    return lines


def replica_status(trace: Trace) -> dict:
    """Whether every replica of a logical parameter (``embedding.word_embeddings.weight@mtp``; with expert
    parallelism the ``@ep{r}`` copies of every non-expert parameter) matches its original within one run: same shape/dtype/weight-decay group, same initial value, and after every step
    the same gradient (after the replica sum), the same Adam moments and the same value after the optimizer step.

    Returns ``{"consistent": bool, "first_broken_step": int|None, "replicas": [keys], "detail": str}``, with
    ``"replica"``: the first broken replica's key when inconsistent;
    a run without replicas is consistent.  A broken replica means the copies train apart: the MTP stage
    then looks up embeddings the first stage no longer has.
    """
    pairs = [(k, trace.params[k]["name"]) for k in trace.order if trace.params[k]["replica"] is not None]
    replicas = [k for k, _ in pairs]

    def broken(step, detail, key):
        return {"consistent": False, "first_broken_step": step, "replica": key, "replicas": replicas,
                "detail": detail}
    for key, orig in pairs:
        if orig not in trace.params:
            return broken(0, f"{key}: its original {orig} is not in the run", key)
        fields = [f"{f} {trace.params[key].get(f)!r} vs {trace.params[orig].get(f)!r}" for f in INVENTORY_FIELDS
                  if trace.params[key].get(f) != trace.params[orig].get(f)]
        if fields:
            return broken(0, f"{key}: " + ", ".join(fields) + f" of {orig}", key)
        if trace.init.get(key) != trace.init.get(orig):
            return broken(0, f"{key}: initial value {trace.init.get(key)} vs {trace.init.get(orig)} of {orig}", key)
    for st in trace.steps:
        for what, fps in (("gradient", st.grads), *((f"Adam {n} after the optimizer step", getattr(st, n))
                                                      for n in OPTIMIZER_STATES),
                          ("value after the optimizer step", st.params)):
            for key, orig in pairs:
                if fps.get(key) != fps.get(orig):
                    return broken(st.step, f"{key}: {what} at step {st.step} {fps.get(key)} vs "
                                           f"{fps.get(orig)} of {orig}", key)
    detail = (f"{len(replicas)} replica(s) match their originals at init and after all {len(trace.steps)} steps"
              if replicas else "no replicas in this run")
    return {"consistent": True, "first_broken_step": None, "replicas": replicas, "detail": detail}


def _loss_diffs(base_step, other_step):
    """Yield (microbatch, name, base, other) for the loss entries that differ, in walk order."""
    for b, o in zip(base_step.losses, other_step.losses):
        if b["lm"]["hex"] != o["lm"]["hex"]:
            yield b["microbatch"], "lm", b["lm"], o["lm"]
        for k, (bm, om) in enumerate(zip(b["mtp"], o["mtp"]), start=1):
            if bm["hex"] != om["hex"]:
                yield b["microbatch"], f"mtp_{k}", bm, om
    if len(base_step.losses) != len(other_step.losses):
        yield None, "microbatch count", {"hex": str(len(base_step.losses))}, {"hex": str(len(other_step.losses))}
    bl, ol = base_step.lm_loss, other_step.lm_loss
    if (bl or {}).get("hex") != (ol or {}).get("hex"):
        yield None, "lm loss (reported)", bl or {"hex": "none"}, ol or {"hex": "none"}


def _ulp(a_hex: str, b_hex: str) -> Optional[int]:
    """ULP distance of two float bit patterns of one width, else None (e.g. a count, 'none', two widths)."""
    try:
        return ulp_distance(a_hex, b_hex) if a_hex.startswith("0x") and b_hex.startswith("0x") else None
    except ValueError:
        return None


def _bits(a_hex: str) -> int:
    """Width in bits of a ``0x…`` bit pattern (8 hex digits: fp32; 16: float64)."""
    return 4 * (len(a_hex) - 2)


def _ulp_words(ulp: Optional[int], a_hex: str = "") -> str:
    wide = " float64" if ulp is not None and _bits(a_hex) == 64 else ""
    return f" ({ulp}{wide} ulp)" if ulp is not None else ""


def backward_first(keys: list, params: dict) -> str:
    """Of `keys` (parameter keys in canonical order, as `Trace.order` lists them; not empty), the one whose
    gradient a step's backward computes first: the last in canonical order (the backward runs the canonical
    order in reverse, module docstring); of a tensor and its replicas (the same ``params[k]["order"]`` key)
    the original, whose name the reader knows.  Layout comparisons (`compare`) and the cross-implementation
    check (`harness.judging.crossimpl.compare`) both name their first gradient so."""
    last = params[keys[-1]]["order"]
    return next(k for k in keys if params[k]["order"] == last)


def compare(base: Trace, other: Trace) -> Comparison:
    """Compare `other` with `base` bit for bit (fingerprints and loss bits).

    The first divergence is the first tensor *computed* differently (dataflow order, module docstring):
    gradients in backward order, the reverse of the canonical order, so a difference that starts in one
    layer is named there and not at the word embedding its consequences reach last.  When the first differing
    gradient in canonical order is another tensor, `FirstDivergence.canonical` says so in one line.  Every
    difference is listed in `Comparison.differences` (for `harness.judging.signature`).

    An inventory difference (`inventory_diff`) is the first divergence, kind ``inventory`` at step 0, named
    after the first differing parameter: the runs do not train the same model.  The numbers are still
    compared for the keys both hold (for the mismatch counts).  Replica keys (``@mtp``) are compared when
    both runs hold them.
    """
    inventory = inventory_diff(base, other)
    keys = [k for k in base.order if k in other.params]
    families = {k: base.params[k]["family"] for k in keys}
    diffs: list[Difference] = []
    first: Optional[FirstDivergence] = None
    if inventory:
        first = FirstDivergence(step=0, kind="inventory", microbatch=None, name=inventory[0].split(":")[0],
                                detail=f"parameter inventory differs ({len(inventory)}): " + "; ".join(inventory[:5]))
        diffs += [Difference(0, "inventory", line.split(":")[0]) for line in inventory]
    counts = {"grad": [], "optimizer_state": [], "param": [], "buffer": []}
    norm_ulps = []
    # align by step number: a resumed run starts after its checkpoint step
    base_by_step = {st.step: st for st in base.steps}
    pairs = [(base_by_step[st.step], st) for st in other.steps if st.step in base_by_step]
    # what a resume loaded belongs after its checkpoint's step: judged before the steps that follow it
    loads = sorted((r["step"], _loaded_diffs(base_by_step[r["step"]], r, keys))
                   for r in other.resumed if r["step"] in base_by_step)

    def judge_loads(before: float) -> None:
        nonlocal first
        while loads and loads[0][0] < before:
            _, loaded = loads.pop(0)
            diffs.extend(loaded)
            if loaded and first is None:
                d = loaded[0]
                first = FirstDivergence(d.step, d.kind, None, d.name,
                                        f"loaded from the checkpoint: {d.kind} {d.name} differs from what the run "
                                        f"that saved it held after step {d.step}")
    for bs, os_ in pairs:
        judge_loads(bs.step)
        for mb, name, b, o in _loss_diffs(bs, os_):
            diffs.append(Difference(bs.step, "loss", name, mb))
            if first is None:
                ulp = _ulp(b["hex"], o["hex"])
                first = FirstDivergence(bs.step, "loss", mb, name,
                                        f"{name}: reference {b['hex']} vs {o['hex']}{_ulp_words(ulp, b['hex'])}",
                                        ulp=ulp, ulp_bits=_bits(b["hex"]) if ulp is not None else None)
        grads = [k for k in keys if bs.grads.get(k) != os_.grads.get(k)]          # canonical order
        diffs += [Difference(bs.step, "grad", k) for k in grads]
        counts["grad"].append(_per_family(grads, families))
        if grads and first is None:
            k = backward_first(grads, base.params)
            first = FirstDivergence(bs.step, "grad", None, k,
                                    f"grad fingerprint {bs.grads.get(k)} vs {os_.grads.get(k)}")
            if grads[0] != k:
                first.canonical = (f"first in canonical order: grad {grads[0]} (fingerprint "
                                   f"{bs.grads.get(grads[0])} vs {os_.grads.get(grads[0])})")
        norm_ulps.append(None)
        if bs.grad_norm and os_.grad_norm:
            bh, oh = bs.grad_norm["hex"], os_.grad_norm["hex"]
            norm_ulps[-1] = _ulp(bh, oh)
            if bh != oh:
                diffs.append(Difference(bs.step, "grad_norm", "grad norm"))
                if first is None:
                    first = FirstDivergence(bs.step, "grad_norm", None, "grad norm",
                                            f"grad norm {bh} vs {oh}{_ulp_words(norm_ulps[-1], bh)}",
                                            ulp=norm_ulps[-1], ulp_bits=_bits(bh) if norm_ulps[-1] is not None else None)
        states = [k for k in keys if _moments_differing(bs, os_, k)]
        diffs += [Difference(bs.step, "optimizer_state", k) for k in states]
        counts["optimizer_state"].append(_per_family(states, families))
        if states and first is None:
            first = FirstDivergence(bs.step, "optimizer_state", None, states[0], _state_words(bs, os_, states[0]))
        params = [k for k in keys if bs.params.get(k) != os_.params.get(k)]
        buffers = [k for k in sorted(set(bs.buffers) | set(os_.buffers)) if bs.buffers.get(k) != os_.buffers.get(k)]
        diffs += [Difference(bs.step, "param", k) for k in params] + [Difference(bs.step, "buffer", k) for k in buffers]
        counts["param"].append(_per_family(params, families))
        counts["buffer"].append(_per_family(buffers, {k: names.family(k, strict=False) for k in buffers}))
        if params and first is None:
            first = FirstDivergence(bs.step, "param", None, params[0],
                                    f"param fingerprint {bs.params.get(params[0])} vs {os_.params.get(params[0])}")
        if buffers and first is None:
            first = FirstDivergence(bs.step, "buffer", None, buffers[0],
                                    f"buffer fingerprint {bs.buffers.get(buffers[0])} vs {os_.buffers.get(buffers[0])}")
    judge_loads(float("inf"))
    missing_steps = sorted(({st.step for st in other.steps} ^ {st.step for st in base.steps})
                           - set(range(other.steps[0].step if other.steps else 0)))
    if missing_steps:
        diffs.append(Difference(missing_steps[0], "loss", "steps"))
        if first is None:
            first = FirstDivergence(missing_steps[0], "loss", None, "steps",
                                    f"step {missing_steps[0]} is in only one run ({len(base.steps)} vs "
                                    f"{len(other.steps)} steps)")
    return Comparison(bitwise_equal=first is None, first_divergence=first, family_mismatches=counts,
                      inventory=inventory, grad_norm_ulps=norm_ulps, differences=diffs)


def _loaded_diffs(saved, loaded: dict, keys: list) -> list[Difference]:
    """What a resumed run loaded (`Trace.resumed`) against the saving run's step record `saved`, the step the
    checkpoint was written after: every parameter, Adam moment and buffer must be bit-equal whatever the layout
    (global keys; a moment or buffer one side lacks is not compared).  Moments first: a load that dropped the
    optimizer state is named so, not by the parameters it moves one step later."""
    step = saved.step
    as_step = StepTrace(step=step, **{n: loaded.get(n, {}) for n in OPTIMIZER_STATES})
    states = [k for k in keys if _moments_differing(saved, as_step, k)]
    params = [k for k in keys if k in loaded.get("params", {}) and loaded["params"][k] != saved.params.get(k)]
    buffers = [k for k in sorted(saved.buffers) if k in loaded.get("buffers", {})
               and loaded["buffers"][k] != saved.buffers[k]]
    return ([Difference(step, "optimizer_state", k) for k in states] + [Difference(step, "param", k) for k in params]
            + [Difference(step, "buffer", k) for k in buffers])


def _moments_differing(a, b, key: str) -> list[str]:
    """The Adam moments (`OPTIMIZER_STATES` names) of `key` that differ between two steps; a moment one trace
    lacks (written before they were traced, or by a capture that cannot read them) is not compared."""
    return [n for n in OPTIMIZER_STATES
            if key in getattr(a, n) and key in getattr(b, n) and getattr(a, n)[key] != getattr(b, n)[key]]


def _state_words(a, b, key: str) -> str:
    """'exp_avg fingerprint X vs Y' for each moment of `key` that differs."""
    return "; ".join(f"{n} fingerprint {getattr(a, n)[key]} vs {getattr(b, n)[key]}"
                     for n in _moments_differing(a, b, key))


def _per_family(keys: list, families: dict) -> dict:
    per_family = dict.fromkeys(FAMILIES, 0)
    for k in keys:
        per_family[families[k]] = per_family.get(families[k], 0) + 1   # names.OTHER: a user's own model
    return per_family
