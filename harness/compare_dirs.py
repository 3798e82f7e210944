"""`bitparity compare DIR_A DIR_B`: two trace directories made anywhere (bitparity's trainers, Megatron-LM's own
``pretrain_gpt.py`` under `megatron_trainer.pretrain`, torchrun, Slurm, many nodes) compared like `verify`'s
runs: the same merge (`harness.judging.trace.merge`), comparison, first divergence, signature, replica and finiteness
checks, and the same report (HTML / JSON / JUnit / Markdown) with A as the reference run.

A directory holds ``rank0.jsonl`` .. ``rank{W-1}.jsonl`` (W: the world size rank 0's header states; gathered from
the nodes into one directory, see README "Capture inside your own training job"); a job stopped and resumed from
a checkpoint adds ``iter{N:07d}/`` segments, stitched by iteration (`segments`, `stitch`), and a trace that starts
after a resume lines up with the other by step number.  Two directories that cannot
be compared are refused before anything is written, one line naming the first reason (`UsageError`): a missing,
truncated or foreign rank trace, a rank file beyond the world size, another model (parameter names or shapes),
another number of steps, microbatches or MTP depths.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

from trainerkit.config import DEFAULT_TRAINER
from trainerkit.names import SEGMENT_DIR

from .errors import UsageError
from .judging import signature
from .judging.compare import compare, replica_status
from .judging.judge import Evidence, Expectation, Verdict, comparison_record, decide
from .judging.localise import boundary_mismatches, localise
from .judging.results import CaseResult, VariantResult
from .judging.trace import RANK_FORMAT, Trace, TraceError, first_nonfinite, merge, overlap_coverage
from .planning.case_schema import ExpectedDivergence
from .report import write_report
from .running import outdir
from .verify import series

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
    """(world size, rank 0's header) of trace directory `d`, every rank file present, a regular file, of that
    world and of the same command line."""
    if not d.exists():
        raise UsageError(f"{label} {d}: no such directory")
    if not d.is_dir():
        raise UsageError(f"{label} {d}: not a directory")
    files = {int(m.group(1)): p for p in d.iterdir() if (m := _RANK_FILE.match(p.name))}
    if not files:
        raise UsageError(f"{label} {d}: no rank traces (rank0.jsonl ...)")
    odd = next((p for _, p in sorted(files.items()) if not p.is_file()), None)
    if odd is not None:
        raise UsageError(f"{label} {odd}: not a regular file")
    if 0 not in files:
        raise UsageError(f"{label} {d}: rank0.jsonl is missing")
    first = _header(files[0])
    world = first.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise UsageError(f"{files[0]}: its header has no world size")
    ranks = sorted(files)
    extra = [r for r in ranks if r >= world or files[r].name != f"rank{r}.jsonl"]
    if extra:
        raise UsageError(f"{label} {files[extra[0]]}: beyond the world size {world} rank0.jsonl states "
                         "(a trace of another run in the same directory)")
    if len(ranks) < world:      # the first gap, without enumerating a world size the header may exaggerate
        gap = next((i for i, r in enumerate(ranks) if i != r), len(ranks))
        raise UsageError(f"{label} {d}: rank{gap}.jsonl is missing ({world - len(ranks)} of {world} ranks; "
                         "gather every rank's trace into one directory)")
    argv = (first.get("settings") or {}).get("argv") if isinstance(first.get("settings"), dict) else None
    for r in range(1, world):
        h = _header(files[r])
        if h.get("world_size") != world or h.get("rank") != r:
            raise UsageError(f"{files[r]}: header says rank {h.get('rank')} of {h.get('world_size')}, "
                             f"rank0.jsonl says world size {world} (traces of two runs mixed)")
        theirs = (h.get("settings") or {}).get("argv") if isinstance(h.get("settings"), dict) else None
        if argv is not None and theirs is not None and theirs != argv:
            raise UsageError(f"{files[r]}: another training command line than rank0.jsonl's (traces of two runs "
                             "mixed)")
    return world, first


def segments(d: Path) -> list[Path]:
    """The trace directories of one job in `d`, in iteration order: `d` itself when it holds rank traces (the job
    from scratch), then each ``iter{N:07d}`` subdirectory (the job resumed from a checkpoint of N iterations,
    `trainerkit.capture.segment_dir`); [d] when there is none of either (`_world` says why)."""
    subs = sorted((p for p in d.iterdir() if SEGMENT_DIR.match(p.name) and p.is_dir()), key=lambda p: p.name) \
        if d.is_dir() else []
    own = d.is_dir() and any(_RANK_FILE.match(p.name) for p in d.iterdir())
    return ([d] if own or not subs else []) + subs


def load(label: str, d: Path) -> tuple[Trace, dict]:
    """The merged trace of directory `d` and rank 0's header (of its first segment): a job stopped and resumed
    (`segments`) is stitched by iteration (`stitch`).

    Raises:
        UsageError: one line, naming the directory or file: see the module docstring."""
    merged = []
    for seg in segments(d):
        world, header = _world(label, seg)
        try:
            merged.append((merge(seg, world), header))
        except TraceError as e:
            raise UsageError(f"{label} {seg}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"{label} {seg}: malformed rank trace ({type(e).__name__}: {e})") from None
    return stitch([t for t, _ in merged]), merged[0][1]


def stitch(traces: list[Trace]) -> Trace:
    """One job's trace from its segments in iteration order (a job stopped and resumed, possibly under another
    layout): every segment's steps by step number, a later segment's replacing an earlier one's of the same
    number (the job went on from the checkpoint, not from the steps run after it); parameters by global key (a
    replica only one layout holds is kept); each segment's ``resumed`` records; the first segment's ``init`` and
    parallel sizes."""
    if len(traces) == 1:
        return traces[0]
    first = traces[0]
    params = dict(first.params)
    steps: dict = {}
    resumed: list = []
    for t in traces:
        for k, meta in t.params.items():
            params.setdefault(k, meta)
        steps.update({st.step: st for st in t.steps})
        resumed += t.resumed
    order = sorted(params, key=lambda k: (params[k]["order"], params[k]["replica"] or ""))
    return dataclasses.replace(first, params=params, order=order, steps=[steps[k] for k in sorted(steps)],
                               resumed=resumed)


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
    na, nb = [st.step for st in a.steps], [st.step for st in b.steps]
    # a capture of a resumed job alone (its first segment elsewhere) holds the steps after its checkpoint
    suffix = (b.resumed and nb == na[len(na) - len(nb):]) or (a.resumed and na == nb[len(nb) - len(na):])
    if na != nb and not suffix:
        return (f"other steps: A has {len(na)} steps ({_span(na)}), B {len(nb)} ({_span(nb)})")
    by_step = {st.step: st for st in a.steps}
    for sb in b.steps:
        sa = by_step.get(sb.step)
        if sa is None:
            continue
        if len(sa.losses) != len(sb.losses):
            return f"other batch: step {sa.step} has {len(sa.losses)} microbatches in A, {len(sb.losses)} in B"
        depths = {len(x["mtp"]) for x in sa.losses} | {len(x["mtp"]) for x in sb.losses}
        if len(depths) > 1:
            return f"other MTP depth: step {sa.step} has MTP losses of depths {sorted(depths)}"
    return None


def _span(steps: list) -> str:
    return "none" if not steps else f"steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"


def _layout(header: dict, trace: Trace) -> tuple[str, int, int, bool]:
    """(layout words, P, V, MTP standalone) from a trace: megatron's pipeline_model_parallel_layout when the
    header has it, a HybridModel job's hybrid_layer_pattern with its GPT layout (`trainerkit.hybrid_pattern`)
    (standalone: Megatron's sense, the MTP stage not on the last pp rank)."""
    settings = header.get("settings") if isinstance(header.get("settings"), dict) else {}
    pp = trace.pipeline_model_parallel_size
    vpp = max(1, len(header.get("stages") or [0]))
    text = settings.get("pipeline_model_parallel_layout")
    pattern = settings.get("hybrid_layer_pattern")
    standalone = False
    if pattern and not text:        # a HybridModel job: its pattern, and the GPT layout of it where it has one
        from trainerkit.hybrid_pattern import parse_hybrid_pattern
        try:
            text = parse_hybrid_pattern(pattern).layout
        except ValueError:          # a pattern of other blocks (Mamba, attention without MLP): the words only
            return f"hybrid {pattern}", pp, vpp, standalone
    if text:
        from trainerkit.layout import PipelineLayout, parse_layout
        try:
            count = sum(st.count("t") for st in parse_layout(text))
            layout = PipelineLayout.from_string(text, pp, count, settings.get("mtp_num_layers") or 0, True)
            standalone, vpp = layout.mtp_standalone, layout.virtual_pipeline_model_parallel_size
        except ValueError:      # LayoutError: megatron accepted it; a newer grammar only loses the word
            pass
    if pattern:
        text = f"hybrid {pattern} [{text}]"
    return text or f"P={pp} V={vpp}", pp, vpp, standalone


def _evidence(trace: Trace, header: dict, cmp, replicas: dict, nonfinite, where: Optional[dict]) -> Evidence:
    """What `harness.judging.judge.decide` judges of a captured run: its comparison, replicas, stage boundaries,
    finiteness and (megatron's MoE 1F1B overlap, when its header's settings ask for it) overlap coverage."""
    settings = header.get("settings") if isinstance(header.get("settings"), dict) else {}
    return Evidence(cmp=cmp, replicas=replicas, nonfinite=nonfinite, boundary=tuple(boundary_mismatches(trace)),
                    localisation=where, clipping=any(st.clip_coeff is not None for st in trace.steps),
                    coverage=overlap_coverage(trace, bool(settings.get("overlap_moe_expert_parallel_comm"))))


def _variant(name: str, role: str, trace: Trace, header: dict, verdict: Verdict, cmp, compare_to: str,
             run_dir: str, expect: str, extra: dict) -> VariantResult:
    text, pp, vpp, standalone = _layout(header, trace)
    return VariantResult(
        name=name, layout=text, pp=pp, vpp=vpp, mtp_standalone=standalone, expect=expect, verdict=verdict.verdict,
        outcome=verdict.outcome, reason=verdict.reason, bitwise_equal=cmp.bitwise_equal if cmp else True,
        first_divergence=cmp.first_divergence if cmp else None, series=series(trace, cmp),
        family_mismatches=cmp.family_mismatches if cmp else {}, run_dir=run_dir, compare_to=compare_to,
        trainer=header.get("trainer", DEFAULT_TRAINER), expert_model_parallel_size=trace.expert_model_parallel_size,
        data_parallel_size=trace.data_parallel_size, tensor_model_parallel_size=trace.tensor_model_parallel_size,
        inventory=list(cmp.inventory) if cmp else [],
        command=_command(header, role),
        mtp_num_layers=next((len(x["mtp"]) for st in trace.steps for x in st.losses), None), **extra)


def _command(header: dict, role: str) -> str:
    """The command that made a trace directory, as far as its header knows it (megatron's own loop: the
    torchrun line with the training script's arguments)."""
    settings = header.get("settings") if isinstance(header.get("settings"), dict) else {}
    argv = settings.get("argv")
    if not isinstance(argv, list) or not argv:
        return f"(run {role}: its trainer did not record its command)"
    import shlex
    return shlex.join(["torchrun", "--nproc_per_node", str(header.get("world_size", "?")), "-m",
                       "megatron_trainer.pretrain", "--bitparity-out", "DIR", *map(str, argv)])


def run(dir_a: Path, dir_b: Path, out_root: Path, command: str, expect: str = "bitwise",
        first_divergence: Optional[list[ExpectedDivergence]] = None, name: Optional[str] = None,
        progress=print, warn=lambda line: print(line, file=sys.stderr),
        want: Optional[Expectation] = None) -> CaseResult:
    """Compare trace directory `dir_b` with `dir_a` (the reference) and write the report to ``out_root/<name>``
    (default name: ``compare-<A's directory name>-<B's>``).  `expect` / `first_divergence`: what B is expected
    to do against A, as a case variant states it (`harness.planning.case_schema.VariantSpec`); `want`: a whole
    `harness.judging.judge.Expectation` instead (signature, replica_drift: a case's run judged outside `verify`).

    Raises:
        UsageError: the directories cannot be compared (one line, the first reason), or the report directory is
            not bitparity's (`harness.running.outdir`)."""
    start = time.monotonic()
    if Path(dir_a).exists() and Path(dir_b).exists() and Path(dir_a).resolve() == Path(dir_b).resolve():
        warn(f"bitparity: warning: A and B are the same directory ({dir_a}): it is compared with itself")
    a, ha = load("A", Path(dir_a))
    b, hb = load("B", Path(dir_b))
    why = comparable(a, b)
    if why:
        raise UsageError(f"cannot compare {dir_a} with {dir_b}: {why}")
    name_a, name_b = _names(Path(dir_a), Path(dir_b))
    case = name or re.sub(r"[^A-Za-z0-9._-]+", "_", f"compare-{name_a}-{name_b}")
    cmp = compare(a, b)
    replicas_b, replicas_a = replica_status(b), replica_status(a)
    nonfinite_a, nonfinite_b = first_nonfinite(a), first_nonfinite(b)
    fd = cmp.first_divergence
    where = localise(a, b, fd.step) if fd is not None and fd.kind != "inventory" else None
    want = dataclasses.replace(want or Expectation(expect, first_divergence), compare_to=name_a, is_baseline=False)
    expect = want.expect
    base = decide(Expectation(is_baseline=True), _evidence(a, ha, compare(a, a), replicas_a, nonfinite_a, None))
    decided = decide(want, _evidence(b, hb, cmp, replicas_b, nonfinite_b, where))
    verdict, reason = decided.verdict, decided.reason
    with outdir.workspace(out_root, case) as (work, final):
        for n, t in ((name_a, a), (name_b, b)):
            (work / "runs" / n).mkdir(parents=True)
            t.save(work / "runs" / n / "trace.json")
        variants = [
            _variant(name_a, "A", a, ha, base, None, name_a, f"runs/{name_a}", "bitwise",
                     {"replica_status": replicas_a, "nonfinite": str(nonfinite_a or "")}),
            _variant(name_b, "B", b, hb, decided, cmp, name_a, f"runs/{name_b}", expect,
                     {"replica_status": replicas_b, "nonfinite": str(nonfinite_b or ""), "localisation": where or {},
                      "outside_signature": signature.lines(list(decided.outside)),
                      "outside_signature_count": len(decided.outside)})]
        for v in variants:
            (work / v.run_dir / "comparison.json").write_text(json.dumps(
                comparison_record(v, a=str(dir_a), b=str(dir_b)), indent=1))
        env = {"a": str(Path(dir_a).resolve()), "b": str(Path(dir_b).resolve()),
               "a_settings": ha.get("settings"), "b_settings": hb.get("settings"), "device": ha.get("device")}
        result = CaseResult(case=case, case_path=f"{dir_a} vs {dir_b}", baseline=name_a, variants=variants,
                            elapsed_s=time.monotonic() - start, environment=env, command=command)
        write_report(result, work)
        outdir.publish(work, final)
    progress(f"{verdict.upper():5} {name_b} vs {name_a}: {reason}")
    return result


def _names(a: Path, b: Path) -> tuple[str, str]:
    """Run names for the report: the directories' names, told apart when equal."""
    na = re.sub(r"[^A-Za-z0-9._-]+", "_", a.resolve().name).strip("._") or "a"
    nb = re.sub(r"[^A-Za-z0-9._-]+", "_", b.resolve().name).strip("._") or "b"
    return (na, nb) if na != nb else (f"a-{na}", f"b-{nb}")
