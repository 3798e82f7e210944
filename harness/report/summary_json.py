"""``summary.json``: the machine-readable verdicts of a case (schema in `summary_dict`)."""
from __future__ import annotations

import math
from typing import Any

from harness.judging.results import CaseResult, VariantResult

from .chart_timeline import timeline_cells
from .words import (
    bug_words,
    canonical_words,
    clean_text,
    detail_page,
    finite_or_none,
    golden_of,
    inventory_lines,
    outside_count,
    outside_lines,
    reference_of,
    trace_file,
)


def json_safe(x: Any) -> Any:
    """Values as JSON: containers recursively, non-finite floats as strings, anything else `str`."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return str(x)


def _first_divergence(v: VariantResult) -> Any:
    fd = v.first_divergence
    if fd is None:
        return None
    return {"step": int(fd.step), "kind": str(fd.kind),
            "microbatch": None if fd.microbatch is None else int(fd.microbatch),
            "name": str(fd.name), "ulp": None if fd.ulp is None else int(fd.ulp),
            "canonical": canonical_words(fd) or None}


def _variant(v: VariantResult, baseline: str) -> dict:
    return {
        "name": str(v.name),
        "layout": str(v.layout),
        "pp": int(v.pp),
        "vpp": int(v.vpp),
        "ep": int(v.expert_model_parallel_size),
        "dp": int(getattr(v, "data_parallel_size", 1) or 1),
        "tp": int(getattr(v, "tensor_model_parallel_size", 1) or 1),
        "sp": bool(getattr(v, "sequence_parallel", False)),
        "overlap_coverage": json_safe(dict(v.overlap_coverage)) if isinstance(getattr(v, "overlap_coverage", None), dict) else {},
        "schedule": v.schedule,
        "mtp_standalone": bool(v.mtp_standalone),
        "expect": str(v.expect),
        "verdict": str(v.verdict),
        "outcome": str(v.outcome),
        "bitwise_equal": None if v.bitwise_equal is None else bool(v.bitwise_equal),
        "first_divergence": _first_divergence(v),
        "reason": str(v.reason or ""),
        "elapsed_s": finite_or_none(v.elapsed_s) or 0.0,
        "compare_to": reference_of(v, baseline),
        "reductions": str(v.reductions),
        "trainer": str(v.trainer),
        "clip_grad": finite_or_none(v.clip_grad) or 0.0,
        "bubble_fraction": finite_or_none(v.bubble_fraction),
        "inventory": inventory_lines(v),
        "bug": None if not getattr(v, "bug", None) else str(v.bug),
        "bug_words": bug_words(v),
        "nonfinite": str(getattr(v, "nonfinite", "") or "") or None,
        "replica_status": json_safe(dict(v.replica_status)) if isinstance(v.replica_status, dict) else {},
        "run_to_run": json_safe(dict(v.run_to_run)) if isinstance(v.run_to_run, dict) else {},
        "ulp_evidence": [json_safe(dict(e)) for e in (v.ulp_evidence or []) if isinstance(e, dict)],
        "evidence_error": clean_text(v.evidence_error or ""),
        "outside_signature": outside_lines(v), "outside_signature_count": outside_count(v),
        "golden": json_safe(dict(golden_of(v))),
        "detail_page": detail_page(v),
        "schedule_trace": trace_file(v) if timeline_cells(v) else None,
    }


def summary_dict(result: CaseResult) -> dict:
    """The content of ``summary.json``.

    Schema::

        {"case": str, "baseline": str, "elapsed_s": float,
         "variants": [{"name": str, "layout": str, "pp": int, "vpp": int, "ep": int, "dp": int, "tp": int, "sp": bool, "schedule": str,
                       "mtp_standalone": bool,
                       "expect": "bitwise"|"may_diverge"|"diverge", "verdict": "pass"|"fail"|"error",
                       "outcome": "reference"|"equal"|"differs only where allowed"|"differs as expected"|
                                  "unexpected difference"|"unexpectedly equal"|"not finite"|"error",
                       "bitwise_equal": bool|None,
                       "first_divergence": None | {"step": int,
                                                   "kind": "inventory"|"loss"|"grad"|"grad_norm"|"param"|
                                                           "buffer",
                                                   "microbatch": int|None, "name": str,
                                                   "ulp": int|None, "canonical": str|None},
                       "reason": str, "elapsed_s": float,
                       "compare_to": str, "reductions": "megatron"|"canonical",
                       "trainer": one of trainerkit.config.TRAINERS,
                       "clip_grad": float, "bubble_fraction": float|None,
                       "inventory": [str],
                       "replica_status": {} | {"consistent": bool, "first_broken_step": int|None,
                                               "replicas": [str], "detail": str},
                       "run_to_run": {} | {"runs": int, "deterministic": bool,
                                           "first_divergence": None | {"step", "kind", "microbatch",
                                                                       "name", "detail"},
                                           "detail": str},
                       "ulp_evidence": [{"key": str, "what": "grad"|"param", "dtype": str, "numel": int,
                                         "differing": int, "fraction": float, "max_ulp": int,
                                         "median_ulp": float, "histogram": [[int|None, int]],
                                         "max_abs_err": float, "max_rel_err": float,
                                         "nan_mismatch": int}],
                       "evidence_error": str,
                       "outside_signature": [str], "outside_signature_count": int,
                       "golden": {} | {"status": "equal"|"differs"|"unchecked"|"missing"|"other environment",
                                       "first_divergence": dict|None, "detail": str},
                       "detail_page": str|None, "schedule_trace": str|None}],
         "all_pass": bool (every variant and the cross-implementation check passed: exit code 0),
         "cross_implementation": None | {"verdict": "pass"|"fail"|"error", "reason": str,
                                         "trainers": [str, str], "variant": str|None, "step": int,
                                         "max_ulp": int, "headline": {...}, "losses": [...],
                                         "tensors": [...], ...}  (harness.judging.crossimpl),
         "golden": None | {"dir": str, "environment": str, "verdict": "pass"|"fail"|"unchecked",
                           "checked_on": [str], "detail": str},
         "megatron_sources": None | {"head": {"path": str, "version": str, "commit": str|None,
                                               "modified": bool|None}, "base": {...}, "same": bool
                                               (with --megatron-base)},
         "agreement": {} | {"split": bool, "computations": [{"label": str, "key": str, "split": bool,
                                                             "warning": str|None,
                                                             "groups": [{"runs": [str], "size": int,
                                                                         "has_baseline": bool,
                                                                         "classes": int}],
                                                             "classes": [{"runs": [str], "size": int,
                                                                          "has_baseline": bool,
                                                                          "group": int}]}],
                            "errored": [str]}  (harness.judging.agreement),
         "not_run": [{"name": str, "reason": str}]  (runs not made on this megatron, as the case states),
         "environment": {...}}

    Variants keep the order of `result.variants` (baseline first).  ``compare_to`` is the run the
    variant is compared with (the baseline unless the case names another); ``clip_grad`` is 0.0 when
    clipping is off; ``bubble_fraction`` is the idle share of rank-time of the schedule played with
    unit costs (None when unknown).  ``first_divergence.canonical`` is the first difference in canonical
    parameter order when it names another tensor than the (dataflow-first) ``name``, else None.
    ``inventory`` lists the parameter-inventory differences from that run (empty when the inventories match
    or were not compared); ``replica_status`` is the run's own replica consistency (``{}`` when the run
    errored).  ``run_to_run`` is the run-to-run control of a variant run several times (``{}`` when it ran
    once): nondeterminism, reported apart from the layout comparison.  ``ulp_evidence`` measures each
    differing tensor at the first diverging step in ULPs, with its histogram (``[upper bound, count]`` on
    power-of-two buckets, None = above 2^24); ``[]`` when not collected, ``evidence_error`` saying why
    collection failed (``""`` otherwise).  ``outside_signature`` lists differences outside the expected
    divergence's signature ([] when none or not checked); ``golden`` is the comparison with a golden trace
    (``{}`` when not asked).  ``detail_page`` / ``schedule_trace`` are the variant's detail page and Chrome
    trace, relative to the report directory (None without a run directory or a planned timeline).
    ``agreement`` groups the runs that compute the same thing (same computation key: the run without its
    placement) into classes of bitwise-equal traces, whatever each was compared with, and joins into one group
    the classes a passing run links to its reference (its difference is one its expectation allows):
    ``label`` names the options that tell a computation from the others (``""`` for a single one), groups come
    largest first, ``split`` says there is more than one group, a class's ``group`` indexes ``groups``, and
    ``warning`` says when a reference run (the baseline, or a ``compare_to`` target) stands in a smaller group
    than the largest, i.e. may be the odd one out, or in one of several largest groups ("no majority");
    ``{}`` when not computed.
    Non-finite numbers are written as strings so the file stays strict JSON.
    """
    golden = getattr(result, "golden", None)
    sources = getattr(result, "megatron_sources", None)
    agreement = getattr(result, "agreement", None)
    return {
        "case": str(result.case),
        "baseline": str(result.baseline),
        "elapsed_s": finite_or_none(result.elapsed_s) or 0.0,
        "variants": [_variant(v, result.baseline) for v in result.variants],
        "all_pass": bool(result.all_pass),
        "cross_implementation": json_safe(dict(result.cross_implementation)) if result.cross_implementation else None,
        "golden": json_safe(dict(golden)) if isinstance(golden, dict) else None,
        "megatron_sources": json_safe(dict(sources)) if isinstance(sources, dict) else None,
        "agreement": json_safe(dict(agreement)) if isinstance(agreement, dict) else {},
        "not_run": [{"name": str(r["name"]), "reason": str(r["reason"])} for r in getattr(result, "not_run", [])],
        "environment": json_safe(dict(result.environment or {})),
    }
