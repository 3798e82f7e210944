"""``summary.md``: a short Markdown verdict table for a CI job page, linking to the HTML report.

Every name and reason goes through `md_cell`, so that text containing markup, ``|``, backticks, newlines or
bidi controls neither renders as HTML or Markdown nor breaks the table.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from harness.judging.results import CaseResult
from trainerkit.config import DEFAULT_TRAINER

from .words import (
    agreement_splits,
    bug_words,
    bugs_elsewhere_lines,
    canonical_words,
    clean_text,
    clip_words,
    cross_bug_words,
    divergence_words,
    format_elapsed,
    golden_of,
    golden_words,
    megatron_source_words,
    outside_lines,
)

#: Lines of differences outside the signature listed per failing variant (the rest in the report).
MAX_OUTSIDE_LINES = 5
_VERDICT_MD = {"pass": "✅ pass", "fail": "❌ fail", "error": "⚠️ error", "unchecked": "❔ unchecked"}


#: Characters that break a Markdown line or disguise text: C0/C1 controls and DEL (newlines end a table row
#: and a blank line starts raw HTML), Unicode line/paragraph separators, bidi marks, embeddings, overrides
#: and isolates (a "Trojan Source" name can display as another variant's).
_MD_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def md_cell(s: Any) -> str:
    """Text safe anywhere in summary.md (table cells, headings, list text): one line without control or
    bidi characters, ``& < >`` as entities (no raw HTML), Markdown punctuation (``\\ | ` * _ [ ]``)
    backslash-escaped so that names neither split a table row nor become code, emphasis, links or images."""
    s = _MD_CONTROL.sub(" ", clean_text(s)).strip()    # clean_text first: it drops ANSI sequences whole
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    for ch in "*_[]":
        s = s.replace(ch, "\\" + ch)
    return s


def markdown_summary(result: CaseResult, report_link: str = "index.html") -> str:
    """A short Markdown verdict table for a CI job page, with a link to the HTML report.

    Above the table, only when the runs of a computation split into groups that no expectation explains
    (`agreement_markdown`): which runs agree with which, and a warning when the baseline may be the odd one out.
    Columns: variant, layout, P, V, reductions, clip, expect, verdict (+ outcome words), first divergence.
    Under the table: the first differences in canonical order where they name another tensor than the
    dataflow-first one, and the differences outside the expected signature of each failing variant (at most
    `MAX_OUTSIDE_LINES` each).  Every name and reason (case, baseline, variants, layouts, errors) goes through
    `md_cell`, so that names containing markup, ``|``, backticks or newlines neither render as HTML or Markdown
    nor break the table.
    """
    n = len(result.variants)
    counts = {k: sum(v.verdict == k for v in result.variants) for k in ("pass", "fail", "error")}
    overall = "✅ PASS" if result.all_pass else "❌ FAIL"
    lines = [
        f"## bitparity · {md_cell(result.case)} · {overall}",
        "",
        f"{counts['pass']}/{n} variants pass"
        + (f", {counts['fail']} fail" if counts["fail"] else "")
        + (f", {counts['error']} error" if counts["error"] else "")
        + f" · baseline {md_cell(result.baseline)}"          # not a code span: escapes show literally there
        + "".join(f" · trainer {md_cell(t)}" for t in sorted({v.trainer for v in result.variants} - {DEFAULT_TRAINER}))
        + f" · {format_elapsed(result.elapsed_s)}",
    ]
    lines += agreement_markdown(getattr(result, "agreement", None), result.baseline)
    lines += bugs_markdown(result)
    golden = getattr(result, "golden", None)
    if isinstance(golden, dict) and golden:
        verdict = _VERDICT_MD.get(golden.get("verdict"), md_cell(golden.get("verdict")))
        lines += ["", f"Golden trace {md_cell(golden.get('dir'))}: {verdict} · environment "
                      f"{md_cell(golden.get('environment'))}"]
    srcs = getattr(result, "megatron_sources", None)
    if isinstance(srcs, dict) and srcs:
        lines += [""] + [f"Megatron {role}: {md_cell(megatron_source_words(srcs[role]))}" + (
            " (runs named <run>@base, each compared bit for bit with its run on head)" if role == "base" else "")
            for role in ("head", "base") if isinstance(srcs.get(role), dict)]
        if srcs.get("same"):
            lines += ["", "⚠️ base and head are the same directory: this compares megatron with itself "
                          "(a run-to-run control), not two versions"]
    lines += [
        "",
        "| variant | layout | P | V | reductions | clip | expect | verdict | first divergence |",
        "|---|---|--:|--:|---|--:|---|---|---|",
    ]
    for v in result.variants:
        name = md_cell(v.name) + (" (baseline)" if v.name == result.baseline else "")
        fd = divergence_words(v.first_divergence)
        if getattr(v, "nonfinite", ""):     # where it broke says more than where it first differed
            fd = f"not finite: {v.nonfinite}"
        if not fd:      # an error, or a failure with no divergence (not finite, replicas, run-to-run): its reason
            fd = "—" if v.verdict == "pass" else md_cell(v.reason) or "—"
        else:
            fd = md_cell(fd)
        tp = int(getattr(v, "tensor_model_parallel_size", 1) or 1)
        layout = md_cell(v.layout) + (f" (TP {tp}{', SP' if getattr(v, 'sequence_parallel', False) else ''})"
                                      if tp > 1 else "")
        resumed = v.series.resumed_after if v.series else []
        if resumed:
            layout += f" (resumed after step {', '.join(map(str, resumed))}" + \
                      (f" from {md_cell(v.resumed_from)})" if v.resumed_from else ")")
        lines.append(f"| {name} | {layout} | {int(v.pp)} | {int(v.vpp)} | "
                     f"{md_cell(v.reductions)} | {md_cell(clip_words(v.clip_grad))} | "
                     f"{md_cell(v.expect)} | {_VERDICT_MD.get(v.verdict, md_cell(v.verdict))}"
                     f"{' ' + md_cell(v.outcome) if v.outcome and v.outcome != v.verdict else ''} | {fd} |")
    lines += _notes(result)
    lines += cross_implementation_markdown(result.cross_implementation)
    lines += ["", f"[Full report]({report_link.replace(' ', '%20').replace(')', '%29')})", ""]
    return "\n".join(lines)


def _notes(result: CaseResult) -> list[str]:
    """The lines under the table: canonical-order first differences, differences outside the signature of
    failing variants, golden comparisons that are not equal."""
    canonical = [(v, canonical_words(v.first_divergence)) for v in result.variants]
    canonical = [(v, c) for v, c in canonical if c]
    out = []
    if canonical:
        out += ["", "First difference in canonical order, where it names another tensor than the dataflow-first one:"]
        out += [f"- {md_cell(v.name)}: {md_cell(c)}" for v, c in canonical]
    for v in result.variants:
        outside = outside_lines(v)
        if outside and v.verdict == "fail":
            out += ["", f"**{md_cell(v.name)}**: {len(outside)} difference{'s' if len(outside) != 1 else ''} "
                        "outside the expected signature:"]
            out += [f"- {md_cell(line)}" for line in outside[:MAX_OUTSIDE_LINES]]
            if len(outside) > MAX_OUTSIDE_LINES:
                out.append(f"- … and {len(outside) - MAX_OUTSIDE_LINES} more (see the report)")
    golden = [(v, golden_of(v)) for v in result.variants]
    golden = [(v, g) for v, g in golden if g and g.get("status") != "equal"]
    if golden:
        out += ["", "Golden trace comparison, runs that are not equal to it:"]
        out += [f"- {md_cell(v.name)}: {md_cell(golden_words(g))}" for v, g in golden]
    if result.not_run:
        out += ["", "Not run on this megatron, as the case states:"]
        out += [f"- {md_cell(r['name'])}: {md_cell(r['reason'])}" for r in result.not_run]
    return out


def bugs_markdown(result: CaseResult) -> list[str]:
    """The upstream bugs the case states ([] when none): per run with a ``bug``, and for the cross-implementation
    check, whether it was caught and what moved first, how far (`words.bug_words`)."""
    lines = [f"- {md_cell(v.name)}: {md_cell(w)}" for v in result.variants for w in [bug_words(v, False)] if w]
    lines += [f"- {md_cell(w)}" for w in bugs_elsewhere_lines(result.variants)]
    lines += [f"- cross-implementation: {md_cell(w)}" for w in cross_bug_words(result.cross_implementation)]
    return ["", "Upstream bugs this case states:"] + lines if lines else []


def agreement_markdown(agreement, baseline: str) -> list[str]:
    """Lines for the runs that split into groups ([] when nothing is split; `words.agreement_splits`): per split
    computation its warning (the baseline or another reference run may be the odd one out, or no group holds
    a majority), then one list item per group, largest first, saying when it joins several bitwise classes."""
    out = []
    for c in agreement_splits(agreement):
        if c["warning"]:
            out += ["", f"⚠️ {md_cell(c['warning'])}"]
        label = f" ({md_cell(c['label'])})" if c["label"] else ""
        out += ["", f"Runs that agree bit for bit or differ only where allowed{label}, {len(c['groups'])} groups:"]
        for k in c["groups"]:
            names = ", ".join(md_cell(n) + (" (baseline)" if n == baseline else "") for n in k["runs"])
            joined = f" ({k['classes']} bitwise classes)" if k["classes"] > 1 else ""
            out.append(f"- {len(k['runs'])} run{'s' if len(k['runs']) != 1 else ''}: {names}{joined}")
    return out


def cross_implementation_markdown(rec: Optional[dict]) -> list[str]:
    """Lines of the cross-implementation section of summary.md ([] without one): verdict, reason, headline."""
    if not rec:
        return []
    a, b = rec.get("trainers", ["?", "?"])
    lines = ["", f"**Cross-implementation** ({md_cell(a)} vs {md_cell(b)}, step {rec.get('step')}): "
             f"{_VERDICT_MD.get(rec['verdict'], md_cell(rec['verdict']))} {md_cell(rec.get('reason', ''))}"]
    h = rec.get("headline")
    if h:
        lines.append(f"losses ≤ {h['loss_max_ulp']} ULP · gradients ≤ {h['grad_max_scaled_ulp']:.3g} ULP at "
                     f"tensor scale (median {h['grad_median_scaled_ulp']:.3g}) over {h['tensors']} tensors, "
                     f"{h['grads_bitwise_equal']} bitwise equal · bound {rec.get('max_ulp')}")
    return lines


