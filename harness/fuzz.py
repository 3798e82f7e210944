"""`bitparity fuzz`: random valid layouts of a case's model against its baseline, until a time budget ends.

Every generated layout (`harness.strategies.layouts`) is a real multi-process run (the same forkserver
runner as `verify`, by the case's trainer: ours or megatron-core), compared bit for bit with the baseline's
trace.  With megatron-core, a layout megatron's own validator refuses is drawn again, not counted.  On the first layout that differs
(or errors), hypothesis shrinks it toward the simplest layout that still fails; the minimal one is written as
a ready-to-run case YAML and verified into its own report.
"""
from __future__ import annotations

import random
import shutil
import tempfile
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

from .cases import CasePlan
from .compare import compare
from .trace import first_nonfinite
from . import bounds
from .errors import UsageError
from . import trainers
from .runner import preload, run_ranks
from .strategies import layouts
from .trace import TraceError, merge


MAX_BUDGET_S = 7 * 86_400.0


class _Differs(AssertionError):
    """A layout whose run is not bitwise equal to the baseline (hypothesis shrinks on it)."""


@dataclass
class FuzzResult:
    """What a fuzz session did: layouts tried, distinct (P, stage grid) pairs, wall and in-run seconds, and the
    minimal failing layout with the case file written for it (None when nothing differed)."""

    tried: int = 0
    grids: set = field(default_factory=set)
    elapsed_s: float = 0.0
    compute_s: float = 0.0                     # time inside runs (startup + training)
    failure: Optional[dict] = None             # {layout, pp, why} of the minimal failing layout
    minimal_case: Optional[Path] = None

    @property
    def per_minute(self) -> float:
        """Layouts verified per minute of wall time."""
        return 60.0 * self.tried / self.elapsed_s if self.elapsed_s else 0.0


def parse_budget(text: str) -> float:
    """'90s', '10m', '1h' or plain seconds -> seconds.

    Raises:
        UsageError: unparsable, or not in (0, MAX_BUDGET_S] (so 'nan', 'inf', '1e400' never mean "forever").
    """
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise UsageError(f"--budget {text!r}: expected e.g. 90s, 10m, 1h") from None
    if not (0 < value <= MAX_BUDGET_S):      # written so that nan fails too
        raise UsageError(f"--budget {text!r} must be positive and at most {MAX_BUDGET_S // 3600:.0f}h")
    return value


def fuzz(plan: CasePlan, out_root: Path, budget_s: float, seed_value: Optional[int] = None,
         inject: Optional[str] = None, max_pp: int = 4, max_vpp: int = 2, batch: int = 10,
         progress: Callable[[str], None] = print, max_layouts: Optional[int] = None) -> FuzzResult:
    """Fuzz `plan`'s model for `budget_s` seconds or until `max_layouts` layouts ran, whichever comes first (see
    module docstring); `inject` plants a fault in every generated run (never the baseline).  A failure found
    is shrunk within half the budget again, whatever `max_layouts`.

    With ``reductions: megatron`` and MTP, P=1 is not drawn: it accumulates the embedding's two uses per
    microbatch and is expected to differ (see reference_impl/reductions.py); ``canonical`` draws P >= 1."""
    base_cfg = plan.runs[0].config.model_copy(update={"inject": None})
    model, t = base_cfg.model, base_cfg.training
    if base_cfg.parallel.data_parallel_size > 1:
        raise UsageError(f"{plan.path}: fuzz draws layouts (P, V) at data_parallel_size 1; the baseline "
                         f"{plan.runs[0].spec.name!r} has data_parallel_size {base_cfg.parallel.data_parallel_size}, "
                         "whose global batch no drawn layout would share: fuzz a baseline without it")
    min_pp = 2 if t.reductions == "megatron" and model.mtp_num_layers else 1
    if max_pp < min_pp:
        raise UsageError(f"--max-pp {max_pp}: megatron reductions need P >= 2 (P=1 differs by design)")
    rng = random.Random(seed_value)
    result = FuzzResult()
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

        def check(example) -> None:
            text, pp = example
            if time.monotonic() > deadline + (budget_s * 0.5 if state["shrinking"] else 0):
                return                              # out of time: stop exploring (and shrinking)
            if not state["shrinking"] and max_layouts is not None and result.tried >= max_layouts:
                return
            layout = PipelineLayout.from_string(text, pp, model.num_layers, model.mtp_num_layers)
            try:
                check_sizes(pp, layout.virtual_pipeline_model_parallel_size, t.num_microbatches)
                bounds.check_run_size("", pp, 1, layout.virtual_pipeline_model_parallel_size, t.num_microbatches)
            except (ScheduleError, UsageError):   # impossible, or too large a schedule: draw another
                reject()
            cfg = base_cfg.model_copy(update={"inject": inject, "parallel": ParallelConfig(
                pipeline_model_parallel_layout=text, pipeline_model_parallel_size=pp)})
            if cfg.trainer != "reference" and trainers.megatron_config_problem(cfg):
                reject()                  # megatron's own validator refuses it: not a run, not a finding
            run_dir = work / f"run{result.tried}"
            t0 = time.monotonic()
            out = run_ranks(cfg, run_dir, plan.spec.timeout_s)
            result.compute_s += time.monotonic() - t0
            result.tried += 1
            result.grids.add((pp, layout.stages))
            why = None
            if not out.ok:
                why = f"error: {out.error.splitlines()[0]}"
            else:
                try:
                    trace = merge(run_dir, pp)
                    cmp = compare(baseline, trace)
                    broken = first_nonfinite(trace)
                    if broken:
                        why = f"not finite: {broken}"
                    elif not cmp.bitwise_equal:
                        fd = cmp.first_divergence
                        why = f"step {fd.step} {fd.kind} {fd.name}" + (f" mb {fd.microbatch}" if fd.microbatch
                                                                      is not None else "")
                except TraceError as e:
                    why = f"trace error: {e}"
            shutil.rmtree(run_dir, ignore_errors=True)
            if why:
                state["shrinking"] = True
                state["last"] = {"layout": text, "pp": pp, "why": why}
                progress(f"  differs: {text} (P={pp}): {why}")
                raise _Differs(why)

        strategy = layouts(model.num_layers, model.mtp_num_layers,
                           pp=_sizes(min_pp, max_pp), vpp=_sizes(1, max_vpp))
        while time.monotonic() < deadline and state["last"] is None and (
                max_layouts is None or result.tried < max_layouts):
            test = settings(max_examples=batch, deadline=None, database=None, derandomize=False,
                            suppress_health_check=list(HealthCheck),
                            phases=[Phase.generate, Phase.shrink])(given(strategy)(check))
            try:
                seed(rng.getrandbits(64))(test)()
            except _Differs:
                break
            except Flaky:       # a failing layout that no longer fails when shrinking re-runs it (out of time, or a
                break           # hang that timed out once): the failure recorded first stands
            progress(f"  {result.tried} layouts, {len(result.grids)} distinct grids, "
                     f"{60 * result.tried / (time.monotonic() - start):.0f}/min")
        result.failure = state["last"]
        result.elapsed_s = time.monotonic() - start
        if result.failure:
            result.minimal_case = write_minimal_case(plan, result.failure, out_root, inject)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _sizes(low: int, high: int):
    from hypothesis import strategies as st
    return st.integers(low, high)


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
    path = out_root / f"{plan.name}-fuzz-minimal.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Written by bitparity fuzz: {failure['why']}\n" + yaml.safe_dump(case, sort_keys=False))
    return path
