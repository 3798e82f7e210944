"""`bitparity compare DIR_A DIR_B`: two trace directories made anywhere (bitparity's trainers, Megatron-LM's own
``pretrain_gpt.py`` under `megatron_trainer.pretrain`, torchrun, Slurm, many nodes) compared like `verify`'s
runs: the same merge (`harness.trace.merge`), comparison, first divergence, signature, replica and finiteness
checks, and the same report (HTML / JSON / JUnit / Markdown) with A as the reference run.

A directory holds ``rank0.jsonl`` .. ``rank{W-1}.jsonl`` (W: the world size rank 0's header states; gathered from
the nodes into one directory, see README "Capture inside your own training job").  Two directories that cannot
be compared are refused before anything is written, one line naming the first reason (`UsageError`): a missing,
truncated or foreign rank trace, a rank file beyond the world size, another model (parameter names or shapes),
another number of steps, microbatches or MTP depths.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from . import outdir, signature
from .case_schema import ExpectedDivergence
from .compare import compare, replica_status
from .errors import UsageError
from .localise import localise
from .report import write_report
from .results import CaseResult, VariantResult
from .trace import RANK_FORMAT, Trace, TraceError, first_nonfinite, merge
from .verify import judge, judge_nonfinite, series

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def _header(path: Path) -> dict:
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        header = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: not a bitparity rank trace ({type(e).__name__})") from None
    if not isinstance(header, dict) or header.get("type") != "header" or header.get("format") != RANK_FORMAT:
        raise UsageError(f"{path}: not a {RANK_FORMAT} trace (first line is not its header)")
    return header


def _world(label: str, d: Path) -> tuple[int, dict]:
    """(world size, rank 0's header) of trace directory `d`, every rank file present and of that world."""
    if not d.is_dir():
        raise UsageError(f"{label} {d}: not a directory")
    ranks = sorted(int(m.group(1)) for p in d.iterdir() if (m := _RANK_FILE.match(p.name)))
    if not ranks:
        raise UsageError(f"{label} {d}: no rank traces (rank0.jsonl ...)")
    if 0 not in ranks:
        raise UsageError(f"{label} {d}: rank0.jsonl is missing")
    first = _header(d / "rank0.jsonl")
    world = first.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise UsageError(f"{d / 'rank0.jsonl'}: its header has no world size")
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise UsageError(f"{label} {d}: rank{missing[0]}.jsonl is missing ({len(missing)} of {world} ranks; "
                         "gather every rank's trace into one directory)")
    extra = [r for r in ranks if r >= world]
    if extra:
        raise UsageError(f"{label} {d}: rank{extra[0]}.jsonl is beyond the world size {world} rank0.jsonl states "
                         "(a trace of another run in the same directory)")
    for r in range(1, world):
        h = _header(d / f"rank{r}.jsonl")
        if h.get("world_size") != world or h.get("rank") != r:
            raise UsageError(f"{d / f'rank{r}.jsonl'}: header says rank {h.get('rank')} of {h.get('world_size')}, "
                             f"rank0.jsonl says world size {world} (traces of two runs mixed)")
    return world, first


def load(label: str, d: Path) -> tuple[Trace, dict]:
    """The merged trace of directory `d` and rank 0's header.

    Raises:
        UsageError: one line, naming the directory or file: see the module docstring."""
    world, header = _world(label, d)
    try:
        return merge(d, world), header
    except TraceError as e:
        raise UsageError(f"{label} {d}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{label} {d}: malformed rank trace ({type(e).__name__}: {e})") from None


def comparable(a: Trace, b: Trace) -> Optional[str]:
    """Why traces `a` and `b` cannot be compared (the first reason, one line), or None."""
    def model(t: Trace) -> dict:
        return {m["name"]: tuple(m["shape"]) for m in t.params.values()}
    ma, mb = model(a), model(b)
    only = sorted(set(ma) ^ set(mb), key=lambda n: (n not in ma, n))
    if only:
        where = "A" if only[0] in ma else "B"
        return f"other model: {only[0]} is only in {where} ({len(only)} parameter names differ)"
    shape = next((n for n in ma if ma[n] != mb[n]), None)
    if shape:
        return f"other model: {shape} has shape {list(ma[shape])} in A, {list(mb[shape])} in B"
    if len(a.steps) != len(b.steps):
        return f"other step count: A has {len(a.steps)} steps, B {len(b.steps)}"
    for sa, sb in zip(a.steps, b.steps):
        if len(sa.losses) != len(sb.losses):
            return f"other batch: step {sa.step} has {len(sa.losses)} microbatches in A, {len(sb.losses)} in B"
        depths = {len(x["mtp"]) for x in sa.losses} | {len(x["mtp"]) for x in sb.losses}
        if len(depths) > 1:
            return f"other MTP depth: step {sa.step} has MTP losses of depths {sorted(depths)}"
    return None


def _layout(header: dict, trace: Trace) -> tuple[str, int, int]:
    """(layout words, P, V) from a trace: megatron's pipeline_model_parallel_layout when the header has it."""
    settings = header.get("settings") or {}
    pp = trace.world_size // max(trace.data_parallel_size, trace.expert_model_parallel_size, 1)
    vpp = max(1, len(header.get("stages") or [0]))
    text = settings.get("pipeline_model_parallel_layout") or f"P={pp} V={vpp}"
    return text, pp, vpp


def _variant(name: str, role: str, trace: Trace, header: dict, verdict: tuple, cmp, compare_to: str,
             run_dir: str, expect: str, extra: dict) -> VariantResult:
    text, pp, vpp = _layout(header, trace)
    return VariantResult(
        name=name, layout=text, pp=pp, vpp=vpp, mtp_standalone=False, expect=expect, verdict=verdict[0],
        outcome=verdict[1], reason=verdict[2], bitwise_equal=cmp.bitwise_equal if cmp else True,
        first_divergence=cmp.first_divergence if cmp else None, series=series(trace, cmp),
        family_mismatches=cmp.family_mismatches if cmp else {}, run_dir=run_dir, compare_to=compare_to,
        trainer=header.get("trainer", "reference"), expert_model_parallel_size=trace.expert_model_parallel_size,
        data_parallel_size=trace.data_parallel_size, inventory=list(cmp.inventory) if cmp else [],
        command=" ".join((header.get("settings") or {}).get("argv") or []) or role, **extra)


def run(dir_a: Path, dir_b: Path, out_root: Path, command: str, expect: str = "bitwise",
        first_divergence: Optional[list[ExpectedDivergence]] = None, name: Optional[str] = None,
        progress=print) -> CaseResult:
    """Compare trace directory `dir_b` with `dir_a` (the reference) and write the report to ``out_root/<name>``
    (default name: ``compare-<A's directory name>-<B's>``).  `expect` / `first_divergence`: what B is expected
    to do against A, as a case variant states it (`harness.case_schema.VariantSpec`).

    Raises:
        UsageError: the directories cannot be compared (one line, the first reason), or the report directory is
            not bitparity's (`harness.outdir`)."""
    start = time.monotonic()
    a, ha = load("A", Path(dir_a))
    b, hb = load("B", Path(dir_b))
    why = comparable(a, b)
    if why:
        raise UsageError(f"cannot compare {dir_a} with {dir_b}: {why}")
    name_a, name_b = _names(Path(dir_a), Path(dir_b))
    case = name or re.sub(r"[^A-Za-z0-9._-]+", "_", f"compare-{name_a}-{name_b}")
    spec = SimpleNamespace(expect=expect, compare_to=name_a, first_divergence=first_divergence, signature=None)
    cmp = compare(a, b)
    replicas_b, replicas_a = replica_status(b), replica_status(a)
    base = judge(SimpleNamespace(is_baseline=True, spec=spec), None, None, replicas_a)
    verdict, happened, reason, out = signature.judge(
        judge(SimpleNamespace(is_baseline=False, spec=spec), cmp, None, replicas_b), spec, cmp,
        any(st.clip_coeff is not None for st in b.steps))
    nonfinite = first_nonfinite(b)
    verdict, happened, reason = judge_nonfinite(spec, nonfinite, verdict, happened, reason)
    fd = cmp.first_divergence
    where = localise(a, b, fd.step) if fd is not None and fd.kind != "inventory" else None
    if where:
        reason += f"; localised: {where['message']}"
    progress(f"{verdict.upper():5} {name_b} vs {name_a}: {reason}")
    with outdir.workspace(out_root, case) as (work, final):
        for n, t in ((name_a, a), (name_b, b)):
            (work / "runs" / n).mkdir(parents=True)
            t.save(work / "runs" / n / "trace.json")
        variants = [
            _variant(name_a, "A", a, ha, base, None, name_a, f"runs/{name_a}", "bitwise",
                     {"replica_status": replicas_a, "nonfinite": str(first_nonfinite(a) or "")}),
            _variant(name_b, "B", b, hb, (verdict, happened, reason), cmp, name_a, f"runs/{name_b}", expect,
                     {"replica_status": replicas_b, "nonfinite": str(nonfinite or ""), "localisation": where or {},
                      "outside_signature": signature.lines(out), "outside_signature_count": len(out)})]
        (work / "runs" / name_b / "comparison.json").write_text(json.dumps(
            {"format": "bitparity-comparison/1", "a": str(dir_a), "b": str(dir_b), "verdict": verdict,
             "outcome": happened, "reason": reason, "bitwise_equal": cmp.bitwise_equal,
             "first_divergence": asdict(fd) if fd else None, "inventory": cmp.inventory,
             "replica_status": replicas_b}, indent=1))
        env = {"a": str(Path(dir_a).resolve()), "b": str(Path(dir_b).resolve()),
               "a_settings": ha.get("settings"), "b_settings": hb.get("settings"), "device": ha.get("device")}
        result = CaseResult(case=case, case_path=f"{dir_a} vs {dir_b}", baseline=name_a, variants=variants,
                            elapsed_s=time.monotonic() - start, environment=env, command=command)
        write_report(result, work)
        outdir.publish(work, final)
    return result


def _names(a: Path, b: Path) -> tuple[str, str]:
    """Run names for the report: the directories' names, told apart when equal."""
    na = re.sub(r"[^A-Za-z0-9._-]+", "_", a.resolve().name).strip("._") or "a"
    nb = re.sub(r"[^A-Za-z0-9._-]+", "_", b.resolve().name).strip("._") or "b"
    return (na, nb) if na != nb else (f"a-{na}", f"b-{nb}")
