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
from typing import Any, Optional

import jinja2
from markupsafe import Markup

from harness.results import FAMILIES, CaseResult, FirstDivergence, VariantResult

__all__ = ["write_report", "summary_dict", "junit_xml", "markdown_summary", "render_html"]

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

    Loss divergences name the microbatch: ``step 3 · loss · mb 1 · lm``.  ``""`` when `fd` is None.
    """
    if fd is None:
        return ""
    parts = [f"step {fd.step}", str(fd.kind)]
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
    return f"expected to diverge from {_ref_words(v, baseline)}"


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
    lines.append(_expectation_words(v, baseline))
    lines.append(f"layout: {v.layout} (pp={v.pp}, vpp={v.vpp}, mtp_standalone={v.mtp_standalone})")
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
         "variants": [{"name": str, "layout": str, "pp": int, "vpp": int, "mtp_standalone": bool,
                       "expect": "bitwise"|"diverge", "verdict": "pass"|"fail"|"error",
                       "bitwise_equal": bool|None,
                       "first_divergence": None | {"step": int,
                                                   "kind": "loss"|"grad"|"grad_norm"|"param",
                                                   "microbatch": int|None, "name": str},
                       "reason": str, "elapsed_s": float,
                       "compare_to": str, "reductions": "megatron"|"canonical",
                       "clip_grad": float, "bubble_fraction": float|None}],
         "environment": {...}}

    Variants keep the order of `result.variants` (baseline first).  ``compare_to`` is the run the
    variant is compared with (the baseline unless the case names another); ``clip_grad`` is 0.0 when
    clipping is off; ``bubble_fraction`` is the idle share of rank-time of the schedule played with
    unit costs (None when unknown).
    """
    variants = []
    for v in result.variants:
        fd = v.first_divergence
        variants.append({
            "name": str(v.name),
            "layout": str(v.layout),
            "pp": int(v.pp),
            "vpp": int(v.vpp),
            "mtp_standalone": bool(v.mtp_standalone),
            "expect": str(v.expect),
            "verdict": str(v.verdict),
            "bitwise_equal": None if v.bitwise_equal is None else bool(v.bitwise_equal),
            "first_divergence": None if fd is None else {
                "step": int(fd.step),
                "kind": str(fd.kind),
                "microbatch": None if fd.microbatch is None else int(fd.microbatch),
                "name": str(fd.name),
            },
            "reason": str(v.reason or ""),
            "elapsed_s": _finite_or_none(v.elapsed_s) or 0.0,
            "compare_to": reference_of(v, result.baseline),
            "reductions": str(v.reductions),
            "clip_grad": _finite_or_none(v.clip_grad) or 0.0,
            "bubble_fraction": _finite_or_none(v.bubble_fraction),
        })
    return {
        "case": str(result.case),
        "baseline": str(result.baseline),
        "elapsed_s": _finite_or_none(result.elapsed_s) or 0.0,
        "variants": variants,
        "environment": _json_safe(dict(result.environment or {})),
    }


# --------------------------------------------------------------------------------------------------
# junit.xml
# --------------------------------------------------------------------------------------------------

def junit_xml(result: CaseResult) -> str:
    """JUnit XML: ``<testsuites>`` holding one ``<testsuite name=case>``, one ``<testcase>`` per variant.

    Each testcase has ``classname="bitparity.<case>"``, ``name=<variant>`` and ``time=<elapsed_s>``.
    A failing variant carries ``<failure message=reason>`` whose text is the first divergence and the
    expectation; an errored one carries ``<error message=...>`` with the error text.  ANSI colour codes
    and characters XML cannot represent are removed so the file always parses.
    """
    case = _clean_text(result.case)
    n = len(result.variants)
    failures = sum(v.verdict == "fail" for v in result.variants)
    errors = sum(v.verdict == "error" for v in result.variants)
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
                "type": "BitwiseMismatch" if v.expect == "bitwise" else "UnexpectedEquality",
            })
            fail.text = _clean_text(_variant_failure_text(v, result.baseline))
        elif v.verdict == "error":
            message = v.reason or (str(v.error).strip().splitlines() or ["variant run failed"])[-1]
            err = ET.SubElement(tc, "error", {"message": _clean_text(message), "type": "RunError"})
            err.text = _clean_text(v.error or v.reason or "variant run failed")
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = _clean_text(v.reason or "pass")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------------------------------
# summary.md
# --------------------------------------------------------------------------------------------------

_VERDICT_MD = {"pass": "✅ pass", "fail": "❌ fail", "error": "⚠️ error"}


def _md_cell(s: Any) -> str:
    """Text safe inside a GitHub/GitLab Markdown table cell: one line, no raw HTML, pipes escaped."""
    s = _clean_text(s).replace("\r", " ").replace("\n", " ").strip()
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    for ch in "*_[]":
        s = s.replace(ch, "\\" + ch)
    return s


def markdown_summary(result: CaseResult, report_link: str = "index.html") -> str:
    """A short Markdown verdict table for a CI job page, with a link to the HTML report.

    Columns: variant, layout, P, V, reductions, clip, expect, verdict, first divergence.  Cell text is
    escaped so that variant names containing markup or ``|`` neither render as HTML nor break the
    table.
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
        + f" · baseline `{_clean_text(result.baseline).replace('`', '')}`"
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
                     f"{_md_cell(v.expect)} | {_VERDICT_MD.get(v.verdict, _md_cell(v.verdict))} | {fd} |")
    lines += ["", f"[Full report]({report_link.replace(' ', '%20').replace(')', '%29')})", ""]
    return "\n".join(lines)


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


def _hex_table(result: CaseResult) -> dict:
    """Per-step lm-loss bit patterns: ``{"variants": [...], "rows": [{"step", "cells": [...]}]}``."""
    variants = [v for v in result.variants if v.series and v.series.lm_loss_hex]
    base = next((v for v in result.variants if v.name == result.baseline), None)
    base_hex = list(base.series.lm_loss_hex) if base is not None and base.series else []
    n_steps = max((len(v.series.lm_loss_hex) for v in variants), default=0)
    rows = []
    for step in range(n_steps):
        cells = []
        for v in variants:
            hx = v.series.lm_loss_hex[step] if step < len(v.series.lm_loss_hex) else None
            val = v.series.lm_loss[step] if step < len(v.series.lm_loss) else None
            ref = base_hex[step] if step < len(base_hex) else None
            is_base = base is not None and v is base
            cells.append({
                "hex": hx,
                "value": "" if val is None else repr(float(val)),
                "differs": (hx is not None and not is_base and (ref is None or hx.lower() != ref.lower())),
            })
        rows.append({"step": step, "cells": cells})
    return {"variants": variants, "rows": rows}


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
    env.filters["fmt_value"] = lambda x: (json.dumps(_json_safe(x), sort_keys=True)
                                          if isinstance(x, (dict, list, tuple)) else _clean_text(x))
    env.tests["relative_link"] = _is_relative_link
    return env


def render_html(result: CaseResult) -> str:
    """The self-contained ``index.html`` page (inline CSS, inline SVG, no JavaScript, no network).

    Rendered from ``templates/report.html.j2`` with autoescaping, so names and error text containing
    markup are shown as text.
    """
    svg = loss_curves_svg(result)
    counts = {k: sum(v.verdict == k for v in result.variants) for k in ("pass", "fail", "error")}
    variants = [{
        "v": v,
        "anchor": f"variant-{i}",
        "is_baseline": v.name == result.baseline,
        "family_tables": _family_tables(v),
        "options": sorted((v.options or {}).items(), key=lambda kv: str(kv[0])),
        "expectation": _expectation_words(v, result.baseline),
    } for i, v in enumerate(result.variants)]
    template = _environment().get_template(TEMPLATE_NAME)
    return template.render(
        result=result,
        all_pass=result.all_pass,
        counts=counts,
        variants=variants,
        loss_svg=Markup(svg) if svg else None,
        hex_table=_hex_table(result),
        mismatch_variants=[d for d in variants if d["family_tables"]],
        environment=sorted((result.environment or {}).items(), key=lambda kv: str(kv[0])),
    )


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
        "index.html": render_html(result),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, pathlib.Path] = {}
    for filename in REPORT_FILES:
        path = out_dir / filename
        _atomic_write(path, contents[filename])
        paths[filename] = path
    _fsync_dir(out_dir)
    return paths
