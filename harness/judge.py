"""A run's verdict: its comparison with its reference judged against what the case expects (``expect``,
``first_divergence``), its replicas, its run-to-run control and whether it stayed finite.  Used by `bitparity
verify` (`harness.verify`) and `bitparity compare` (`harness.compare_dirs`)."""
from __future__ import annotations

from typing import Optional

from . import expectations, trainers
from .cases import PlannedRun
from .compare import Comparison


def judge(run: PlannedRun, cmp: Optional[Comparison], error: Optional[str],
          replicas: Optional[dict] = None, run_to_run: Optional[dict] = None) -> tuple[str, str, str]:
    """(verdict, outcome, one-line reason) for a variant from its expectation, comparison and replica status.

    verdict: pass / fail / error (the exit code).  outcome (`harness.results.Outcome`): what happened —
    ``equal``, ``differs only where allowed`` (``may_diverge``, first divergence where it was allowed),
    ``differs as expected`` (``diverge``), ``unexpected difference``, ``unexpectedly equal``, ``error``, or
    ``reference`` for the baseline.

    Structural failures come first: a parameter inventory that differs from the reference run's fails
    unless the variant expects exactly that (``first_divergence: {kind: inventory}``); a replica that
    drifted from its original (`harness.compare.replica_status`) fails the baseline and every
    ``bitwise`` / ``may_diverge`` variant (a ``diverge`` run may be broken on purpose).
    """
    if error:
        return "error", "error", error.splitlines()[0]
    if run_to_run and run_to_run["deterministic"] is None:     # the repeats did not all run (--budget)
        return "error", "error", f"run to run not checked: {run_to_run['detail']}"
    if run_to_run and not run_to_run["deterministic"]:   # nondeterminism, not a layout effect
        return "fail", "unexpected difference", f"run-to-run nondeterminism: {run_to_run['detail']}"
    broken = replicas is not None and replicas.get("consistent") is False
    replica_why = f"replica inconsistent from step {replicas['first_broken_step']}: {replicas['detail']}" \
        if broken else ""
    if run.is_baseline:
        return ("fail", "unexpected difference", f"reference run: {replica_why}") if broken else \
            ("pass", "reference", "reference run: completed (compared with itself)")
    if run.spec.expect == "not_finite":     # judged by where it stopped being finite (`judge_nonfinite`)
        return "pass", "not finite as expected", ""
    fd, exp = cmp.first_divergence, run.spec
    where = f"first divergence: step {fd.step} {fd.kind} {fd.name}" if fd else ""
    ref = exp.compare_to or "the baseline"
    want = exp.first_divergence
    if cmp.inventory and not (exp.expect != "bitwise" and any(w.kind == "inventory" for w in want or [])):
        return "fail", "unexpected difference", \
            f"parameter inventory differs from {ref} ({len(cmp.inventory)}): {cmp.inventory[0]}"
    if cmp.bitwise_equal:
        if exp.expect == "diverge":
            return "fail", "unexpectedly equal", f"expected a divergence but the run is bitwise equal to {ref}"
        if broken:
            return "fail", "unexpected difference", f"bitwise equal to {ref}, but {replica_why}"
        allowed = f" (allowed to differ: {' or '.join(map(_allowed, want))})" if exp.expect == "may_diverge" else ""
        return "pass", "equal", f"bitwise equal to {ref}{allowed}"
    if exp.expect == "bitwise":
        return "fail", "unexpected difference", f"expected bitwise equality; {where}" + \
            (f"; {replica_why}" if broken else "")
    misses = [_misplaced(fd, w) for w in want or []]
    mismatch = min(misses, key=len) if misses and all(misses) else []
    if mismatch:
        return "fail", "unexpected difference", \
            ("differs outside what is allowed: " if exp.expect == "may_diverge" else
             "diverged elsewhere than expected: ") + ", ".join(mismatch)
    if exp.expect == "may_diverge":     # a layout that may round differently must still keep its replicas
        if broken:
            return "fail", "unexpected difference", f"{_where_words(fd)} is allowed, but {replica_why}"
        return "pass", "differs only where allowed", f"differs only where allowed: {_where_words(fd)}"
    return "pass", "differs as expected", f"differs as expected; {where}"


def bugs_elsewhere(run: PlannedRun) -> list[str]:
    """The bugs `run`'s variant states for other megatron versions than the one it ran on."""
    declared = run.declared or run.spec
    if run.config.trainer != "megatron-core" or not declared.megatron_versions:
        return []
    return expectations.bugs_elsewhere(declared, expectations.entry_for(
        declared, trainers.megatron_version(run.config.megatron_path)))


def judge_nonfinite(spec, nonfinite, verdict: str, happened: str, reason: str,
                     planted: bool = False) -> tuple[str, str, str]:
    """(verdict, outcome, reason) once the run's first NaN / inf (`harness.trace.first_nonfinite`, or None) is
    known.  NaN bits compare equal to themselves, so a broken run must not pass as "equal": it fails, except a
    ``diverge`` run with a planted fault (`planted`: broken on purpose, it only says so) and a ``not_finite``
    run, which passes only when it is not finite where its first_divergence says (the bug it states is caught
    there).  A ``diverge`` run without a planted fault differs for a reason the case states (other data, another
    option), not by breaking: not finite, it fails."""
    if spec.expect == "not_finite":
        if nonfinite is None:
            return "fail", "unexpectedly finite", "expected training to become not finite, but every loss and grad " \
                "norm is finite"
        misses = [_misplaced(nonfinite, w) for w in spec.first_divergence or []]
        if misses and all(misses):
            return "fail", "unexpected difference", f"not finite elsewhere than expected: {nonfinite}; " + \
                ", ".join(min(misses, key=len))
        return "pass", "not finite as expected", f"not finite as expected: {nonfinite}"
    if nonfinite is None:
        return verdict, happened, reason
    if spec.expect == "diverge" and planted:
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
