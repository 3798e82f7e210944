"""Result model shared by `harness.judging.compare` (producer) and `harness.report` (consumer).

Plain dataclasses so that `dataclasses.asdict` gives the JSON written to `summary.json`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from trainerkit.config import DEFAULT_TRAINER

Verdict = Literal["pass", "fail", "error"]
#: What a run's ``expect`` may say (a case's variant, `bitparity compare --expect`): the one list.
Expect = Literal["bitwise", "may_diverge", "diverge", "not_finite"]
EXPECTS: tuple = get_args(Expect)
#: What a reader sees first, one of five (plus the reference run's own): the verdict says whether the
#: expectation held, the outcome says what happened.
Outcome = Literal["reference", "equal", "differs only where allowed", "differs as expected",
                  "unexpected difference", "unexpectedly equal", "not finite", "not finite as expected",
                  "unexpectedly finite", "crashed as stated", "unexpectedly completed", "error"]
#: ``buffer``: a traced buffer after its update (the routers' expert bias), not a parameter; ``optimizer_state``:
#: Adam's moments of a parameter after the update (`harness.judging.compare`)
DivergenceKind = Literal["inventory", "loss", "grad", "grad_norm", "optimizer_state", "param", "buffer"]

#: Parameter families used to group mismatches (see `trainerkit.names.family`).
FAMILIES = ("embedding/head", "attention", "dense mlp", "router", "experts", "shared expert", "norms", "mtp")


@dataclass
class FirstDivergence:
    """The earliest difference from the baseline.

    Ordered by step, then kind (inventory < loss < grad < grad_norm < param), then microbatch (losses) or
    canonical parameter order (grads/params).  ``inventory`` (always step 0, before training): the two runs
    do not hold the same parameters (name, shape, dtype, weight-decay group); `name` is the first differing
    parameter.  `name` is `lm` / `mtp_1`… for losses and the global parameter name otherwise; `detail` is a
    human sentence with both bit patterns (or both inventory entries).
    """

    step: int
    kind: DivergenceKind
    microbatch: Optional[int]
    name: str
    detail: str = ""
    ulp: Optional[int] = None      # loss / grad_norm: ULP distance of the two bit patterns, else None
    ulp_bits: Optional[int] = None  # their width (32; 64 for megatron-core's float64 grad norm), with `ulp`
    # the first difference in canonical parameter order when it is another tensor than this one (which is
    # the first in dataflow order), one line like `detail`; None when both orders name the same tensor
    canonical: Optional[str] = None


@dataclass
class StepSeries:
    """Per-step scalars of one run, for curves and tables (index = step)."""

    lm_loss: list[float] = field(default_factory=list)          # reported lm loss (global per-token mean)
    lm_loss_hex: list[str] = field(default_factory=list)        # its fp32 bits, "0x3f8ccccd"
    mtp_loss: list[list[float]] = field(default_factory=list)   # [step][depth k-1]
    grad_norm: list[Optional[float]] = field(default_factory=list)  # None when clip_grad == 0
    grad_norm_hex: list[Optional[str]] = field(default_factory=list)
    grad_norm_ulp: list[Optional[int]] = field(default_factory=list)   # ULP distance from the reference run's
    clip_coeff: list[Optional[float]] = field(default_factory=list)     # None when clip_grad == 0
    clipped: list[Optional[bool]] = field(default_factory=list)        # whether clipping triggered (coeff < 1)
    # steps after which the run resumed from a checkpoint (new processes loaded it); a run resumed after step k
    # has no values before step k + 1: its lists hold NaN / "" / None there, so that the index is still the step
    resumed_after: list[int] = field(default_factory=list)


@dataclass
class VariantResult:
    """Outcome of one variant compared with the baseline (the baseline itself has expect='bitwise')."""

    name: str
    layout: str
    pp: int
    vpp: int
    mtp_standalone: bool
    expect: Expect
    verdict: Verdict
    bitwise_equal: Optional[bool]                 # None when the run errored
    first_divergence: Optional[FirstDivergence]
    reason: str = ""                              # one line: why pass/fail/error
    error: Optional[str] = None                   # error text incl. the failing rank's last log lines
    layout_grid: str = ""                         # `PipelineLayout.pretty()`
    options: dict = field(default_factory=dict)   # the variant's overrides of the case defaults
    series: StepSeries = field(default_factory=StepSeries)
    # mismatch counts per step per family: {"grad": [{family: n}, ...per step], "param": [...], "buffer": [...]}
    family_mismatches: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    run_dir: str = ""                             # relative to the report dir
    command: str = ""                             # command that reproduces this variant alone
    compare_to: str = ""                          # the reference run it is compared with
    reductions: str = "megatron"                  # reduction mode (reference_impl/reductions.py)
    trainer: str = DEFAULT_TRAINER                # which trainer ran it (harness.planning.trainers)
    clip_grad: float = 0.0
    # schedule timeline with unit costs (forward 1, backward 2): one dict per compute action
    # {rank, start, end, op: "F"|"B", stage, microbatch}; and the idle fraction of rank-time
    # run-to-run control (`repeat: n`): {"runs": n, "deterministic": bool, "first_divergence": dict|None,
    # "detail": str}; {} when the variant ran once.  Kept apart from the layout comparison.
    run_to_run: dict = field(default_factory=dict)
    # ULP evidence at the first diverging step (`harness.running.evidence`): per differing tensor {key, what:
    # "grad"|"param", dtype, numel, differing, fraction, max_ulp, median_ulp, histogram, max_abs_err,
    # max_rel_err, nan_mismatch}; [] when not collected.  `evidence_error`: why collection failed.
    ulp_evidence: list = field(default_factory=list)
    # with capture: activations (`harness.judging.localise`): {step, microbatch, tensor, direction, message} of the
    # first differing in-step tensor; {} when not captured or not found
    localisation: dict = field(default_factory=dict)
    evidence_error: str = ""
    timeline: list = field(default_factory=list)
    bubble_fraction: Optional[float] = None
    # parameter-inventory differences from the reference run, one line each, in canonical order
    # ("<key>: only in the baseline", "<key>: weight_decay True (baseline) vs False"); empty when equal
    inventory: list = field(default_factory=list)
    # this run's own replicas vs their originals (`harness.judging.compare.replica_status`):
    # {"consistent": bool, "first_broken_step": int|None, "replicas": [keys], "detail": str}; {} on error
    replica_status: dict = field(default_factory=dict)
    expert_model_parallel_size: int = 1           # EP
    data_parallel_size: int = 1                   # DP (megatron-core; the run has pp x max(DP, EP) ranks)
    tensor_model_parallel_size: int = 1                 # TP (megatron-core)
    sequence_parallel: bool = False
    # megatron's MoE 1F1B overlap as it ran (`harness.judging.trace.overlap_coverage`): {"merged": {rank: [per step]},
    # "backward_dw": {...}, "warning": str | None}; {} without the overlap
    overlap_coverage: dict = field(default_factory=dict)
    overlap: bool = False                         # overlap_moe_expert_parallel_comm (Megatron's 1F1B overlap)
    delay_wgrad: bool = False                     # delay_wgrad_compute
    outcome: Outcome | Literal[""] = ""           # what happened, in words (`harness.judging.judge.judge`); "" unjudged
    # differences outside the expected divergence's signature (`harness.judging.signature`), one line each
    # ("step 0 grad mtp.layers.0.eh_proj.weight"), at most 20 then "… and N more"; [] when none or not checked
    outside_signature: list = field(default_factory=list)
    outside_signature_count: int = 0              # how many differences lie outside (all, not only the lines)
    # comparison with the golden trace (`harness.judging.golden`, `verify --golden DIR`): {"status": "equal" | "differs"
    # | "missing" | "other environment", "first_divergence": dict | None, "detail": str}; {} when not asked
    golden: dict = field(default_factory=dict)
    # the upstream bug this run states (its `bug:` for the run's megatron version), and where the run first went
    # wrong when not finite (`harness.judging.trace.NonFinite` as words); None / "" otherwise
    bug: Optional[str] = None
    nonfinite: str = ""
    # bugs the case states for other megatron versions than this run's, "<bug> (megatron-core <versions>)": the
    # report says they pass here
    bug_elsewhere: list = field(default_factory=list)
    # MTP depth D of the run's model (0: no MTP, the report labels its layout so); None when not known
    mtp_num_layers: Optional[int] = None
    # the run whose checkpoint this one resumed from (a case's `resume:`); None when it did not resume
    resumed_from: Optional[str] = None

    @property
    def schedule(self) -> str:
        """The schedule's name: no pipelining, 1F1B or interleaved, + "overlap" (and delayed wgrad)."""
        name = "no pipelining" if self.pp == 1 else ("1F1B" if self.vpp == 1 else "interleaved")
        if self.overlap:
            name += " · overlap" + (" + delayed wgrad" if self.delay_wgrad else "")
        return name


@dataclass
class CaseResult:
    """Everything the report needs for one case file."""

    case: str
    case_path: str
    baseline: str
    variants: list[VariantResult]                 # baseline first
    elapsed_s: float
    environment: dict                             # torch version, threads, python, platform, device
    command: str                                  # command line that reproduces the whole report
    cross_implementation: Optional[dict] = None   # harness.judging.crossimpl's record, when the case asks for one
    # `verify --golden DIR`: {"dir": str, "environment": "same" | one line naming what differs, "verdict":
    # "pass" | "fail" | "unchecked" (differs on a CPU family the goldens were never checked on, when they were
    # checked on fewer than two: `harness.judging.golden.check`), "checked_on"}; None
    # when not asked
    golden: Optional[dict] = None
    # `verify --megatron-base/--megatron-head` (harness.planning.sources): {"head": {"path", "version", "commit",
    # "modified"}, "base": {...}, "same": bool (base is head's directory)}; None when the case ran on the
    # interpreter's megatron alone
    megatron_sources: Optional[dict] = None
    # which runs agree (`harness.judging.agreement.groups`): {"split": bool, "computations": [{"label", "key", "split",
    # "warning": str | None, "groups": [{"runs", "size", "has_baseline", "classes"}], "classes": [{"runs",
    # "size", "has_baseline", "group"}]}], "errored": [str]}; {} when not computed
    agreement: dict = field(default_factory=dict)
    # runs of the case not made on this megatron, as the case states (a megatron_versions entry's not_run):
    # [{"name", "reason"}]
    not_run: list = field(default_factory=list)

    @property
    def all_pass(self) -> bool:
        """True when every variant's verdict is pass and the cross-implementation check and the golden check
        (if any) passed (the CLI's exit code 0); a golden ``unchecked`` on this CPU family is not a failure."""
        return all(v.verdict == "pass" for v in self.variants) and \
            (self.cross_implementation is None or self.cross_implementation.get("verdict") == "pass") and \
            (self.golden is None or self.golden.get("verdict") in ("pass", "unchecked"))
