"""Data of one variant's card (in index.html) and of its detail page (``<run_dir>/index.html``).

The card carries what a reviewer reads first: verdict, first divergence, differences outside the expected
signature, structural checks, run-to-run control, golden comparison, reproduce command.  The heavy evidence
(schedule timeline, differing-parameter heatmap, ULP histograms) is drawn on the detail page only, so that
index.html stays small at 30+ runs; the card says what is there in one line each.
"""
from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Optional

from markupsafe import Markup

from harness.judging.results import FirstDivergence, VariantResult

from .chart_evidence import family_heatmap_svg, family_tables, ulp_bound_words, ulp_histogram_svg
from .chart_timeline import timeline_cells, timeline_svg
from .chrome_trace import measured_events
from .words import (
    canonical_words,
    clean_text,
    clip_words,
    detail_page,
    divergence_words,
    expectation_words,
    finite_or_none,
    format_fraction,
    golden_of,
    golden_words,
    int_or_none,
    inventory_lines,
    num,
    outcome_class,
    outcome_of,
    outside_count,
    outside_lines,
    reference_of,
    replica_keys,
    replica_words,
    run_dir_of,
    run_to_run_words,
    trace_file,
)

#: Replica keys listed in a card (the detail page lists them all).
MAX_REPLICA_KEYS = 8


def read_run_trace(v: VariantResult, report_dir: Optional[pathlib.Path]) -> Optional[dict]:
    """The run's merged ``trace.json`` (``report_dir / v.run_dir / trace.json``), or None when there is no
    report directory, `run_dir` is absolute or leads outside it, or the file is missing or unreadable."""
    run_dir = run_dir_of(v)
    if report_dir is None or run_dir is None:
        return None
    try:
        root = pathlib.Path(report_dir).resolve()
        path = (root / run_dir / "trace.json").resolve()
        if root not in path.parents or not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def parameter_count(v: VariantResult, report_dir: Optional[pathlib.Path]) -> Optional[int]:
    """Number of parameters (replicas such as ``...@mtp`` not counted) in the run's ``trace.json``.

    Read from ``report_dir / v.run_dir / trace.json``; None when there is no report directory, `run_dir`
    is absolute or leads outside it, or the trace is missing or unreadable.
    """
    return _count_params(read_run_trace(v, report_dir))


def _count_params(trace: Optional[dict]) -> Optional[int]:
    params = (trace or {}).get("params")
    if not isinstance(params, dict):
        return None
    return sum(1 for meta in params.values() if not (isinstance(meta, dict) and meta.get("replica")))


def structural(v: VariantResult, ref: str, n_params: Optional[int]) -> dict:
    """Data of a variant card's "Structural checks" block and of its markers in the run list.

    ``inventory``: the differing lines (empty when equal); ``inventory_checked``: whether a comparison ran
    (False when the variant or its reference errored); ``replica``: ``{"state": "consistent"|"broken"|
    "unknown", "step", "detail", "names", "names_shown" (the first `MAX_REPLICA_KEYS`), "names_more"}``;
    ``flags``: ``[(css class, label, tooltip)]``.
    """
    inventory = inventory_lines(v)
    rs = v.replica_status if isinstance(v.replica_status, dict) else {}
    state = "unknown" if not rs else ("broken" if rs.get("consistent") is False else "consistent")
    step = rs.get("first_broken_step") if state == "broken" else None
    names = replica_keys(rs)
    # an EP=2 run replicates every non-expert parameter: the card lists a few, the detail page all of them
    replica = {"state": state, "step": step, "detail": clean_text(rs.get("detail") or ""), "names": names,
               "names_shown": names[:MAX_REPLICA_KEYS], "names_more": max(0, len(names) - MAX_REPLICA_KEYS)}
    flags = []
    if inventory:
        n = len(inventory)
        flags.append(("inventory", "inventory ≠",
                      f"parameter inventory differs from {ref} ({n} parameter{'s' if n != 1 else ''}): "
                      + inventory[0]))
    if state == "broken":
        flags.append(("replicas", "replicas ≠", f"replicas inconsistent: {replica_words(rs)}"))
    return {"inventory": inventory, "inventory_checked": bool(inventory) or v.bitwise_equal is not None,
            "n_params": n_params, "replica": replica, "flags": flags}


def run_to_run(v: VariantResult) -> Optional[dict]:
    """Data of a card's "Run-to-run control" block; None when the variant ran once."""
    words = run_to_run_words(v.run_to_run)
    if not words:
        return None
    rr = v.run_to_run
    fd, fd_detail = None, ""
    raw = rr.get("first_divergence")
    if isinstance(raw, dict):
        try:
            mb = raw.get("microbatch")
            fd = divergence_words(FirstDivergence(step=int(raw.get("step", 0)), kind=str(raw.get("kind", "")),
                                                  microbatch=None if mb is None else int(mb),
                                                  name=clean_text(raw.get("name", ""))))
        except (TypeError, ValueError):
            fd = None
        fd_detail = clean_text(raw.get("detail") or "")
    return {"words": words, "deterministic": rr.get("deterministic") is not False,
            "runs": int_or_none(rr.get("runs")), "fd": fd, "fd_detail": fd_detail}


def _sig(x: Any, digits: int = 3) -> Optional[str]:
    f = finite_or_none(x)
    return None if f is None else f"{f:.{digits}g}"


def ulp_rows(v: VariantResult, charts: bool = True) -> list[dict]:
    """Display rows of `v.ulp_evidence` (entries that are not dicts are skipped), in the producer's order; with
    `charts` each row carries its ULP histogram SVG."""
    rows = []
    for e in v.ulp_evidence or []:
        if not isinstance(e, dict):
            continue
        numel, differing = int_or_none(e.get("numel")), int_or_none(e.get("differing"))
        frac = finite_or_none(e.get("fraction"))
        if frac is None and numel and differing is not None:
            frac = differing / numel
        nan, max_ulp = int_or_none(e.get("nan_mismatch")), int_or_none(e.get("max_ulp"))
        svg = ulp_histogram_svg(e) if charts else None
        rows.append({
            "key": clean_text(e.get("key")), "what": clean_text(e.get("what")),
            "key_parts": re.findall(r"[^.]*\.|[^.]+", clean_text(e.get("key"))),   # break after dots
            "dtype": clean_text(e.get("dtype")),
            "numel": None if numel is None else f"{numel:,}",
            "differing": None if differing is None else f"{differing:,}",
            "fraction": None if frac is None else f"{100.0 * frac:.3g} %",
            "max_ulp": None if max_ulp is None else str(max_ulp), "max_ulp_int": max_ulp,
            "median_ulp": _sig(e.get("median_ulp"), 6),
            "max_abs": _sig(e.get("max_abs_err")), "max_rel": _sig(e.get("max_rel_err")),
            "nan": nan, "svg": Markup(svg) if svg else None,
        })
    return rows


def ulp_section(v: VariantResult, charts: bool = True) -> Optional[dict]:
    """Data of the "ULP evidence" block; None when there is neither evidence nor an evidence error.  ``summary``
    is the one line the card shows (``2 tensors · max 2^30 ULP``)."""
    rows = ulp_rows(v, charts)
    error = clean_text(v.evidence_error or "").strip()
    if not rows and not error:
        return None
    fd = v.first_divergence
    step = fd.step if fd is not None and fd.kind in ("grad", "optimizer_state", "param") else None
    worst = max((r["max_ulp_int"] for r in rows if r["max_ulp_int"] is not None), default=None)
    summary = (f"{len(rows)} differing tensor{'s' if len(rows) != 1 else ''}"
               + (f" · max {ulp_bound_words(worst)} ULP" if worst is not None else "")) if rows else ""
    return {"rows": rows, "error": error, "step": step, "summary": summary}


def heatmap(v: VariantResult, charts: bool = True) -> Optional[dict]:
    """Data of the "Differing parameters" block: None without counts; ``svg`` None when all are zero (or
    without `charts`)."""
    tables = family_tables(v)
    if not tables:
        return None
    svg = family_heatmap_svg(v) if charts else None
    return {"svg": Markup(svg) if svg else None, "any": any(t["total"] for t in tables),
            "totals": [(t["kind"], t["total"]) for t in tables], "n_steps": max(len(t["steps"]) for t in tables)}


def overlap_words(cov: Any) -> Optional[dict]:
    """The MoE 1F1B overlap's coverage (`harness.judging.trace.overlap_coverage`) in words: merged forward+backward
    steps and delayed weight-gradient calls per rank at step 0, and the warning; None without the overlap."""
    if not isinstance(cov, dict) or not cov.get("merged"):
        return None if not isinstance(cov, dict) or not cov.get("warning") else \
            {"words": clean_text(cov["warning"]), "warning": True}
    merged = ", ".join(f"{clean_text(r)}: {clean_text(c[0] if c else 0)}" for r, c in cov["merged"].items())
    dw = ", ".join(f"{clean_text(r)}: {clean_text(c[0] if c else 0)}" for r, c in (cov.get("backward_dw") or {}).items())
    words = f"merged forward+backward steps per rank at step 0 — {merged}; backward_dw calls — {dw}"
    if cov.get("warning"):
        words += f"; warning: {clean_text(cov['warning'])}"
    return {"words": words, "warning": bool(cov.get("warning"))}


def timeline(v: VariantResult, charts: bool = True) -> Optional[dict]:
    """Caption numbers (and with `charts` the SVG) of a variant's schedule timeline; None without cells."""
    cells = timeline_cells(v)
    if not cells:
        return None
    svg = timeline_svg(v) if charts else None
    return {"svg": Markup(svg) if svg else None, "bubble": format_fraction(v.bubble_fraction),
            "makespan": num(max(c["end"] for c in cells)), "n_cells": len(cells)}


def card(v: VariantResult, i: int, anchors: dict[int, str], result: Any, report_dir: Optional[pathlib.Path] = None,
         charts: bool = False) -> dict:
    """Everything the templates show about one variant: its card in index.html (`charts` False: summaries
    only) or its detail page (`charts` True: timeline, heatmap and ULP histograms drawn)."""
    ref = reference_of(v, result.baseline)
    ref_index = next((j for j, r in enumerate(result.variants) if r.name == ref), None)
    fd = v.first_divergence
    g = golden_of(v)
    trace = read_run_trace(v, report_dir)
    return {
        "v": v, "anchor": anchors[i], "is_baseline": v.name == result.baseline,
        "cls": outcome_class(v, result.baseline), "outcome": outcome_of(v, result.baseline),
        "ref": ref, "ref_anchor": None if ref_index is None else anchors[ref_index],
        "ref_is_baseline": ref == result.baseline, "ref_is_self": ref == v.name,
        "clip": clip_words(v.clip_grad),
        "fd": divergence_words(fd), "fd_detail": clean_text(fd.detail) if fd is not None else "",
        "canonical": canonical_words(fd),
        "outside": outside_lines(v), "outside_count": outside_count(v),
        "golden": {"status": clean_text(g.get("status") or ""), "words": golden_words(g)} if g else None,
        "options": sorted((v.options or {}).items(), key=lambda kv: str(kv[0])),
        "expectation": expectation_words(v, result.baseline),
        "structural": structural(v, ref, _count_params(trace)),
        "run_to_run": run_to_run(v),
        "heatmap": None if ref == v.name else heatmap(v, charts),
        "ulp": ulp_section(v, charts),
        "timeline": timeline(v, charts),
        "detail_page": detail_page(v), "trace_file": trace_file(v) if timeline_cells(v) else None,
        "measured": bool(measured_events(trace)),
        "overlap": overlap_words(getattr(v, "overlap_coverage", None)),
        "resumed": resumed_words(v),
    }


def resumed_words(v: VariantResult) -> str:
    """The card's line on a resumed run ('' when it did not resume): after which step, from whose checkpoint,
    and that what it loaded was compared."""
    after = v.series.resumed_after if v.series else []
    if not after:
        return ""
    src = f" of {v.resumed_from}" if v.resumed_from else ""
    steps = ", ".join(map(str, after))
    return (f"after step {steps}: new processes loaded the checkpoint{src}; what they loaded (every parameter, "
            "Adam moment and buffer) is compared bit for bit with the state it was saved from")
