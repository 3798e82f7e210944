"""`bitparity verify`: run every variant of a case, compare each with the baseline, write the report.

Everything is written into ``<out>/.<case>.partial/`` and moved to ``<out>/<case>/`` only when complete,
so an interrupted or failed harness never leaves a half-written report.  Next to each run's ``manifest.json``
and ``trace.json``, ``comparison.json`` holds its verdict, first divergence, parameter-inventory differences
and replica status (`harness.judging.judge.comparison_record`).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from trainerkit.config import CheckpointConfig
from trainerkit.data import text_sha256
from trainerkit.schedule import build_schedule, serialise, timeline

from .errors import UsageError
from .judging import agreement, crossimpl, golden, signature
from .judging.compare import Comparison, compare, replica_status
from .judging.judge import Evidence, Expectation, bugs_elsewhere, comparison_record, decide, judge_cross_implementation
from .judging.localise import boundary_mismatches, localise
from .judging.results import CaseResult, StepSeries, VariantResult
from .judging.trace import Trace, TraceError, check_losses, first_nonfinite, merge, overlap_coverage
from .planning import crosscheck, trainers
from .planning.budget import Deadline
from .planning.cases import CasePlan, PlannedRun
from .report import write_report
from .report.words import megatron_source_words
from .running import mps as mps_daemon
from .running import outdir, pool
from .running.arithmetic import arithmetic_facts, environment
from .running.evidence import collect as collect_evidence
from .running.runner import RunOutcome, in_forkserver, run_ranks
from .running.runner import preload as runner_preload


def _transport_facts(run_dir: Path) -> dict:
    """Transport and device settings the ranks recorded in their trace headers (rank 0's)."""
    try:
        header = json.loads((run_dir / "rank0.jsonl").read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return {}
    return {"transport": header.get("transport"), "device_settings": header.get("settings")}


def _dir_name(name: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "variant"
    candidate, i = base, 1
    while candidate in taken:
        i += 1
        candidate = f"{base}_{i}"
    taken.add(candidate)
    return candidate


def _schedule(run: PlannedRun) -> list:
    t = run.config.training
    return build_schedule(run.layout, t.num_microbatches, t.seq_length, t.micro_batch_size,
                          run.config.model.hidden_size, run.config.parallel.overlap_moe_expert_parallel_comm)


def _manifest(plan: CasePlan, run: PlannedRun, outcome: RunOutcome, trace: Optional[Trace], env: dict,
              command: str, lists: list) -> dict:
    t = run.config.training
    step_times = [max(st.time_s.values()) for st in trace.steps] if trace else []
    # CPU seconds of all ranks per step: with the step's wall time, how many cores the run kept busy
    step_cpu = [None if None in st.cpu_s.values() or not st.cpu_s else sum(st.cpu_s.values())
                for st in trace.steps] if trace else []
    return {"format": "bitparity-manifest/1", "case": plan.name, "variant": run.spec.name,
            "config": run.config.model_dump(mode="json"),
            "layout": {"text": run.layout.text, "pipeline_model_parallel_size": run.layout.pipeline_model_parallel_size,
                       "virtual_pipeline_model_parallel_size": run.layout.virtual_pipeline_model_parallel_size,
                       "mtp_standalone": run.layout.mtp_standalone, "grid": run.layout.pretty()},
            "schedule": serialise(lists), "environment": env, "num_threads": t.num_threads,
            "device": run.config.device, "seed": t.seed, "command": command,
            "trainer": trainers.versions(run.config),
            "data": {"path": t.data.path or "(shipped) trainerkit/text", "sha256": text_sha256(t.data)},
            "timings": {"elapsed_s": outcome.elapsed_s, "step_time_s": step_times, "step_cpu_s": step_cpu}, "ok": outcome.ok,
            "error": outcome.error}


def series(trace: Optional[Trace], cmp: Optional[Comparison]) -> StepSeries:
    """A run's per-step scalars for the report (`StepSeries`), with the grad norm's ULP distance from `cmp`'s
    reference run."""
    s = StepSeries()
    steps = trace.steps if trace else []
    # a run resumed after step k has no steps before k + 1: blanks there keep the index the step number
    first = steps[0].step if steps else 0
    s.lm_loss, s.lm_loss_hex, s.mtp_loss = [float("nan")] * first, [""] * first, [[] for _ in range(first)]
    s.grad_norm, s.grad_norm_hex, s.clip_coeff, s.clipped = ([None] * first for _ in range(4))
    s.grad_norm_ulp = [None] * first + (list(cmp.grad_norm_ulps) if cmp else [])
    s.resumed_after = [r["step"] for r in trace.resumed] if trace else []
    for st in steps:
        s.lm_loss.append(st.lm_loss["value"] if st.lm_loss else float("nan"))
        s.lm_loss_hex.append(st.lm_loss["hex"] if st.lm_loss else "")
        depths = len(st.losses[0]["mtp"]) if st.losses else 0
        s.mtp_loss.append([sum(l["mtp"][k]["value"] for l in st.losses) / len(st.losses) for k in range(depths)])
        s.grad_norm.append(st.grad_norm["value"] if st.grad_norm else None)
        s.grad_norm_hex.append(st.grad_norm["hex"] if st.grad_norm else None)
        s.clip_coeff.append(st.clip_coeff["value"] if st.clip_coeff else None)
        s.clipped.append(st.clipped)
    return s


def _repeat(run: PlannedRun, first: Trace, run_dir: Path, timeout: float, launcher: str, progress,
            deadline: Deadline) -> dict:
    """Run `run` again ``repeat - 1`` times (into run_dir/repeat{k}) and compare each with the first run: any
    difference is run-to-run nondeterminism, reported apart from layout effects.  A repeat the budget leaves no
    time for is not run: ``deterministic`` None (unchecked, `judge` makes it an error)."""
    for k in range(2, run.spec.repeat + 1):
        rdir = run_dir / f"repeat{k}"
        outcome = deadline.run(run_ranks, run.config, rdir, timeout, launcher)
        if Deadline.undone(outcome):
            return {"runs": k - 1, "deterministic": None, "first_divergence": None,
                    "detail": f"repeat {k} {outcome.error.splitlines()[0]}"}
        if not outcome.ok:
            return {"runs": k, "deterministic": False, "first_divergence": None,
                    "detail": f"repeat {k} did not complete: {outcome.error.splitlines()[0]}"}
        cmp = compare(first, merge(rdir, run.config.parallel.world_size))
        progress(f"      repeat {k}: {'bitwise equal' if cmp.bitwise_equal else 'DIFFERS'} ({outcome.elapsed_s:.1f} s)")
        if not cmp.bitwise_equal:
            fd = cmp.first_divergence
            return {"runs": k, "deterministic": False, "first_divergence": asdict(fd),
                    "detail": f"repeat {k} differs from run 1: step {fd.step} {fd.kind} {fd.name}"}
    return {"runs": run.spec.repeat, "deterministic": True, "first_divergence": None,
            "detail": f"{run.spec.repeat} runs bitwise equal"}


def verify(plan: CasePlan, out_root: Path, command: str, timeout_s: Optional[float] = None,
           progress: Callable[[str], None] = print, launcher: str = "fork", evidence_all: bool = False,
           goldens: Optional[golden.GoldenRequest] = None, jobs: Optional[int] = None,
           deadline: Optional[Deadline] = None, ranks_per_core: int = 1, mps: bool = False) -> CaseResult:
    """Run, compare and report a planned case; returns the `CaseResult` (report written to ``out_root/<case>``).

    deadline (`harness.planning.budget`, ``--budget``): once it is spent no run, repeat, evidence run or cross-implementation
    check starts, and those in flight are stopped at it (their watchdog is capped); each run left undone is an
    ``error`` (``not run: ...`` / ``stopped: ...``), every finished run is compared and reported as usual.

    jobs: how many runs may go at once (`harness.running.pool.run_packed`: packed by rank count into this process's CPU
    cores); None: as many as fit, 1: one after another.  ranks_per_core: how many ranks the packing puts on one
    core (its budget is the cores times this; bitwise, packing moves no bit: `harness.running.pool`).  mps: the
    runs' ranks go through a private MPS daemon (`harness.running.mps`; CUDA runs only), at most
    ``mps.CLIENTS_PER_GPU`` ranks at once.

    ULP evidence (`harness.running.evidence`) is collected for every failing variant whose first divergence is a
    gradient or parameter, and with `evidence_all` also for variants that diverge as expected.  `goldens`:
    compare every run with its golden trace, or record them (`harness.judging.golden`).

    Raises:
        UsageError: before anything runs or is written: `mps` with a run not on CUDA or larger than MPS serves, or
            the MPS daemon does not start; --out is not a directory, ``out_root/<case>`` (or its
            partial directory) exists but was not written by bitparity, or another `bitparity verify` is
            writing the same case there (`harness.running.outdir`).
    """
    start = time.monotonic()
    slots = pool.cores() * ranks_per_core
    if mps:
        _check_mps(plan)
        slots = min(slots, mps_daemon.CLIENTS_PER_GPU)
    # the partial directory is removed and the lock released on every exit, a crash included; the MPS daemon's
    # directories reach every rank (the runner hands them over at each rank's start)
    with (mps_daemon.daemon() if mps else nullcontext()), outdir.workspace(out_root, plan.name) as (work, final):
        return _verify(plan, out_root, command, timeout_s, progress, launcher, start, final, work, evidence_all,
                       goldens, jobs or slots, deadline or Deadline(None), slots)


def _check_mps(plan: CasePlan) -> None:
    for r in plan.runs:
        if r.config.device != "cuda":
            raise UsageError(f"--mps: run {r.spec.name!r} is on the {r.config.device}; MPS serves CUDA runs only")
        if r.config.parallel.world_size > mps_daemon.CLIENTS_PER_GPU:
            raise UsageError(f"--mps: run {r.spec.name!r} has {r.config.parallel.world_size} ranks; one MPS server "
                             f"takes at most {mps_daemon.CLIENTS_PER_GPU} clients")


def _layout_words(cfg) -> str:
    """A run's layout as its model class writes it: the GPT layout, or HybridModel's pattern (its GPT layout
    in brackets, which the schedule and the trace use)."""
    par = cfg.parallel
    if par.hybrid_layer_pattern is None:
        return par.pipeline_model_parallel_layout
    return f"hybrid {par.hybrid_layer_pattern} [{par.pipeline_model_parallel_layout}]"


def _verify(plan, out_root, command, timeout_s, progress, launcher, start, final, work, evidence_all,  # noqa: C901 (next: run, judge and report phases apart)
            goldens, jobs, deadline, slots) -> CaseResult:
    runner_preload(r.config for r in plan.runs)
    # the arithmetic facts from a child of the forkserver the ranks come from, which has torch imported: a passing
    # verify of the reference trainer never imports torch here (~1.3 s of CPU on 2 cores, per verify)
    env = environment(in_forkserver(arithmetic_facts))
    timeout = timeout_s or plan.spec.timeout_s
    traces, outcomes, repeats = {}, {}, {}
    taken: set = set()
    dirs = {r.spec.name: Path("runs") / _dir_name(r.spec.name, taken) for r in plan.runs}
    plan_configs = {r.spec.name: r.config for r in plan.runs}
    schedules = {r.spec.name: _schedule(r) for r in plan.runs}
    # a fault planted from the command line (--inject) is not in the case file: the command must repeat it
    reproduce = {r.spec.name: shlex.join(["bitparity", "verify", str(plan.path), "--only", r.twin_of or r.spec.name,
                                          "--out", str(out_root), *plan.flags] +
                                         (["--inject", r.config.inject] if r.config.inject and not r.spec.inject
                                          else [])) for r in plan.runs}
    # checkpoints: a run that others resume from saves after their step; resuming runs go last
    for r in plan.runs:
        if r.spec.resume:
            src, k = r.spec.resume.variant, r.spec.resume.after_step
            ckpt = str(work / dirs[src] / f"checkpoint-step{k}")
            plan_configs[src] = plan_configs[src].model_copy(update={"checkpoint": CheckpointConfig(step=k, dir=ckpt)})
            plan_configs[r.spec.name] = plan_configs[r.spec.name].model_copy(update={"resume_from": ckpt})
    for r in plan.not_run:
        progress(f"[-] {r.spec.name}: not run: {r.not_run}")
    numbered = {r.spec.name: i for i, r in enumerate(plan.runs, start=1)}

    def execute(run: PlannedRun) -> tuple:
        name = run.spec.name
        run = dataclasses.replace(run, config=plan_configs[name])
        par = run.config.parallel
        ep, dp, tp = par.expert_model_parallel_size, par.data_parallel_size, par.tensor_model_parallel_size
        who = "" if trainers.is_default(run.config.trainer) else f" [{run.config.trainer}]"
        if deadline.spent():
            outcome = deadline.not_started()
            (work / dirs[name]).mkdir(parents=True, exist_ok=True)
            (work / dirs[name] / "manifest.json").write_text(
                json.dumps(_manifest(plan, run, outcome, None, env, reproduce[name], schedules[name]), indent=1))
            progress(f"[{numbered[name]}/{len(plan.runs)}] {name}{who}: not run ({deadline.words()} is spent)")
            return None, outcome, None
        progress(f"[{numbered[name]}/{len(plan.runs)}] {name}{who}: P={run.layout.pipeline_model_parallel_size} "
                 f"V={run.layout.virtual_pipeline_model_parallel_size}{f' TP={tp}' if tp > 1 else ''}"
                 f"{' SP' if par.sequence_parallel else ''}{f' DP={dp}' if dp > 1 else ''}"
                 f"{f' EP={ep}' if ep > 1 else ''} "
                 f"{_layout_words(run.config)} ...")
        saver = run.spec.resume.variant if run.spec.resume else None
        if saver is not None and not outcomes[saver].ok:
            # its error line follows, so a crash the case states for both (a known upstream bug) reads as one
            outcome = RunOutcome(False, f"not run: the run it resumes from, {saver!r}, did not complete: "
                                        f"{outcomes[saver].error.splitlines()[0]}", 0.0)
        else:
            outcome = deadline.run(run_ranks, run.config, work / dirs[name], timeout, launcher)
        trace = None
        if outcome.ok:
            try:
                trace = merge(work / dirs[name], run.config.parallel.world_size)
                check_losses(trace, run.config.training.num_microbatches * run.config.parallel.data_parallel_size,
                             run.config.model.mtp_num_layers)
                trace.save(work / dirs[name] / "trace.json")
            except TraceError as e:
                outcome = RunOutcome(False, f"trace error: {e}", outcome.elapsed_s)
        (work / dirs[name]).mkdir(parents=True, exist_ok=True)     # a run never started has no directory yet
        (work / dirs[name] / "manifest.json").write_text(
            json.dumps(_manifest(plan, run, outcome, trace, env, reproduce[name], schedules[name]), indent=1))
        progress(f"      {name}: {'ran' if outcome.ok else 'ERROR'} in {outcome.elapsed_s:.1f} s"
                 + ("" if outcome.ok else f": {outcome.error.splitlines()[0]}"))
        repeat = _repeat(run, trace, work / dirs[name], timeout, launcher, progress, deadline) \
            if trace is not None and run.spec.repeat > 1 else None
        return trace, outcome, repeat

    # a run that resumes from another's checkpoint starts after every run that saves one
    for phase in ([r for r in plan.runs if not r.spec.resume], [r for r in plan.runs if r.spec.resume]):
        done = pool.run_packed(phase, lambda r: r.config.parallel.world_size, execute, slots, jobs)
        for run, (trace, outcome, repeat) in zip(phase, done):
            traces[run.spec.name], outcomes[run.spec.name] = trace, outcome
            if repeat is not None:
                repeats[run.spec.name] = repeat
    base_name = plan.runs[0].spec.name
    variants = []
    for run in plan.runs:
        t = run.config.training
        cells, bubble = timeline(schedules[run.spec.name])
        name, trace, outcome = run.spec.name, traces[run.spec.name], outcomes[run.spec.name]
        ref_name = run.spec.compare_to or base_name
        ref = traces[ref_name]
        error = outcome.error if not outcome.ok else (
            None if ref is not None or run.spec.crash else
            f"reference run {ref_name!r} did not run, nothing to compare with")
        cmp = compare(ref, trace) if error is None and ref is not None else None
        replicas = replica_status(trace) if trace is not None else {}
        # a run on --megatron-base asks one thing: did base move a bit against head? (harness.judging.judge.decide)
        alike = run.twin_of is not None and cmp is not None and cmp.bitwise_equal
        nonfinite = first_nonfinite(trace) if trace is not None else None
        coverage = overlap_coverage(trace, run.config.parallel.overlap_moe_expert_parallel_comm) \
            if trace is not None and trainers.runs_megatron(run.config.trainer) else {}
        fd = cmp.first_divergence if cmp else None
        where = localise(ref, trace, fd.step) if fd is not None and fd.kind != "inventory" else None
        decided = decide(Expectation.of(run), Evidence(
            error=error, cmp=cmp, replicas=replicas, run_to_run=repeats.get(name), nonfinite=nonfinite,
            boundary=tuple(boundary_mismatches(trace)) if trace is not None else (), coverage=coverage,
            localisation=where, clipping=t.clip_grad > 0, planted=run.config.inject is not None, twin_equal=alike))
        verdict, happened, reason, outside = decided.verdict, decided.outcome, decided.reason, decided.outside
        evidence, evidence_error = [], ""
        # a run that states a bug shows how far it moved (the report's "caught" line), as a failure does
        if fd and fd.kind in ("grad", "optimizer_state", "param") and (verdict == "fail" or evidence_all or run.spec.bug):
            progress(f"      collecting ULP evidence at step {fd.step} ...")
            try:
                evidence = collect_evidence(plan_configs[ref_name], run.config, ref, trace, fd.step,
                                            work / dirs[name] / "evidence", timeout, launcher, deadline)
            except RuntimeError as e:
                evidence_error = str(e)
        variants.append(VariantResult(
            name=name, layout=_layout_words(run.config), pp=run.layout.pipeline_model_parallel_size,
            expert_model_parallel_size=run.config.parallel.expert_model_parallel_size,
            data_parallel_size=run.config.parallel.data_parallel_size, overlap_coverage=coverage,
            tensor_model_parallel_size=run.config.parallel.tensor_model_parallel_size,
            sequence_parallel=run.config.parallel.sequence_parallel,
            overlap=run.config.parallel.overlap_moe_expert_parallel_comm,
            delay_wgrad=run.config.parallel.delay_wgrad_compute,
            vpp=run.layout.virtual_pipeline_model_parallel_size, mtp_standalone=run.layout.mtp_standalone,
            expect=run.spec.expect, verdict=verdict, outcome=happened, bitwise_equal=cmp.bitwise_equal if cmp else None,
            first_divergence=cmp.first_divergence if cmp else None, reason=reason, error=error,
            layout_grid=run.layout.pretty(), options=dict(run.spec.options), series=series(trace, cmp),
            resumed_from=run.spec.resume.variant if run.spec.resume else None,
            family_mismatches=cmp.family_mismatches if cmp else {}, elapsed_s=outcome.elapsed_s,
            run_dir=str(dirs[name]), compare_to=ref_name,
            command=reproduce[name],
            reductions=t.reductions, trainer=run.config.trainer, clip_grad=t.clip_grad, timeline=[asdict(c) for c in cells],
            bubble_fraction=bubble, inventory=list(cmp.inventory) if cmp else [], replica_status=replicas,
            run_to_run=repeats.get(name, {}), ulp_evidence=evidence, evidence_error=evidence_error,
            localisation=where or {}, outside_signature=signature.lines(outside),
            outside_signature_count=len(outside), bug=run.spec.bug, nonfinite=str(nonfinite or ""),
            bug_elsewhere=bugs_elsewhere(run), mtp_num_layers=run.config.model.mtp_num_layers))
        progress(f"{verdict.upper():5} {name}: {reason}")
    env.update(plan.facts(), launcher=launcher)
    if deadline.text is not None:            # the report says the runs had a time limit (not a fact of the bits)
        env["budget"] = deadline.text
    for role in ("head", "base"):
        if role in (plan.megatron_sources or {}):
            env[f"megatron_{role}"] = megatron_source_words(plan.megatron_sources[role])
    env.update(_transport_facts(work / dirs[base_name]))
    cross = None
    spec = plan.spec.cross_implementation
    chosen = next((r for r in plan.runs if spec and r.spec.name == (spec.variant or base_name)), None)
    against = next((r.config for r in plan.runs if spec and spec.against and r.spec.name == spec.against), None)
    # not made on this megatron, as the case states (its variant is not run, or crashes, here: `cases` checks it)
    cross_not_run = crosscheck.stated_not_run(plan.spec, plan.runs + plan.not_run)
    if cross_not_run:
        chosen = None
        progress(f"[cross-implementation] not run: {cross_not_run}")
    elif spec and spec.against and against is None:
        chosen = None
        progress(f"[cross-implementation] skipped: variant {spec.against!r} (against) is not among the runs (--only)")
    elif spec and chosen is None:
        progress(f"[cross-implementation] skipped: variant {spec.variant or base_name!r} is not among the runs "
                 "(--only)")
    if chosen is not None and deadline.spent():
        cross = judge_cross_implementation(crossimpl.not_run(spec, chosen.config, deadline.not_started().error),
                                           crossimpl.expectation(spec, chosen.config))
        progress(f"[cross-implementation] {cross['reason']}")
    elif chosen is not None:
        cross = judge_cross_implementation(crossimpl.run(spec, chosen.config, work / "cross-implementation",
                                                         timeout, launcher, progress, deadline, against),
                                           crossimpl.expectation(spec, chosen.config))
        progress(f"      {cross['verdict'].upper()}: {cross['reason']}")
        (work / "cross-implementation" / "cross_implementation.json").write_text(json.dumps(cross, indent=1))
    golden_record = golden.apply(goldens, plan, env, traces, variants, dirs, progress)
    for v in variants:
        (work / v.run_dir / "comparison.json").write_text(json.dumps(comparison_record(v), indent=1))
    # which runs agree with which (bit for bit, or where a passing run's expectation allows it to differ from
    # its reference): a wrong baseline shows as the small group (harness.judging.agreement)
    passed = {v.name: v.verdict == "pass" for v in variants}
    agreed = agreement.groups([(r.spec.name, traces[r.spec.name], agreement.computation_key(r.config),
                                r.spec.compare_to or base_name, passed.get(r.spec.name, False))
                               for r in plan.runs], base_name)
    for c in agreed["computations"]:
        if c["warning"]:
            progress(f"[agreement] {c['warning']}")
    result = CaseResult(case=plan.name, case_path=str(plan.path), baseline=base_name, variants=variants,
                        elapsed_s=time.monotonic() - start, environment=env, command=command,
                        cross_implementation=cross, golden=golden_record, megatron_sources=plan.megatron_sources,
                        agreement=agreed, not_run=[{"name": r.spec.name, "reason": r.not_run} for r in plan.not_run]
                        + ([{"name": "cross-implementation", "reason": cross_not_run}] if cross_not_run else []))
    write_report(result, work)
    outdir.publish(work, final)
    return result
