"""Cross-implementation comparison: one run of a case by both trainers (ours and megatron-core) from identical
weights and data, measured tensor by tensor in ULPs.

Layout comparison asks "did a bit move?"; this asks "do two implementations of the same model compute the same
numbers, up to rounding?", which catches what is wrong the same way on every layout (a wrong loss scale, a
missing weight decay, a convention mismatch).  What is compared, at one step (``step``):

* the initial weights: bitwise (both trainers initialise every parameter from the case seed keyed by its global
  name, `trainerkit.init`); any difference is an error, since then nothing else means anything;
* the parameter inventory: keys, shapes and optimizer groups (weight decay on or off);
* each microbatch's lm and MTP losses: distance in ULPs of the fp32 values;
* each parameter's gradient (``main_grad`` after finalize): ``max |a - b| / ulp(max |a|)``, the largest
  difference in ULPs at the tensor's own scale.  Raw per-element ULPs are also reported, but they are not
  bounded: an element that nearly cancels has a tiny ULP, so two correct implementations can be millions of
  ULPs apart there;
* each parameter after the optimizer step: reported, not bounded, because Adam's first update is
  ``lr * m / (sqrt(v) + eps)`` ~ ``lr * sign(g)`` per element: a gradient element near zero may change its
  update by a whole ``lr`` between two implementations that agree to 1e-7.

The verdict fails when a loss or a gradient is beyond ``max_ulp``, and names the first such place in dataflow
order, as layout comparisons name their first divergence (`harness.judging.compare`): the losses first (microbatches
ascending; lm, then mtp_1..mtp_D), then the gradients in backward order (the reverse of the canonical order:
output head, MTP, final norm, decoder layers from the last, embedding; `harness.judging.compare.backward_first`), so a
difference that starts in one layer is named there and not at the word embedding its consequences reach last.
Beside it the record names the farthest gradient (the largest ULP at tensor scale) and, when it is another
tensor, the first one in canonical order.  A gradient that is all zero in one trainer and not in the other is
said so in words (`harness.judging.ulp.scale_words`), not as a ULP count at the scale of zero.

``against`` (a variant of the same case) compares the chosen run with that run by the same trainer instead of
the other trainer: the same computation by two parallel implementations, e.g. megatron-core at TP = 2 against
TP = 1 (the row-parallel layers sum partial products over the TP ranks: rounding, bounded in ULPs here).  The
record's ``trainers`` then name the two variants.

A case states what the comparison must show (`expect`, `first_beyond_bound`, `bug`, per megatron-core
version); a run that carries more than one upstream bug states each further one with a tensor it puts beyond
the bound (`more_bugs`), and the record names every stated bug with the tensor it explains (``bugs``).
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainerkit.config import TRAINERS, DumpConfig, RunConfig

from ..planning import trainers
from ..planning.bounds import printable
from ..planning.budget import Deadline
from ..planning.expectations import bugs_elsewhere, check_specifiers, entry_for
from ..running.runner import run_ranks
from .compare import backward_first
from .trace import Trace, TraceError, merge
from .ulp import scale_words, tensor_stats, ulp_distance, zero_side

MAX_DUMP_BYTES = 1 << 30


class StatedBug(BaseModel):
    """One more upstream bug a disagreeing comparison carries, and a place it puts beyond the bound: a parameter
    key (its gradient) or ``loss`` (a microbatch's loss)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    bug: str = Field(min_length=1, max_length=300)
    beyond_bound: str = Field(min_length=1, max_length=300)
    _printable = field_validator("bug", "beyond_bound")(printable)


class CrossImplementationSpec(BaseModel):
    """The case file's ``cross_implementation:`` mapping."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    variant: Optional[str] = None      # the run to repeat with the other trainer (default: the baseline)
    # another variant, run by the same trainer, to compare with instead of the other trainer (module docstring)
    against: Optional[str] = None
    # the step whose gradients and parameters are dumped and compared: 0, the only step both trainers start
    # from identical weights (harness.planning.cases refuses others, saying why)
    step: int = Field(0, ge=0)
    max_ulp: int = Field(16, ge=0, le=1 << 30)   # bound on loss ULPs and on gradient ULPs at each tensor's scale
    # both runs in this dtype, whatever the case trains in: in bf16 two correct implementations round
    # activations at different places (e.g. before or after a norm's weight), so a ULP bound would measure
    # where each casts, not whether they compute the same function
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    # what the comparison must show: agree (within max_ulp), or disagree — an implementation bug caught, first
    # beyond the bound at `first_beyond_bound` (a parameter key: its gradient; "loss": a microbatch's loss)
    expect: Literal["agree", "disagree"] = "agree"
    first_beyond_bound: Optional[str] = Field(None, max_length=300)
    bug: Optional[str] = Field(None, max_length=300)     # the upstream bug a disagreement shows (the report says it)
    # further bugs the same run carries, each with a tensor it puts beyond the bound (expect: disagree)
    more_bugs: list[StatedBug] = Field(default_factory=list, max_length=8)
    # per megatron-core version (PEP 440 specifiers; the first match replaces expect / first_beyond_bound / bug)
    megatron_versions: list["CrossVersionExpectation"] = Field(default_factory=list, max_length=16)
    _printable = field_validator("variant", "against", "first_beyond_bound", "bug")(printable)


class CrossVersionExpectation(BaseModel):
    """What the cross-implementation comparison shows on the megatron-core versions `versions`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    versions: str = Field(min_length=1, max_length=200)
    expect: Literal["agree", "disagree"] = "agree"
    first_beyond_bound: Optional[str] = Field(None, max_length=300)
    bug: Optional[str] = Field(None, max_length=300)
    more_bugs: list[StatedBug] = Field(default_factory=list, max_length=8)
    # the check is not made on these versions, and why (its variant is not run there, or crashes as stated)
    not_run: Optional[str] = Field(None, min_length=1, max_length=300)

    _specifiers = field_validator("versions")(check_specifiers)
    _printable = field_validator("versions", "first_beyond_bound", "bug", "not_run")(printable)

    @model_validator(mode="after")
    def _not_run_alone(self):
        if self.not_run is not None and (self.expect != "agree" or self.first_beyond_bound or self.bug
                                         or self.more_bugs):
            raise ValueError(f"not_run: the check is not made on {self.versions}, so nothing else can be said there")
        return self


CrossImplementationSpec.model_rebuild()


def expectation(spec: CrossImplementationSpec, cfg: RunConfig) -> dict:
    """`expected` on the megatron-core version that the check's megatron side (`cfg` or its other trainer) runs."""
    megatron = cfg if trainers.runs_megatron(cfg.trainer) else \
        cfg.model_copy(update={"trainer": other_trainer(cfg.trainer)})
    return expected(spec, trainers.megatron_version(megatron.megatron_path))


def expected(spec: CrossImplementationSpec, version: Optional[str]) -> dict:
    """{expect, first_beyond_bound, bug, more_bugs: [{bug, beyond_bound}], bug_elsewhere} that hold on
    megatron-core `version` (None: the spec's own)."""
    applied = entry_for(spec, version)
    entry = applied or spec
    return {"expect": entry.expect, "first_beyond_bound": entry.first_beyond_bound,
            "bug": entry.bug if entry.bug is not None else spec.bug,
            "more_bugs": [m.model_dump() for m in entry.more_bugs or spec.more_bugs],
            "bug_elsewhere": bugs_elsewhere(spec, applied)}


def measured_at(rec: dict, place: str, trainers: tuple[str, str]) -> Optional[dict]:
    """What the comparison record `rec` measured at a stated `place`: ``loss`` (the farthest microbatch loss) or
    a parameter key (its gradient), as a place dict (`_place`); None when it compared no such place."""
    if place == "loss":
        rows = [(r, name, ulp) for r in rec.get("losses") or [] for name, ulp in _loss_ulps(r)]
        if not rows:
            return None
        r, name, ulp = max(rows, key=lambda x: x[2])
        return _place(rec["step"], "loss", name, {"scaled_ulp": ulp}, trainers, r["microbatch"])
    row = next((r for r in rec.get("tensors") or [] if r["key"] == place and r.get("grad")), None)
    return None if row is None else _place(rec["step"], "grad", place, row["grad"], trainers)


def _loss_ulps(row: dict) -> list:
    """[(name, ULP)] of one microbatch's loss row in dataflow order: lm, then mtp_1..mtp_D."""
    return [("lm", row["lm"])] + [(f"mtp_{k}", u) for k, u in enumerate(row["mtp"], start=1)]


def _place(step: int, kind: str, name: str, entry: dict, trainers: tuple[str, str],
           microbatch: Optional[int] = None) -> dict:
    """A place of the comparison with its distance, in `harness.judging.results.FirstDivergence`'s fields (step, kind,
    microbatch, name, ulp) and ``words`` like a layout comparison's first divergence: ``step 0 grad
    decoder.layers.2.mlp.router.weight, 3.3e+05 ULP at tensor scale`` / ``step 0 loss mb 3 mtp_1, 120 ULP``.
    `entry`: a tensor entry (``scaled_ulp``, ``zero_in``, ``max_abs_err``) or ``{"scaled_ulp": loss ULP}``."""
    where = f"step {step} {kind}" + (f" mb {microbatch}" if microbatch is not None else "") + f" {name}"
    dist = f"{entry['scaled_ulp']} ULP" if kind == "loss" else scale_words(entry, trainers)
    return {"step": step, "kind": kind, "microbatch": microbatch, "name": name, "ulp": entry["scaled_ulp"],
            "zero_in": entry.get("zero_in"), "words": f"{where}, {dist}"}


def other_trainer(trainer: str) -> str:
    """The trainer a cross-implementation run compares `trainer` with (its registry entry's partner)."""
    return trainers.entry(trainer).partner


def on_other_trainer(cfg: RunConfig) -> RunConfig:
    """`cfg` run by the other trainer (`other_trainer`), without a planted fault: a HybridModel run becomes the
    GPT run of the same placement (``parallel.pipeline_model_parallel_layout`` is already its layout), the only
    model class the reference trainer has."""
    parallel = cfg.parallel.model_copy(update={"hybrid_layer_pattern": None})
    return cfg.model_copy(update={"trainer": other_trainer(cfg.trainer), "inject": None, "model_class": "gpt",
                                  "parallel": parallel})


def scaled_ulp(a, b) -> float:
    """``max |a - b| / ulp(max |a|)`` of two same-shape float tensors: their largest difference in units of the
    last place of `a`'s largest-magnitude element (0 when equal; inf when only one is finite).

    Raises ValueError on a shape mismatch."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {tuple(a.shape)} and {tuple(b.shape)}")
    x, y = a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy()
    if x.size == 0:
        return 0.0
    err = np.abs(x - y)
    if not np.all(np.isfinite(err)):
        return math.inf
    scale = float(np.abs(x).max())
    unit = float(np.spacing(np.asarray(scale, dtype=a.detach().cpu().numpy().dtype)))
    return float(err.max()) / unit if unit > 0 else (0.0 if err.max() == 0 else math.inf)


def _run(cfg: RunConfig, step: int, run_dir: Path, timeout: float, launcher: str, deadline: Deadline):
    cfg = cfg.model_copy(update={
        "dump": DumpConfig(step=step, keys=["*"], max_bytes=MAX_DUMP_BYTES), "checkpoint": None, "resume_from": None,
        "training": cfg.training.model_copy(update={"train_iters": step + 1})})
    shutil.rmtree(run_dir, ignore_errors=True)
    out = deadline.run(run_ranks, cfg, run_dir, timeout, launcher)
    if not out.ok:
        raise RuntimeError(f"{cfg.trainer} run failed: {out.error.splitlines()[0]}")
    trace = merge(run_dir, cfg.parallel.world_size)
    from trainerkit.capture import read_dumps  # here: it imports torch, which a passing verify never needs
    return trace, read_dumps(run_dir, trace.shapes()), out.elapsed_s


def compare(a: Trace, ta: dict, b: Trace, tb: dict, step: int, max_ulp: int,
            trainers: tuple[str, str] = TRAINERS) -> dict:
    """The comparison record of two dumped runs at `step`: `a` (with its dumped tensors `ta`) by ``trainers[0]``,
    `b` by ``trainers[1]``.

    ``first_beyond_bound``: the first loss or gradient beyond `max_ulp` in dataflow order (module docstring), a
    place dict (`_place`: step, kind, microbatch, name, ulp, zero_in, words) with ``canonical``, the first
    gradient beyond the bound in canonical order when that is another tensor (else None); None when nothing is
    beyond.  ``farthest``: the gradient with the largest ULP at tensor scale (a place dict; None without
    gradients).  Each tensor row's ``grad`` / ``param`` entry: ``scaled_ulp`` (`scaled_ulp`), ``zero_in`` (the
    trainer whose tensor is all zero while the other's is not, `harness.judging.ulp.zero_side`), ``max_abs_err`` and the
    per-element statistics of `harness.judging.ulp.tensor_stats`."""
    sa = next(s for s in a.steps if s.step == step)
    sb = next(s for s in b.steps if s.step == step)
    rec: dict = {"step": step, "max_ulp": max_ulp, "first_beyond_bound": None}
    # replicas repeat their original (checked per trace), and another parallel layout has other ones (@tp1, @dp1)
    keys_a, keys_b = ({k for k in t.params if "@" not in k} for t in (a, b))
    rec["inventory"] = {
        "only_in_" + trainers[0]: sorted(keys_a - keys_b), "only_in_" + trainers[1]: sorted(keys_b - keys_a),
        "shape_differs": sorted(k for k in keys_a & keys_b if a.params[k]["shape"] != b.params[k]["shape"]),
        "weight_decay_differs": sorted(k for k in keys_a & keys_b
                                       if a.params[k].get("weight_decay") != b.params[k].get("weight_decay"))}
    rec["init_differs"] = sorted(k for k in keys_a & keys_b if a.init.get(k) != b.init.get(k))
    losses = []
    for la, lb in zip(sa.losses or [], sb.losses or []):
        row = {"microbatch": la["microbatch"], "lm": ulp_distance(la["lm"]["hex"], lb["lm"]["hex"]),
               "mtp": [ulp_distance(x["hex"], y["hex"]) for x, y in zip(la["mtp"], lb["mtp"])],
               "num_tokens_equal": la["num_tokens"] == lb["num_tokens"]}
        losses.append(row)
        beyond = next(((name, u) for name, u in _loss_ulps(row) if u > max_ulp), None)
        if rec["first_beyond_bound"] is None and beyond is not None:
            rec["first_beyond_bound"] = {**_place(step, "loss", beyond[0], {"scaled_ulp": beyond[1]}, trainers,
                                                  row["microbatch"]), "canonical": None}
    rec["losses"] = losses
    tensors = []
    for key in a.order:
        if key not in keys_b or "@" in key:     # replicas repeat their original (checked per trace)
            continue
        row = {"key": key, "family": a.params[key].get("family")}
        for what in ("grad", "param"):
            x, y = ta.get(f"{what}/{key}"), tb.get(f"{what}/{key}")
            if x is None or y is None:
                row[what] = None
                continue
            stats = tensor_stats(x, y)
            row[what] = {"scaled_ulp": scaled_ulp(x, y), "zero_in": zero_side(x, y, trainers),
                         "max_ulp": stats["max_ulp"], "median_ulp": stats["median_ulp"],
                         "fraction": stats["fraction"], "max_abs_err": stats["max_abs_err"],
                         "max_rel_err": stats["max_rel_err"]}
        tensors.append(row)
    rec["tensors"] = tensors
    graded = [r for r in tensors if r["grad"]]
    over = [r["key"] for r in graded if r["grad"]["scaled_ulp"] > max_ulp]        # canonical order
    by_key = {r["key"]: r for r in graded}
    if over and rec["first_beyond_bound"] is None:
        first = backward_first(over, a.params)
        rec["first_beyond_bound"] = {**_place(step, "grad", first, by_key[first]["grad"], trainers),
                                     "canonical": None if over[0] == first else
                                     _place(step, "grad", over[0], by_key[over[0]]["grad"], trainers)}
    far = max(graded, key=lambda r: r["grad"]["scaled_ulp"], default=None)    # the first of equals: canonical
    rec["farthest"] = None if far is None else _place(step, "grad", far["key"], far["grad"], trainers)
    grads = [r["grad"]["scaled_ulp"] for r in tensors if r["grad"]]
    rec["headline"] = {
        "loss_max_ulp": max((max([r["lm"], *r["mtp"]]) for r in losses), default=0),
        "grad_max_scaled_ulp": max(grads, default=0.0),
        "grad_median_scaled_ulp": float(np.median(grads)) if grads else 0.0,
        "grads_bitwise_equal": sum(r["grad"]["max_ulp"] == 0 and r["grad"]["fraction"] == 0 for r in tensors if r["grad"]),
        "tensors": len(tensors),
        "param_max_scaled_ulp": max((r["param"]["scaled_ulp"] for r in tensors if r["param"]), default=0.0)}
    problems = []
    if rec["init_differs"]:
        problems.append(f"initial weights differ ({len(rec['init_differs'])} tensors, first {rec['init_differs'][0]})")
    inv = rec["inventory"]
    for field, items in inv.items():
        if items:
            problems.append(f"inventory: {field.replace('_', ' ')}: {', '.join(items[:3])}")
    if not all(r["num_tokens_equal"] for r in losses) or len(sa.losses or []) != len(sb.losses or []):
        problems.append("the two runs saw different data (token counts or microbatch counts differ)")
    fb = rec["first_beyond_bound"]
    if fb:
        problems.append(f"first beyond the bound: {fb['words']} > {max_ulp}"
                        + (f"; farthest: {rec['farthest']['words']}" if rec["farthest"] else "")
                        + (f"; first in canonical order: {fb['canonical']['words']}" if fb["canonical"] else ""))
    rec["verdict"] = "fail" if problems else "pass"
    rec["reason"] = "; ".join(problems) or (
        f"losses within {rec['headline']['loss_max_ulp']} ULP, gradients within "
        f"{rec['headline']['grad_max_scaled_ulp']:.3g} ULP at tensor scale (bound {max_ulp})"
        + (f", farthest: {rec['farthest']['name']}" if rec["farthest"] else ""))
    return rec


def _base(spec: CrossImplementationSpec, cfg: RunConfig, against: Optional[RunConfig] = None) -> dict:
    labels = [cfg.trainer, other_trainer(cfg.trainer)] if against is None else \
        [spec.variant or "baseline", spec.against]
    return {"trainers": labels, "variant": spec.variant, "against": spec.against, "step": spec.step,
            "max_ulp": spec.max_ulp, "params_dtype": spec.params_dtype, "device": cfg.device}


def not_run(spec: CrossImplementationSpec, cfg: RunConfig, reason: str) -> dict:
    """The record of a check that did not run (verdict ``error``, `reason`; e.g. the --budget was spent)."""
    return {**_base(spec, cfg), "verdict": "error", "reason": reason}


def run(spec: CrossImplementationSpec, cfg: RunConfig, work: Path, timeout: float, launcher: str,
        progress: Callable[[str], None] = print, deadline: Deadline = Deadline(None),
        against: Optional[RunConfig] = None) -> dict:
    """Run `cfg` (the chosen variant's config) with its own trainer and with the other one (or, with
    ``spec.against``, the config `against` of that variant by the same trainer), each dumping every parameter's
    gradient and updated value at ``spec.step``, and compare them (`compare`).  Returns the measured record
    (``verdict`` pass / fail / error against the bound alone, ``reason``, per-loss and per-tensor rows,
    ``headline``); `harness.judging.judge.judge_cross_implementation` judges it against the case's `expectation`."""
    cfg = cfg.model_copy(update={"params_dtype": spec.params_dtype})
    base = _base(spec, cfg, against)
    first, second = base["trainers"]
    other = on_other_trainer(cfg) if against is None else \
        against.model_copy(update={"params_dtype": spec.params_dtype})
    try:
        progress(f"[cross-implementation] {first} vs {second} at step {spec.step} ({spec.params_dtype}) ...")
        # the run directories are named by trainer, or the two runs of one trainer "a" and "b" (variant names
        # may hold a "/")
        dirs = (first, second) if against is None else ("a", "b")
        a, ta, ea = _run(cfg, spec.step, work / dirs[0], timeout, launcher, deadline)
        b, tb, eb = _run(other, spec.step, work / dirs[1], timeout, launcher, deadline)
        rec = compare(a, ta, b, tb, spec.step, spec.max_ulp, (first, second))
        rec.update(base, elapsed_s={first: ea, second: eb})
    except (RuntimeError, TraceError, StopIteration) as e:
        rec = {**base, "verdict": "error", "reason": str(e) or type(e).__name__}
    return rec

