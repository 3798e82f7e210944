"""The schedule of one run as a Chrome trace (``runs/<variant>/schedule.trace.json``), which opens in Perfetto
(ui.perfetto.dev, "Open trace file") and ``chrome://tracing``, as torch.distributed.pipelining's schedule
visualiser writes it.

Format (Trace Event Format, JSON object form): ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData":
{...}}``.  One complete event (``"ph": "X"``) per compute action of the planned timeline
(`VariantResult.timeline`: unit costs, forward 1, backward 2, merged forward|backward 3, communication free),
``pid`` = pipeline rank, ``tid`` = 0, ``ts`` / ``dur`` = unit cost x `UNIT_US` microseconds, ``name`` like
``F mb3 s1`` (forward of microbatch 3 on stage 1); metadata events (``"ph": "M"``) name each process
``pp rank r``.

Measured times are added as a second process group (``pid`` = `MEASURED_PID` + rank, named ``measured · pp rank
r``, one thread per step) when the run's merged ``trace.json`` carries per-action times, in this (proposed)
shape: ``steps[k].actions = {"<pp rank>": [{"op", "stage", "microbatch", "start_s", "end_s"}, ...]}`` with
seconds since the rank's step began.  No trainer records them yet (``trace.json`` has one ``time_s`` per rank
and step), so today every file holds the planned timeline only and says so in ``otherData.measured``.
"""
from __future__ import annotations

from typing import Any, Optional

from harness.judging.results import VariantResult

from .chart_timeline import timeline_cells
from .words import clean_text, finite_or_none, int_or_none

#: Microseconds per unit of planned cost: a forward of 1 unit shows as 1 ms in Perfetto.
UNIT_US = 1000
#: Process id offset of the measured group (planned ranks use pid = pp rank).
MEASURED_PID = 1000
_OP_CATEGORY = {"F": "forward", "B": "backward", "FB": "forward+backward"}


def action_name(op: str, stage: int, microbatch: int, b_stage: Optional[int] = None,
                b_microbatch: Optional[int] = None) -> str:
    """``F mb3 s1``; a merged cell ``F mb3 s1 + B mb1 s5``."""
    if op == "FB" and b_stage is not None and b_microbatch is not None:
        return f"F mb{microbatch} s{stage} + B mb{b_microbatch} s{b_stage}"
    return f"{clean_text(op)} mb{microbatch} s{stage}"


def planned_events(v: VariantResult) -> list[dict]:
    """One ``X`` event per compute action of the variant's planned timeline, ordered by rank then time."""
    try:
        pp = max(1, int(v.pp))
    except (TypeError, ValueError):
        pp = 1
    events = []
    for c in timeline_cells(v):
        args: dict[str, Any] = {"stage": c["stage"], "microbatch": c["microbatch"], "chunk": c["stage"] // pp,
                                "start_units": c["start"], "end_units": c["end"]}
        if c["op"] == "FB":
            args.update(b_stage=c["b_stage"], b_microbatch=c["b_microbatch"])
        events.append({"name": action_name(c["op"], c["stage"], c["microbatch"], c.get("b_stage"),
                                           c.get("b_microbatch")),
                       "cat": _OP_CATEGORY.get(c["op"], "other"), "ph": "X", "pid": c["rank"], "tid": 0,
                       "ts": round(c["start"] * UNIT_US, 3), "dur": round((c["end"] - c["start"]) * UNIT_US, 3),
                       "args": args})
    return events


def measured_events(run_trace: Any) -> list[dict]:
    """``X`` events of the measured per-action times in a merged ``trace.json`` (see the module docstring), one
    thread per step, steps laid end to end; [] when the trace has none (every trainer today)."""
    steps = run_trace.get("steps") if isinstance(run_trace, dict) else None
    events, offset = [], 0.0
    for k, step in enumerate(steps if isinstance(steps, list) else []):
        actions = step.get("actions") if isinstance(step, dict) else None
        if not isinstance(actions, dict):
            continue
        step_end = 0.0
        for rank_key, items in sorted(actions.items(), key=lambda kv: str(kv[0])):
            rank = int_or_none(rank_key)
            if rank is None or rank < 0 or not isinstance(items, list):
                continue
            for a in items:
                if not isinstance(a, dict):
                    continue
                start, end = finite_or_none(a.get("start_s")), finite_or_none(a.get("end_s"))
                stage, mb = int_or_none(a.get("stage")), int_or_none(a.get("microbatch"))
                if start is None or end is None or end < start or stage is None or mb is None:
                    continue
                op = clean_text(a.get("op") or "?")
                events.append({"name": action_name(op, stage, mb), "cat": _OP_CATEGORY.get(op, "other"),
                               "ph": "X", "pid": MEASURED_PID + rank, "tid": k,
                               "ts": round(offset + start * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                               "args": {"stage": stage, "microbatch": mb, "step": k}})
                step_end = max(step_end, end * 1e6)
        offset += step_end
    return events


def _metadata(pids: list[int], measured: bool, steps: list[int]) -> list[dict]:
    out = []
    for pid in pids:
        rank = pid - MEASURED_PID if measured else pid
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": f"measured · pp rank {rank}" if measured else f"pp rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid in steps if measured else [0]:
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": f"step {tid}" if measured else "planned (unit costs: F 1, B 2)"}})
    return out


def chrome_trace(v: VariantResult, run_trace: Any = None) -> Optional[dict]:
    """The Chrome trace of the variant's schedule: planned (always) and measured (when `run_trace`, its merged
    ``trace.json``, carries per-action times).  None when the variant has no planned timeline."""
    planned = planned_events(v)
    if not planned:
        return None
    measured = measured_events(run_trace)
    pp = max(max(e["pid"] for e in planned) + 1, int_or_none(v.pp) or 1)
    events = _metadata(list(range(pp)), False, [])
    if measured:
        pids = sorted({e["pid"] for e in measured})
        events += _metadata(pids, True, sorted({e["tid"] for e in measured}))
    events += planned + measured
    note = ("planned: the schedule played with unit costs (forward 1, backward 2, communication free), "
            f"1 unit = {UNIT_US} us; "
            + ("measured: per-action times recorded by the trainer" if measured else
               "measured: not recorded (the trainer writes one time per rank and step, not per action)"))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"variant": clean_text(v.name), "layout": clean_text(v.layout), "schedule": v.schedule,
                          "compute_actions": len(planned), "measured": bool(measured), "note": note}}
