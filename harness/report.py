"""Render a :class:`harness.results.CaseResult` as a report directory.

`write_report` writes four files into one directory:

* ``index.html``  -- a self-contained page (inline CSS and SVG, no JavaScript, no network);
* ``summary.json`` -- the machine-readable verdicts (schema in `summary_dict`);
* ``junit.xml``    -- one ``<testcase>`` per variant, for CI test-report widgets;
* ``summary.md``   -- a short verdict table for a CI job page.

Every file is written atomically (temporary file in the same directory, then `os.replace`), so a
reader never sees a half-written file and an interrupted run leaves no temporary files behind.
"""
from __future__ import annotations

import io
import json
import math
import os
import pathlib
import re
import uuid
import xml.etree.ElementTree as ET
from html import escape as html_escape
from typing import Any, Optional

import jinja2
from markupsafe import Markup

from harness.results import FAMILIES, CaseResult, FirstDivergence, VariantResult

__all__ = ["write_report", "summary_dict", "junit_xml", "markdown_summary", "render_html", "timeline_svg",
           "ulp_histogram_svg", "family_heatmap_svg", "run_to_run_words"]

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "report.html.j2"

#: Output file names, in the order they are written (the page last, once everything it links exists).
REPORT_FILES = ("summary.json", "junit.xml", "summary.md", "index.html")

#: Characters XML 1.0 cannot represent at all (not even as character references).
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


# --------------------------------------------------------------------------------------------------
# small formatting helpers shared by all outputs
# --------------------------------------------------------------------------------------------------

def _clean_text(s: Any) -> str:
    """`str(s)` without ANSI colour codes and without characters XML cannot carry."""
    if s is None:
        return ""
    s = _ANSI_ESCAPE.sub("", str(s))
    return _XML_INVALID.sub("\ufffd", s)


def _finite_or_none(x: Any) -> Optional[float]:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def format_elapsed(seconds: Any) -> str:
    """Human duration: ``0.42 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    s = _finite_or_none(seconds)
    if s is None:
        return "—"
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def divergence_words(fd: Optional[FirstDivergence]) -> str:
    """One line for a first divergence, e.g. ``step 0 · grad · embedding.word_embeddings.weight``.

    Loss divergences name the microbatch: ``step 3 · loss · mb 1 · lm``.  An inventory difference is found
    before any training step: ``before training · inventory · output_layer.weight``.  ``""`` when `fd` is
    None.
    """
    if fd is None:
        return ""
    when = "before training" if fd.kind == "inventory" else f"step {fd.step}"
    parts = [when, str(fd.kind)]
    if fd.microbatch is not None:
        parts.append(f"mb {fd.microbatch}")
    parts.append(str(fd.name))
    return " · ".join(parts)


def reference_of(v: VariantResult, baseline: str) -> str:
    """Name of the run `v` is compared with (`compare_to`, the case baseline when unset)."""
    return str(v.compare_to) if v.compare_to else str(baseline)


def clip_words(clip_grad: Any) -> str:
    """``"off"`` when gradient clipping is disabled (0, None, not a number), else the threshold (``0.05``)."""
    c = _finite_or_none(clip_grad)
    return "off" if c is None or c <= 0 else f"{c:g}"


def clipping_on(v: VariantResult) -> bool:
    """True when the variant trains with grad clipping (clip_grad > 0)."""
    return clip_words(v.clip_grad) != "off"


def format_fraction(x: Any) -> str:
    """A fraction in [0, 1] as a percentage with one decimal: ``0.1579`` -> ``15.8 %``; ``—`` when unknown."""
    f = _finite_or_none(x)
    return "—" if f is None else f"{100.0 * f:.1f} %"


def _ref_words(v: VariantResult, baseline: str) -> str:
    ref = reference_of(v, baseline)
    return f"baseline {ref!r}" if ref == baseline else f"reference run {ref!r}"


def _expectation_words(v: VariantResult, baseline: str) -> str:
    if v.expect == "bitwise":
        return f"expected bitwise equality with {_ref_words(v, baseline)}"
    if v.expect == "may_diverge":
        return (f"expected bitwise equality with {_ref_words(v, baseline)}, or a first divergence only where "
                "allowed (rounding that depends on the values)")
    return f"expected to diverge from {_ref_words(v, baseline)}"


def inventory_lines(v: VariantResult) -> list[str]:
    """The variant's parameter-inventory differences from its reference run, one cleaned line each."""
    return [_clean_text(x) for x in (v.inventory or [])]


def replica_words(rs: Any) -> str:
    """One line for a `VariantResult.replica_status`; ``""`` when it is empty (the run errored).

    ``consistent · 1 replica(s) match ...`` or ``broken at step 1 · <key>: gradient at step 1 ...``.
    """
    if not isinstance(rs, dict) or not rs:
        return ""
    detail = _clean_text(rs.get("detail") or "")
    if rs.get("consistent") is False:
        step = rs.get("first_broken_step")
        head = "broken" if step is None else f"broken at step {step}"
    else:
        head = "consistent"
    return f"{head} · {detail}" if detail else head


def replicas_broken(v: VariantResult) -> bool:
    """True when the run's replicas drifted from their originals (`replica_status.consistent` is False)."""
    rs = v.replica_status
    return isinstance(rs, dict) and rs.get("consistent") is False


def _replica_keys(rs: Any) -> list[str]:
    keys = rs.get("replicas") if isinstance(rs, dict) else None
    return [_clean_text(k) for k in keys] if isinstance(keys, (list, tuple)) else []


def _variant_failure_text(v: VariantResult, baseline: str) -> str:
    """Body of a JUnit <failure>: what diverged (or did not) and what was expected."""
    lines = []
    if v.reason:
        lines.append(v.reason)
    if v.first_divergence is not None:
        lines.append(f"first divergence: {divergence_words(v.first_divergence)}")
        if v.first_divergence.detail:
            lines.append(f"  {v.first_divergence.detail}")
    elif v.bitwise_equal:
        lines.append(f"no divergence: the run is bitwise equal to {_ref_words(v, baseline)}")
    inventory = inventory_lines(v)
    if inventory:
        lines.append(f"parameter inventory differs from {_ref_words(v, baseline)} "
                     f"({len(inventory)} parameter{'s' if len(inventory) != 1 else ''}):")
        lines += [f"  {line}" for line in inventory]
    if replica_words(v.replica_status):
        lines.append(f"replica consistency: {replica_words(v.replica_status)}")
        keys = _replica_keys(v.replica_status)
        if keys:
            lines.append(f"  replicas: {', '.join(keys)}")
    lines.append(_expectation_words(v, baseline))
    lines.append(f"layout: {v.layout} (pp={v.pp}, vpp={v.vpp}, ep={v.expert_model_parallel_size}, "
                 f"schedule={v.schedule}, mtp_standalone={v.mtp_standalone})")
    lines.append(f"reductions: {v.reductions} · clip_grad: {clip_words(v.clip_grad)} · "
                 f"compared with: {reference_of(v, baseline)}")
    if v.run_dir:
        lines.append(f"run dir: {v.run_dir}")
    if v.command:
        lines.append(f"reproduce: {v.command}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# summary.json
# --------------------------------------------------------------------------------------------------

def _json_safe(x: Any) -> Any:
    """Environment values as JSON: containers recursively, non-finite floats as strings, rest `str`."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return str(x)


def summary_dict(result: CaseResult) -> dict:
    """The content of ``summary.json``.

    Schema::

        {"case": str, "baseline": str, "elapsed_s": float,
         "variants": [{"name": str, "layout": str, "pp": int, "vpp": int, "ep": int, "schedule": str,
                       "mtp_standalone": bool,
                       "expect": "bitwise"|"may_diverge"|"diverge", "verdict": "pass"|"fail"|"error",
                       "outcome": "reference"|"equal"|"differs only where allowed"|"differs as expected"|
                                  "unexpected difference"|"unexpectedly equal"|"error",
                       "bitwise_equal": bool|None,
                       "first_divergence": None | {"step": int,
                                                   "kind": "inventory"|"loss"|"grad"|"grad_norm"|"param",
                                                   "microbatch": int|None, "name": str,
                                                   "ulp": int|None},
                       "reason": str, "elapsed_s": float,
                       "compare_to": str, "reductions": "megatron"|"canonical",
                       "trainer": "reference"|"megatron-core",
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
                       "evidence_error": str}],
         "all_pass": bool (every variant and the cross-implementation check passed: exit code 0),
         "cross_implementation": None | {"verdict": "pass"|"fail"|"error", "reason": str,
                                         "trainers": [str, str], "variant": str|None, "step": int,
                                         "max_ulp": int, "headline": {...}, "losses": [...],
                                         "tensors": [...], ...}  (harness.crossimpl),
         "environment": {...}}

    Variants keep the order of `result.variants` (baseline first).  ``compare_to`` is the run the
    variant is compared with (the baseline unless the case names another); ``clip_grad`` is 0.0 when
    clipping is off; ``bubble_fraction`` is the idle share of rank-time of the schedule played with
    unit costs (None when unknown).  ``inventory`` lists the parameter-inventory differences from that
    run (empty when the inventories match or were not compared); ``replica_status`` is the run's own
    replica consistency (``{}`` when the run errored).  ``run_to_run`` is the run-to-run control of a
    variant run several times (``{}`` when it ran once): nondeterminism, reported apart from the layout
    comparison.  ``ulp_evidence`` measures each differing tensor at the first diverging step in ULPs, with
    its histogram (``[upper bound, count]`` on power-of-two buckets, None = above 2^24); ``[]`` when not
    collected, ``evidence_error`` saying why collection failed (``""`` otherwise).  Non-finite numbers are
    written as strings so the file stays strict JSON.
    """
    variants = []
    for v in result.variants:
        fd = v.first_divergence
        variants.append({
            "name": str(v.name),
            "layout": str(v.layout),
            "pp": int(v.pp),
            "vpp": int(v.vpp),
            "ep": int(v.expert_model_parallel_size),
            "schedule": v.schedule,
            "mtp_standalone": bool(v.mtp_standalone),
            "expect": str(v.expect),
            "verdict": str(v.verdict),
            "outcome": str(v.outcome),
            "bitwise_equal": None if v.bitwise_equal is None else bool(v.bitwise_equal),
            "first_divergence": None if fd is None else {
                "step": int(fd.step),
                "kind": str(fd.kind),
                "microbatch": None if fd.microbatch is None else int(fd.microbatch),
                "name": str(fd.name),
                "ulp": None if fd.ulp is None else int(fd.ulp),
            },
            "reason": str(v.reason or ""),
            "elapsed_s": _finite_or_none(v.elapsed_s) or 0.0,
            "compare_to": reference_of(v, result.baseline),
            "reductions": str(v.reductions),
            "trainer": str(v.trainer),
            "clip_grad": _finite_or_none(v.clip_grad) or 0.0,
            "bubble_fraction": _finite_or_none(v.bubble_fraction),
            "inventory": inventory_lines(v),
            "replica_status": _json_safe(dict(v.replica_status)) if isinstance(v.replica_status, dict) else {},
            "run_to_run": _json_safe(dict(v.run_to_run)) if isinstance(v.run_to_run, dict) else {},
            "ulp_evidence": [_json_safe(dict(e)) for e in (v.ulp_evidence or []) if isinstance(e, dict)],
            "evidence_error": _clean_text(v.evidence_error or ""),
        })
    return {
        "case": str(result.case),
        "baseline": str(result.baseline),
        "elapsed_s": _finite_or_none(result.elapsed_s) or 0.0,
        "variants": variants,
        "all_pass": bool(result.all_pass),
        "cross_implementation": _json_safe(dict(result.cross_implementation)) if result.cross_implementation else None,
        "environment": _json_safe(dict(result.environment or {})),
    }


# --------------------------------------------------------------------------------------------------
# junit.xml
# --------------------------------------------------------------------------------------------------

def junit_xml(result: CaseResult) -> str:
    """JUnit XML: ``<testsuites>`` holding one ``<testsuite name=case>``, one ``<testcase>`` per variant (and one
    named ``cross-implementation`` when the case has that check).

    Each testcase has ``classname="bitparity.<case>"``, ``name=<variant>`` and ``time=<elapsed_s>``.
    A failing variant carries ``<failure message=reason>`` whose text is the first divergence, the
    parameter-inventory differences and the replica status (when there are any) and the expectation; an
    errored one carries ``<error message=...>`` with the error text.  ANSI colour codes
    and characters XML cannot represent are removed so the file always parses.
    """
    case = _clean_text(result.case)
    cross = result.cross_implementation
    n = len(result.variants) + (cross is not None)
    failures = sum(v.verdict == "fail" for v in result.variants) + (cross is not None and cross.get("verdict") == "fail")
    errors = sum(v.verdict == "error" for v in result.variants) + (cross is not None and cross.get("verdict") == "error")
    total_time = f"{_finite_or_none(result.elapsed_s) or 0.0:.3f}"
    counts = {"tests": str(n), "failures": str(failures), "errors": str(errors), "skipped": "0",
              "time": total_time}

    root = ET.Element("testsuites", {"name": "bitparity", **counts})
    suite = ET.SubElement(root, "testsuite", {"name": case, **counts})
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "baseline", "value": _clean_text(result.baseline)})
    ET.SubElement(props, "property", {"name": "case_path", "value": _clean_text(result.case_path)})
    ET.SubElement(props, "property", {"name": "command", "value": _clean_text(result.command)})
    for k, val in (result.environment or {}).items():
        ET.SubElement(props, "property", {"name": f"env.{_clean_text(k)}", "value": _clean_text(val)})

    for v in result.variants:
        tc = ET.SubElement(suite, "testcase", {
            "classname": f"bitparity.{case}",
            "name": _clean_text(v.name),
            "time": f"{_finite_or_none(v.elapsed_s) or 0.0:.3f}",
        })
        if v.verdict == "fail":
            fail = ET.SubElement(tc, "failure", {
                "message": _clean_text(v.reason or "variant does not match its expectation"),
                "type": "UnexpectedEquality" if v.outcome == "unexpectedly equal" else "BitwiseMismatch",
            })
            fail.text = _clean_text(_variant_failure_text(v, result.baseline))
        elif v.verdict == "error":
            message = v.reason or (str(v.error).strip().splitlines() or ["variant run failed"])[-1]
            err = ET.SubElement(tc, "error", {"message": _clean_text(message), "type": "RunError"})
            err.text = _clean_text(v.error or v.reason or "variant run failed")
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = _clean_text(v.reason or "pass")
    if cross is not None:       # one more testcase: the cross-implementation check (harness.crossimpl)
        tc = ET.SubElement(suite, "testcase", {"classname": f"bitparity.{case}", "name": "cross-implementation",
                                               "time": f"{sum((cross.get('elapsed_s') or {}).values()):.3f}"})
        reason = _clean_text(cross.get("reason") or "")
        if cross.get("verdict") == "fail":
            ET.SubElement(tc, "failure", {"message": reason, "type": "CrossImplementationMismatch"}).text = reason
        elif cross.get("verdict") == "error":
            ET.SubElement(tc, "error", {"message": reason, "type": "RunError"}).text = reason
        else:
            ET.SubElement(tc, "system-out").text = reason
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------------------------------
# summary.md
# --------------------------------------------------------------------------------------------------

_VERDICT_MD = {"pass": "✅ pass", "fail": "❌ fail", "error": "⚠️ error"}


#: Characters that break a Markdown line or disguise text: C0/C1 controls and DEL (newlines end a table row
#: and a blank line starts raw HTML), Unicode line/paragraph separators, bidi marks, embeddings, overrides
#: and isolates (a "Trojan Source" name can display as another variant's).
_MD_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _md_cell(s: Any) -> str:
    """Text safe anywhere in summary.md (table cells, headings, list text): one line without control or
    bidi characters, ``& < >`` as entities (no raw HTML), Markdown punctuation (``\\ | ` * _ [ ]``)
    backslash-escaped so that names neither split a table row nor become code, emphasis, links or images."""
    s = _MD_CONTROL.sub(" ", _clean_text(s)).strip()    # _clean_text first: it drops ANSI sequences whole
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    for ch in "*_[]":
        s = s.replace(ch, "\\" + ch)
    return s


def markdown_summary(result: CaseResult, report_link: str = "index.html") -> str:
    """A short Markdown verdict table for a CI job page, with a link to the HTML report.

    Columns: variant, layout, P, V, reductions, clip, expect, verdict (+ outcome words), first divergence.  Every name and
    reason (case, baseline, variants, layouts, errors) goes through `_md_cell`, so that names containing
    markup, ``|``, backticks or newlines neither render as HTML or Markdown nor break the table.
    """
    n = len(result.variants)
    counts = {k: sum(v.verdict == k for v in result.variants) for k in ("pass", "fail", "error")}
    overall = "✅ PASS" if result.all_pass else "❌ FAIL"
    lines = [
        f"## bitparity · {_md_cell(result.case)} · {overall}",
        "",
        f"{counts['pass']}/{n} variants pass"
        + (f", {counts['fail']} fail" if counts["fail"] else "")
        + (f", {counts['error']} error" if counts["error"] else "")
        + f" · baseline {_md_cell(result.baseline)}"          # not a code span: escapes show literally there
        + "".join(f" · trainer {_md_cell(t)}" for t in sorted({v.trainer for v in result.variants} - {"reference"}))
        + f" · {format_elapsed(result.elapsed_s)}",
        "",
        "| variant | layout | P | V | reductions | clip | expect | verdict | first divergence |",
        "|---|---|--:|--:|---|--:|---|---|---|",
    ]
    for v in result.variants:
        name = _md_cell(v.name) + (" (baseline)" if v.name == result.baseline else "")
        fd = divergence_words(v.first_divergence)
        if not fd:
            fd = "—" if v.verdict != "error" else _md_cell(v.reason) or "—"
        else:
            fd = _md_cell(fd)
        lines.append(f"| {name} | {_md_cell(v.layout)} | {int(v.pp)} | {int(v.vpp)} | "
                     f"{_md_cell(v.reductions)} | {_md_cell(clip_words(v.clip_grad))} | "
                     f"{_md_cell(v.expect)} | {_VERDICT_MD.get(v.verdict, _md_cell(v.verdict))}"
                     f"{' ' + _md_cell(v.outcome) if v.outcome else ''} | {fd} |")
    lines += cross_implementation_markdown(result.cross_implementation)
    lines += ["", f"[Full report]({report_link.replace(' ', '%20').replace(')', '%29')})", ""]
    return "\n".join(lines)


def cross_implementation_markdown(rec: Optional[dict]) -> list[str]:
    """Lines of the cross-implementation section of summary.md ([] without one): verdict, reason, headline."""
    if not rec:
        return []
    a, b = rec.get("trainers", ["?", "?"])
    lines = ["", f"**Cross-implementation** ({_md_cell(a)} vs {_md_cell(b)}, step {rec.get('step')}): "
             f"{_VERDICT_MD.get(rec['verdict'], _md_cell(rec['verdict']))} {_md_cell(rec.get('reason', ''))}"]
    h = rec.get("headline")
    if h:
        lines.append(f"losses ≤ {h['loss_max_ulp']} ULP · gradients ≤ {h['grad_max_scaled_ulp']:.3g} ULP at tensor "
                     f"scale (median {h['grad_median_scaled_ulp']:.3g}) over {h['tensors']} tensors, "
                     f"{h['grads_bitwise_equal']} bitwise equal · bound {rec.get('max_ulp')}")
    return lines


# --------------------------------------------------------------------------------------------------
# index.html
# --------------------------------------------------------------------------------------------------

#: (linestyle, marker, linewidth, alpha) per variant: wide solid baseline underneath, thinner
#: dashed/dotted lines with different markers on top, so bitwise-equal curves stay distinguishable.
_LINE_STYLES = [
    ("-", None, 4.5, 0.35),
    ("--", "o", 2.2, 0.9),
    (":", "s", 2.0, 0.9),
    ("-.", "^", 1.8, 0.9),
    ((0, (5, 1, 1, 1, 1, 1)), "D", 1.6, 0.9),
    ((0, (1, 2)), "v", 1.6, 0.9),
    ((0, (8, 3)), "x", 1.4, 0.9),
    ((0, (3, 1, 1, 1)), "P", 1.4, 0.9),
]
_COLOURS = ["#57606a", "#0969da", "#bf3989", "#1a7f37", "#bc4c00", "#8250df", "#0a7b83", "#9a6700"]

_SVG_PROLOG = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?(<!DOCTYPE[^>]*>\s*)?", re.S)
_SVG_COMMENT = re.compile(r"<!--.*?-->", re.S)
_SVG_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)  # RDF block with http:// URIs


def _legend_label(name: str) -> str:
    # `$` would start mathtext (and can raise on parse errors); a leading `_` hides the entry.
    s = str(name).replace("\\", "\\\\").replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def loss_curves_svg(result: CaseResult) -> Optional[str]:
    """Inline SVG (no XML prolog/DOCTYPE/comments) of the lm loss per step of every variant with data.

    Returns None when no variant has any loss values.  Output is deterministic for equal input
    (fixed SVG hash salt, no date metadata).
    """
    plotted = [(i, v) for i, v in enumerate(result.variants) if v.series and v.series.lm_loss]
    if not plotted:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": "bitparity", "svg.fonttype": "path",
                                "font.size": 9}):
        fig, ax = plt.subplots(figsize=(8.0, 3.6), layout="constrained")
        try:
            for i, v in plotted:
                ls, marker, lw, alpha = _LINE_STYLES[i % len(_LINE_STYLES)]
                ys = [float("nan") if _finite_or_none(y) is None else float(y) for y in v.series.lm_loss]
                xs = list(range(len(ys)))
                ax.plot(xs, ys, linestyle=ls, marker=marker, linewidth=lw, alpha=alpha,
                        markersize=4 if marker else 0, markevery=max(1, len(xs) // 25),
                        color=_COLOURS[i % len(_COLOURS)], label=_legend_label(v.name), zorder=2 + i)
            ax.set_xlabel("step")
            ax.set_ylabel("lm loss")
            ax.grid(True, color="#d0d7de", linewidth=0.6)
            ax.spines[["top", "right"]].set_visible(False)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend(loc="best", fontsize=8, frameon=False)
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
        finally:
            plt.close(fig)
    svg = _SVG_PROLOG.sub("", buf.getvalue(), count=1)
    svg = _SVG_COMMENT.sub("", svg)
    svg = _SVG_METADATA.sub("", svg)
    return svg.strip()


def _at(seq: Any, i: int) -> Any:
    """``seq[i]`` or None when `seq` is missing or too short."""
    try:
        return seq[i] if seq is not None and 0 <= i < len(seq) else None
    except TypeError:
        return None


def _reference(result: CaseResult, v: VariantResult) -> Optional[VariantResult]:
    """The variant `v` is compared with (its `compare_to`, else the baseline); None if not in the result."""
    ref = reference_of(v, result.baseline)
    return next((r for r in result.variants if r.name == ref), None)


def _hex_table(result: CaseResult) -> dict:
    """Per-step lm-loss bit patterns: ``{"variants": [...], "rows": [{"step", "cells": [...]}]}``.

    A cell ``differs`` when its bits differ from those of the run the variant is compared with
    (`compare_to`, the baseline by default) at that step.
    """
    variants = [v for v in result.variants if v.series and v.series.lm_loss_hex]
    n_steps = max((len(v.series.lm_loss_hex) for v in variants), default=0)
    refs = [_reference(result, v) for v in variants]
    rows = []
    for step in range(n_steps):
        cells = []
        for v, ref_v in zip(variants, refs):
            hx = _at(v.series.lm_loss_hex, step) or None
            val = _finite_or_none(_at(v.series.lm_loss, step))
            is_ref = ref_v is None or ref_v is v
            ref = None if is_ref or not ref_v.series else _at(ref_v.series.lm_loss_hex, step)
            cells.append({
                "hex": hx,
                "value": "" if val is None else repr(val),
                "differs": (hx is not None and not is_ref and (not ref or hx.lower() != str(ref).lower())),
            })
        rows.append({"step": step, "cells": cells})
    return {"variants": variants, "rows": rows}


def _grad_norm_section(result: CaseResult) -> dict:
    """Data of the "Grad norm & clipping" section.

    ``{"on": [{"v", "ref", "ref_is_baseline", "precision", "rows": [...]}], "off": [VariantResult]}``;
    one row per step: ``{"step", "hex", "value", "ulp", "ref_hex", "coeff", "clipped"}`` where `ulp` is the
    ULP distance from the reference run's grad norm (None when not comparable).
    """
    on, off = [], []
    for i, v in enumerate(result.variants):
        if not clipping_on(v):
            off.append({"v": v, "anchor": f"variant-{i}"})
            continue
        s = v.series or None
        ref_v = _reference(result, v)
        ref_s = ref_v.series if ref_v is not None and ref_v is not v else None
        n = max((len(getattr(s, k) or []) for k in ("grad_norm_hex", "grad_norm", "clip_coeff", "clipped")),
                default=0) if s is not None else 0
        rows = []
        for step in range(n):
            ulp = _at(s.grad_norm_ulp, step)
            coeff = _finite_or_none(_at(s.clip_coeff, step))
            value = _finite_or_none(_at(s.grad_norm, step))
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
        on.append({"v": v, "anchor": f"variant-{i}", "ref": ref, "ref_is_baseline": ref == result.baseline,
                   "ref_anchor": next((f"variant-{j}" for j, r in enumerate(result.variants) if r.name == ref),
                                      None),
                   "precision": precision, "rows": rows,
                   "ulp_nonzero": sum(1 for r in rows if r["ulp"])})
    return {"on": on, "off": off}


# --------------------------------------------------------------------------------------------------
# schedule timeline (inline SVG, built here: deterministic, no JavaScript, no external resources)
# --------------------------------------------------------------------------------------------------

#: (fill, text colour) per virtual chunk, cycling; forward in blues, backward in oranges.  Adjacent chunks
#: alternate dark and light so neighbouring chunks stay distinguishable.
TIMELINE_FORWARD = (("#0969da", "#ffffff"), ("#80ccff", "#1f2328"), ("#0550ae", "#ffffff"),
                    ("#b6e3ff", "#1f2328"))
TIMELINE_BACKWARD = (("#bc4c00", "#ffffff"), ("#ffb77c", "#1f2328"), ("#762c00", "#ffffff"),
                     ("#ffd8b5", "#1f2328"))
TIMELINE_OTHER = ("#8c959f", "#ffffff")
TIMELINE_MERGED = "#6639ba"       # outline (and legend swatch) of a merged forward|backward cell
TIMELINE_IDLE = "#f6f8fa"
TIMELINE_MAX_WIDTH = 1100

_TL_LABEL_W = 58      # rank labels
_TL_PAD_R = 12
_TL_AXIS_H = 20       # time axis above the rows
_TL_ROW_H = 18
_TL_ROW_GAP = 3
_TL_MAX_UNIT = 32     # px per time unit for short schedules
_TL_FONT = "system-ui, -apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif"


def _num(x: float) -> str:
    """Deterministic short SVG number: at most two decimals, no trailing zeros."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _attr(s: Any) -> str:
    return html_escape(_clean_text(s), quote=True)


def _timeline_cells(v: VariantResult) -> list[dict]:
    """The valid cells of `v.timeline`, normalised and sorted (rank, start, end, op, stage, microbatch)."""
    cells = []
    for c in v.timeline or []:
        if not isinstance(c, dict):
            continue
        try:
            rank, stage, mb = int(c.get("rank")), int(c.get("stage", 0)), int(c.get("microbatch", 0))
        except (TypeError, ValueError):
            continue
        start, end = _finite_or_none(c.get("start")), _finite_or_none(c.get("end"))
        if rank < 0 or start is None or end is None or end <= start or start < 0:
            continue
        cell = {"rank": rank, "start": start, "end": end, "op": str(c.get("op", "")), "stage": stage,
                "microbatch": mb}
        if cell["op"] == "FB":      # merged forward + backward (1F1B overlap)
            try:
                cell.update(b_stage=int(c.get("b_stage")), b_microbatch=int(c.get("b_microbatch")))
            except (TypeError, ValueError):
                continue
        cells.append(cell)
    cells.sort(key=lambda c: (c["rank"], c["start"], c["end"], c["op"], c["stage"], c["microbatch"]))
    return cells


def _cell_colours(op: str, chunk: int) -> tuple[str, str]:
    palette = {"F": TIMELINE_FORWARD, "B": TIMELINE_BACKWARD}.get(op)
    return TIMELINE_OTHER if palette is None else palette[chunk % len(palette)]


def _cell_label(text: str, x: float, w: float, y: float, ink: str) -> list[str]:
    """The microbatch label of a timeline cell [x, x + w) in the row at y, in the largest font that fits
    (digits are about 0.6 em wide); [] when none does."""
    size = next((fs for fs in (10, 9, 8) if w >= 0.6 * fs * len(text) + 2), None)
    if size is None:
        return []
    return [f'<text class="mb" x="{_num(x + w / 2)}" y="{_num(y + _TL_ROW_H / 2 + size * 0.35)}" '
            f'text-anchor="middle" fill="{ink}" font-size="{size}">{_attr(text)}</text>']


def _merged_cell(c: dict, pp: int, x: float, w: float, y: float) -> list[str]:
    """SVG of one merged 1F1B-overlap cell: the forward third and the backward two thirds in their chunks'
    colours inside one outlined box, labelled ``f|b`` (the two microbatches) when it fits."""
    fchunk, bchunk = c["stage"] // pp, c["b_stage"] // pp
    (ffill, fink), (bfill, _) = _cell_colours("F", fchunk), _cell_colours("B", bchunk)
    tip = (f'rank {c["rank"]} · merged (1F1B overlap): forward stage {c["stage"]} (chunk {fchunk}) microbatch '
           f'{c["microbatch"]} + backward stage {c["b_stage"]} (chunk {bchunk}) microbatch {c["b_microbatch"]}'
           f' · t {_num(c["start"])}–{_num(c["end"])}')
    out = [f'<g class="cell FB merged chunk-{fchunk} bchunk-{bchunk}"><title>{_attr(tip)}</title>',
           f'<rect x="{_num(x)}" y="{y}" width="{_num(w / 3)}" height="{_TL_ROW_H}" fill="{ffill}"/>',
           f'<rect x="{_num(x + w / 3)}" y="{y}" width="{_num(2 * w / 3)}" height="{_TL_ROW_H}" fill="{bfill}"/>',
           f'<rect x="{_num(x)}" y="{y}" width="{_num(w)}" height="{_TL_ROW_H}" fill="none" '
           f'stroke="{TIMELINE_MERGED}" stroke-width="1.4"/>']
    out += _cell_label(f'{c["microbatch"]}|{c["b_microbatch"]}', x, w, y, "#1f2328")
    out.append("</g>")
    return out


def _tick_step(unit_px: float) -> int:
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000):
        if step * unit_px >= 30:
            return step
    return 10000


def timeline_svg(v: VariantResult) -> Optional[str]:
    """Inline SVG of the schedule timeline of `v` (None when it has no valid cells).

    Ranks are rows (rank 0 at the top), x is time in units (forward 1, backward 2), one
    ``<rect class="cell ...">`` per compute action: forward in blue, backward in orange, the shade cycling
    with the virtual chunk (``stage // pp``); the microbatch is written inside a cell when it fits and every
    cell has a ``<title>`` tooltip.  Idle time shows the light lane background.  A legend sits below.
    The output depends only on the cells (sorted), so it is deterministic; width <= TIMELINE_MAX_WIDTH.
    """
    cells = _timeline_cells(v)
    if not cells:
        return None
    try:
        pp = max(1, int(v.pp))
    except (TypeError, ValueError):
        pp = 1
    n_ranks = max(pp, max(c["rank"] for c in cells) + 1)
    makespan = max(c["end"] for c in cells)
    avail = TIMELINE_MAX_WIDTH - _TL_LABEL_W - _TL_PAD_R
    unit = min(float(_TL_MAX_UNIT), avail / makespan)
    plot_w = makespan * unit
    x0 = _TL_LABEL_W
    rows_h = n_ranks * (_TL_ROW_H + _TL_ROW_GAP) - _TL_ROW_GAP

    # Legend items: (fill, stroke, label); forward/backward per chunk present, then idle.
    chunks = sorted({c["stage"] // pp for c in cells})
    ops = [op for op in ("F", "B") if any(c["op"] == op for c in cells)]
    legend = []
    for op in ops:
        word = "forward" if op == "F" else "backward"
        for ch in chunks:
            if any(c["op"] == op and c["stage"] // pp == ch for c in cells):
                label = f"{word} (1 unit)" if op == "F" else f"{word} (2 units)"
                if len(chunks) > 1:
                    label = f"{word} · chunk {ch}"
                legend.append((_cell_colours(op, ch)[0], None, label))
    if any(c["op"] == "FB" for c in cells):
        legend.append((TIMELINE_MERGED, None, "merged forward | backward (1F1B overlap, 3 units)"))
    if any(c["op"] not in ("F", "B", "FB") for c in cells):
        legend.append((TIMELINE_OTHER[0], None, "other"))
    legend.append((TIMELINE_IDLE, "#d0d7de", "idle (bubble)"))
    legend_note = "number in a cell = microbatch"

    # Lay the legend out in lines that fit the width.
    width = max(x0 + plot_w + _TL_PAD_R, 360.0)
    item_w = [12 + 6 + 6.2 * len(label) + 16 for _, _, label in legend] + [6.2 * len(legend_note)]
    lines, cur, cur_w = [], [], 0.0
    for i, w in enumerate(item_w):
        if cur and x0 + cur_w + w > width - _TL_PAD_R:
            lines.append(cur)
            cur, cur_w = [], 0.0
        cur.append((i, cur_w))
        cur_w += w
    lines.append(cur)
    legend_y0 = _TL_AXIS_H + rows_h + 12
    height = legend_y0 + 18 * len(lines)

    out = []
    label = f"schedule timeline of {_clean_text(v.name)}: {n_ranks} ranks, {_num(makespan)} time units"
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline-svg" width="{_num(width)}" '
               f'height="{_num(height)}" viewBox="0 0 {_num(width)} {_num(height)}" role="img" '
               f'aria-label="{_attr(label)}" font-family="{_TL_FONT}" font-size="11">')
    # time axis: ticks and light vertical guides
    step = _tick_step(unit)
    t = 0
    while t <= makespan + 1e-9:
        x = x0 + t * unit
        out.append(f'<line class="tick" x1="{_num(x)}" y1="{_TL_AXIS_H - 4}" x2="{_num(x)}" '
                   f'y2="{_num(_TL_AXIS_H + rows_h)}" stroke="#d0d7de" stroke-width="0.5"/>')
        out.append(f'<text x="{_num(x)}" y="{_TL_AXIS_H - 7}" text-anchor="middle" fill="#656d76" '
                   f'font-size="10">{t}</text>')
        t += step
    # lanes (light background where a rank idles) and rank labels
    for r in range(n_ranks):
        y = _TL_AXIS_H + r * (_TL_ROW_H + _TL_ROW_GAP)
        out.append(f'<text x="{x0 - 6}" y="{_num(y + _TL_ROW_H / 2 + 4)}" text-anchor="end" '
                   f'fill="#1f2328">rank {r}</text>')
        out.append(f'<rect class="lane" x="{x0}" y="{y}" width="{_num(plot_w)}" height="{_TL_ROW_H}" '
                   f'fill="{TIMELINE_IDLE}" fill-opacity="0.85" stroke="#d0d7de" stroke-width="0.5"/>')
    # cells
    for c in cells:
        if c["op"] == "FB":
            out += _merged_cell(c, pp, x0 + c["start"] * unit, (c["end"] - c["start"]) * unit,
                                _TL_AXIS_H + c["rank"] * (_TL_ROW_H + _TL_ROW_GAP))
            continue
        chunk = c["stage"] // pp
        fill, ink = _cell_colours(c["op"], chunk)
        x = x0 + c["start"] * unit
        w = (c["end"] - c["start"]) * unit
        y = _TL_AXIS_H + c["rank"] * (_TL_ROW_H + _TL_ROW_GAP)
        op_cls = c["op"] if c["op"] in ("F", "B") else "other"
        tip = (f'rank {c["rank"]} · {"forward" if c["op"] == "F" else "backward" if c["op"] == "B" else c["op"]}'
               f' · stage {c["stage"]} (chunk {chunk}) · microbatch {c["microbatch"]}'
               f' · t {_num(c["start"])}–{_num(c["end"])}')
        out.append(f'<rect class="cell {op_cls} chunk-{chunk}" x="{_num(x)}" y="{y}" width="{_num(w)}" '
                   f'height="{_TL_ROW_H}" fill="{fill}" stroke="#ffffff" stroke-width="0.6">'
                   f'<title>{_attr(tip)}</title></rect>')
        out += _cell_label(str(c["microbatch"]), x, w, y, ink)
    # legend
    for li, line in enumerate(lines):
        y = legend_y0 + li * 18
        for i, dx in line:
            x = x0 + dx
            if i == len(legend):
                out.append(f'<text x="{_num(x)}" y="{_num(y + 10)}" fill="#656d76">{_attr(legend_note)}</text>')
                continue
            fill, stroke, text = legend[i]
            stroke_attr = f' stroke="{stroke}" stroke-width="0.8"' if stroke else ""
            out.append(f'<rect class="swatch" x="{_num(x)}" y="{_num(y + 1)}" width="12" height="12" '
                       f'fill="{fill}"{stroke_attr}/>')
            out.append(f'<text x="{_num(x + 18)}" y="{_num(y + 11)}" fill="#1f2328">{_attr(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _timeline(v: VariantResult) -> Optional[dict]:
    """SVG and caption numbers of a variant's schedule timeline (None without cells)."""
    svg = timeline_svg(v)
    if svg is None:
        return None
    cells = _timeline_cells(v)
    return {"svg": Markup(svg), "bubble": format_fraction(v.bubble_fraction),
            "makespan": _num(max(c["end"] for c in cells)), "n_cells": len(cells)}


def _family_tables(v: VariantResult) -> list[dict]:
    """Mismatch-count tables of one variant, one per kind present (``grad`` then ``param``)."""
    fm = v.family_mismatches or {}
    tables = []
    for kind in ("grad", "param"):
        per_step = fm.get(kind)
        if not per_step:
            continue
        per_step = [d or {} for d in per_step]
        extra = sorted({f for d in per_step for f in d} - set(FAMILIES))
        rows = []
        for fam in list(FAMILIES) + extra:
            counts = [int(d.get(fam, 0) or 0) for d in per_step]
            rows.append({"family": fam, "counts": counts, "total": sum(counts)})
        col_totals = [sum(r["counts"][s] for r in rows) for s in range(len(per_step))]
        tables.append({"kind": kind, "steps": list(range(len(per_step))), "rows": rows,
                       "col_totals": col_totals, "total": sum(col_totals)})
    return tables


# --------------------------------------------------------------------------------------------------
# ULP evidence, run-to-run control and the differing-parameter heatmap of a variant card
# (inline SVG built here: deterministic, escaped, no JavaScript, no external resources)
# --------------------------------------------------------------------------------------------------

#: Upper bounds (in ULPs) of the histogram buckets of `harness.ulp.tensor_stats`; None = above the last one.
ULP_BUCKETS = (1, 2, 4, 8, 16, 64, 256, 1024, 2 ** 16, 2 ** 24, None)
ULP_BAR = "#0969da"
HEATMAP_ZERO = "#eaeef2"
#: Colour ramp of nonzero heatmap cells: light (one differing tensor) to dark (the variant's maximum).
HEATMAP_LOW = (255, 216, 211)
HEATMAP_HIGH = (130, 7, 30)
HEATMAP_MAX_WIDTH = 1100

_UH_SLOT = 34        # px per histogram bucket
_UH_BAR = 26
_UH_PAD = 6
_UH_TOP = 14         # room for the counts above the bars
_UH_PLOT_H = 46
_UH_LABEL_H = 16

_HM_ROW_H = 16
_HM_MAX_CELL = 28
_HM_AXIS_H = 16
_HM_TITLE_H = 18
_HM_PANEL_GAP = 10
_HM_PAD_R = 12


def _int_or_none(x: Any) -> Optional[int]:
    if isinstance(x, bool):
        return None
    f = _finite_or_none(x)
    return None if f is None or f != int(f) else int(f)


def ulp_bound_words(upper: Any) -> str:
    """A bucket's upper bound: ``1``, ``1024``; powers of two from 2^11 up as ``2^16``, ``2^24``."""
    n = _int_or_none(upper)
    if n is None:
        f = _finite_or_none(upper)
        return "?" if f is None else _num(f)
    if n > 1024 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return str(n)


def _ulp_buckets(hist: Any) -> list[tuple[Optional[float], int]]:
    """The histogram on the standard buckets (`ULP_BUCKETS`, plus any other bound it names), in order,
    zero counts included; None (unbounded) last.  Malformed entries are skipped, repeated bounds summed."""
    counts: dict = {}
    for item in hist if isinstance(hist, (list, tuple)) else []:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            continue
        upper, n = item
        count = _int_or_none(n)
        if count is None or count < 0:
            continue
        if upper is None:
            key = None
        else:
            try:
                key = float(upper)
            except (TypeError, ValueError):
                continue
            if math.isnan(key) or key <= 0:
                continue
            if math.isinf(key):
                key = None          # +inf: the unbounded bucket
        counts[key] = counts.get(key, 0) + count
    bounds = sorted({float(b) for b in ULP_BUCKETS if b is not None} | {k for k in counts if k is not None})
    return [(b, counts.get(b, 0)) for b in bounds] + [(None, counts.get(None, 0))]


def ulp_bucket_label(upper: Any, top: Any = ULP_BUCKETS[-2]) -> str:
    """``≤1``, ``≤2``, ... ``≤2^24``; the unbounded bucket (None) reads ``>`` + `top` (``>2^24``)."""
    return f">{ulp_bound_words(top)}" if upper is None else f"≤{ulp_bound_words(upper)}"


def _compact(n: int) -> str:
    if n < 10000:
        return str(n)
    if n < 1_000_000:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M"


def ulp_histogram_svg(entry: Any) -> Optional[str]:
    """Small inline SVG: one bar per ULP bucket of one ULP-evidence row (linear height, the count above it,
    a ``<title>`` tooltip with the exact count), buckets labelled ``≤1``, ``≤2``, ... ``>2^24``.

    Every standard bucket is drawn (empty ones as a gap) so all histograms share one axis.  None when the
    entry has no histogram or every count is zero.  Deterministic for equal input.
    """
    if not isinstance(entry, dict):
        return None
    buckets = _ulp_buckets(entry.get("histogram"))
    total = sum(n for _, n in buckets)
    if total <= 0:
        return None
    top = max(b for b, _ in buckets if b is not None)
    peak = max(n for _, n in buckets)
    width = 2 * _UH_PAD + len(buckets) * _UH_SLOT
    base_y = _UH_TOP + _UH_PLOT_H
    height = base_y + _UH_LABEL_H
    what, key = _clean_text(entry.get("what") or "tensor"), _clean_text(entry.get("key") or "")
    label = f"ULP histogram of {what} {key}: {total} differing elements"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="ulp-hist-svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{_attr(label)}" '
           f'font-family="{_TL_FONT}" font-size="9">',
           f'<line x1="{_UH_PAD}" y1="{base_y}" x2="{width - _UH_PAD}" y2="{base_y}" stroke="#8c959f" '
           f'stroke-width="0.8"/>']
    for i, (upper, n) in enumerate(buckets):
        x = _UH_PAD + i * _UH_SLOT + (_UH_SLOT - _UH_BAR) / 2
        cx = _UH_PAD + i * _UH_SLOT + _UH_SLOT / 2
        text = ulp_bucket_label(upper, top)
        if n:
            h = max(1.5, _UH_PLOT_H * n / peak)
            share = f"{100.0 * n / total:.3g} %"
            tip = f"{text} ULP: {n} element{'s' if n != 1 else ''} ({share} of the differing ones)"
            out.append(f'<rect class="ulp-bar" x="{_num(x)}" y="{_num(base_y - h)}" width="{_UH_BAR}" '
                       f'height="{_num(h)}" fill="{ULP_BAR}"><title>{_attr(tip)}</title></rect>')
            out.append(f'<text class="ulp-count" x="{_num(cx)}" y="{_num(base_y - h - 3)}" text-anchor="middle" '
                       f'fill="#1f2328">{_compact(n)}</text>')
        out.append(f'<text class="ulp-bucket{" empty" if not n else ""}" x="{_num(cx)}" y="{base_y + 12}" '
                   f'text-anchor="middle" font-size="8" fill="{"#1f2328" if n else "#8c959f"}">{_attr(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _sig(x: Any, digits: int = 3) -> Optional[str]:
    f = _finite_or_none(x)
    return None if f is None else f"{f:.{digits}g}"


def _ulp_rows(v: VariantResult) -> list[dict]:
    """Display rows of `v.ulp_evidence` (entries that are not dicts are skipped), in the producer's order."""
    rows = []
    for e in v.ulp_evidence or []:
        if not isinstance(e, dict):
            continue
        numel, differing = _int_or_none(e.get("numel")), _int_or_none(e.get("differing"))
        frac = _finite_or_none(e.get("fraction"))
        if frac is None and numel and differing is not None:
            frac = differing / numel
        nan, max_ulp = _int_or_none(e.get("nan_mismatch")), _int_or_none(e.get("max_ulp"))
        svg = ulp_histogram_svg(e)
        rows.append({
            "key": _clean_text(e.get("key")), "what": _clean_text(e.get("what")),
            "key_parts": re.findall(r"[^.]*\.|[^.]+", _clean_text(e.get("key"))),   # break after dots
            "dtype": _clean_text(e.get("dtype")),
            "numel": None if numel is None else f"{numel:,}",
            "differing": None if differing is None else f"{differing:,}",
            "fraction": None if frac is None else f"{100.0 * frac:.3g} %",
            "max_ulp": None if max_ulp is None else str(max_ulp),
            "median_ulp": _sig(e.get("median_ulp"), 6),
            "max_abs": _sig(e.get("max_abs_err")), "max_rel": _sig(e.get("max_rel_err")),
            "nan": nan, "svg": Markup(svg) if svg else None,
        })
    return rows


def _ulp_section(v: VariantResult) -> Optional[dict]:
    """Data of a card's "ULP evidence" block; None when there is neither evidence nor an evidence error."""
    rows = _ulp_rows(v)
    error = _clean_text(v.evidence_error or "").strip()
    if not rows and not error:
        return None
    fd = v.first_divergence
    step = fd.step if fd is not None and fd.kind in ("grad", "param") else None
    return {"rows": rows, "error": error, "step": step}


def run_to_run_words(rr: Any) -> str:
    """One line for a `VariantResult.run_to_run`: ``"3 runs bitwise equal"`` or
    ``"NONDETERMINISTIC: <detail>"``; ``""`` when the variant ran once (``{}``)."""
    if not isinstance(rr, dict) or not rr:
        return ""
    detail = _clean_text(rr.get("detail") or "").strip()
    if rr.get("deterministic") is False:
        return f"NONDETERMINISTIC: {detail or 'the repeated runs differ'}"
    runs = _int_or_none(rr.get("runs"))
    return f"{runs} runs bitwise equal" if runs is not None else (detail or "runs bitwise equal")


def _run_to_run(v: VariantResult) -> Optional[dict]:
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
                                                  name=_clean_text(raw.get("name", ""))))
        except (TypeError, ValueError):
            fd = None
        fd_detail = _clean_text(raw.get("detail") or "")
    return {"words": words, "deterministic": rr.get("deterministic") is not False,
            "runs": _int_or_none(rr.get("runs")), "fd": fd, "fd_detail": fd_detail}


def _heat_colour(n: int, peak: int) -> tuple[str, str]:
    """(fill, text colour) of a heatmap cell with `n` differing tensors, `peak` the variant's maximum."""
    if n <= 0:
        return HEATMAP_ZERO, "#8c959f"
    t = 1.0 if peak <= 1 else (n - 1) / (peak - 1)
    t = 0.15 + 0.85 * t          # one differing tensor is already clearly tinted
    rgb = tuple(round(lo + (hi - lo) * t) for lo, hi in zip(HEATMAP_LOW, HEATMAP_HIGH))
    return "#%02x%02x%02x" % rgb, "#ffffff" if t > 0.55 else "#1f2328"


def family_heatmap_svg(v: VariantResult) -> Optional[str]:
    """Inline SVG heatmap of `v.family_mismatches`: one panel per kind present (grad, then param), families as
    rows, steps as columns; colour intensity by the number of differing tensors (one scale for both panels,
    darkest at the variant's maximum), zero cells light grey.  Every cell has a ``<title>`` tooltip and
    shows its count when it fits.  None when there are no counts or all are zero.  Deterministic."""
    tables = _family_tables(v)
    if not tables or sum(t["total"] for t in tables) == 0:
        return None
    peak = max(max(r["counts"] or [0]) for t in tables for r in t["rows"])
    families = [r["family"] for r in tables[0]["rows"]]
    for t in tables[1:]:
        families += [r["family"] for r in t["rows"] if r["family"] not in families]
    label_w = max(96.0, 6.2 * max(len(_clean_text(f)) for f in families) + 14)
    n_steps = max(len(t["steps"]) for t in tables)
    avail = HEATMAP_MAX_WIDTH - label_w - _HM_PAD_R
    cell = min(float(_HM_MAX_CELL), avail / max(1, n_steps))
    width = max(label_w + n_steps * cell + _HM_PAD_R, 360.0)
    tick = _tick_step(cell) if cell < 24 else 1
    stroke = "1" if cell >= 8 else "0.25"      # thin separators when the cells are narrow

    out, y = [], 0.0
    for t in tables:
        rows = {r["family"]: r["counts"] for r in t["rows"]}
        out.append(f'<text class="hm-title" x="0" y="{_num(y + 12)}" fill="#1f2328" font-weight="600">'
                   f'{_attr(t["kind"])} · {t["total"]} differing</text>')
        y += _HM_TITLE_H
        for s in t["steps"]:
            if s % tick == 0:
                out.append(f'<text class="hm-step" x="{_num(label_w + (s + 0.5) * cell)}" y="{_num(y + 11)}" '
                           f'text-anchor="middle" fill="#656d76" font-size="10">{s}</text>')
        y += _HM_AXIS_H
        for fam in families:
            counts = rows.get(fam, [0] * len(t["steps"]))
            out.append(f'<text x="{_num(label_w - 6)}" y="{_num(y + _HM_ROW_H / 2 + 4)}" text-anchor="end" '
                       f'fill="#1f2328">{_attr(fam)}</text>')
            for s, n in enumerate(counts):
                fill, ink = _heat_colour(n, peak)
                x = label_w + s * cell
                tip = f"{t['kind']} · {fam} · step {s}: {n} differing tensor{'s' if n != 1 else ''}"
                out.append(f'<rect class="hm-cell {_attr(t["kind"])} {"nonzero" if n else "zero"}" x="{_num(x)}" '
                           f'y="{_num(y)}" width="{_num(cell)}" height="{_HM_ROW_H}" fill="{fill}" '
                           f'stroke="#ffffff" stroke-width="{stroke}"><title>{_attr(tip)}</title></rect>')
                if n and cell >= 6.5 * len(str(n)) + 3:
                    out.append(f'<text class="hm-count" x="{_num(x + cell / 2)}" y="{_num(y + _HM_ROW_H / 2 + 3.5)}" '
                               f'text-anchor="middle" fill="{ink}" font-size="10">{n}</text>')
            y += _HM_ROW_H
        y += _HM_PANEL_GAP
    # legend: zero, then the ramp at a few counts up to the maximum
    samples = sorted({1, peak} | {max(1, round(peak * q)) for q in (0.25, 0.5, 0.75)})
    note = "differing tensors per family and step"
    items = [(0, "0")] + [(n, str(n)) for n in samples]
    legend_w = sum(22 + 6.2 * len(text) for _, text in items) + 6 + 6.2 * len(note)
    x0 = label_w if label_w + legend_w <= width else 0.0
    width = max(width, x0 + legend_w + _HM_PAD_R)
    x, y = x0, y + 2
    for n, text in items:
        fill, _ = _heat_colour(n, peak)
        out.append(f'<rect class="hm-swatch" x="{_num(x)}" y="{_num(y)}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{_num(x + 16)}" y="{_num(y + 10)}" fill="#1f2328">{text}</text>')
        x += 22 + 6.2 * len(text)
    out.append(f'<text x="{_num(x + 6)}" y="{_num(y + 10)}" fill="#656d76">{note}</text>')
    height = y + 16
    label = (f"differing parameters of {_clean_text(v.name)} by family and step: "
             + ", ".join(f"{t['kind']} {t['total']}" for t in tables))
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap-svg" width="{_num(width)}" '
            f'height="{_num(height)}" viewBox="0 0 {_num(width)} {_num(height)}" role="img" '
            f'aria-label="{_attr(label)}" font-family="{_TL_FONT}" font-size="11">')
    return "\n".join([head] + out + ["</svg>"])


def _heatmap(v: VariantResult) -> Optional[dict]:
    """Data of a card's "Differing parameters" block: None without counts; ``svg`` None when all are zero."""
    tables = _family_tables(v)
    if not tables:
        return None
    svg = family_heatmap_svg(v)
    return {"svg": Markup(svg) if svg else None,
            "totals": [(t["kind"], t["total"]) for t in tables], "n_steps": max(len(t["steps"]) for t in tables)}


def parameter_count(v: VariantResult, report_dir: Optional[pathlib.Path]) -> Optional[int]:
    """Number of parameters (replicas such as ``...@mtp`` not counted) in the run's ``trace.json``.

    Read from ``report_dir / v.run_dir / trace.json``; None when there is no report directory, `run_dir`
    is absolute or leads outside it, or the trace is missing or unreadable.
    """
    run_dir = str(v.run_dir or "")
    if report_dir is None or not _is_relative_link(run_dir) or pathlib.PurePath(run_dir).is_absolute():
        return None
    try:
        root = pathlib.Path(report_dir).resolve()
        path = (root / run_dir / "trace.json").resolve()
        if root not in path.parents or not path.is_file():
            return None
        params = json.loads(path.read_text(encoding="utf-8")).get("params")
        if not isinstance(params, dict):
            return None
        return sum(1 for meta in params.values() if not (isinstance(meta, dict) and meta.get("replica")))
    except (OSError, ValueError, AttributeError):
        return None


def _structural(v: VariantResult, ref: str, n_params: Optional[int]) -> dict:
    """Data of a variant card's "Structural checks" block and of its verdict-matrix markers.

    ``inventory``: the differing lines (empty when equal); ``inventory_checked``: whether a comparison ran
    (False when the variant or its reference errored); ``replica``: ``{"state": "consistent"|"broken"|
    "unknown", "step", "detail", "names"}``; ``flags``: ``[(css class, label, tooltip)]`` for the matrix.
    """
    inventory = inventory_lines(v)
    rs = v.replica_status if isinstance(v.replica_status, dict) else {}
    if not rs:
        state = "unknown"
    else:
        state = "broken" if rs.get("consistent") is False else "consistent"
    step = rs.get("first_broken_step") if state == "broken" else None
    replica = {"state": state, "step": step, "detail": _clean_text(rs.get("detail") or ""),
               "names": _replica_keys(rs)}
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


def _is_relative_link(path: str) -> bool:
    return bool(path) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path) and not path.startswith("//")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["elapsed"] = format_elapsed
    env.filters["divergence"] = divergence_words
    env.filters["clean"] = _clean_text
    env.filters["clip"] = clip_words
    env.filters["fmt_value"] = lambda x: (json.dumps(_json_safe(x), sort_keys=True)
                                          if isinstance(x, (dict, list, tuple)) else _clean_text(x))
    env.tests["relative_link"] = _is_relative_link
    return env


def render_html(result: CaseResult, report_dir: Optional[pathlib.Path] = None) -> str:
    """The self-contained ``index.html`` page (inline CSS, inline SVG, no JavaScript, no network).

    Rendered from ``templates/report.html.j2`` with autoescaping, so names and error text containing
    markup are shown as text.  `report_dir`, when given, is the directory the page is written to: the
    runs' ``trace.json`` files there (under each ``run_dir``) give the parameter counts of the
    "Structural checks" blocks (`parameter_count`); without it the counts are left out.
    """
    svg = loss_curves_svg(result)
    counts = {k: sum(v.verdict == k for v in result.variants) for k in ("pass", "fail", "error")}
    anchors = {}
    for i, v in enumerate(result.variants):
        anchors.setdefault(v.name, f"variant-{i}")
    variants = []
    for i, v in enumerate(result.variants):
        tables = _family_tables(v)
        ref = reference_of(v, result.baseline)
        variants.append({
            "v": v,
            "anchor": f"variant-{i}",
            "is_baseline": v.name == result.baseline,
            "ref": ref,
            "ref_anchor": anchors.get(ref),
            "ref_is_baseline": ref == result.baseline,
            "ref_is_self": ref == v.name,
            "clip": clip_words(v.clip_grad),
            "family_tables": tables,
            "mismatch_total": sum(t["total"] for t in tables),
            "timeline": _timeline(v),
            "options": sorted((v.options or {}).items(), key=lambda kv: str(kv[0])),
            "expectation": _expectation_words(v, result.baseline),
            "structural": _structural(v, ref, parameter_count(v, report_dir)),
            "heatmap": None if ref == v.name else _heatmap(v),
            "ulp": _ulp_section(v),
            "run_to_run": _run_to_run(v),
        })
    template = _environment().get_template(TEMPLATE_NAME)
    return template.render(
        result=result,
        all_pass=result.all_pass,
        counts=counts,
        variants=variants,
        loss_svg=Markup(svg) if svg else None,
        hex_table=_hex_table(result),
        mismatch_variants=[d for d in variants if d["family_tables"] and not d["ref_is_self"]],
        grad_norm=_grad_norm_section(result),
        cross=_cross_section(result.cross_implementation),
        environment=sorted((result.environment or {}).items(), key=lambda kv: str(kv[0])),
    )


def _cross_section(rec: Optional[dict]) -> Optional[dict]:
    """The cross-implementation section of index.html: the record, its loss rows, and its tensor rows sorted
    by gradient ULP at tensor scale, worst first."""
    if not rec:
        return None
    rows = sorted(rec.get("tensors", []), key=lambda r: -(r["grad"]["scaled_ulp"] if r.get("grad") else -1))
    return {"rec": rec, "rows": rows, "losses": rec.get("losses", [])}


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------

def _atomic_write(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same directory and `os.replace`.

    The temp file is created with mode 0o666 minus the umask (like a plain `open`), fsynced before
    the rename, and removed if anything fails.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    data = text.encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_report(result: CaseResult, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write index.html, summary.json, junit.xml, summary.md into `out_dir` (created if missing).

    Returns the written paths keyed by file name: ``{"summary.json": ..., "junit.xml": ...,
    "summary.md": ..., "index.html": ...}``.
    Everything is rendered before anything is written, so a rendering error leaves the directory
    untouched; each file is then written atomically (temp file + `os.replace`).
    """
    out_dir = pathlib.Path(out_dir)
    contents = {
        "summary.json": json.dumps(summary_dict(result), indent=2, ensure_ascii=False) + "\n",
        "junit.xml": junit_xml(result),
        "summary.md": markdown_summary(result, report_link="index.html"),
        "index.html": render_html(result, report_dir=out_dir),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, pathlib.Path] = {}
    for filename in REPORT_FILES:
        path = out_dir / filename
        _atomic_write(path, contents[filename])
        paths[filename] = path
    _fsync_dir(out_dir)
    return paths
