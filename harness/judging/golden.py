"""Golden traces: a case's bits kept in the repository, so a change that moves every layout alike fails.

Layout comparison cannot see a bug that is the same on every layout (an aux-loss scale divided twice, a loss
normalised per sample): every run gets the same wrong numbers.  A golden is the trace of each variant of a
passing run (`harness.judging.trace.Trace` without timings, activations and boundary fingerprints: loss bits,
gradient / parameter / buffer fingerprints, grad norms, the inventory), plus the environment key that the
bits depend on.  ``bitparity verify CASE --golden DIR`` compares every run with its golden exactly like a
layout comparison (`harness.judging.compare.compare`: the first difference in dataflow order); ``--write-golden DIR``
records them (only from a run whose verdicts all pass).

Environment: bits are only comparable under the same arithmetic (torch build, Python, ATen kernel set, MKL's
reproducibility branch, BLAS, device, dtype, thread count: `environment_key`; per run, the trainer's
versions).  A golden from another environment is refused before anything runs, naming the field (comparing
would blame the code for the machine); so is one whose step count differs from the run's (``--train-iters``).
The shipped goldens are recorded with ``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`` (``make golden``).

CPU family (vendor and family, `harness.running.arithmetic.cpu_family`): not a refusal but a record of where the goldens
held.  ``checked_on`` lists the families on which these goldens were recorded or confirmed bitwise.  On a
family not in it the runs are compared all the same: equal -> pass (and ``--write-golden`` adds the family).
A difference there depends on what the list shows:

* two or more families: the bits were shown portable across vendors' code paths, so a difference is far more
  likely the code's than the CPU's: status ``differs``, verdict ``fail`` (exit 1), the detail naming this
  family as the possible cause and the command that adds it once a clean build agrees (`_unlisted_hint`).
  Calling it ``unchecked`` instead let a real bug pass (measured: the aux-loss scale divided by 3 gave
  "golden unchecked", exit 0, on an unlisted family);
* none or one: nothing says the bits survive another CPU family (vendors' math libraries round differently:
  measured for MKL's vector square root, which is why the reference trainer's optimizer does not use it,
  `reference_impl.optimizer`), so the difference cannot be judged: verdict ``unchecked``, one line saying the
  goldens were never checked on this family, not a code failure.

Layout (``DIR``): ``golden.json`` {format, case, environment, checked_on: [cpu family], recorded: {cpu_model,
bitparity}, variants: {name:
{file: "runs/<stem>.json", trainer}}} and one ``runs/<stem>.json`` per distinct run (compact JSON, sorted keys,
one step per line; the bitwise-equal layouts of a case share one file).  Everything is validated when the
golden is loaded, before any run; a refresh touches only the files its own index names.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..planning import trainers
from ..running.arithmetic import environment
from .compare import compare
from .golden_schema import trace_problem
from .trace import StepTrace, Trace

FORMAT = "bitparity-golden/2"
#: The environment facts a trace's bits depend on (`harness.running.arithmetic.environment`'s keys plus the case's device,
#: params_dtype and num_threads); each variant's entry also keeps its trainer's versions.
KEY_FIELDS = ("torch", "python", "machine", "aten_cpu_capability", "mkl_cbwr", "blas", "blas_version", "gpu", "cuda",
              "cublas", "device", "params_dtype", "num_threads")
#: StepTrace fields that are not bits of the computation (or are not captured by every run).
_VOLATILE = ("time_s", "cpu_s", "activations", "boundaries", "router_ties", "actions", "overlap")
#: Trace fields that describe the layout, not the computation: taken from the run being checked.
_PER_RUN = ("world_size", "expert_model_parallel_size", "data_parallel_size", "tensor_model_parallel_size", "resumed")
_FILE = re.compile(r"^runs/[A-Za-z0-9][A-Za-z0-9._-]{0,150}\.json$")
_TRACE_KEYS = {"format", "params", "order", "init", "steps"}


def environment_key(env: dict) -> dict:
    """The facts of `env` that decide the bits (`KEY_FIELDS` present in it)."""
    return {k: env[k] for k in KEY_FIELDS if env.get(k) is not None}


def environment_difference(golden: dict, here: dict) -> str:
    """'' when the keys agree, else one line naming every field that differs."""
    fields = sorted(set(golden) | set(here))
    return "; ".join(f"{f} {golden.get(f)!r} (golden) vs {here.get(f)!r} (here)"
                     for f in fields if golden.get(f) != here.get(f))


def _golden_trace(trace: Trace) -> dict:
    raw = {k: v for k, v in asdict(trace).items() if k not in _PER_RUN}
    # which rank held a parameter is the layout's business, not the computation's
    raw["params"] = {k: {f: x for f, x in meta.items() if f != "rank"} for k, meta in raw["params"].items()}
    for st in raw["steps"]:
        for k in _VOLATILE:
            st.pop(k, None)
    return raw


def _dump(raw: dict) -> str:
    """Sorted compact JSON with one step per line: small, and a refresh shows in a diff as the steps it moved."""
    head = {k: v for k, v in raw.items() if k != "steps"}
    steps = ",\n".join(json.dumps(st, sort_keys=True, separators=(",", ":")) for st in raw["steps"])
    return json.dumps(head, sort_keys=True, separators=(",", ":"))[:-1] + ',\n"steps":[\n' + steps + "\n]}\n"


def _read_index(directory: Path, flag: str) -> dict:
    path = directory / "golden.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{flag} {directory}: no golden.json there (record one with --write-golden)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {directory}: golden.json unreadable ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UsageError(f"{flag} {directory}: golden.json is not {FORMAT}")
    variants = index.get("variants")
    if not isinstance(variants, dict) or not isinstance(index.get("environment"), dict) or any(
            not isinstance(e, dict) or not isinstance(e.get("file"), str) or not _FILE.match(e["file"])
            or not isinstance(e.get("trainer"), dict) for e in variants.values()):
        raise UsageError(f"{flag} {directory}: golden.json malformed (variants: {{name: {{file: runs/<name>.json, "
                         "trainer: {...}}}}, environment: {...})")
    checked = index.setdefault("checked_on", [])
    if not isinstance(checked, list) or not all(isinstance(f, str) and f.strip() for f in checked):
        raise UsageError(f"{flag} {directory}: golden.json checked_on must be a list of CPU families "
                         "(e.g. [\"AuthenticAMD family 26\"])")
    return index


def _read_trace(directory: Path, file: str) -> dict:
    """One golden file, parsed and checked against the golden trace schema.  Raises UsageError naming the file."""
    path = directory / file
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--golden {path}: unreadable ({e})") from None
    if not isinstance(raw, dict) or set(raw) != _TRACE_KEYS:
        raise UsageError(f"--golden {path}: not a golden trace (keys {sorted(_TRACE_KEYS)}, steps of trace fields)")
    problem = trace_problem(raw)
    if problem:
        raise UsageError(f"--golden {path}: not a golden trace: {problem}")
    return raw


def load(directory: Path, case: str, runs: dict, key: dict) -> dict:
    """Load and check DIR's goldens before anything runs; returns {"index": ..., "traces": {file: raw}}.

    `runs`: {variant: (train_iters, `harness.planning.trainers.versions`)} of the planned runs that have a golden;
    `key`: this machine's `environment_key`.

    Raises:
        UsageError: DIR or a file is missing, unreadable or malformed; the goldens are of another case; they
            come from another environment (naming every field) or another trainer version; a run's step count
            differs from its golden's.
    """
    index = _read_index(directory, "--golden")
    if index.get("case") != case:
        raise UsageError(f"--golden {directory}: the goldens are of case {index.get('case')!r}, not {case!r}")
    diff = environment_difference(index["environment"], key)
    if diff:
        raise UsageError(f"--golden {directory}: recorded in another environment, nothing run: {diff}")
    traces = {}
    for name, (iters, versions) in runs.items():
        entry = index["variants"].get(name)
        if entry is None:
            continue
        diff = environment_difference(entry["trainer"], versions)
        if diff:
            raise UsageError(f"--golden {directory}: variant {name!r} recorded with another trainer, nothing run: {diff}")
        raw = traces.get(entry["file"]) or _read_trace(directory, entry["file"])
        traces[entry["file"]] = raw
        if len(raw["steps"]) != iters:
            raise UsageError(f"--golden {directory}: variant {name!r} has {len(raw['steps'])} golden steps, the run "
                             f"{iters} (train_iters / --train-iters must match the golden's)")
    return {"index": index, "traces": traces}


def check_writable(directory: Path, case: str, partial: bool, key: dict, family: str = "unknown") -> None:
    """Before anything runs: --write-golden's DIR can take this case's goldens; creates it (empty) if missing.

    Raises:
        UsageError: an empty path; DIR is not a directory or cannot be created; it holds files but no
            golden.json, or a golden.json that is unreadable, of another format or of another case; a
            partial refresh (`partial`: --only) in another environment, or on a CPU family (`family`) the
            goldens were never checked on (either would mix two machines' bits in one golden).
    """
    if not str(directory):
        raise UsageError("--write-golden: empty path")
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--write-golden {directory}: not a directory")
    if directory.is_dir() and any(directory.iterdir()):
        if not (directory / "golden.json").exists():
            raise UsageError(f"--write-golden {directory}: not empty and holds no golden.json (not a golden directory)")
        index = _read_index(directory, "--write-golden")
        if index.get("case") != case:
            raise UsageError(f"--write-golden {directory}: holds the goldens of case {index.get('case')!r}, not "
                             f"{case!r}: choose another directory")
        diff = environment_difference(index["environment"], key)
        if partial and diff:
            raise UsageError(f"--write-golden {directory}: a partial refresh (--only) here would mix two "
                             f"environments ({diff}): refresh every variant")
        if partial and family not in index["checked_on"]:
            raise UsageError(f"--write-golden {directory}: a partial refresh (--only) on {family}, which these "
                             f"goldens were never checked on ({', '.join(index['checked_on']) or 'none'}), would mix "
                             "two machines' bits: refresh every variant")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--write-golden {directory}: cannot create it ({e.strerror or e})") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--write-golden {directory}: not writable")


def write(directory: Path, case: str, traces: dict, files: dict, key: dict, env: dict, trainers: dict) -> None:
    """Record `traces` ({variant: Trace}) as goldens under `directory` (`files`: {variant: file stem},
    `trainers`: {variant: `harness.planning.trainers.versions`}), after `check_writable`.

    Runs with identical bits share one file (the bitwise-equal layouts of a case: one golden).  Goldens of
    variants not in `traces` are kept when the environment is the same (a refresh with --only); only files
    the old index named and the new one does not are removed.  ``checked_on``: a full refresh with the same
    bits adds this CPU family (``env["cpu_family"]``), other bits leave only this family; a partial refresh
    (on a family already checked, `check_writable`) keeps the list when its bits are the same."""
    index_path = directory / "golden.json"
    old = _read_index(directory, "--write-golden") if index_path.exists() else {"variants": {}, "environment": {}}
    same = old.get("case") == case and old["environment"] == key
    keep = {n: e for n, e in old["variants"].items() if n not in traces} if same else {}
    texts = {name: _dump(_golden_trace(trace)) for name, trace in traces.items()}

    def old_text(name):
        entry = old["variants"].get(name)
        path = directory / entry["file"] if entry else None
        return path.read_text() if path is not None and path.is_file() else None

    unchanged = same and all(old_text(n) == t for n, t in texts.items())
    family = env.get("cpu_family", "unknown")
    if not unchanged:
        checked = [family]
    elif keep:                  # the kept goldens were not run on this family: it confirms nothing new
        checked = list(old["checked_on"])
    else:                       # every golden was run here with the same bits
        checked = sorted(set(old["checked_on"]) | {family})
    by_text: dict = {}
    for name, text in texts.items():
        by_text.setdefault(text, []).append(name)
    (directory / "runs").mkdir(exist_ok=True)
    variants = dict(keep)
    kept_files = {e["file"] for e in keep.values()}
    kept_texts = {f: (directory / f).read_text() for f in sorted(kept_files) if (directory / f).is_file()}
    for text, group in by_text.items():
        # a kept golden with these very bits: share its file (a partial refresh that moved nothing writes nothing)
        file = next((f for f, kept in kept_texts.items() if kept == text), None)
        if file is None:
            file = f"runs/{files[group[0]]}.json"
            while file in kept_files:                           # never overwrite a kept variant's golden
                file = f"runs/_{file[5:]}"
            tmp = directory / f"{file}.tmp"
            tmp.write_text(text)
            os.replace(tmp, directory / file)
        variants.update({name: {"file": file, "trainer": trainers[name]} for name in group})
    for stale in {e["file"] for e in old["variants"].values()} - {e["file"] for e in variants.values()}:
        (directory / stale).unlink(missing_ok=True)
    index = {"format": FORMAT, "case": case, "environment": key, "variants": dict(sorted(variants.items())),
             "checked_on": checked,
             "recorded": {"cpu_model": env.get("cpu_model"), "bitparity": env.get("bitparity")}}
    tmp = directory / ".golden.json.tmp"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, index_path)


def _trace(raw: dict, run: Trace) -> Trace:
    return Trace(**{**raw, "steps": [StepTrace(**st) for st in raw["steps"]]},
                 **{k: getattr(run, k) for k in _PER_RUN})


#: How many CPU families in ``checked_on`` show the bits portable: from then on a difference on an unlisted family
#: is a failure (`check`), since one family alone says nothing about another vendor's code paths.
PORTABLE_FAMILIES = 2


def _unlisted_hint(family: str, checked_on: list, directory: Path) -> str:
    """The words added to a difference on an unlisted family of portable goldens: the family as a possible cause,
    and the command that adds it to checked_on (`write` adds a family only when every golden's bits agree; on a
    build that moved bits it would record that build's bits instead, hence "once a clean build agrees")."""
    return (f"may differ, only here: this CPU family ({family}) is not in checked_on [{', '.join(checked_on)}]; "
            f"once a clean build (a known-good commit) agrees here, `make golden` (`bitparity verify CASE "
            f"--write-golden {directory}`) adds it")


def check(loaded: dict, directory: Path, traces: dict, family: str) -> tuple[dict, dict]:
    """Compare each run of `traces` ({variant: Trace, or None when it errored}) with its golden (`load`'s result)
    on a machine of CPU family `family`.

    Returns (case record {dir, environment: "same", recorded, checked_on, verdict, detail}, {variant: {status,
    first_divergence, detail}}) with status ``equal`` / ``differs`` / ``unchecked`` (differs, on a CPU family
    the goldens were never checked on, when fewer than `PORTABLE_FAMILIES` are: the bits cannot be judged) /
    ``missing`` (no golden for that variant) / ``not run``; verdict ``pass`` / ``fail`` / ``unchecked`` (every
    difference is of the ``unchecked`` kind: not a code failure).  A difference on an unlisted family of goldens
    checked on `PORTABLE_FAMILIES` or more is ``differs`` / ``fail``, its detail naming the family as a possible
    cause (`_unlisted_hint`).
    """
    if not isinstance(family, str) or not family.strip():
        raise ValueError(f"golden check: the CPU family must be a non-empty string, not {family!r}")
    index, per = loaded["index"], {}
    checked_on = index["checked_on"]          # a list of families (`_read_index`)
    known = family in checked_on
    # where the bits were shown portable, a difference is judged on any family; else only on a listed one
    judged = known or len(checked_on) >= PORTABLE_FAMILIES
    hint = "" if known else _unlisted_hint(family, checked_on, directory)
    for name, trace in traces.items():
        entry = index["variants"].get(name)
        if trace is None:
            per[name] = {"status": "not run", "first_divergence": None, "detail": "the run did not complete"}
        elif entry is None:
            per[name] = {"status": "missing", "first_divergence": None,
                         "detail": f"no golden for variant {name!r} in {directory} (record with --write-golden)"}
        else:
            fd = compare(_trace(loaded["traces"][entry["file"]], trace), trace).first_divergence
            per[name] = {"status": "equal" if fd is None else "differs" if judged else "unchecked",
                         "first_divergence": asdict(fd) if fd else None,
                         "detail": "bitwise equal to the golden" if fd is None else
                         f"first difference from the golden (golden vs this run): step {fd.step} {fd.kind} "
                         f"{fd.name}: {fd.detail}" + (f" ({hint})" if judged and hint else "")}
    bad = [n for n, r in per.items() if r["status"] != "equal"]
    # a run that did not complete (an error, or left undone by --budget) has no bits to check: not a difference
    not_run = [n for n in bad if per[n]["status"] == "not run"]
    differ = [n for n in bad if n not in not_run]
    unchecked = bool(bad) and all(per[n]["status"] in ("unchecked", "not run") for n in bad)
    words = [f"{len(differ)} of {len(per)} run(s) not bitwise equal to their golden: {', '.join(differ[:3])}"] \
        if differ else []
    words += [f"{len(not_run)} of {len(per)} run(s) did not complete, not checked: {', '.join(not_run[:3])}"] \
        if not_run else []
    case = {"dir": str(directory), "environment": "same", "recorded": index.get("recorded", {}),
            "checked_on": checked_on, "verdict": "unchecked" if unchecked else "fail" if bad else "pass",
            "detail": "; ".join(words) if bad else f"{len(per)} run(s) bitwise equal to their goldens"}
    if unchecked and differ:
        case["detail"] = (f"goldens checked on {', '.join(checked_on) or 'no CPU family'}, never on {family}: "
                          f"{len(differ)} of {len(per)} run(s) differ, not counted as a code change (confirm the "
                          "goldens on this family from a known-good commit: `make golden`)"
                          + (f"; {words[-1]}" if not_run else ""))
    elif hint and any(per[n]["status"] == "differs" for n in differ):     # not for a missing golden alone
        case["detail"] += f"; {hint}"
    elif not bad and not known:
        case["detail"] += f" (first check on {family}: `make golden` adds it to checked_on)"
    return case, per


@dataclass
class GoldenRequest:
    """`verify --golden DIR` (`loaded`: `load`'s result, checked before anything runs) or `--write-golden DIR`
    (`write`); `key`: this machine's `key_for` the case, taken once before the runs and recorded as is."""

    directory: Path
    write: bool
    key: dict
    loaded: Optional[dict] = None


def key_for(plan) -> dict:
    """This machine's golden environment key for `plan` (`environment_key` of `harness.running.arithmetic.environment`
    plus the case's own facts, `harness.planning.cases.CasePlan.facts`)."""
    return environment_key({**environment(), **plan.facts()})


def apply(req: Optional[GoldenRequest], plan, env: dict, traces: dict, variants: list, dirs: dict,
          progress) -> Optional[dict]:
    """`harness.verify`'s last step: check the runs (`traces`, `variants`: the `VariantResult` s, whose
    `golden` it fills) against their goldens, or record them; returns `CaseResult.golden`.  Goldens are
    recorded only from a run whose verdicts all pass."""
    if req is None:
        return None
    if req.write:
        failed = [v.name for v in variants if v.verdict != "pass"]
        if failed:
            progress(f"[golden] not recorded: {len(failed)} variant(s) do not pass ({', '.join(failed[:3])})")
            return {"dir": str(req.directory), "environment": "same", "verdict": "fail",
                    "detail": "not recorded: not every variant passes"}
        write(req.directory, plan.name, traces, {n: Path(d).name for n, d in dirs.items()}, req.key,
                     env, {r.spec.name: trainers.versions(r.config) for r in plan.runs})
        progress(f"[golden] recorded {len(traces)} run(s) in {req.directory}")
        return {"dir": str(req.directory), "environment": "same", "verdict": "pass",
                "detail": f"recorded {len(traces)} run(s)"}
    case, per = check(req.loaded, req.directory, traces, env.get("cpu_family", "unknown"))
    for v in variants:
        v.golden = per[v.name]
        if v.golden["status"] != "equal":
            progress(f"[golden] {v.name}: {v.golden['status'].upper()}: {v.golden['detail']}")
    progress(f"[golden] {case['detail']} ({req.directory})")
    return case
