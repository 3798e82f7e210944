"""The verdict matrix of the report's first screen: layouts as rows, option groups as columns, one coloured
cell per run, so that "did anything move, and where?" is answered at a glance for 30+ runs.

A row is a pipeline layout (layout text, P, V, MTP placement); a column is what else the run changes: its
reductions and clipping, the 1F1B overlap, expert parallelism, other option overrides, and the trainer once
a case uses two.  Runs that land in the same cell (a repeated configuration) share it.
"""
from __future__ import annotations

import json
from typing import Any

from harness.judging.results import CaseResult, VariantResult

from .words import (
    OUTCOME_LEGEND,
    canonical_words,
    clean_text,
    clip_words,
    divergence_words,
    golden_of,
    golden_words,
    mtp_words,
    outcome_class,
    outcome_of,
    outcome_symbol,
    outside_count,
    reference_of,
)

#: Options that have their own place in a column label (`VariantResult` fields), not an ``k=v`` line.
_OWN_FIELDS = {"reductions", "clip_grad", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
               "expert_model_parallel_size", "trainer"}


def _overlap_words(v: VariantResult) -> str:
    if not v.overlap:
        return ""
    return "overlap + delayed wgrad" if v.delay_wgrad else "overlap"


def _extra_options(v: VariantResult) -> tuple:
    """Option overrides other than those with a field of their own, as sorted ``(key, value text)`` pairs."""
    opts = v.options if isinstance(v.options, dict) else {}
    return tuple(sorted((clean_text(k), json.dumps(val, sort_keys=True, default=str) if isinstance(val, (dict, list))
                         else clean_text(val)) for k, val in opts.items() if k not in _OWN_FIELDS))


def column_key(v: VariantResult) -> tuple:
    """What a run changes besides its layout: (trainer, reductions, clip, overlap, EP, other options)."""
    return (clean_text(v.trainer), clean_text(v.reductions), clip_words(v.clip_grad), _overlap_words(v),
            int(v.expert_model_parallel_size or 1), _extra_options(v))


def row_key(v: VariantResult) -> tuple:
    """The run's pipeline layout: (layout text, P, V, where it puts MTP: `mtp_words`)."""
    return (clean_text(v.layout), int(v.pp), int(v.vpp), mtp_words(v))


def _column(key: tuple, several_trainers: bool) -> dict:
    trainer, reductions, clip, overlap, ep, extra = key
    lines = ([trainer] if several_trainers else []) + [reductions, f"clip {clip}"]
    if overlap:
        lines.append(overlap)
    if ep > 1:
        lines.append(f"EP {ep}")
    lines += [f"{k}={val}" for k, val in extra]
    title = (f"trainer {trainer} · reductions {reductions} · clip_grad {clip} · "
             f"{overlap or 'no overlap'} · expert parallel {ep}"
             + "".join(f" · {k}={val}" for k, val in extra))
    return {"key": key, "lines": lines, "title": title}


def _row(key: tuple) -> dict:
    layout, pp, vpp, mtp = key
    head = "P1 · no pipelining" if pp == 1 else f"P{pp} · V{vpp}"
    return {"key": key, "head": head, "mtp": mtp, "layout": layout}


def cell_title(v: VariantResult, baseline: str) -> str:
    """The tooltip of a run's matrix cell: name, outcome and verdict, first divergence (and its canonical-order
    counterpart), reference run, golden comparison."""
    lines = [clean_text(v.name), f"{outcome_of(v, baseline)} ({v.verdict})"]
    fd = divergence_words(v.first_divergence)
    if fd:
        lines.append(f"first divergence: {fd}")
    if canonical_words(v.first_divergence):
        lines.append(f"in canonical order: {canonical_words(v.first_divergence)}")
    if v.verdict == "error" and v.reason:
        lines.append(clean_text(v.reason).splitlines()[0] if clean_text(v.reason) else "")
    ref = reference_of(v, baseline)
    lines.append("reference run of the case" if ref == v.name else f"compared with {clean_text(ref)}")
    if golden_of(v):
        lines.append(f"golden: {golden_words(golden_of(v))}")
    return "\n".join(x for x in lines if x)


def _entry(v: VariantResult, anchor: str, baseline: str, references: set) -> dict:
    g = golden_of(v)
    status = clean_text(g.get("status")) if g else ""
    return {"name": clean_text(v.name), "anchor": anchor, "cls": outcome_class(v, baseline),
            "symbol": outcome_symbol(v, baseline),
            "title": cell_title(v, baseline), "is_ref": v.name in references or v.name == baseline,
            "golden": status if status and status != "equal" else ""}


def verdict_matrix(result: CaseResult, anchors: dict[int, str]) -> dict[str, Any]:
    """The matrix of `result`: ``{"columns": [{"lines", "title"}], "rows": [{"head", "mtp", "layout", "cells":
    [[entry, ...] per column]}], "failing": [{"name", "anchor", "cls", "outcome", "words", "canonical",
    "outside" (count of differences outside the expected signature)}], "legend": [(cls, words,
    count)], "n_runs"}``.  An entry is ``{"name", "anchor" (its card), "cls" (colour), "symbol", "title"
    (tooltip), "is_ref" (others are compared with it: outlined), "golden" (status when not equal)}``.  Rows and
    columns keep the order in which the case first names them."""
    variants = result.variants
    several_trainers = len({clean_text(v.trainer) for v in variants}) > 1
    col_keys = list(dict.fromkeys(column_key(v) for v in variants))
    row_keys = list(dict.fromkeys(row_key(v) for v in variants))
    col_index = {k: i for i, k in enumerate(col_keys)}
    references = {reference_of(v, result.baseline) for v in variants if reference_of(v, result.baseline) != v.name}
    rows = [{**_row(k), "cells": [[] for _ in col_keys]} for k in row_keys]
    row_index = {k: i for i, k in enumerate(row_keys)}
    for i, v in enumerate(variants):
        rows[row_index[row_key(v)]]["cells"][col_index[column_key(v)]].append(
            _entry(v, anchors[i], result.baseline, references))
    failing = []
    for i, v in enumerate(variants):
        if v.verdict == "pass":
            continue
        words = divergence_words(v.first_divergence) or clean_text(v.reason).split("\n")[0] or v.verdict
        failing.append({"name": clean_text(v.name), "anchor": anchors[i], "cls": outcome_class(v, result.baseline),
                        "outcome": outcome_of(v, result.baseline), "words": words,
                        "canonical": canonical_words(v.first_divergence), "outside": outside_count(v)})
    counts: dict = {}
    for v in variants:
        cls = outcome_class(v, result.baseline)
        counts[cls] = counts.get(cls, 0) + 1
    legend = [(cls, words, counts.get(cls, 0)) for cls, words in OUTCOME_LEGEND]
    return {"columns": [_column(k, several_trainers) for k in col_keys], "rows": rows, "failing": failing,
            "legend": legend, "n_runs": len(variants)}


__all__ = ["verdict_matrix", "column_key", "row_key", "cell_title"]
