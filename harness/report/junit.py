"""``junit.xml``: one ``<testcase>`` per variant (and one for the cross-implementation check), for CI
test-report widgets."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from harness.judging.results import CaseResult, VariantResult

from .words import (
    canonical_words,
    clean_text,
    clip_words,
    divergence_words,
    expectation_words,
    finite_or_none,
    golden_of,
    golden_words,
    inventory_lines,
    outside_lines,
    ref_words,
    reference_of,
    replica_keys,
    replica_words,
)


def failure_text(v: VariantResult, baseline: str) -> str:
    """Body of a JUnit <failure>: what diverged (or did not), what differs outside the expected signature, the
    structural checks, what was expected, and how to reproduce it."""
    lines = []
    if v.reason:
        lines.append(v.reason)
    if v.first_divergence is not None:
        lines.append(f"first divergence: {divergence_words(v.first_divergence)}")
        if v.first_divergence.detail:
            lines.append(f"  {v.first_divergence.detail}")
        if canonical_words(v.first_divergence):
            lines.append(f"  in canonical order: {canonical_words(v.first_divergence)}")
    elif v.bitwise_equal:
        lines.append(f"no divergence: the run is bitwise equal to {ref_words(v, baseline)}")
    outside = outside_lines(v)
    if outside:
        lines.append(f"differences outside the expected signature ({len(outside)}):")
        lines += [f"  {line}" for line in outside]
    inventory = inventory_lines(v)
    if inventory:
        lines.append(f"parameter inventory differs from {ref_words(v, baseline)} "
                     f"({len(inventory)} parameter{'s' if len(inventory) != 1 else ''}):")
        lines += [f"  {line}" for line in inventory]
    if replica_words(v.replica_status):
        lines.append(f"replica consistency: {replica_words(v.replica_status)}")
        keys = replica_keys(v.replica_status)
        if keys:
            lines.append(f"  replicas: {', '.join(keys)}")
    if golden_of(v):
        lines.append(f"golden trace: {golden_words(golden_of(v))}")
    lines.append(expectation_words(v, baseline))
    lines.append(f"layout: {v.layout} (pp={v.pp}, vpp={v.vpp}, ep={v.expert_model_parallel_size}, "
                 f"schedule={v.schedule}, mtp_standalone={v.mtp_standalone})")
    lines.append(f"reductions: {v.reductions} · clip_grad: {clip_words(v.clip_grad)} · "
                 f"compared with: {reference_of(v, baseline)}")
    if v.run_dir:
        lines.append(f"run dir: {v.run_dir}")
    if v.command:
        lines.append(f"reproduce: {v.command}")
    return "\n".join(lines)


def junit_xml(result: CaseResult) -> str:
    """JUnit XML: ``<testsuites>`` holding one ``<testsuite name=case>``, one ``<testcase>`` per variant (and one
    named ``cross-implementation`` when the case has that check, one named ``golden`` when the runs were compared
    with goldens: a failure when a run differs from its golden, ``<skipped>`` when the goldens were never
    checked on this CPU family and a run differs: not counted as a failure; one ``<skipped>`` testcase per run the
    case says is not made on this megatron, its reason the message).

    Each testcase has ``classname="bitparity.<case>"``, ``name=<variant>`` and ``time=<elapsed_s>``.
    A failing variant carries ``<failure message=reason>`` whose text is the first divergence (and its
    canonical-order counterpart), the differences outside the expected signature, the parameter-inventory
    differences, the replica status and the golden comparison (when there are any) and the expectation; an
    errored one carries ``<error message=...>`` with the error text.  ANSI colour codes
    and characters XML cannot represent are removed so the file always parses.
    """
    case = clean_text(result.case)
    cross = result.cross_implementation
    n = len(result.variants) + (cross is not None)
    cross_verdict = cross.get("verdict") if cross is not None else None
    golden = result.golden if isinstance(result.golden, dict) and result.golden else None
    golden_verdict = golden.get("verdict") if golden else None
    n += golden is not None
    not_run = list(getattr(result, "not_run", None) or [])
    n += len(not_run)
    failures = sum(v.verdict == "fail" for v in result.variants) + (cross_verdict == "fail") + \
        (golden_verdict == "fail")
    errors = sum(v.verdict == "error" for v in result.variants) + (cross_verdict == "error")
    total_time = f"{finite_or_none(result.elapsed_s) or 0.0:.3f}"
    counts = {"tests": str(n), "failures": str(failures), "errors": str(errors),
              "skipped": str(int(golden_verdict == "unchecked") + len(not_run)), "time": total_time}

    root = ET.Element("testsuites", {"name": "bitparity", **counts})
    suite = ET.SubElement(root, "testsuite", {"name": case, **counts})
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "baseline", "value": clean_text(result.baseline)})
    ET.SubElement(props, "property", {"name": "case_path", "value": clean_text(result.case_path)})
    ET.SubElement(props, "property", {"name": "command", "value": clean_text(result.command)})
    for k, val in (result.environment or {}).items():
        ET.SubElement(props, "property", {"name": f"env.{clean_text(k)}", "value": clean_text(val)})

    for v in result.variants:
        tc = ET.SubElement(suite, "testcase", {
            "classname": f"bitparity.{case}",
            "name": clean_text(v.name),
            "time": f"{finite_or_none(v.elapsed_s) or 0.0:.3f}",
        })
        if v.verdict == "fail":
            fail = ET.SubElement(tc, "failure", {
                "message": clean_text(v.reason or "variant does not match its expectation"),
                "type": "UnexpectedEquality" if v.outcome == "unexpectedly equal" else "BitwiseMismatch",
            })
            fail.text = clean_text(failure_text(v, result.baseline))
        elif v.verdict == "error":
            message = v.reason or (str(v.error).strip().splitlines() or ["variant run failed"])[-1]
            err = ET.SubElement(tc, "error", {"message": clean_text(message), "type": "RunError"})
            err.text = clean_text(v.error or v.reason or "variant run failed")
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = clean_text(v.reason or "pass")
    for r in not_run:           # runs the case says are not made on this megatron: skipped, with why
        tc = ET.SubElement(suite, "testcase", {"classname": f"bitparity.{case}", "name": clean_text(r["name"]),
                                               "time": "0.000"})
        ET.SubElement(tc, "skipped", {"message": clean_text(r["reason"])})
    if cross is not None:       # one more testcase: the cross-implementation check (harness.judging.crossimpl)
        tc = ET.SubElement(suite, "testcase", {"classname": f"bitparity.{case}", "name": "cross-implementation",
                                               "time": f"{sum((cross.get('elapsed_s') or {}).values()):.3f}"})
        reason = clean_text(cross.get("reason") or "")
        if cross.get("verdict") == "fail":
            ET.SubElement(tc, "failure", {"message": reason, "type": "CrossImplementationMismatch"}).text = reason
        elif cross.get("verdict") == "error":
            ET.SubElement(tc, "error", {"message": reason, "type": "RunError"}).text = reason
        else:
            ET.SubElement(tc, "system-out").text = reason
    if golden is not None:      # one more testcase: every run against its golden (harness.judging.golden)
        tc = ET.SubElement(suite, "testcase", {"classname": f"bitparity.{case}", "name": "golden", "time": "0.000"})
        detail = clean_text(golden.get("detail") or "")
        lines = [f"{clean_text(v.name)}: {clean_text(golden_words(golden_of(v)))}" for v in result.variants
                 if golden_of(v) and golden_of(v).get("status") != "equal"]
        if golden_verdict == "fail":
            ET.SubElement(tc, "failure", {"message": detail, "type": "GoldenMismatch"}).text = \
                "\n".join([detail, *lines])
        elif golden_verdict == "unchecked":
            ET.SubElement(tc, "skipped", {"message": detail}).text = "\n".join([detail, *lines])
        else:
            ET.SubElement(tc, "system-out").text = detail
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
