"""The case file's schema (pydantic models; `harness.planning.cases` reads, validates and plans a case with them).

Schema (unknown keys and wrong types are errors naming the key; top-level keys starting with ``x-`` are
ignored, so they can hold YAML anchors that variants merge with ``<<: *anchor``; ``extends: other.yaml``
starts from another case and deep-merges this file's mappings over it)::

    name: dsv3                       # optional, defaults to the file stem
    description: ...
    timeout_s: 600                   # per run watchdog
    device: cpu                      # or cuda (params_dtype then defaults to bfloat16); num_gpus: N
    model: {ModelConfig fields}      # trainerkit.config
    training: {TrainingConfig fields}
    baseline: {name, pipeline_model_parallel_layout, pipeline_model_parallel_size, options}
    trainer: reference               # or megatron-core (harness.planning.trainers); a variant may set its own
    cross_implementation: {variant: pp1, step: 0, max_ulp: 16}   # optional: that run again by the other
                                     # trainer, from the same weights and data, compared in ULPs (harness.judging.crossimpl;
                                     # both in params_dtype: float32 by default); `against: <variant>`:
                                     # compared with that variant by the same trainer instead (TP 2 vs TP 1)
    variants:
      - name: ...
        pipeline_model_parallel_layout: "Et*3|(tt|)*29,m|L"
        pipeline_model_parallel_size: 16
        expert_model_parallel_size: 2  # EP (default 1): routed experts over 2 ranks per pipeline rank, world P x EP;
                                     # num_moe_experts and seq_length*micro_batch_size must be divisible by it
        data_parallel_size: 2          # DP (megatron-core; default 1): world P x DP, DP rank d trains global
                                     # microbatch m*DP+d; Megatron's EP is carved out of DP (EP divides DP)
        tensor_model_parallel_size: 2  # TP (megatron-core; default 1): world P x TP x DP; with TP, ETP x EP
        sequence_parallel: true        # divides TP x DP; expert_tensor_parallel_size: default TP (Megatron-LM's)
        options: {clip_grad: 0.05}   # overrides of `training` for this variant
        compare_to: other-variant    # reference run (default: the baseline)
        repeat: 2                    # also run it again and require the runs bitwise equal (a control)
        expect: bitwise | may_diverge | diverge
        first_divergence: {step: 0, kind: grad, name: embedding.word_embeddings.weight}   # with may_diverge
                                     # (required) or diverge (optional); kinds: inventory, loss, grad, grad_norm,
                                     # optimizer_state (Adam's moments), param, buffer (the routers' expert_bias); max_ulp: N bounds a loss / grad_norm first divergence; a list
                                     # [{...}, {...}] allows any one of several places
        signature: [{step: 0, kind: grad, name: ...}, {from_step: 1}]   # everything that may differ
                                     # (harness.judging.signature; default: derived from first_divergence)
        replica_drift: {name: embedding.word_embeddings.weight@mtp, step: 0}   # a replica stated to train
                                     # apart (an upstream bug); any other replica drift fails the run, whatever
                                     # its expect (harness.judging.judge), and a stated one that does not happen too

    ``may_diverge`` is the honest statement about rounding: the run may be bitwise equal, and if it is not, its
    first divergence must be the one given (so nothing differs before it).  Use it wherever a difference
    depends on the values (a sum regrouped by the layout: whether its last bit moves depends on the data, the
    CPU's kernels, the GPU).  ``diverge`` demands a difference: keep it for differences that are certain by
    construction (another model, another microbatch count, a planted bit flip).
        inject: grad_bit_flip        # test-only planted fault (reference_impl.faults); --inject sets it for all
        trainer: megatron-core       # this variant's trainer (default: the case's `trainer:`, itself default
                                     # reference); harness.planning.trainers says what megatron-core can run
        megatron: {batch_p2p_comm: true}   # megatron's own options (megatron_trainer.options), over the case's
                                     # top-level `megatron:` mapping
        model_class: hybrid          # megatron-core's HybridModel (>= 0.17; default: the case's model_class, itself
        hybrid_layer_pattern: "+-+E|+E+E/+E"   # default gpt): its layout instead of pipeline_model_parallel_layout
                                     # (trainerkit.hybrid_pattern: DeepSeek-V3 blocks '+-' / '+E', '|' segments,
                                     # '/' MTP depths); GPT layer i is Hybrid layers 2i and 2i + 1
        layout_rules: megatron       # only megatron's layout rules (run a layout megatron accepts and trains wrong)
        bug: "Megatron-LM d7500d4d2a"  # the upstream bug this run states (the report shows it with what moved)
        megatron_versions:           # what holds on other megatron-core versions (first match): expect,
          - {versions: "<0.17", expect: not_finite, first_divergence: {step: 1, kind: loss, name: mtp_1}}
                                     # first_divergence, signature, replica_drift, bug; expect: not_finite = the run must stop
                                     # being finite there (a bug caught); {versions: "<0.17", not_run: "why"}:
                                     # the run is not made there (listed as such; what compares with it neither)

`harness.planning.cases` plans what passes the schema: layouts, schedules, sizes, trainers, megatron's own validators.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainerkit.config import (
    DEFAULT_TRAINER,
    MAX_GPUS,
    MAX_TIMEOUT_S,
    ModelClass,
    ModelConfig,
    TrainerName,
    TrainingConfig,
)

from ..judging.crossimpl import CrossImplementationSpec
from ..judging.results import DivergenceKind, Expect
from ..judging.signature import SignaturePlace
from . import bounds
from .expectations import check_specifiers


class _Strict(BaseModel):
    # allow_inf_nan=False: `timeout_s: .inf` would let a hung rank hang forever
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ExpectedDivergence(_Strict):
    """Where a `diverge` / `may_diverge` variant must first differ: any field left out (None) matches anything.
    `max_ulp` (loss and grad_norm only: a scalar with one bit pattern per run) bounds the distance in ULPs."""

    step: Optional[int] = Field(None, ge=0)     # None: any step
    kind: DivergenceKind
    name: Optional[str] = None
    _name_printable = field_validator("name")(bounds.printable)
    microbatch: Optional[int] = Field(None, ge=0)
    max_ulp: Optional[int] = Field(None, ge=0)


class ReplicaDrift(_Strict):
    """A replica stated to train apart from its original (an upstream bug, e.g. Megatron-LM e0afe89a75: with
    ``decoupled_lr`` the MTP stage's word-embedding copy trains at the base LR): the run passes its replica check
    only when the first broken replica (`harness.judging.compare.replica_status`) is `name` (a trace key with its replica
    tag, ``embedding.word_embeddings.weight@mtp``) from `step` (None: any step), and fails when every replica
    matches (the bug is not caught)."""

    name: str = Field(min_length=1, max_length=300)
    step: Optional[int] = Field(None, ge=0)
    _name_printable = field_validator("name")(bounds.printable)


def _one_or_more(v):
    """A single place written as a mapping is a list of one (``first_divergence: {kind: grad}``)."""
    return [v] if isinstance(v, dict) else v


class ResumeSpec(_Strict):
    """Start from the checkpoint that run `variant` saves after step `after_step` (any layout: checkpoints
    use global parameter names); the resumed steps are compared with this variant's reference run."""

    variant: str
    after_step: int = Field(ge=0)
    _variant_printable = field_validator("variant")(bounds.printable)


def _crash_with_bug(spec):
    """A stated crash names the upstream bug behind it (`bug`): the report says what was caught."""
    if spec.crash is not None and not spec.bug:
        raise ValueError("crash: needs bug: (the upstream bug the run crashes with, which the report names)")
    return spec


class VersionExpectation(_Strict):
    """What holds for a run on the megatron-core versions `versions` (PEP 440 specifiers, e.g. ``"<0.17"``,
    ``">=0.17,<0.20"``; pre-releases and Megatron-LM checkouts match by their version number): it replaces the
    run's expect / first_divergence / signature / bug there, so one case states an upstream bug and its fix."""

    versions: str = Field(min_length=1, max_length=200)
    expect: Optional[Expect] = None     # required unless not_run
    # the run is not made on these versions, and why in one line (a model class they do not have): the report
    # lists it as not run there, as the case states; nothing else may be said with it
    not_run: Optional[str] = Field(None, min_length=1, max_length=300)
    crash: Optional[str] = Field(None, min_length=1, max_length=300)    # as VariantSpec.crash, on these versions
    first_divergence: Optional[list[ExpectedDivergence]] = None
    signature: Optional[list[SignaturePlace]] = None
    replica_drift: Optional[list[ReplicaDrift]] = None
    bug: Optional[str] = Field(None, max_length=300)
    _printable = field_validator("versions", "bug", "not_run", "crash")(bounds.printable)

    _specifiers = field_validator("versions")(check_specifiers)
    _lists = field_validator("first_divergence", "replica_drift", mode="before")(_one_or_more)

    @model_validator(mode="after")
    def _expect_or_not_run(self):
        said = [k for k in ("crash", "first_divergence", "signature", "replica_drift", "bug")
                if getattr(self, k) is not None]
        if self.not_run is not None and (self.expect is not None or said):
            first = "expect" if self.expect is not None else said[0]
            raise ValueError(f"not_run: the run is not made on {self.versions}, so {first} says nothing there")
        _crash_with_bug(self)
        if self.not_run is None and self.expect is None and self.crash is None:
            raise ValueError("expect: required (or crash: the error a known upstream bug stops the run with, or "
                             "not_run: why the run is not made on these versions)")
        return self


class VariantSpec(_Strict):
    """One run of the case: a layout and P, overrides of `training`, and what its comparison must show."""

    name: str = Field(min_length=1, max_length=100)
    # the GPT layout; a HybridModel variant (model_class: hybrid) gives hybrid_layer_pattern instead
    pipeline_model_parallel_layout: Optional[str] = None
    hybrid_layer_pattern: Optional[str] = Field(None, max_length=100_000)
    model_class: Optional[ModelClass] = None     # default: the case's
    pipeline_model_parallel_size: int = Field(ge=1, le=1024)
    expert_model_parallel_size: int = Field(1, ge=1, le=64)
    data_parallel_size: int = Field(1, ge=1, le=64)     # megatron-core only: world P x DP, EP divides DP
    # megatron-core only: TP (world P x TP x DP), sequence parallelism, expert TP (None: TP, as Megatron-LM)
    tensor_model_parallel_size: int = Field(1, ge=1, le=64)
    sequence_parallel: bool = False
    expert_tensor_parallel_size: Optional[int] = Field(None, ge=1, le=64)
    overlap_moe_expert_parallel_comm: bool = False    # Megatron's 1F1B overlap schedule
    delay_wgrad_compute: bool = False
    options: dict = Field(default_factory=dict)
    # not_finite: the run must become not finite (a bug caught), first where first_divergence says (kind loss or
    # grad_norm, name lm / mtp_k / grad norm); its comparison with compare_to is not judged
    expect: Expect = "bitwise"
    # one place, or a list of places any one of which may be the first divergence
    first_divergence: Optional[list[ExpectedDivergence]] = None
    signature: Optional[list[SignaturePlace]] = None    # everything that may differ (harness.judging.signature)
    # replicas stated to train apart from their originals (an upstream bug); any other drift fails the run
    replica_drift: Optional[list[ReplicaDrift]] = None
    inject: Optional[str] = None        # test-only planted fault (reference_impl.faults)
    compare_to: Optional[str] = None    # reference run (another variant); default: the baseline
    repeat: int = Field(1, ge=1, le=5)  # run it this many times: a run-to-run (nondeterminism) control
    resume: Optional[ResumeSpec] = None  # start from another run's checkpoint
    trainer: Optional[TrainerName] = None     # default: the case's
    # megatron's own options by Megatron-LM's names, over the case's `megatron:` (megatron_trainer.options)
    megatron: dict = Field(default_factory=dict)
    # megatron: only megatron's own layout rules (run a layout megatron accepts and trains wrong)
    layout_rules: Literal["bitparity", "megatron"] = "bitparity"
    # the upstream bug this run exposes (a Megatron-LM commit or issue): the report shows it beside the verdict
    bug: Optional[str] = Field(None, max_length=300)
    # a known upstream crash: the run must stop with an error whose text contains this (with `bug`, naming it);
    # it passes as "crashed as stated", fails if it completes (the bug was fixed: say so) or stops otherwise
    crash: Optional[str] = Field(None, min_length=1, max_length=300)
    # what holds on other megatron versions: the first entry whose `versions` (PEP 440) match the run's
    # megatron-core replaces expect / first_divergence / signature / replica_drift / bug (harness.planning.expectations.resolve)
    megatron_versions: list[VersionExpectation] = Field(default_factory=list, max_length=16)
    # names reach the terminal and the report: an ANSI escape or a newline in one is rejected, not printed
    _names_printable = field_validator("name", "compare_to", "inject", "bug", "crash")(bounds.printable)
    _lists = field_validator("first_divergence", "replica_drift", mode="before")(_one_or_more)

    @model_validator(mode="after")
    def _crash_names_its_bug(self):
        return _crash_with_bug(self)


class CaseSpec(_Strict):
    """A whole case file (schema in the module docstring)."""

    name: Optional[str] = Field(None, min_length=1)      # left out: the file's stem; "" is a mistake
    description: str = ""
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    device: Literal["cpu", "cuda"] = "cpu"
    params_dtype: Optional[Literal["float32", "bfloat16"]] = None   # default: float32 on cpu, bfloat16 on cuda
    num_gpus: Optional[int] = Field(None, ge=1, le=MAX_GPUS)         # cuda: GPUs to spread ranks over
    capture: Literal["full", "activations"] = "full"                 # activations: in-step fingerprints too
    trainer: TrainerName = DEFAULT_TRAINER     # harness.planning.trainers; a variant may override
    model_class: ModelClass = "gpt"            # megatron-core's GPTModel or HybridModel; a variant may override
    # megatron's own options by Megatron-LM's names (megatron_trainer.options); a variant's `megatron:` adds to it
    megatron: dict = Field(default_factory=dict)
    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    baseline: VariantSpec
    variants: list[VariantSpec] = Field(default_factory=list)
    # one run repeated by the other trainer from identical weights and data, measured in ULPs (harness.judging.crossimpl)
    cross_implementation: Optional[CrossImplementationSpec] = None
