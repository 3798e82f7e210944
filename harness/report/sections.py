"""Data of the case-wide sections of index.html: the lm-loss bits per run and step, grad norm & clipping, and
the cross-implementation check."""
from __future__ import annotations

from typing import Any, Optional

from harness.judging.results import CaseResult, VariantResult
from harness.judging.ulp import scale_words

from .words import clipping_on, finite_or_none, reference_of


def _at(seq: Any, i: int) -> Any:
    """``seq[i]`` or None when `seq` is missing or too short."""
    try:
        return seq[i] if seq is not None and 0 <= i < len(seq) else None
    except TypeError:
        return None


def reference_run(result: CaseResult, v: VariantResult) -> Optional[VariantResult]:
    """The variant `v` is compared with (its `compare_to`, else the baseline); None if not in the result."""
    ref = reference_of(v, result.baseline)
    return next((r for r in result.variants if r.name == ref), None)


def hex_table(result: CaseResult, anchors: dict[int, str]) -> dict:
    """Per-run lm-loss bit patterns, one row per run with data and one column per step (so 30 runs make a
    long table, not a wide one): ``{"steps": [int], "rows": [{"v", "anchor", "cells": [{"hex", "value",
    "differs"}]}]}``.

    A cell ``differs`` when its bits differ from those of the run the variant is compared with
    (`compare_to`, the baseline by default) at that step.
    """
    indexed = [(i, v) for i, v in enumerate(result.variants) if v.series and v.series.lm_loss_hex]
    n_steps = max((len(v.series.lm_loss_hex) for _, v in indexed), default=0)
    rows = []
    for i, v in indexed:
        ref_v = reference_run(result, v)
        is_ref = ref_v is None or ref_v is v
        cells = []
        for step in range(n_steps):
            hx = _at(v.series.lm_loss_hex, step) or None
            val = finite_or_none(_at(v.series.lm_loss, step))
            ref = None if is_ref or not ref_v.series else _at(ref_v.series.lm_loss_hex, step)
            cells.append({"hex": hx, "value": "" if val is None else repr(val),
                          "differs": hx is not None and not is_ref and (not ref or hx.lower() != str(ref).lower())})
        rows.append({"v": v, "anchor": anchors[i], "cells": cells})
    return {"steps": list(range(n_steps)), "rows": rows}


def grad_norm_section(result: CaseResult, anchors: dict[int, str]) -> dict:
    """Data of the "Grad norm & clipping" section.

    ``{"on": [{"v", "anchor", "ref", "ref_anchor", "ref_is_baseline", "precision", "rows", "ulp_nonzero"}],
    "off": [{"v", "anchor"}]}``; one row per step: ``{"step", "hex", "value", "ulp", "ref_hex", "coeff",
    "clipped"}`` where `ulp` is the ULP distance from the reference run's grad norm (None when not comparable).
    """
    on, off = [], []
    for i, v in enumerate(result.variants):
        if not clipping_on(v):
            off.append({"v": v, "anchor": anchors[i]})
            continue
        s = v.series or None
        ref_v = reference_run(result, v)
        ref_s = ref_v.series if ref_v is not None and ref_v is not v else None
        n = max((len(getattr(s, k) or []) for k in ("grad_norm_hex", "grad_norm", "clip_coeff", "clipped")),
                default=0) if s is not None else 0
        rows = []
        for step in range(n):
            ulp = _at(s.grad_norm_ulp, step)
            coeff = finite_or_none(_at(s.clip_coeff, step))
            value = finite_or_none(_at(s.grad_norm, step))
            clipped = _at(s.clipped, step)
            rows.append({
                "step": step,
                "hex": _at(s.grad_norm_hex, step) or None,
                "value": None if value is None else repr(value),
                "ulp": None if ulp is None else int(ulp),
                "ref_hex": (_at(ref_s.grad_norm_hex, step) or None) if ref_s is not None else None,
                "coeff": None if coeff is None else repr(coeff),
                "clipped": None if clipped is None else bool(clipped),
            })
        widths = {len(r["hex"]) for r in rows if r["hex"]}
        precision = {10: "fp32", 18: "fp64"}.get(widths.pop()) if len(widths) == 1 else None
        ref = reference_of(v, result.baseline)
        ref_index = next((j for j, r in enumerate(result.variants) if r.name == ref), None)
        on.append({"v": v, "anchor": anchors[i], "ref": ref, "ref_is_baseline": ref == result.baseline,
                   "ref_anchor": None if ref_index is None else anchors[ref_index],
                   "precision": precision, "rows": rows, "ulp_nonzero": sum(1 for r in rows if r["ulp"])})
    return {"on": on, "off": off}


def cross_section(rec: Optional[dict]) -> Optional[dict]:
    """The cross-implementation section of index.html: the record, its loss rows, and its tensor rows sorted
    by gradient ULP at tensor scale, worst first, each with ``cells``: {"grad", "param"} -> the ULP at tensor
    scale as text, or the words for a tensor all zero on one side (`harness.judging.ulp.scale_words`); "—" when not
    compared."""
    if not rec:
        return None
    names = tuple(rec.get("trainers") or ("?", "?"))
    rows = sorted(rec.get("tensors", []), key=lambda r: -(r["grad"]["scaled_ulp"] if r.get("grad") else -1))

    def cell(entry):        # the column says "ULP at scale": the number alone, or the zero-side words
        return scale_words(entry, names).removesuffix(" ULP at tensor scale") if entry else "—"
    rows = [{**r, "cells": {w: cell(r.get(w)) for w in ("grad", "param")}} for r in rows]
    return {"rec": rec, "rows": rows, "losses": rec.get("losses", [])}
