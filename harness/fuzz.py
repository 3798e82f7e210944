"""`bitparity fuzz`: random valid layouts of a case's model against its baseline, until a time budget ends.

Every generated layout (`harness.strategies.layouts`) is a real multi-process run (the same forkserver
runner as `verify`, by the case's trainer: ours or megatron-core), compared bit for bit with the baseline's
trace.  With megatron-core, a layout megatron's own validator refuses is drawn again, not counted.  On the first layout that differs
(or errors), hypothesis shrinks it toward the simplest layout that still fails; the minimal one is written as
a ready-to-run case YAML and verified into its own report.

Throughput: the runs of a small case are bound by latency (rank start-up, rendezvous, pipeline hand-offs), not by
the cores, so fuzz runs `jobs` layouts at once (default: one per core; on 2 cores, `cases/smoke.yaml`: ~95-115
layouts/min one at a time, ~135-150 two at a time, three no better; bench/results/fuzz_cpu.json).  Hypothesis stays
sequential: each batch of `BATCH` examples is first drawn without running anything, its new layouts then run side
by side (`harness.running.pool.run_packed`), and only a batch in which one differs is replayed under the same seed, every
layout answering from what was measured, so hypothesis meets the failure where it drew it and shrinks it (the
shrinking runs one layout at a time).  The batches do not depend on `jobs`: one seed draws the same layouts, and
finds the same minimal one, whatever `jobs` (the time budget aside).  Bitwise: every run is its own processes;
running two at once moves no bit (`harness.running.pool`).
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis.errors import Flaky

from trainerkit.config import ParallelConfig
from trainerkit.layout import PipelineLayout
from trainerkit.schedule import ScheduleError, check_sizes

from .errors import UsageError
from .judging.compare import compare, replica_status
from .judging.judge import Evidence, Expectation, decide
from .judging.localise import boundary_mismatches
from .judging.trace import TraceError, first_nonfinite, merge
from .planning import bounds, trainers
from .planning.cases import CasePlan
from .running import outdir, pool
from .running.runner import preload, run_ranks
from .strategies import layouts

# examples hypothesis draws per batch: each batch ends in a wait for its slowest run, and its drawing costs
# a few ms an example before anything runs; a constant, so that a seed means the same layouts on every machine
BATCH = 24
CASE_HEADER = "# Written by bitparity fuzz"


class _Differs(AssertionError):
    """A layout whose run is not bitwise equal to the baseline (hypothesis shrinks on it)."""


@dataclass
class FuzzResult:
    """What a fuzz session did: layouts tried, distinct (P, stage grid) pairs, wall and in-run seconds, and the
    minimal failing layout (None when nothing differed; `write_minimal_case` writes its case file)."""

    tried: int = 0
    grids: set = field(default_factory=set)
    elapsed_s: float = 0.0
    compute_s: float = 0.0                     # time inside runs (startup + training)
    failure: Optional[dict] = None             # {layout, pp, why} of the minimal failing layout
    jobs: int = 1                              # layouts run at once

    @property
    def per_minute(self) -> float:
        """Layouts verified per minute of wall time."""
        return 60.0 * self.tried / self.elapsed_s if self.elapsed_s else 0.0


def fuzz(plan: CasePlan, out_root: Path, budget_s: float, seed_value: Optional[int] = None,  # noqa: C901 (its closures share the run state; next: a class)
         inject: Optional[str] = None, max_pp: int = 4, max_vpp: int = 2, batch: int = BATCH,
         progress: Callable[[str], None] = print, max_layouts: Optional[int] = None,
         jobs: Optional[int] = None) -> FuzzResult:
    """Fuzz `plan`'s model for `budget_s` seconds or until `max_layouts` layouts ran, whichever comes first (see
    module docstring); `inject` plants a fault in every generated run (never the baseline).  A failure found
    is shrunk within half the budget again, whatever `max_layouts`.  `jobs`: layouts run at once (default: this
    process's CPU cores, `harness.running.pool.cores`); `batch`: examples hypothesis draws at a time; `tried` counts
    distinct layouts run (a layout hypothesis draws again answers from the first run).

    With ``reductions: megatron`` and MTP, P=1 is not drawn: it accumulates the embedding's two uses per
    microbatch and is expected to differ (see reference_impl/reductions.py); ``canonical`` draws P >= 1."""
    base_cfg = plan.runs[0].config.model_copy(update={"inject": None})
    model, t = base_cfg.model, base_cfg.training
    if base_cfg.parallel.data_parallel_size > 1:
        raise UsageError(f"{plan.path}: fuzz draws layouts (P, V) at data_parallel_size 1; the baseline "
                         f"{plan.runs[0].spec.name!r} has data_parallel_size {base_cfg.parallel.data_parallel_size}, "
                         "whose global batch no drawn layout would share: fuzz a baseline without it")
    jobs = jobs or pool.cores()
    min_pp = 2 if t.reductions == "megatron" and model.mtp_num_layers else 1
    if max_pp < min_pp:
        raise UsageError(f"--max-pp {max_pp}: megatron reductions need P >= 2 (P=1 differs by design)")
    rng = random.Random(seed_value)
    result = FuzzResult(jobs=jobs)
    start = time.monotonic()
    deadline = start + budget_s
    work = Path(tempfile.mkdtemp(prefix=f"bitparity-fuzz-{plan.name}-"))
    preload([base_cfg])           # megatron-core imported once, in the forkserver, not in every rank
    try:
        outcome = run_ranks(base_cfg, work / "baseline", plan.spec.timeout_s)
        if not outcome.ok:
            raise UsageError(f"baseline {plan.runs[0].spec.name!r} failed: {outcome.error.splitlines()[0]}")
        baseline = merge(work / "baseline", base_cfg.parallel.world_size)
        broken = first_nonfinite(baseline)
        if broken:      # every layout would compare NaN with NaN: nothing to find
            raise UsageError(f"baseline {plan.runs[0].spec.name!r} is not finite ({broken}): fuzz compares layouts "
                             "with a baseline that trains")
        state = {"last": None, "shrinking": False}
        known: dict[tuple[str, int], Optional[str]] = {}     # (layout, P) -> why it differs; None: bitwise equal
        shown: set = set()                  # failing layouts already printed
        lock = threading.Lock()
        serial = itertools.count()          # next() is atomic under the GIL: a distinct directory per run

        def config(example):
            """The run of a drawn (layout, P), or hypothesis' reject() for one that cannot or must not run."""
            text, pp = example
            layout = PipelineLayout.from_string(text, pp, model.num_layers, model.mtp_num_layers)
            try:
                check_sizes(pp, layout.virtual_pipeline_model_parallel_size, t.num_microbatches)
                bounds.check_run_size("", pp, 1, layout.virtual_pipeline_model_parallel_size, t.num_microbatches)
            except (ScheduleError, UsageError):   # impossible, or too large a schedule: draw another
                reject()
            cfg = base_cfg.model_copy(update={"inject": inject, "parallel": ParallelConfig(
                pipeline_model_parallel_layout=text, pipeline_model_parallel_size=pp)})
            if trainers.runs_megatron(cfg.trainer) and trainers.megatron_config_problem(cfg):
                reject()                  # megatron's own validator refuses it: not a run, not a finding
            return cfg, layout.stages

        def run_one(example, cfg, stages) -> Optional[str]:
            """Run one layout and compare it with the baseline: why it differs, or None (bitwise equal)."""
            text, pp = example
            run_dir = work / f"run{next(serial)}"
            t0 = time.monotonic()
            out = run_ranks(cfg, run_dir, plan.spec.timeout_s)
            why, error, trace = None, None, None
            if not out.ok:
                error = out.error
            else:
                try:
                    trace = merge(run_dir, pp)
                except TraceError as e:
                    error = f"trace error: {e}"
            # the one judge (harness.judging.judge.decide): a drawn layout must be bitwise equal to the baseline, keep
            # its replicas, its stage boundaries and finiteness, as a case's `expect: bitwise` run must
            decided = decide(Expectation(compare_to=plan.runs[0].spec.name), Evidence(error=error) if trace is None
                             else Evidence(cmp=compare(baseline, trace), replicas=replica_status(trace),
                                           nonfinite=first_nonfinite(trace),
                                           boundary=tuple(boundary_mismatches(trace))))
            if decided.verdict != "pass":
                why = f"error: {decided.reason}" if decided.verdict == "error" else decided.reason
            shutil.rmtree(run_dir, ignore_errors=True)
            with lock:
                result.compute_s += time.monotonic() - t0
                result.tried += 1
                result.grids.add((pp, stages))
                known[example] = why
            return why

        def out_of_layouts() -> bool:
            return max_layouts is not None and result.tried >= max_layouts

        def check(drawn_example) -> None:
            """Hypothesis' test: a layout already run answers from `known`; a new one runs now (while shrinking,
            or when a batch is replayed) unless the budget or --max-layouts is spent."""
            example = tuple(drawn_example)
            cfg, stages = config(example)
            if example in known:
                why = known[example]
            elif time.monotonic() > deadline + (budget_s * 0.5 if state["shrinking"] else 0) or (
                    not state["shrinking"] and out_of_layouts()):
                return                              # out of time: stop exploring (and shrinking)
            else:
                why = run_one(example, cfg, stages)
            if why:
                state["shrinking"] = True
                state["last"] = {"layout": example[0], "pp": example[1], "why": why}
                if example not in shown:            # hypothesis may try it again while shrinking
                    shown.add(example)
                    progress(f"  differs: {example[0]} (P={example[1]}): {why}")
                raise _Differs(why)

        strategy = layouts(model.num_layers, model.mtp_num_layers,
                           pp=_sizes(min_pp, max_pp), vpp=_sizes(1, max_vpp))

        while time.monotonic() < deadline and state["last"] is None and not out_of_layouts():
            batch_seed = rng.getrandbits(64)
            # 1. draw the batch hypothesis would try (nothing runs), 2. run its new layouts `jobs` at a time,
            # 3. only if one differs, replay the batch sequentially under the same seed: every layout answers from
            # `known`, so hypothesis meets the same examples in the same order and shrinks the first failure
            drawn: dict = {}                        # new example -> (its run config, stages), in draw order

            def draw(drawn_example) -> None:
                example = tuple(drawn_example)
                made = config(example)              # the same rejections as `check`, so the same draws
                if example not in known:
                    drawn.setdefault(example, made)
            _hypothesis(draw, strategy, batch, batch_seed, shrink=False)
            todo = list(drawn)
            if max_layouts is not None:
                todo = todo[:max(0, max_layouts - result.tried)]

            def body(example):
                if time.monotonic() > deadline:
                    return None                     # the budget ended while this one waited: not run
                return run_one(example, *drawn[example])
            pool.run_packed(todo, lambda _: 1, body, jobs, jobs)
            if any(known.get(example) for example in todo):
                try:
                    _hypothesis(check, strategy, batch, batch_seed, shrink=True)
                except _Differs:
                    pass
                except Flaky:   # a failing layout that no longer fails when shrinking re-runs it (out of time, or
                    pass        # a hang that timed out once): the failure recorded first stands
                if state["last"] is None:           # the replay did not meet it (hypothesis drew otherwise)
                    first = next(example for example in todo if known.get(example))
                    state["last"] = {"layout": first[0], "pp": first[1], "why": known[first]}
                break
            progress(f"  {result.tried} layouts, {len(result.grids)} distinct grids, "
                     f"{60 * result.tried / (time.monotonic() - start):.0f}/min")
        result.failure = state["last"]
        result.elapsed_s = time.monotonic() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _hypothesis(test, strategy, batch: int, batch_seed: int, shrink: bool) -> None:
    """Run `test` on up to `batch` examples of `strategy` drawn from `batch_seed` (the same seed draws the same
    examples while the test answers the same); `shrink`: minimise a failing example (hypothesis' shrink phase)."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    runner = settings(max_examples=batch, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck), phases=phases)(given(strategy)(test))
    seed(batch_seed)(runner)()


def _sizes(low: int, high: int):
    from hypothesis import strategies as st
    return st.integers(low, high)


def minimal_case_path(plan: CasePlan, out_root: Path) -> Path:
    """Where `write_minimal_case` writes: ``OUT/<case>-fuzz-minimal.yaml`` (its report: ``OUT/<case>-fuzz-minimal/``)."""
    return out_root / f"{plan.name}-fuzz-minimal.yaml"


def check_out(plan: CasePlan, out_root: Path) -> None:
    """Before the search: raises UsageError, writing nothing, when the minimal case and its report could not be
    written under `out_root` (`outdir.check`), or the case file's path holds something fuzz did not write."""
    path = minimal_case_path(plan, out_root)
    outdir.check(out_root, path.stem)
    if os.path.lexists(path):
        try:
            with open(path, "rb") as f:
                ours = path.is_file() and not path.is_symlink() and f.read(len(CASE_HEADER)) == CASE_HEADER.encode()
        except OSError:
            ours = False
        if not ours:
            raise UsageError(f"{path} exists and was not written by bitparity fuzz; not replacing it: move it "
                             "away or choose another --out")


def write_minimal_case(plan: CasePlan, failure: dict, out_root: Path, inject: Optional[str]) -> Path:
    """A ready-to-run case: the original model/training/baseline plus the minimal failing layout."""
    spec = plan.spec
    case = {"name": f"{plan.name}-fuzz-minimal",
            "description": f"minimal failing layout found by bitparity fuzz: {failure['why']}",
            "timeout_s": spec.timeout_s, "device": spec.device, "trainer": spec.trainer,
            "model": spec.model.model_dump(mode="json"),
            # the whole computation, megatron options and data (masks, padding) included, so the case reproduces
            "megatron": dict(spec.megatron),
            "training": spec.training.model_dump(mode="json"),
            "baseline": spec.baseline.model_dump(mode="json", exclude_none=True),
            "variants": [{"name": "minimal", "pipeline_model_parallel_layout": failure["layout"],
                          "pipeline_model_parallel_size": failure["pp"], "expect": "bitwise",
                          **({"inject": inject} if inject else {})}]}
    path = minimal_case_path(plan, out_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{CASE_HEADER}: {failure['why']}\n" + yaml.safe_dump(case, sort_keys=False))
    return path
