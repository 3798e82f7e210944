"""The one judge: every verdict bitparity gives — `bitparity verify`'s runs (`harness.verify`), `bitparity compare`'s
pair (`harness.compare_dirs`), a drawn layout of `bitparity fuzz` (`harness.fuzz`) — is `decide`'s, from what the
case expects (`Expectation`) and what was measured of the run (`Evidence`); the cross-implementation check's
(`harness.judging.crossimpl`: two trainers, one run) is `judge_cross_implementation`'s, and a golden's
(`harness.judging.golden`) adds to a run's verdict.  Rules, in the order they apply:

0. a run the case states to crash (``crash``: a known upstream bug): pass when it stopped with that error, fail
   when it completed, ``error`` when it stopped otherwise; nothing else is judged of it;
1. the run did not complete (``error``), or its run-to-run repeats were not all run: ``error``;
2. run-to-run nondeterminism: ``fail`` (not a layout effect);
3. a replica that trains apart from its original (`harness.judging.compare.replica_status`) fails *whatever the
   expectation*, unless the expectation states that drift (``replica_drift``: its replica and first step; an
   upstream bug such as Megatron-LM e0afe89a75); a stated drift that does not happen fails too (the bug is
   not caught);
4. the comparison with the reference run against ``expect`` / ``first_divergence`` (`judge`), then the
   divergence signature (`harness.judging.signature`: nothing may differ outside it);
5. a stage-boundary message that arrived with other bits than were sent: ``fail``;
6. finiteness (`judge_nonfinite`: NaN bits compare equal to themselves);
7. words only, no verdict change: overlap coverage, activation localisation.

A run on ``--megatron-base`` (`Evidence.twin_equal`: bitwise equal to its head run) asks one thing, whether base
moved a bit: broken alike on both (a bug the case states) it is equal, and its head run's verdict judges the
breakage.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from ..planning import expectations, trainers
from ..planning.cases import PlannedRun
from . import crossimpl, signature
from .compare import Comparison

#: The format tag of ``runs/<variant>/comparison.json`` (`comparison_record`).
COMPARISON_FORMAT = "bitparity-comparison/1"


@dataclass(frozen=True)
class Expectation:
    """What a run must show: a variant's ``expect``, ``first_divergence``, ``signature`` and ``replica_drift``
    (`harness.planning.case_schema.VariantSpec`, after `harness.planning.expectations.resolve`), the reference's name for the words
    and whether the run is the case's baseline (compared with itself)."""

    expect: str = "bitwise"
    first_divergence: Optional[list] = None
    signature: Optional[list] = None
    replica_drift: Optional[list] = None
    compare_to: Optional[str] = None
    is_baseline: bool = False
    crash: Optional[str] = None         # a known upstream crash: the text its error must contain

    @classmethod
    def of(cls, run: PlannedRun) -> "Expectation":
        """The expectation of planned run `run` (its resolved spec)."""
        s = run.spec
        return cls(s.expect, s.first_divergence, s.signature, getattr(s, "replica_drift", None), s.compare_to,
                   run.is_baseline, getattr(s, "crash", None))


@dataclass(frozen=True)
class Evidence:
    """What was measured of one run; a field left at its default was not measured (an errored run has only
    `error`).  ``replicas``: `harness.judging.compare.replica_status`; ``boundary``: `harness.judging.localise.boundary_mismatches`;
    ``nonfinite``: `harness.judging.trace.first_nonfinite`; ``coverage``: `harness.judging.trace.overlap_coverage`;
    ``localisation``: `harness.judging.localise.localise`; ``clipping``: the runs clip the grad norm (the signature's
    reach); ``planted``: the run carries a planted fault (`reference_impl.faults`)."""

    error: Optional[str] = None
    cmp: Optional[Comparison] = None
    replicas: Optional[dict] = None
    run_to_run: Optional[dict] = None
    nonfinite: object = None
    boundary: tuple = ()
    coverage: dict = field(default_factory=dict)
    localisation: Optional[dict] = None
    clipping: bool = False
    planted: bool = False
    twin_equal: bool = False


@dataclass(frozen=True)
class Verdict:
    """`decide`'s answer: ``verdict`` (pass / fail / error), ``outcome`` (`harness.judging.results.Outcome`, what happened
    in words), ``reason`` (one line) and ``outside`` (the `harness.judging.compare.Difference` s outside the divergence
    signature)."""

    verdict: str
    outcome: str
    reason: str
    outside: tuple = ()


def decide(want: Expectation, ev: Evidence) -> Verdict:
    """The verdict of one run from its expectation and evidence, by the rules of the module docstring (the only
    place a verdict is made)."""
    if want.crash is not None:
        return _crash(want.crash, ev.error)
    if ev.error:
        return Verdict("error", "error", ev.error.splitlines()[0])
    replicas = None if ev.twin_equal else ev.replicas
    verdict, happened, reason = judge(want, ev.cmp, None, replicas, ev.run_to_run)
    verdict, happened, reason, outside = signature.judge((verdict, happened, reason), want, ev.cmp, ev.clipping)
    if ev.boundary and verdict != "error":
        verdict, happened, reason = "fail", "unexpected difference", f"stage boundary: {ev.boundary[0]}"
    if ev.twin_equal and ev.nonfinite:
        reason += f" (not finite on both: {ev.nonfinite})"
    elif verdict != "error":
        verdict, happened, reason = judge_nonfinite(want, ev.nonfinite, verdict, happened, reason, ev.planted)
    if (ev.coverage or {}).get("warning"):
        reason += f"; overlap coverage: {ev.coverage['warning']}"
    if ev.localisation:
        reason += f"; localised: {ev.localisation['message']}"
    return Verdict(verdict, happened, reason, tuple(outside))


def _crash(stated: str, error: Optional[str]) -> Verdict:
    """The verdict of a run stated to crash (a known upstream bug, `VariantSpec.crash`): pass when its error says
    `stated`; an error of another kind stays an error; a run that completed fails (the bug is gone: say so)."""
    if error is None:
        return Verdict("fail", "unexpectedly completed", f"completed, but the case states it crashes with {stated!r} "
                                                         "(fixed upstream? then update the case)")
    line = next((x for x in error.splitlines() if stated in x), None)
    if line is None:
        return Verdict("error", "error", error.splitlines()[0] + f" (the case states a crash with {stated!r})")
    return Verdict("pass", "crashed as stated", f"crashed as stated: {line.strip()}")


def comparison_record(v, **extra) -> dict:
    """``runs/<variant>/comparison.json`` of `harness.judging.results.VariantResult` `v`: its verdict and structural
    checks (the one writer: `bitparity verify` and `bitparity compare`, which adds the directories ``a``, ``b``)."""
    return {"format": COMPARISON_FORMAT, "variant": v.name, "compare_to": v.compare_to, **extra,
            "verdict": v.verdict, "outcome": v.outcome, "reason": v.reason, "bitwise_equal": v.bitwise_equal,
            "first_divergence": asdict(v.first_divergence) if v.first_divergence else None,
            "inventory": v.inventory, "replica_status": v.replica_status, "run_to_run": v.run_to_run,
            "ulp_evidence": v.ulp_evidence, "evidence_error": v.evidence_error, "localisation": v.localisation,
            "outside_signature": v.outside_signature, "outside_signature_count": v.outside_signature_count,
            "golden": v.golden}


def replica_words(want: Expectation, replicas: Optional[dict]) -> tuple[bool, str]:
    """(whether the replicas break the run, in words) against the stated ``replica_drift`` places: an unstated
    drift breaks it, a stated one that happens does not (its words say so), a stated one that does not happen
    breaks it (the bug it states is not caught).  ``replicas`` None or {}: not measured, nothing to say."""
    stated = want.replica_drift or []
    if not replicas:
        return False, ""
    if replicas.get("consistent") is False:
        where = f"replica inconsistent from step {replicas['first_broken_step']}: {replicas['detail']}"
        key = replicas.get("replica")
        misses = [_drift_miss(w, key, replicas["first_broken_step"]) for w in stated]
        if stated and not all(misses):
            return False, f"replica drifts as stated: {where}"
        if stated:
            return True, f"{where} (not where stated: {min(misses, key=len)})"
        return True, where
    if stated:
        return True, "replica drift stated (" + " or ".join(_drift_words(w) for w in stated) + \
            ") but every replica matches its original"
    return False, ""


def _drift_miss(want, key: Optional[str], step: int) -> str:
    """How the first broken replica `key` at `step` misses the stated drift `want` ('' when it is the one)."""
    out = []
    if key != want.name:
        out.append(f"replica {key!r} (stated {want.name!r})")
    if want.step is not None and want.step != step:
        out.append(f"step {step} (stated {want.step})")
    return ", ".join(out)


def _drift_words(want) -> str:
    return f"{want.name}" + (f" from step {want.step}" if want.step is not None else "")


def judge(want: Expectation, cmp: Optional[Comparison], error: Optional[str], replicas: Optional[dict] = None,
          run_to_run: Optional[dict] = None) -> tuple[str, str, str]:
    """(verdict, outcome, one-line reason) of a run's comparison `cmp` with its reference, its replicas
    (`replica_words`) and its run-to-run control: rules 1-4 of the module docstring without the signature.

    verdict: pass / fail / error (the exit code).  outcome (`harness.judging.results.Outcome`): what happened —
    ``equal``, ``differs only where allowed`` (``may_diverge``, first divergence where it was allowed),
    ``differs as expected`` (``diverge``), ``unexpected difference``, ``unexpectedly equal``, ``error``, or
    ``reference`` for the baseline.

    Structural failures come first: a parameter inventory that differs from the reference run's fails
    unless the variant expects exactly that (``first_divergence: {kind: inventory}``); a replica that drifted
    from its original fails every run that does not state it (``replica_drift``), a ``diverge`` run too.
    """
    if error:
        return "error", "error", error.splitlines()[0]
    if run_to_run and run_to_run["deterministic"] is None:     # the repeats did not all run (--budget)
        return "error", "error", f"run to run not checked: {run_to_run['detail']}"
    if run_to_run and not run_to_run["deterministic"]:   # nondeterminism, not a layout effect
        return "fail", "unexpected difference", f"run-to-run nondeterminism: {run_to_run['detail']}"
    broken, replica_why = replica_words(want, replicas)
    seen = "" if broken or not replica_why else f"; {replica_why}"      # a stated drift, as stated
    if want.is_baseline:
        return ("fail", "unexpected difference", f"reference run: {replica_why}") if broken else \
            ("pass", "reference", f"reference run: completed (compared with itself){seen}")
    if want.expect == "not_finite":     # judged by where it stopped being finite (`judge_nonfinite`)
        return ("fail", "unexpected difference", replica_why) if broken else ("pass", "not finite as expected", "")
    fd = cmp.first_divergence
    where = f"first divergence: step {fd.step} {fd.kind} {fd.name}" if fd else ""
    ref = want.compare_to or "the baseline"
    wants = want.first_divergence
    if cmp.inventory and not (want.expect != "bitwise" and any(w.kind == "inventory" for w in wants or [])):
        return "fail", "unexpected difference", \
            f"parameter inventory differs from {ref} ({len(cmp.inventory)}): {cmp.inventory[0]}"
    if cmp.bitwise_equal:
        if want.expect == "diverge":
            return "fail", "unexpectedly equal", f"expected a divergence but the run is bitwise equal to {ref}"
        if broken:
            return "fail", "unexpected difference", f"bitwise equal to {ref}, but {replica_why}"
        allowed = f" (allowed to differ: {' or '.join(map(_allowed, wants))})" if want.expect == "may_diverge" else ""
        return "pass", "equal", f"bitwise equal to {ref}{allowed}{seen}"
    if want.expect == "bitwise":
        return "fail", "unexpected difference", f"expected bitwise equality; {where}" + \
            (f"; {replica_why}" if broken else "")
    misses = [_misplaced(fd, w) for w in wants or []]
    mismatch = min(misses, key=len) if misses and all(misses) else []
    if mismatch:
        return "fail", "unexpected difference", \
            ("differs outside what is allowed: " if want.expect == "may_diverge" else
             "diverged elsewhere than expected: ") + ", ".join(mismatch)
    if broken:          # a run that differs, even on purpose, must still keep its replicas
        return "fail", "unexpected difference", \
            f"{_where_words(fd)} is {'allowed' if want.expect == 'may_diverge' else 'expected'}, but {replica_why}"
    if want.expect == "may_diverge":
        return "pass", "differs only where allowed", f"differs only where allowed: {_where_words(fd)}{seen}"
    return "pass", "differs as expected", f"differs as expected; {where}{seen}"


def judge_cross_implementation(rec: dict, want: dict) -> dict:
    """The cross-implementation check's verdict: `rec` (`harness.judging.crossimpl.run`'s measured record: verdict
    pass / fail against the bound alone, or error) judged against the expectation `want` (`harness.judging.crossimpl.expected`):
    a ``disagree`` expectation passes only when the runs disagree first where it says, every further stated bug
    (``more_bugs``) has its tensor beyond the bound, and for no other reason (weights, inventory or data that
    differ mean the comparison itself is broken).  The measured verdict stays in ``measured``; ``bugs`` lists
    each stated bug with ``caught`` and ``words`` (what it explains: the first place beyond the bound, or its
    own tensor; or why it is not caught)."""
    rec = {**rec, **{f"expected_{k}" if k not in ("bug", "bug_elsewhere") else k: v for k, v in want.items()},
           "measured": rec["verdict"], "bugs": []}
    if want["expect"] == "agree":
        return rec
    if rec["verdict"] == "error":
        rec["bugs"] = [{"bug": b, "caught": False, "words": rec["reason"]}
                       for b in [want["bug"], *(m["bug"] for m in want["more_bugs"])] if b]
        return rec
    fb = rec.get("first_beyond_bound")
    place = None if fb is None else ("loss" if fb["kind"] == "loss" else fb["name"])
    broken = rec["init_differs"] or any(rec["inventory"].values()) or "different data" in rec["reason"]
    if rec["verdict"] == "pass":
        verdict, why = "fail", f"expected the implementations to disagree, but they agree: {rec['reason']}"
    elif broken or place is None:
        verdict, why = "fail", f"the comparison itself is broken: {rec['reason']}"
    elif want["first_beyond_bound"] is not None and place != want["first_beyond_bound"]:
        verdict, why = "fail", f"disagree elsewhere than expected (first {place}, expected " \
            f"{want['first_beyond_bound']}): {rec['reason']}"
    else:
        verdict, why = "pass", f"disagree as expected: {rec['reason']}"
    bugs = [{"bug": want["bug"], "place": place, "caught": verdict == "pass", "words": why}] if want["bug"] else []
    trainers = tuple(rec.get("trainers") or ("a", "b"))      # a bare record (a unit test) names none
    for m in want["more_bugs"]:
        at = crossimpl.measured_at(rec, m["beyond_bound"], trainers)
        if verdict == "fail" and (broken or rec["verdict"] == "pass"):
            caught, words = False, why
        elif at is None:
            caught, words = False, f"{m['beyond_bound']} is not among the compared places"
        elif at["ulp"] > rec["max_ulp"]:
            caught, words = True, f"beyond the bound at {at['words']} > {rec['max_ulp']}"
        else:
            caught, words = False, f"within the bound at {at['words']} (bound {rec['max_ulp']})"
        bugs.append({"bug": m["bug"], "place": m["beyond_bound"], "caught": caught, "words": words})
        if verdict == "pass" and not caught:
            verdict, why = "fail", f"{m['bug']}: stated beyond the bound at {m['beyond_bound']}, but {words}; {why}"
        elif caught and verdict == "pass":
            why += f"; also as stated ({m['bug']}): {words}"
    return {**rec, "verdict": verdict, "reason": why, "bugs": bugs}


def bugs_elsewhere(run: PlannedRun) -> list[str]:
    """The bugs `run`'s variant states for other megatron versions than the one it ran on."""
    declared = run.declared or run.spec
    if not trainers.runs_megatron(run.config.trainer) or not declared.megatron_versions:
        return []
    return expectations.bugs_elsewhere(declared, expectations.entry_for(
        declared, trainers.megatron_version(run.config.megatron_path)))


def judge_nonfinite(want, nonfinite, verdict: str, happened: str, reason: str,
                     planted: bool = False) -> tuple[str, str, str]:
    """(verdict, outcome, reason) once the run's first NaN / inf (`harness.judging.trace.first_nonfinite`, or None) is
    known.  NaN bits compare equal to themselves, so a broken run must not pass as "equal": it fails, except a
    ``diverge`` run with a planted fault (`planted`: broken on purpose, it only says so) and a ``not_finite``
    run, which passes only when it is not finite where its first_divergence says (the bug it states is caught
    there) and nothing else failed it (a replica).  A ``diverge`` run without a planted fault differs for a
    reason the case states (other data, another option), not by breaking: not finite, it fails."""
    if want.expect == "not_finite" and verdict != "fail":
        if nonfinite is None:
            return "fail", "unexpectedly finite", "expected training to become not finite, but every loss and grad " \
                "norm is finite"
        misses = [_misplaced(nonfinite, w) for w in want.first_divergence or []]
        if misses and all(misses):
            return "fail", "unexpected difference", f"not finite elsewhere than expected: {nonfinite}; " + \
                ", ".join(min(misses, key=len))
        return "pass", "not finite as expected", f"not finite as expected: {nonfinite}"
    if nonfinite is None or want.expect == "not_finite":
        return verdict, happened, reason
    if want.expect == "diverge" and planted:
        return verdict, happened, f"{reason}; training not finite: {nonfinite}"
    return "fail", "not finite", f"training not finite: {nonfinite}"


def _misplaced(fd, want) -> list[str]:
    """How the first divergence `fd` misses the expected place `want` (fields left out match anything)."""
    kind = getattr(fd, "kind", "grad_norm" if fd.name == "grad norm" else "loss")     # a `NonFinite` has no kind
    out = [f"{k} {have!r} (expected {getattr(want, k)!r})" for k, have in
           (("step", fd.step), ("kind", kind), ("name", fd.name), ("microbatch", fd.microbatch))
           if getattr(want, k) is not None and getattr(want, k) != have]
    # the ULP bound only speaks about the place it allows: elsewhere the place itself is the miss
    if not out and want.max_ulp is not None and (getattr(fd, "ulp", None) is None or fd.ulp > want.max_ulp):
        out.append(f"{fd.ulp if fd.ulp is not None else 'unknown'} ulp (at most {want.max_ulp} allowed)")
    return out


def _allowed(want) -> str:
    """'grad norm, any step, <= 4 ulp': where a `may_diverge` variant is allowed to differ, in words."""
    what = "grad norm" if want.kind == "grad_norm" else f"{want.kind} {want.name or '(any)'}"
    parts = [what, f"step {want.step}" if want.step is not None else "any step"]
    if want.microbatch is not None:
        parts.append(f"microbatch {want.microbatch}")
    if want.max_ulp is not None:
        parts.append(f"<= {want.max_ulp} ulp")
    return ", ".join(parts)


def _where_words(fd) -> str:
    """'grad norm, step 1, 1 ULP' / 'grad norm, step 1, 574215113 float64 ULP' (megatron-core's norm) /
    'grad embedding.word_embeddings.weight, step 0'."""
    what = "grad norm" if fd.kind == "grad_norm" else f"{fd.kind} {fd.name}"
    if fd.microbatch is not None:
        what += f", microbatch {fd.microbatch}"
    wide = " float64" if getattr(fd, "ulp_bits", None) == 64 else ""
    return f"{what}, step {fd.step}" + (f", {fd.ulp}{wide} ULP" if fd.ulp is not None else "")
