"""Case files: YAML -> validated plan (one `RunConfig` per variant), or one `UsageError` line.

The schema is `harness.planning.case_schema` (its docstring spells it out).  Every layout is parsed and validated and every
schedule is dry-run (`trainerkit.schedule.simulate`) here, before anything runs or is written.  Sizes are bounded
first (`harness.planning.bounds`: the file and its YAML alias expansion, P x EP ranks, P x V x num_microbatches;
`trainerkit.config`: finite floats, model sizes), so a case that passes cannot exhaust memory or processes later.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml
from pydantic import ValidationError

from trainerkit.config import (
    DEFAULT_TRAINER,
    DataConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    overlap_problem,
    ranks_per_stage,
)
from trainerkit.data import DataError, TokenDataset
from trainerkit.hybrid_pattern import check_against_model, parse_hybrid_pattern, pipeline_layout
from trainerkit.layout import LayoutError, PipelineLayout
from trainerkit.parallel_rules import check_data_parallel_microbatches, check_expert_parallel, check_tensor_parallel
from trainerkit.schedule import ScheduleError, build_schedule, simulate

from ..errors import UsageError
from . import bounds, expectations, trainers
from .case_schema import CaseSpec, VariantSpec
from .crosscheck import check_cross_implementation


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a mapping key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:          # the node's own keys; '<<' merges may be overridden
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = key_node.value
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class PlannedRun:
    """One variant ready to run: its spec, full run config and validated layout."""

    spec: VariantSpec
    config: RunConfig
    layout: PipelineLayout
    is_baseline: bool
    twin_of: Optional[str] = None   # the run of the case file this one repeats on another megatron (harness.planning.sources)
    # the variant as the case file writes it, before its megatron_versions entry for the run's megatron was applied
    declared: Optional[VariantSpec] = None
    # why the run is not made on this megatron (its megatron_versions entry's not_run), or None
    not_run: Optional[str] = None


@dataclass
class CasePlan:
    """A validated case: its name (the report directory), file, spec and runs (baseline first)."""

    name: str
    path: Path
    spec: CaseSpec
    runs: list[PlannedRun]      # baseline first
    not_run: list[PlannedRun] = field(default_factory=list)    # not made on this megatron, as the case states
    # two megatron sources compared (harness.planning.sources): {"base": {...}, "head": {...}} and the flags that say so,
    # which every reproduce command repeats
    megatron_sources: Optional[dict] = None
    flags: list = field(default_factory=list)

    def facts(self) -> dict:
        """What the case adds to the machine's facts that its bits depend on: thread count, device and
        params_dtype (recorded in the report's environment, and part of the golden key, `harness.judging.golden`)."""
        return {"num_threads": self.spec.training.num_threads, "device": self.spec.device,
                "params_dtype": self.runs[0].config.params_dtype}


def _loc(err: ValidationError, raw: Optional[dict] = None) -> str:
    """'<key path>: <message>' of the first error; a variant is named by its name, not its list index."""
    first = err.errors()[0]
    loc = list(first["loc"])
    if raw is not None and len(loc) >= 2 and loc[0] == "variants" and isinstance(loc[1], int):
        items = raw.get("variants")
        name = items[loc[1]].get("name") if isinstance(items, list) and loc[1] < len(items) and \
            isinstance(items[loc[1]], dict) else None
        if isinstance(name, str) and name.isprintable() and loc[2:3] != ["name"]:
            return f"variant {name!r}: {'.'.join(str(p) for p in loc[2:]) or '(the variant)'}: {first['msg']}"
    # a model validator's ValueError has no key path and pydantic's "Value error, " prefix: the message names it
    msg = first["msg"].removeprefix("Value error, ")
    where = ".".join(str(p) for p in loc)
    return f"{where}: {msg}" if where else msg


def load_case(path: str | Path, only: Optional[list[str]] = None, inject: Optional[str] = None,  # noqa: C901 (one check per case field; next: a planner per variant)
              overrides: Optional[dict] = None) -> CasePlan:
    """Read, validate and plan a case file.  `only` keeps the named variants (the baseline always runs).

    Raises:
        UsageError: missing or unreadable file, YAML syntax, oversized file or alias expansion, schema
            violation (non-finite or out-of-bounds numbers, non-printable names), invalid layout or option,
            impossible or oversized schedule, too many ranks, duplicate or unknown variant names, a compare_to
            cycle — one line naming the file and the place.
    """
    path = Path(path)
    raw = _read_yaml(path, seen=())
    raw = _deep_merge(raw, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        spec = CaseSpec.model_validate(raw)
    except ValidationError as e:
        raise UsageError(f"{path}: {_loc(e, raw)}") from None
    _check_data(path, spec)
    if spec.device == "cuda":
        import torch  # the forkserver's children, not this process, run CUDA work
        if not torch.cuda.is_available():
            raise UsageError(f"{path}: device: cuda, but no CUDA device is available here")
        if spec.num_gpus and spec.num_gpus > torch.cuda.device_count():
            raise UsageError(f"{path}: num_gpus: {spec.num_gpus}, but only {torch.cuda.device_count()} "
                             "CUDA devices are visible")
    case_name = spec.name or path.stem
    if not _NAME.match(case_name):
        raise UsageError(f"{path}: name {case_name!r}: use letters, digits, '.', '_', '-' (it names the report "
                         "directory), at most 64 characters, not starting with '.'")
    if not spec.variants:
        raise UsageError(f"{path}: no variants: nothing to compare with the baseline")
    names = [spec.baseline.name] + [v.name for v in spec.variants]
    dup = {n for n, k in Counter(names).items() if k > 1}      # linear: a case may list thousands
    if dup:
        raise UsageError(f"{path}: duplicate variant name {sorted(dup)[0]!r}")
    for v in spec.variants:
        if v.compare_to is not None and v.compare_to not in names:
            raise UsageError(f"{path}: variant {v.name!r}: compare_to {v.compare_to!r} is not a variant")
        if v.compare_to == v.name:
            raise UsageError(f"{path}: variant {v.name!r}: compare_to names itself")
    # a cycle (a -> b -> a) would leave every run on it uncompared with the baseline
    cycle = bounds.compare_to_cycle({v.name: v.compare_to for v in spec.variants})
    if cycle:
        raise UsageError(f"{path}: compare_to cycle {' -> '.join(map(repr, cycle))}: every chain of compare_to "
                         "must end at the baseline")
    if spec.baseline.resume is not None:
        raise UsageError(f"{path}: baseline {spec.baseline.name!r}: resume: the baseline is the reference of the "
                         "other runs and starts from step 0; give resume: to a variant")
    for v in spec.variants:
        if v.resume is not None:
            src = next((x for x in [spec.baseline] + spec.variants if x.name == v.resume.variant), None)
            if src is None or src.resume is not None or src.name == v.name:
                raise UsageError(f"{path}: variant {v.name!r}: resume.variant {v.resume.variant!r} must name "
                                 "another variant that does not itself resume")
            iters = TrainingConfig.model_validate({**spec.training.model_dump(), **v.options}).train_iters
            if v.resume.after_step >= iters - 1:
                raise UsageError(f"{path}: variant {v.name!r}: resume.after_step {v.resume.after_step} leaves "
                                 f"no step to run (train_iters {iters})")
    saves: dict = {}
    for v in spec.variants:
        if v.resume is not None and saves.setdefault(v.resume.variant, v.resume.after_step) != v.resume.after_step:
            raise UsageError(f"{path}: run {v.resume.variant!r} can save one checkpoint; variants resume from it "
                             "after different steps")
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise UsageError(f"{path}: --only {unknown[0]!r} is not a variant (have: {', '.join(names)})")
    if only:      # keep the selected variants and, transitively, the runs they are compared with
        refs = {v.name: [v.compare_to or spec.baseline.name] + ([v.resume.variant] if v.resume else [])
                for v in spec.variants}
        keep, todo = set(), list(only)
        while todo:
            n = todo.pop()
            if n not in keep:
                keep.add(n)
                todo += refs.get(n, [])
        only = keep
    runs = [_plan(path, spec, spec.baseline, True, inject)]
    runs += [_plan(path, spec, v, False, inject) for v in spec.variants if not only or v.name in only]
    runs, not_run = expectations.split_not_run(path, runs)
    _check_resume_trainers(path, spec)
    _check_resume_loadable(path, runs)
    check_cross_implementation(path, spec, runs, names, not_run)
    return CasePlan(name=case_name, path=path, spec=spec, runs=runs, not_run=not_run)


def _check_resume_trainers(path: Path, spec: CaseSpec) -> None:
    """A run resumes from a checkpoint of its own trainer (the formats differ: safetensors by global name,
    megatron's ``dist_checkpointing``), one that writes checkpoints (the harness adds both to the run configs
    after planning, so `trainers.problem` cannot see them)."""
    trainer = {v.name: v.trainer or spec.trainer or DEFAULT_TRAINER for v in [spec.baseline] + spec.variants}
    for v in spec.variants:
        if v.resume is None:
            continue
        for who, name in (("variant", v.name), ("resume.variant", v.resume.variant)):
            if trainers.entry(trainer[name]).resume_problem is None:
                raise UsageError(f"{path}: variant {v.name!r}: {who} {name!r} runs on trainer {trainer[name]}, which "
                                 "does not checkpoint or resume")
        if trainer[v.name] != trainer[v.resume.variant]:
            raise UsageError(f"{path}: variant {v.name!r} runs on trainer {trainer[v.name]} but resumes from "
                             f"{v.resume.variant!r} of trainer {trainer[v.resume.variant]}: a run resumes from its "
                             "own trainer's checkpoint")


def _check_resume_loadable(path: Path, runs: list) -> None:
    """A run resumes only from a checkpoint its trainer can load into it (`trainers.resume_problem`)."""
    configs = {r.spec.name: r.config for r in runs}
    for r in runs:
        if r.spec.resume is None:
            continue
        problem = trainers.resume_problem(configs[r.spec.resume.variant], r.config)
        if problem:
            raise UsageError(f"{path}: variant {r.spec.name!r} resumes from {r.spec.resume.variant!r}: {problem}")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path, seen: tuple) -> dict:
    """Load a case mapping; ``extends: other.yaml`` (relative to this file) deep-merges this file over it.
    Top-level keys starting with ``x-`` only hold YAML anchors and are dropped.  Each file's size and alias
    expansion are bounded (`harness.planning.bounds`) before anything is merged."""
    text = bounds.read_case_text(path)
    if path.resolve() in seen:
        raise UsageError(f"{path}: 'extends' cycle")
    if len(seen) >= bounds.MAX_EXTENDS:
        raise UsageError(f"{path}: 'extends' chain longer than {bounds.MAX_EXTENDS} files")
    try:
        raw = bounds.load_yaml(path, text, _UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise UsageError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: a case file must be a YAML mapping")
    raw = {k: v for k, v in raw.items() if not (isinstance(k, str) and k.startswith("x-"))}
    parent = raw.pop("extends", None)
    if parent is not None:
        if not isinstance(parent, str):
            raise UsageError(f"{path}: extends must be a file name")
        raw = _deep_merge(_read_yaml(path.parent / parent, seen + (path.resolve(),)), raw)
    return raw


def _beside(path: Path, data: DataConfig) -> DataConfig:
    """`data` with a relative path resolved against the case file `path` (training's and each variant's)."""
    if data.path and not Path(data.path).is_absolute():
        return data.model_copy(update={"path": str((path.parent / data.path).resolve())})
    return data


def _check_data(path: Path, spec: CaseSpec) -> None:
    """Load the data once here so a missing file or an out-of-vocabulary token is a usage error."""
    data = _beside(path, spec.training.data)
    spec.training = spec.training.model_copy(update={"data": data})
    try:
        TokenDataset(data, 0, spec.training.seq_length, 1, spec.model.vocab_size)
    except DataError as e:
        raise UsageError(f"{path}: training.{e}") from None
    except OSError as e:        # unreadable file: name it, not "internal error: PermissionError"
        raise UsageError(f"{path}: training.data.path {data.path}: {bounds.os_reason(e)}") from None


def _short(text: str) -> str:
    """`text` quoted, cut to one readable line."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def _layout_text(where: str, v: VariantSpec, model_class: str, model) -> str:
    """The variant's GPT layout: its ``pipeline_model_parallel_layout``, or for a HybridModel the layout of its
    ``hybrid_layer_pattern``'s placement (`trainerkit.hybrid_pattern`).

    Raises:
        UsageError: the field of the other model class given, or neither, or a malformed pattern."""
    if model_class == "hybrid":
        if v.pipeline_model_parallel_layout is not None:
            raise UsageError(f"{where}: a HybridModel variant (model_class: hybrid) places its layers with "
                             "hybrid_layer_pattern, not pipeline_model_parallel_layout (one that `extends:` or a "
                             "YAML merge brings is cleared with pipeline_model_parallel_layout: null)")
        if v.hybrid_layer_pattern is None:
            raise UsageError(f"{where}: model_class: hybrid needs hybrid_layer_pattern (HybridModel's layout)")
        try:
            pattern = parse_hybrid_pattern(v.hybrid_layer_pattern)
        except LayoutError as e:
            raise UsageError(f"{where}: {e}") from None
        # in the pattern's own words before its GPT layout is checked (which counts 't' and 'm')
        problem = check_against_model(pattern, model.moe_layers, model.mtp_num_layers)
        if problem:
            raise UsageError(f"{where}: hybrid_layer_pattern {_short(pattern.text)}: {problem}")
        return pattern.layout
    if v.hybrid_layer_pattern is not None:
        raise UsageError(f"{where}: hybrid_layer_pattern is HybridModel's layout: it needs model_class: hybrid")
    if v.pipeline_model_parallel_layout is None:
        raise UsageError(f"{where}: pipeline_model_parallel_layout is missing")
    return v.pipeline_model_parallel_layout


def _plan(path: Path, spec: CaseSpec, v: VariantSpec, is_baseline: bool, inject: Optional[str]) -> PlannedRun:
    where = f"{path}: {'baseline' if is_baseline else 'variant'} {v.name!r}"
    try:
        training = TrainingConfig.model_validate({**spec.training.model_dump(), **v.options})
    except ValidationError as e:
        raise UsageError(f"{where}: options.{_loc(e)}") from None
    expectations.check(where, v.expect, v.first_divergence, is_baseline, spec.model, training, v.signature,
                       v.replica_drift)
    for i, e in enumerate(v.megatron_versions):
        if is_baseline:
            raise UsageError(f"{where}: the baseline cannot carry an expectation (megatron_versions)")
        if e.not_run is None:
            expectations.check(f"{where}: megatron_versions[{i}] ({e.versions})", e.expect, e.first_divergence, False,
                               spec.model, training, e.signature, e.replica_drift)
    training = training.model_copy(update={"data": _beside(path, training.data)})
    if training.data != spec.training.data:
        try:
            TokenDataset(training.data, 0, training.seq_length, 1, spec.model.vocab_size)
        except DataError as e:
            raise UsageError(f"{where}: options.{e}") from None
        except OSError as e:
            raise UsageError(f"{where}: options.data.path {training.data.path}: {bounds.os_reason(e)}") from None
    model_class = v.model_class or spec.model_class
    layout_text = _layout_text(where, v, model_class, spec.model)
    P, EP = v.pipeline_model_parallel_size, ranks_per_stage(v.tensor_model_parallel_size, v.data_parallel_size,
                                                            v.expert_model_parallel_size)
    bounds.check_run_size(where, P, EP)
    try:
        layout = pipeline_layout(parse_hybrid_pattern(v.hybrid_layer_pattern), P, spec.model.num_layers,
                                 spec.model.mtp_num_layers) if model_class == "hybrid" else \
            PipelineLayout.from_string(layout_text, P, spec.model.num_layers, spec.model.mtp_num_layers,
                                       megatron_rules_only=v.layout_rules == "megatron")
        # before the schedule is built: its size is P x V x M actions (P=1024 x 4096 was a MemoryError)
        bounds.check_run_size(where, P, EP, layout.virtual_pipeline_model_parallel_size, training.num_microbatches)
        simulate(build_schedule(layout, training.num_microbatches, training.seq_length,
                                training.micro_batch_size, spec.model.hidden_size,
                                v.overlap_moe_expert_parallel_comm))
    except LayoutError as e:
        raise UsageError(f"{where}: {e}") from None
    except ScheduleError as e:          # the schedule speaks of the GPT layout: name the pattern it came from
        pattern = f"hybrid_layer_pattern {_short(v.hybrid_layer_pattern)} (GPT layout " \
                  f"{_short(layout_text)}): " if model_class == "hybrid" else ""
        raise UsageError(f"{where}: {pattern}{e}") from None
    problem = overlap_problem(spec.model, v.overlap_moe_expert_parallel_comm, v.delay_wgrad_compute)
    if problem:
        raise UsageError(f"{where}: {problem}")
    parallel = ParallelConfig(pipeline_model_parallel_layout=layout_text, hybrid_layer_pattern=v.hybrid_layer_pattern,
                              pipeline_model_parallel_size=v.pipeline_model_parallel_size,
                              expert_model_parallel_size=v.expert_model_parallel_size,
                              data_parallel_size=v.data_parallel_size,
                              tensor_model_parallel_size=v.tensor_model_parallel_size,
                              sequence_parallel=v.sequence_parallel,
                              expert_tensor_parallel_size=v.expert_tensor_parallel_size,
                              overlap_moe_expert_parallel_comm=v.overlap_moe_expert_parallel_comm,
                              delay_wgrad_compute=v.delay_wgrad_compute, layout_rules=v.layout_rules)
    try:
        check_expert_parallel(spec.model, training, parallel)
    except ValueError as e:
        raise UsageError(f"{where}: expert_model_parallel_size: {e}") from None
    try:
        check_tensor_parallel(spec.model, training, parallel)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None
    try:
        check_data_parallel_microbatches(training, parallel)
    except ValueError as e:
        raise UsageError(f"{where}: training.{e}") from None
    fault = v.inject or (None if is_baseline else inject)
    trainer = v.trainer or spec.trainer
    try:
        config = RunConfig(model=spec.model, training=training, inject=fault, device=spec.device,
                           params_dtype=spec.params_dtype or ("bfloat16" if spec.device == "cuda" else "float32"),
                           num_gpus=spec.num_gpus, capture=spec.capture, parallel=parallel, trainer=trainer,
                           model_class=model_class,
                           megatron={**spec.megatron, **v.megatron})
    except ValidationError as e:
        raise UsageError(f"{where}: {_loc(e)}") from None
    if not trainers.runs_megatron(trainer):
        for key, bad in (("megatron_versions", v.megatron_versions), ("layout_rules: megatron",
                                                                      v.layout_rules == "megatron")):
            if bad:
                raise UsageError(f"{where}: {key} needs trainer: megatron-core")
    version = trainers.megatron_version(config.megatron_path) if trainers.runs_megatron(trainer) else None
    run = PlannedRun(spec=v, config=config, layout=layout, is_baseline=is_baseline)
    skipped = expectations.not_run(run, version)
    if skipped is not None:         # not made on this megatron, as the case states: nothing there to admit
        return skipped
    problem = trainers.problem(config)
    if problem:
        raise UsageError(f"{where}: {problem}")
    return expectations.resolve(run, version)
