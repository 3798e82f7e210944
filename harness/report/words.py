"""Wording shared by every output of the report: numbers, durations, first divergences, expectations,
structural checks, outcomes, and the anchors that link a verdict to its card.

Every function here is pure and total: malformed values (None, NaN, strings where numbers belong) give a
placeholder, never an exception, because a report must render whatever a crashed run left behind.
"""
from __future__ import annotations

import math
import posixpath
import re
from html import escape as html_escape
from typing import Any, Optional

from harness.judging.results import FirstDivergence, VariantResult

#: Characters XML 1.0 cannot represent at all (not even as character references).
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def clean_text(s: Any) -> str:
    """`str(s)` without ANSI colour codes and without characters XML cannot carry."""
    if s is None:
        return ""
    s = _ANSI_ESCAPE.sub("", str(s))
    return _XML_INVALID.sub("\ufffd", s)


def finite_or_none(x: Any) -> Optional[float]:
    """`x` as a finite float, else None."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def int_or_none(x: Any) -> Optional[int]:
    """`x` as an int when it is a whole finite number (bools are not numbers here), else None."""
    if isinstance(x, bool):
        return None
    f = finite_or_none(x)
    return None if f is None or f != int(f) else int(f)


def num(x: float) -> str:
    """Deterministic short SVG number: at most two decimals, no trailing zeros."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def attr(s: Any) -> str:
    """Text escaped for an XML attribute or element body."""
    return html_escape(clean_text(s), quote=True)


def format_elapsed(seconds: Any) -> str:
    """Human duration: ``0.42 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    s = finite_or_none(seconds)
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


def format_fraction(x: Any) -> str:
    """A fraction in [0, 1] as a percentage with one decimal: ``0.1579`` -> ``15.8 %``; ``—`` when unknown."""
    f = finite_or_none(x)
    return "—" if f is None else f"{100.0 * f:.1f} %"


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


def canonical_words(fd: Optional[FirstDivergence]) -> str:
    """The first difference in canonical parameter order when it names another tensor than the dataflow-first
    one (`FirstDivergence.canonical`), cleaned to one line; ``""`` when there is none."""
    text = getattr(fd, "canonical", None) if fd is not None else None
    return " ".join(clean_text(text).split()) if text else ""


def mtp_words(v: VariantResult) -> str:
    """Where a run's layout puts MTP: ``no MTP`` when its model has none (``mtp_num_layers`` 0), else ``MTP
    standalone`` or ``MTP with the loss`` (also when the depth is not known)."""
    if getattr(v, "mtp_num_layers", None) == 0:
        return "no MTP"
    return "MTP standalone" if v.mtp_standalone else "MTP with the loss"


def reference_of(v: VariantResult, baseline: str) -> str:
    """Name of the run `v` is compared with (`compare_to`, the case baseline when unset)."""
    return str(v.compare_to) if v.compare_to else str(baseline)


def clip_words(clip_grad: Any) -> str:
    """``"off"`` when gradient clipping is disabled (0, None, not a number), else the threshold (``0.05``)."""
    c = finite_or_none(clip_grad)
    return "off" if c is None or c <= 0 else f"{c:g}"


def clipping_on(v: VariantResult) -> bool:
    """True when the variant trains with grad clipping (clip_grad > 0)."""
    return clip_words(v.clip_grad) != "off"


def ref_words(v: VariantResult, baseline: str) -> str:
    """``baseline 'x'`` or ``reference run 'y'``: the run `v` is compared with, named for a sentence."""
    ref = reference_of(v, baseline)
    return f"baseline {ref!r}" if ref == baseline else f"reference run {ref!r}"


def expectation_words(v: VariantResult, baseline: str) -> str:
    """The variant's expectation as a sentence naming its reference run."""
    if v.expect == "bitwise":
        return f"expected bitwise equality with {ref_words(v, baseline)}"
    if v.expect == "may_diverge":
        return (f"expected bitwise equality with {ref_words(v, baseline)}, or a first divergence only where "
                "allowed (rounding that depends on the values)")
    return f"expected to diverge from {ref_words(v, baseline)}"


def inventory_lines(v: VariantResult) -> list[str]:
    """The variant's parameter-inventory differences from its reference run, one cleaned line each."""
    return [clean_text(x) for x in (v.inventory or [])]


def outside_lines(v: VariantResult) -> list[str]:
    """Differences outside the expected divergence's signature (`VariantResult.outside_signature`), one cleaned
    line each; [] when none were found or the check did not run (older producers lack the field)."""
    lines = getattr(v, "outside_signature", None) or []
    return [clean_text(x) for x in lines] if isinstance(lines, (list, tuple)) else []


def outside_count(v: VariantResult) -> int:
    """How many differences lie outside the signature (`VariantResult.outside_signature_count`; the lines
    are capped, so their number is not the count)."""
    n = getattr(v, "outside_signature_count", 0)
    return n if isinstance(n, int) and n > 0 else len(outside_lines(v))


def golden_of(v: VariantResult) -> dict:
    """The variant's golden-trace comparison (`VariantResult.golden`) or {} when not asked / malformed."""
    g = getattr(v, "golden", None)
    return g if isinstance(g, dict) else {}


def golden_words(g: Any) -> str:
    """One line for a golden comparison: ``equal``, ``differs · step 1 · grad · w``, ``missing · detail``."""
    if not isinstance(g, dict) or not g:
        return ""
    head = clean_text(g.get("status") or "unknown")
    fd = g.get("first_divergence")
    where = ""
    if isinstance(fd, dict):
        where = " · ".join(clean_text(fd.get(k)) for k in ("step", "kind", "name") if fd.get(k) is not None)
        where = f"step {where}" if fd.get("step") is not None else where
    detail = clean_text(g.get("detail") or "")
    return " · ".join(x for x in (head, where, detail) if x)


def replica_words(rs: Any) -> str:
    """One line for a `VariantResult.replica_status`; ``""`` when it is empty (the run errored).

    ``consistent · 1 replica(s) match ...`` or ``broken at step 1 · <key>: gradient at step 1 ...``.
    """
    if not isinstance(rs, dict) or not rs:
        return ""
    detail = clean_text(rs.get("detail") or "")
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


def replica_keys(rs: Any) -> list[str]:
    """The replica keys named by a replica status, cleaned; [] when there are none."""
    keys = rs.get("replicas") if isinstance(rs, dict) else None
    return [clean_text(k) for k in keys] if isinstance(keys, (list, tuple)) else []


def run_to_run_words(rr: Any) -> str:
    """One line for a `VariantResult.run_to_run`: ``"3 runs bitwise equal"`` or
    ``"NONDETERMINISTIC: <detail>"``; ``""`` when the variant ran once (``{}``)."""
    if not isinstance(rr, dict) or not rr:
        return ""
    detail = clean_text(rr.get("detail") or "").strip()
    if rr.get("deterministic") is False:
        return f"NONDETERMINISTIC: {detail or 'the repeated runs differ'}"
    runs = int_or_none(rr.get("runs"))
    return f"{runs} runs bitwise equal" if runs is not None else (detail or "runs bitwise equal")


def agreement_splits(agreement: Any) -> list[dict]:
    """The computations of `CaseResult.agreement` (`harness.judging.agreement.groups`) whose runs split into several
    groups (runs bitwise equal or differing only where a passing run's expectation allows), for the first
    screen: ``[{"label": str, "warning": str, "groups": [{"runs": [str], "has_baseline": bool, "classes":
    int}]}]`` (text cleaned, ``warning`` "" when none, ``classes``: how many bitwise-equal classes the group
    joins); [] when nothing is split, the grouping was not computed, or it is malformed.  A record without
    ``groups`` (written before groups existed) shows its bitwise classes, one class a group.

    Why groups and not classes: a passing case whose runs may round differently (P=1, clipping) splits into
    bitwise classes by design; only a split no expectation explains belongs on the first screen."""
    comps = agreement.get("computations") if isinstance(agreement, dict) else None
    out = []
    for c in comps if isinstance(comps, list) else []:
        parts = (c.get("groups") if "groups" in c else c.get("classes")) if isinstance(c, dict) else None
        if not isinstance(parts, list) or len(parts) < 2:
            continue
        out.append({"label": clean_text(c.get("label") or ""), "warning": clean_text(c.get("warning") or ""),
                    "groups": [{"runs": [clean_text(n) for n in k.get("runs") or []],
                                "has_baseline": k.get("has_baseline") is True,
                                "classes": k.get("classes") if isinstance(k.get("classes"), int) else 1}
                               for k in parts if isinstance(k, dict)]})
    return out


# ------------------------------------------------------------------------------------- outcomes

#: Outcome (`harness.judging.results.Outcome`) -> (css class, symbol in a matrix cell, legend words).  The class
#: names the colour: green equal, teal allowed, blue expected, red unexpected, grey error, outlined reference.
OUTCOME_STYLE = {
    "equal": ("equal", "=", "equal"),
    "differs only where allowed": ("allowed", "≈", "differs only where allowed"),
    "differs as expected": ("expected", "≠", "differs as expected"),
    "unexpected difference": ("unexpected", "✗", "unexpected difference"),
    "unexpectedly equal": ("unexpected", "✗", "unexpectedly equal"),
    "not finite": ("unexpected", "✗", "not finite"),
    "not finite as expected": ("expected", "nan", "not finite as expected (a bug caught)"),
    "unexpectedly finite": ("unexpected", "✗", "unexpectedly finite"),
    "crashed as stated": ("expected", "!", "crashed as stated (a known upstream bug)"),
    "unexpectedly completed": ("unexpected", "✗", "completed, but a crash was stated"),
    "error": ("error", "!", "error"),
    "reference": ("reference", "ref", "reference run"),
}
#: Legend order of the css classes, with their words.
OUTCOME_LEGEND = (("equal", "equal"), ("allowed", "differs only where allowed"),
                  ("expected", "differs as expected"), ("unexpected", "unexpected difference"),
                  ("error", "error"), ("reference", "reference run"))


def outcome_of(v: VariantResult, baseline: Optional[str] = None) -> str:
    """The variant's outcome words; for an unjudged result (older producers: ``outcome == ""``) derived from
    the verdict (and ``reference`` for the passing `baseline`), so that every variant has a colour."""
    if v.outcome in OUTCOME_STYLE:
        return str(v.outcome)
    if v.verdict == "pass" and baseline is not None and v.name == baseline:
        return "reference"
    if v.verdict == "error":
        return "error"
    if v.verdict == "fail":
        return "unexpected difference"
    if v.bitwise_equal is False:
        return "differs as expected" if v.expect == "diverge" else "differs only where allowed"
    return "equal"


def outcome_class(v: VariantResult, baseline: Optional[str] = None) -> str:
    """CSS class of the variant's outcome (``equal``, ``allowed``, ``expected``, ``unexpected``, ``error``,
    ``reference``); a failing verdict is always ``unexpected`` (red), whatever the words."""
    if v.verdict == "fail":
        return "unexpected"
    if v.verdict == "error":
        return "error"
    return OUTCOME_STYLE[outcome_of(v, baseline)][0]


def outcome_symbol(v: VariantResult, baseline: Optional[str] = None) -> str:
    """Short mark of a matrix cell for the variant's outcome."""
    cls = outcome_class(v, baseline)
    return next(sym for c, sym, _ in OUTCOME_STYLE.values() if c == cls)


# -------------------------------------------------------------------------------------- anchors

def slug(name: Any) -> str:
    """A name as an id fragment: letters, digits, ``_`` and ``-`` only (``clip/pp16`` -> ``clip-pp16``)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", clean_text(name)).strip("-") or "variant"


def card_anchors(variants: list[VariantResult]) -> dict[int, str]:
    """``{index: "card-<slug>"}``: one unique card id per variant (a repeated slug gets ``-2``, ``-3`` ...)."""
    taken: set = set()
    out = {}
    for i, v in enumerate(variants):
        base = f"card-{slug(v.name)}"
        anchor, k = base, 1
        while anchor in taken:
            k += 1
            anchor = f"{base}-{k}"
        taken.add(anchor)
        out[i] = anchor
    return out


def is_relative_link(path: str) -> bool:
    """True for a relative URL (no scheme, not protocol-relative): safe to link from a page on disk."""
    return bool(path) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path) and not path.startswith("//")


def run_dir_of(v: VariantResult) -> Optional[str]:
    """The variant's run directory relative to the report (``runs/x``, normalised, POSIX), or None when it is
    missing, absolute or leads outside the report directory."""
    d = clean_text(v.run_dir or "").replace("\\", "/")
    if not d or not is_relative_link(d) or d.startswith("/"):
        return None
    d = posixpath.normpath(d)
    if d in (".", "") or d == ".." or d.startswith("../"):
        return None
    return d


def detail_page(v: VariantResult) -> Optional[str]:
    """Link (relative to index.html) of the variant's detail page ``<run_dir>/index.html``; None without a
    usable run directory."""
    d = run_dir_of(v)
    return None if d is None else f"{d}/index.html"


def trace_file(v: VariantResult) -> Optional[str]:
    """Link (relative to index.html) of the variant's Chrome trace ``<run_dir>/schedule.trace.json``; None
    without a run directory."""
    d = run_dir_of(v)
    return None if d is None else f"{d}/schedule.trace.json"


def megatron_source_words(src: dict) -> str:
    """One line naming a megatron source (`harness.planning.sources`): version, commit (+ local changes), path."""
    commit = src.get("commit")
    where = f" commit {str(commit)[:12]}{' + local changes' if src.get('modified') else ''}" if commit else ""
    return f"megatron-core {src.get('version')}{where} at {src.get('path')}"


def bug_words(v: VariantResult, elsewhere: bool = True) -> Optional[str]:
    """What a run that states an upstream bug showed, in one line, or None for a run that states none.

    A run whose expectation demands the bug (``diverge``, ``not_finite``) and passes: ``caught`` with what moved
    first and how far — the first divergence (step, kind, tensor; ULPs of a scalar), the largest per-element ULP
    distance in the ULP evidence and which tensor, or where training first stopped being finite; failing: ``NOT
    caught`` and why.  A bug stated with a replica drift (``replica_drift``: a run whose copies train apart):
    ``caught`` with the first broken replica.  A bug stated with an expectation of equality, or only for other
    megatron versions (``bug_elsewhere``; `elsewhere` False: left out, `bugs_elsewhere_lines` says them once
    for all runs): whether it is absent here.  A stated crash (``crash``): ``caught`` with the error line."""
    bug = getattr(v, "bug", None)
    lines = []
    drift = (getattr(v, "replica_status", None) or {}).get("consistent") is False
    if bug and getattr(v, "outcome", None) in ("crashed as stated", "unexpectedly completed"):
        lines.append(f"{clean_text(bug)}: {'caught' if v.verdict == 'pass' else 'NOT as stated'} — "
                     f"{clean_text(v.reason)}")
    elif bug and v.expect in ("diverge", "not_finite"):
        lines.append(_caught(v, bug))
    elif bug and drift:         # a stated replica drift (`replica_drift`): the bug shows as copies training apart
        lines.append(f"{clean_text(bug)}: {'caught' if v.verdict == 'pass' else 'NOT as stated'} — "
                     f"{clean_text(v.replica_status.get('detail', ''))}")
    elif bug:
        lines.append(f"{clean_text(bug)}: {'absent here' if v.verdict == 'pass' else 'NOT as stated'} — "
                     f"{clean_text(v.reason)}")
    for other in (getattr(v, "bug_elsewhere", None) or []) if elsewhere else []:
        lines.append(f"{clean_text(other)}: {'passes' if v.verdict == 'pass' else 'FAILS'} on this megatron — "
                     f"{clean_text(v.reason)}")
    return "; ".join(lines) or None


def bugs_elsewhere_lines(variants: list) -> list[str]:
    """One line per upstream bug the case states only for other megatron versions (a run's ``bug_elsewhere``),
    for all the runs that state it at once: how many pass on this megatron, and which fail (at most 4 named)."""
    runs: dict = {}
    for v in variants:
        for bug in getattr(v, "bug_elsewhere", None) or []:
            runs.setdefault(bug, []).append(v)
    out = []
    for bug, vs in runs.items():
        bad = [clean_text(v.name) for v in vs if v.verdict != "pass"]
        out.append(f"{clean_text(bug)}: stated for other megatron versions; on this one {len(vs) - len(bad)} of "
                   f"{len(vs)} run(s) stating it pass" + (f", FAIL: {', '.join(bad[:4])}" if bad else ""))
    return out


def _caught(v: VariantResult, bug: str) -> str:
    if v.verdict != "pass":
        return f"{clean_text(bug)}: NOT caught — {clean_text(v.reason)}"
    parts = []
    if getattr(v, "nonfinite", ""):
        parts.append(f"not finite first at {clean_text(v.nonfinite)}")
    fd = v.first_divergence
    if fd is not None and not getattr(v, "nonfinite", ""):
        parts.append(f"moved first: {divergence_words(fd)}" + (f", {fd.ulp} ULP" if fd.ulp is not None else ""))
    worst = max((r for r in v.ulp_evidence or [] if isinstance(r, dict) and r.get("max_ulp") is not None),
                key=lambda r: r["max_ulp"], default=None)
    if worst is not None:
        parts.append(f"farthest at that step: {worst.get('what', '')} {clean_text(worst.get('key', ''))}, "
                     f"max {_sig(worst['max_ulp'])} ULP, median {_sig(worst.get('median_ulp'))} ULP "
                     f"({format_fraction(worst.get('fraction'))} of its elements differ)")
    return f"{clean_text(bug)}: caught — " + "; ".join(parts or ["as the case states"])


def _sig(x: Any) -> str:
    f = finite_or_none(x)
    return "—" if f is None else f"{f:.3g}"


def cross_bug_words(rec: Any) -> list[str]:
    """The cross-implementation comparison's bug lines, one per bug: each bug it states on this megatron version,
    caught or not (`harness.judging.judge.judge_cross_implementation` ``bugs``), with what that bug explains (the first place beyond the
    bound and the farthest tensor, or the tensor a further bug states), then the bugs it states for other
    versions; [] when none."""
    if not isinstance(rec, dict):
        return []
    lines = []
    if rec.get("expected_expect") == "disagree":
        for b in rec.get("bugs") or []:
            if isinstance(b, dict) and b.get("bug"):
                lines.append(f"{clean_text(b['bug'])}: {'caught' if b.get('caught') else 'NOT caught'} by the "
                             f"cross-implementation check — {clean_text(b.get('words', ''))}")
    for other in rec.get("bug_elsewhere") or []:
        lines.append(f"{clean_text(other)}: {'passes' if rec.get('verdict') == 'pass' else 'FAILS'} on this "
                     f"megatron — {clean_text(rec.get('reason', ''))}")
    return lines
