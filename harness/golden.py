"""Golden traces: a case's bits kept in the repository, so a change that moves every layout alike fails.

Layout comparison cannot see a bug that is the same on every layout (an aux-loss scale divided twice, a loss
normalised per sample): every run gets the same wrong numbers.  A golden is the trace of each variant of a
passing run (`harness.trace.Trace` without timings, activations and boundary fingerprints: loss bits,
gradient / parameter / buffer fingerprints, grad norms, the inventory), plus the environment key that the
bits depend on.  ``bitparity verify CASE --golden DIR`` compares every run with its golden exactly like a
layout comparison (`harness.compare.compare`: the first difference in dataflow order); ``--write-golden DIR``
records them (only from a run whose verdicts all pass).

Environment: bits are only comparable under the same arithmetic (torch build, ATen kernel set, MKL's
reproducibility branch, BLAS, device, dtype, thread count: `environment_key`).  A golden from another
environment is reported as such, naming the field, before any bit is compared, and fails the check
(comparing would blame the code for the machine).  The CPU model is recorded but not part of the key: the
shipped goldens are recorded with ``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`` (``make golden``),
the arithmetic that is meant to round alike on every x86-64 CPU.

Layout (``DIR``): ``golden.json`` {format, case, environment, recorded, variants: {name: {file, world_size,
expert_model_parallel_size}}} and one ``<variant>.json`` per distinct run (compact JSON, sorted keys, one step
per line; the bitwise-equal layouts of a case share one file).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .compare import compare
from .errors import UsageError
from .trace import StepTrace, Trace

FORMAT = "bitparity-golden/1"
#: The environment facts a trace's bits depend on (`harness.verify.environment`'s keys).
#: Each variant's entry also keeps its trainer's versions (`harness.trainers.versions`), compared per variant.
KEY_FIELDS = ("torch", "machine", "aten_cpu_capability", "mkl_cbwr", "blas", "blas_version", "gpu", "cuda",
              "cublas", "device", "params_dtype", "num_threads")
#: StepTrace fields that are not bits of the computation (or are not captured by every run).
_VOLATILE = ("time_s", "activations", "boundaries", "router_ties", "actions")


def environment_key(env: dict) -> dict:
    """The facts of `env` (`harness.verify.environment` plus the case's device, params_dtype and
    num_threads) that decide the bits."""
    return {k: env[k] for k in KEY_FIELDS if env.get(k) is not None}


def environment_difference(golden: dict, here: dict) -> str:
    """'' when the keys agree, else one line naming every field that differs."""
    fields = sorted(set(golden) | set(here))
    diff = [f"{f} {golden.get(f)!r} (golden) vs {here.get(f)!r} (here)" for f in fields if golden.get(f) != here.get(f)]
    return "; ".join(diff)


#: Trace fields kept in golden.json per variant (they differ between layouts with identical bits).
_PER_RUN = ("world_size", "expert_model_parallel_size")


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


def load_index(directory: Path, case: str) -> dict:
    """``DIR/golden.json``, checked before anything runs.

    Raises:
        UsageError: DIR or its golden.json is missing or unreadable, of another format, or of another case.
    """
    path = directory / "golden.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--golden {directory}: no golden.json there (record one with --write-golden)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--golden {directory}: golden.json unreadable ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UsageError(f"--golden {directory}: golden.json is not {FORMAT}")
    if index.get("case") != case:
        raise UsageError(f"--golden {directory}: the goldens are of case {index.get('case')!r}, not {case!r}")
    return index


def check_writable(directory: Path) -> None:
    """Before anything runs: --write-golden's DIR is a directory or can be created.

    Raises:
        UsageError: DIR exists and is not a directory, or holds files that are not goldens.
    """
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--write-golden {directory}: not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / "golden.json").is_file():
        raise UsageError(f"--write-golden {directory}: not empty and holds no golden.json (not a golden directory)")


def write(directory: Path, case: str, traces: dict, files: dict, key: dict, env: dict, trainers: dict) -> None:
    """Record `traces` ({variant: Trace}) as goldens under `directory` (`files`: {variant: file stem},
    `trainers`: {variant: `harness.trainers.versions`}).
    Runs with identical bits share one file (the bitwise-equal layouts of a case: one golden); goldens of
    variants not in `traces` are kept (a refresh with --only touches only those)."""
    directory.mkdir(parents=True, exist_ok=True)
    index_path = directory / "golden.json"
    old = json.loads(index_path.read_text()) if index_path.is_file() else {}
    keep = {n: f for n, f in old.get("variants", {}).items() if n not in traces} \
        if old.get("case") == case and old.get("environment") == key else {}
    by_text: dict = {}
    for name, trace in traces.items():
        by_text.setdefault(_dump(_golden_trace(trace)), []).append(name)
    variants = dict(keep)
    for text, group in by_text.items():
        file = f"{files[group[0]]}.json"
        while file in {v["file"] for v in keep.values()}:     # never overwrite a kept variant's golden
            file = "_" + file
        tmp = directory / f".{file}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / file)
        variants.update({name: {"file": file, "trainer": trainers[name],
                                **{k: getattr(traces[name], k) for k in _PER_RUN}} for name in group})
    for stale in {p.name for p in directory.glob("*.json")} - {v["file"] for v in variants.values()} - {"golden.json"}:
        (directory / stale).unlink()
    index = {"format": FORMAT, "case": case, "environment": key, "variants": dict(sorted(variants.items())),
             "recorded": {"cpu_model": env.get("cpu_model"), "date": env.get("date"),
                          "bitparity": env.get("bitparity")}}
    tmp = directory / ".golden.json.tmp"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, index_path)


def _load(path: Path, entry: dict) -> Trace:
    raw = json.loads(path.read_text())
    raw["steps"] = [StepTrace(**s) for s in raw["steps"]]
    return Trace(**raw, **{k: entry[k] for k in _PER_RUN})


def check(directory: Path, index: dict, traces: dict, key: dict, trainers: dict) -> tuple[dict, dict]:
    """Compare each run of `traces` ({variant: Trace or None when it errored}; `trainers`: {variant:
    `harness.trainers.versions`}) with its golden.

    Returns (case record {dir, environment, recorded, verdict}, {variant: {status, first_divergence, detail}})
    with status ``equal`` / ``differs`` / ``missing`` (no golden for that variant) / ``other environment`` /
    ``not run``.  The environment is compared first: if it differs no bit is compared.
    """
    env_diff = environment_difference(index.get("environment", {}), key)
    recorded = index.get("recorded", {})
    per: dict = {}
    for name, trace in traces.items():
        entry = index.get("variants", {}).get(name) or {}
        file = entry.get("file")
        trainer_diff = environment_difference(entry.get("trainer", {}), trainers[name]) if file else ""
        if env_diff or trainer_diff:
            per[name] = {"status": "other environment", "first_divergence": None, "detail": env_diff or trainer_diff}
        elif trace is None:
            per[name] = {"status": "not run", "first_divergence": None, "detail": "the run did not complete"}
        elif file is None or not (directory / file).is_file():
            per[name] = {"status": "missing", "first_divergence": None,
                         "detail": f"no golden for variant {name!r} in {directory} (record with --write-golden)"}
        else:
            cmp = compare(_load(directory / file, entry), trace)
            fd = cmp.first_divergence
            per[name] = {"status": "equal" if fd is None else "differs",
                         "first_divergence": asdict(fd) if fd else None,
                         "detail": "bitwise equal to the golden" if fd is None else
                         f"first difference from the golden: step {fd.step} {fd.kind} {fd.name}: {fd.detail}"}
    ok = all(r["status"] == "equal" for r in per.values())
    case = {"dir": str(directory), "environment": f"other environment: {env_diff}" if env_diff else "same",
            "recorded": recorded, "verdict": "pass" if ok else "fail"}
    return case, per
