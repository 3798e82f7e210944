"""Which runs of a case agree: the runs that compute the same thing, split into classes of bitwise-equal traces,
and the classes joined into groups where a run's expectation allows its difference.

Why: a variant is compared only with its reference run (``compare_to``, default the baseline), so a wrong
reference makes every correct run compared with it fail, and the report blames them.  Measured (issue 23 item
6): a planted capture bug that only V>1 runs have made a V=2 baseline wrong, and the nine correct V=1 variants
failed.  Grouping every run that should be equal shows that nine runs agree among themselves and the baseline
with none of them: the baseline is the odd one out.

Semantics:

* Runs are grouped only within one *computation key* (`computation_key`): the run description without where
  the run is placed (pipeline layout and sizes, EP/DP, the 1F1B-overlap flags, GPUs), what it leaves behind
  (dumps, checkpoints) and what is under test (a planted ``inject`` fault, another megatron source): runs
  that differ only there must give the same bits.  Runs of another key (clipping on, canonical reductions,
  another trainer) compute other numbers and are never compared here.
* Equality is `harness.judging.compare.compare`'s ``bitwise_equal``: every loss bit, gradient and parameter
  fingerprint, grad norm and the parameter inventory.  It is transitive, so each run is compared with one
  representative per class only.  A representative is the member with the most steps (ties: case order):
  `compare` aligns by step, so a run resumed from a checkpoint (a subset of the steps) joins the class of
  the full run it continues.
* Classes are joined into *groups* where a run passed its own comparison (``passed``: its verdict against its
  ``compare_to`` is pass): a ``may_diverge`` run that differs only where allowed (P=1's embedding sum, a clipped
  run's grad norm) or a ``diverge`` run that differs as expected is not another computation, it is the same
  one under an allowed rounding.  Measured (issue 34): without this, ``cases/dsv3.yaml`` (29/29 pass) warned
  that ``pp1-no-pipelining`` and ``clip/pp16-vpp2-mtp-standalone`` "may be the odd one out", each alone in
  its bitwise class only because of the differences its case allows.  A failing run links nothing: a
  difference no expectation allows is exactly what the groups must show.  (So a ``may_diverge`` run can
  side with a wrong reference whose error lies where it may differ; it cannot tell, and says nothing more.)
* The warning speaks about groups.  A reference run (the baseline, or a run another names as ``compare_to``)
  in a group strictly smaller than the largest may be the odd one out.  When the largest size is shared by
  several groups of at least two runs and a reference stands in one of them, there is no majority (measured:
  a planted megatron embedding all-reduce skipped for V > 1 split 4 broken runs, the baseline among them,
  against 4 correct ones, and the 4 correct ones took the blame): the warning names the even split, since
  either side may be the wrong one.  A tie of single runs is one failing comparison, which its verdict
  already states.
* Runs without a trace (crashed, hung, unreadable) are listed apart, never grouped.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, NamedTuple, Optional

from trainerkit.config import RunConfig

from .compare import compare
from .trace import Trace

#: RunConfig fields that place or observe a run without changing what it computes (by bitparity's contract).
PLACEMENT_FIELDS = ("parallel", "num_gpus", "dump", "checkpoint", "resume_from", "rank_timeout_s")
#: What a case puts under test: a planted fault, another megatron source, the model class (GPTModel or
#: HybridModel of the same architecture: the migration claims the same numbers).  Left out of the key because
#: a run that differs there is exactly the one the grouping must show apart from the others.
UNDER_TEST_FIELDS = ("inject", "megatron_path", "model_class")


class Run(NamedTuple):
    """One run to group: its name, its merged trace (None: it errored), its computation key, the run it is
    compared with ("" or its own name: none, e.g. the baseline) and whether it passed that comparison (its
    verdict: any difference from `compare_to` is one its expectation allows, so it joins that run's group)."""

    name: str
    trace: Optional[Trace]
    key: str
    compare_to: str = ""
    passed: bool = False


def computation_key(config: RunConfig) -> str:
    """What `config` computes, as a canonical JSON string: equal strings, same numbers expected.

    ``config.model_dump(mode="json")`` without `PLACEMENT_FIELDS` and `UNDER_TEST_FIELDS`, with two
    normalisations: ``training.num_microbatches`` is the *global* count per step (times
    ``data_parallel_size``: DP rank d trains global microbatch m x DP + d, so DP=2 with 8 equals DP=1 with
    16), and ``capture`` only says whether fingerprints are recorded (``full`` and ``activations`` record the
    same compared tensors; ``losses`` records none).
    """
    d = config.model_dump(mode="json")
    for f in PLACEMENT_FIELDS + UNDER_TEST_FIELDS:
        d.pop(f, None)
    d["training"]["num_microbatches"] *= config.parallel.data_parallel_size
    d["capture"] = "losses" if config.capture == "losses" else "fingerprints"
    return json.dumps(d, sort_keys=True)


def groups(runs: Iterable, baseline: str) -> dict:
    """Partition `runs` into classes of bitwise-equal traces, and the classes into groups, per computation key.

    Args:
        runs: `Run` or tuples ``(name, trace | None, key[, compare_to[, passed]])``, in the case's order (names
            unique).
        baseline: the baseline's name.

    Returns (JSON-able)::

        {"split": bool,              # some computation's runs fall into more than one group
         "computations": [{"label": str, "key": str, "split": bool, "warning": str | None,
                           "groups": [{"runs": [str], "size": int, "has_baseline": bool, "classes": int}],
                           "classes": [{"runs": [str], "size": int, "has_baseline": bool, "group": int}]}],
         "errored": [str]}           # runs without a trace, not grouped

    One entry per computation key holding at least two traced runs, in order of first appearance; ``key``
    is the first 12 hex digits of the key's sha256, ``label`` the training options that tell it from the
    other keys (``clip_grad=0.05``; ``""`` when every run shares one key).  ``classes`` are the bitwise-equal
    classes; ``groups`` join the classes linked by a passing run and its ``compare_to`` (see the module), each
    with how many classes it holds; a class's ``group`` indexes ``groups``.  Groups largest first (ties:
    first appearance), classes by group, then largest first (ties: first appearance), runs in case order.
    ``split``: more than one group.  ``warning`` (one line) when a reference run (the baseline, or a run
    named by another's ``compare_to``) stands in a group strictly smaller than the largest (it may be the odd
    one out, and the failures of the runs compared with it may be its own), or in one of several largest
    groups of two runs or more ("no majority").

    Raises:
        TypeError: a run is not a `Run` or a tuple of 3 to 5 fields.
    """
    runs = [Run(*r) for r in runs]
    by_key: dict[str, list[tuple[int, Run]]] = {}
    for i, r in enumerate(runs):
        if r.trace is not None:
            by_key.setdefault(r.key, []).append((i, r))
    labels = _labels(list(by_key))
    refs = [baseline] + [r.compare_to for r in runs if r.compare_to not in ("", r.name, baseline)]
    computations = []
    for key, members in by_key.items():
        if len(members) < 2:
            continue
        classes = _partition(members)
        joined = _join(classes, members, baseline)
        names = {n for c in classes for n in c["runs"]}
        computations.append({
            "label": labels[key], "key": hashlib.sha256(key.encode()).hexdigest()[:12],
            "split": len(joined) > 1,
            "warning": _warning(joined, [r for r in dict.fromkeys(refs) if r in names], baseline, runs),
            "groups": joined,
            "classes": sorted(({**c, "has_baseline": baseline in c["runs"],
                                "group": next(g for g, j in enumerate(joined) if c["runs"][0] in j["runs"])}
                               for c in classes), key=lambda c: c["group"])})      # stable: by size within
    return {"split": any(c["split"] for c in computations), "computations": computations,
            "errored": [r.name for r in runs if r.trace is None]}


def _partition(members: list[tuple[int, Run]]) -> list[dict]:
    """Classes ``{"runs", "size"}`` of (case index, run) pairs; see `groups` for the order."""
    classes: list[tuple[Run, list[tuple[int, str]]]] = []     # (representative, [(index, name)])
    for i, r in sorted(members, key=lambda m: -len(m[1].trace.steps)):     # stable: ties keep case order
        home = next((c for c in classes if compare(c[0].trace, r.trace).bitwise_equal), None)
        if home is None:
            classes.append((r, [(i, r.name)]))
        else:
            home[1].append((i, r.name))
    ordered = sorted((sorted(m) for _, m in classes), key=lambda m: (-len(m), m[0][0]))
    return [{"runs": [n for _, n in m], "size": len(m)} for m in ordered]


def _join(classes: list[dict], members: list[tuple[int, Run]], baseline: str) -> list[dict]:
    """Groups ``{"runs", "size", "has_baseline", "classes"}``: the connected components of `classes` under the
    links "a member passed its comparison with its ``compare_to``, a member of this computation" (a run
    compared with a run of another key links nothing here: that run is not grouped with it).  Order as in
    `groups`."""
    index = {r.name: i for i, r in members}
    home = {n: c for c, k in enumerate(classes) for n in k["runs"]}
    parent = list(range(len(classes)))

    def root(c: int) -> int:
        while parent[c] != c:
            c = parent[c]
        return c

    for _, r in members:
        if r.passed and r.compare_to in home and r.compare_to != r.name:
            a, b = root(home[r.name]), root(home[r.compare_to])
            parent[max(a, b)] = min(a, b)
    parts: dict[int, list[int]] = {}
    for c in range(len(classes)):
        parts.setdefault(root(c), []).append(c)
    out = []
    for cs in parts.values():
        names = sorted((n for c in cs for n in classes[c]["runs"]), key=index.__getitem__)
        out.append({"runs": names, "size": len(names), "has_baseline": baseline in names, "classes": len(cs)})
    out.sort(key=lambda g: (-g["size"], index[g["runs"][0]]))
    return out


def _warning(joined: list[dict], refs: list[str], baseline: str, runs: list[Run]) -> Optional[str]:
    """One line naming each reference run whose group is strictly smaller than the largest, and the even split
    when a reference stands in one of several largest groups of two runs or more; None when neither."""
    largest = joined[0]["size"]
    tied = [g for g in joined if g["size"] == largest]
    home = {n: g for g in joined for n in g["runs"]}
    lines = []
    if len(tied) > 1 and largest >= 2 and any(home[ref] in tied for ref in refs):
        def named(g: dict) -> str:      # a group is named by its first reference run, else its first run
            ref = next((r for r in refs if r in g["runs"]), g["runs"][0])
            return f"the baseline {ref}" if ref == baseline else \
                f"the reference run {ref}" if ref in refs else ref
        first = next(home[ref] for ref in refs if home[ref] in tied)
        others = [g for g in tied if g is not first]
        lines.append(f"no majority: {largest} runs agree with {named(first)}, "
                     + ", ".join(f"{g['size']} with {named(g)}" for g in others)
                     + ": either side may be the wrong one")
    for ref in refs:
        size = home[ref]["size"]
        if size >= largest:
            continue
        n = sum(r.compare_to == ref for r in runs)
        who = f"the baseline {ref}" if ref == baseline else \
            f"the reference run {ref} ({n} run{'s are' if n != 1 else ' is'} compared with it)"
        lines.append(f"{who} agrees with {size - 1} other run{'s' if size != 2 else ''}; {largest} runs agree "
                     f"among themselves without it: {'the baseline' if ref == baseline else 'it'} may be the "
                     "odd one out")
    return "; ".join(lines) or None


def _labels(keys: list[str]) -> dict[str, str]:
    """{key: "clip_grad=0.05, reductions=canonical"}: the fields whose values differ between `keys`, each
    named by its last dotted component unless two differing fields share it; "" for a single key.  A key that
    is not a JSON object (a caller's own) is one field, ``computation``."""
    flat = [_fields(k) for k in keys]
    differing = sorted({p for f in flat for p in f if any(g.get(p) != f.get(p) for g in flat)})
    leaves = [p.rsplit(".", 1)[-1] for p in differing]
    short = {p: leaf if leaves.count(leaf) == 1 else p for p, leaf in zip(differing, leaves)}
    # a field the key does not set (a megatron option left out, an empty list) is the default: not named
    return {k: ", ".join(f"{short[p]}={_value(f.get(p))}" for p in differing if f.get(p) not in (None, [], {}))
            or ("the case's defaults" if differing else "") for k, f in zip(keys, flat)}


def _fields(key: str) -> dict:
    try:
        d = json.loads(key)
    except ValueError:
        d = None
    return _flatten(d) if isinstance(d, dict) else {"computation": key}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)
