"""Command line: ``bitparity verify | compare | fuzz | layout explain | schedule explain`` (also ``python -m harness``).

Exit codes: 0 every expectation holds; 1 at least one does not (fail or error verdict);
2 bad input or a harness error — one line on stderr, no traceback, nothing written.  An OSError becomes a line
naming its path (``--out /x: permission denied``); non-printable characters in any error line are escaped.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path

import harness

from .errors import UsageError
from .judging.results import EXPECTS
from .planning import bounds, trainers
from .running import interrupt


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # argparse's own usage errors: one line, exit 2
        command = self.prog.removeprefix("bitparity").strip()     # main() prints "bitparity: error: " first
        raise UsageError(f"{command}: {message}" if command else message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bitparity", description="Bitwise-determinism verification for pipeline-parallel MoE+MTP training.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    v = sub.add_parser("verify", help="run a case's variants, compare bitwise with the baseline, write the report")
    v.add_argument("case", help="case YAML file, e.g. cases/dsv3.yaml")
    v.add_argument("--out", default="reports", help="report root (default: reports/); the report goes to OUT/<case>/")
    v.add_argument("--only", action="append", metavar="VARIANT", help="run only this variant (repeatable)")
    v.add_argument("--timeout", type=float, help="per-run watchdog in seconds (default: the case's timeout_s)")
    v.add_argument("--device", choices=("cpu", "cuda"), help="override the case's device")
    v.add_argument("--params-dtype", choices=("float32", "bfloat16"), help="override the case's params_dtype "
                   "(bfloat16: fp32 main_grad and fp32 optimizer master weights, Megatron's bf16 training)")
    v.add_argument("--num-gpus", type=int, help="cuda: spread ranks over this many GPUs (fewer than ranks: "
                                                   "ranks share GPUs, staged through host memory)")
    v.add_argument("--evidence", action="store_true",
                   help="collect ULP evidence (tensor dumps at the first diverging step) for every diverging "
                        "variant, not only for failing ones")
    v.add_argument("--launcher", choices=("fork", "torchrun"), default="fork",
                   help="fork: ranks forked from a torch-preloaded forkserver (default); torchrun: one "
                        "torchrun per run, rank/world from the environment, local rank r on cuda:r")
    v.add_argument("--jobs", type=int, metavar="N", help="run at most N runs at once (default: as many as this "
                   "machine's cores carry, packed by rank count; 1: one after another)")
    v.add_argument("--ranks-per-core", type=int, default=1, metavar="N",
                   help="ranks the packing counts on one CPU core (default 1).  A rank that waits on its pipeline "
                   "peers sleeps, so on a GPU, where a run's ranks are mostly waiting, 2 packs two 16-rank runs on "
                   "16 cores (bench/bench_packing.py measures it); on a CPU every busy rank wants its core")
    v.add_argument("--mps", action="store_true",
                   help="cuda: run the ranks through a private MPS daemon (nvidia-cuda-mps-control), so ranks sharing "
                   "a GPU run their kernels side by side instead of time-slicing it; at most 48 ranks at once")
    v.add_argument("--budget", metavar="DURATION", help="time for the command, e.g. 9m, 90s, counted from its "
                   "start: runs are given what is left less the ~6 s stopping one takes and none starts once that "
                   "is spent; runs left undone are errors ('not run' / 'stopped'), the finished ones are compared "
                   "and reported (an outside time limit then still leaves verdicts)")
    v.add_argument("--inject", metavar="FAULT", help=argparse.SUPPRESS)   # test-only planted faults
    g = v.add_mutually_exclusive_group()
    g.add_argument("--golden", metavar="DIR", help="also compare every run with its golden trace in DIR "
                   "(harness.judging.golden; e.g. goldens/smoke); any differing bit fails")
    g.add_argument("--write-golden", metavar="DIR", help="record the runs as goldens in DIR (only if every "
                   "variant passes); refresh after an intended change with `make golden`")
    v.add_argument("--megatron-base", metavar="DIR", help="also run every megatron-core run on this megatron (a "
                   "Megatron-LM checkout, or 'installed') as <run>@base, compared bit for bit with the run on head "
                   "(harness.planning.sources: Megatron-LM PR #2136's 'main branch vs this MR')")
    v.add_argument("--megatron-head", metavar="DIR", help="the megatron the case's megatron-core runs import (a "
                   "Megatron-LM checkout, or 'installed'; default: the one this Python imports)")
    v.add_argument("--train-iters", type=int, metavar="N", help="override the case's training.train_iters "
                   "(e.g. 8 for the long profile, make verify-long)")
    cp = sub.add_parser("compare", help="compare two trace directories made anywhere (rank{r}.jsonl: bitparity's "
                        "trainers, megatron's pretrain_gpt.py under python -m megatron_trainer.pretrain)")
    cp.add_argument("a", metavar="DIR_A", help="the reference run's traces")
    cp.add_argument("b", metavar="DIR_B", help="the run compared with it")
    cp.add_argument("--out", default="reports", help="report root (default: reports/); the report goes to "
                    "OUT/<name>/")
    cp.add_argument("--name", help="the report's name (default: compare-<A's dir name>-<B's>)")
    cp.add_argument("--expect", choices=EXPECTS, default="bitwise",
                    help="what B is expected to do against A (default: bitwise)")
    cp.add_argument("--first-divergence", action="append", metavar="K=V,...",
                    help="where B may / must first differ, as a case states it: e.g. 'step=0,kind=grad,"
                    "name=mtp.layers.0.eh_proj.weight' (keys: step, kind, name, microbatch, max_ulp; repeatable)")
    fz = sub.add_parser("fuzz", help="random valid layouts of a case's model against its baseline; shrinks a failure")
    fz.add_argument("case")
    fz.add_argument("--budget", default="10m", help="time budget, e.g. 90s, 10m (default 10m)")
    fz.add_argument("--seed", type=int, help="random seed (default: fresh)")
    fz.add_argument("--max-layouts", type=int, metavar="N", help="stop after N layouts (or the budget, whichever "
                    "comes first): a fixed amount of work whatever the machine's speed")
    fz.add_argument("--out", default="reports", help="where the minimal failing case and its report go")
    fz.add_argument("--max-pp", type=int, default=4, help="largest pipeline_model_parallel_size drawn")
    fz.add_argument("--max-vpp", type=int, default=2, help="largest virtual stages per rank drawn")
    fz.add_argument("--reductions", choices=("megatron", "canonical"), help="override the case's reduction mode")
    fz.add_argument("--jobs", type=int, metavar="N", help="run at most N layouts at once (default: one per CPU core "
                    "of this process; 1: one after another)")
    fz.add_argument("--inject", metavar="FAULT", help=argparse.SUPPRESS)
    lay = sub.add_parser("layout", help="layout tools").add_subparsers(dest="action", required=True,
                                                                          parser_class=_Parser)
    le = lay.add_parser("explain", help="parse, validate and print a pipeline layout (or a HybridModel "
                        "hybrid_layer_pattern: '+', '-' or '/' in it) as a rank x stage grid")
    le.add_argument("layout")
    le.add_argument("--pp", type=int, required=True, help="pipeline_model_parallel_size")
    le.add_argument("--num-layers", type=int, help="decoder layers (default: as many 't' as the layout has)")
    le.add_argument("--mtp-num-layers", type=int, help="MTP depth D (default: as many 'm' as the layout has)")
    sch = sub.add_parser("schedule", help="schedule tools").add_subparsers(dest="action", required=True,
                                                                            parser_class=_Parser)
    se = sch.add_parser("explain", help="print the per-rank compute order of a schedule")
    se.add_argument("--pp", type=int, required=True)
    se.add_argument("--vpp", type=int, default=1)
    se.add_argument("--microbatches", type=int, required=True)
    se.add_argument("--all", action="store_true", help="also show send/recv actions")
    se.add_argument("--overlap", action="store_true",
                    help="Megatron's 1F1B overlap (overlap_moe_expert_parallel_comm): merged F+B actions")
    return p


def _layout_explain(args) -> int:
    from trainerkit.hybrid_pattern import parse_hybrid_pattern, pipeline_layout
    from trainerkit.layout import LayoutError, PipelineLayout, parse_layout
    if any(c in args.layout for c in "+-/"):       # never in a GPT layout: HybridModel's pattern
        try:
            pattern = parse_hybrid_pattern(args.layout)
            layout = pipeline_layout(pattern, args.pp, len(pattern.moe_layers) if args.num_layers is None
                                     else args.num_layers,
                                     pattern.mtp_depths if args.mtp_num_layers is None else args.mtp_num_layers)
        except LayoutError as e:
            raise UsageError(str(e)) from None
        print(f"hybrid_layer_pattern {args.layout} = GPT layout {pattern.layout} (GPT layer i: Hybrid layers 2i, "
              f"2i+1)\n{pattern.pretty()}\n{layout.pretty()}")
        return 0
    try:
        stages = parse_layout(args.layout)
        flat = [s for stage in stages for s in stage]
        layout = PipelineLayout.from_string(args.layout, args.pp,
                                            args.num_layers if args.num_layers is not None else flat.count("t"),
                                            args.mtp_num_layers if args.mtp_num_layers is not None else flat.count("m"))
    except LayoutError as e:
        raise UsageError(str(e)) from None
    print(layout.pretty())
    print(f"canonical: {layout.canonical()}")
    return 0


def _schedule_explain(args) -> int:
    from trainerkit.layout import PipelineLayout
    from trainerkit.schedule import ScheduleError, build_schedule, grid, simulate, timeline
    if min(args.pp, args.vpp, args.microbatches) < 1:
        raise UsageError("--pp, --vpp and --microbatches must be >= 1")
    if args.pp > 1024 or args.vpp > 64 or args.microbatches > 4096 or args.pp * args.vpp * args.microbatches > 200_000:
        raise UsageError("schedule too large to print (limits: --pp 1024, --vpp 64, --microbatches 4096, "
                         "P*V*M 200000)")
    stages = args.pp * args.vpp
    text = "|".join(["Et"] + ["t"] * (stages - 2) + ["tL"]) if stages > 1 else "EtL"
    layout = PipelineLayout.from_string(text, args.pp, stages, 0)
    if args.pp == 1 and args.vpp > 1:
        raise UsageError("--vpp > 1 needs --pp > 1 (the no-pipelining schedule runs one chunk)")
    try:
        lists = build_schedule(layout, args.microbatches, 1, 1, 1, args.overlap)
        rounds = simulate(lists)
        _, bubble = timeline(lists)
    except ScheduleError as e:
        raise UsageError(str(e)) from None
    kind = "no pipelining" if args.pp == 1 else ("1F1B" if args.vpp == 1 else "interleaved 1F1B")
    kind += " with 1F1B overlap (F+B = merged, node by node)" if args.overlap else ""
    print(f"{kind}: P={args.pp} V={args.vpp} M={args.microbatches}  (F<stage>.<microbatch>; dry run: "
          f"{rounds} rounds, no deadlock; bubble fraction {bubble:.3f} with forward 1 / backward 2)")
    print(grid(lists, compute_only=not args.all))
    return 0


def _verify(args, argv, started=None) -> int:
    from trainerkit.config import MAX_TIMEOUT_S, MAX_TRAIN_ITERS

    from .judging import golden
    from .planning import sources
    from .planning.budget import Deadline
    from .planning.cases import load_case
    from .running.arithmetic import cpu_family
    from .verify import verify
    if args.train_iters is not None and not 1 <= args.train_iters <= MAX_TRAIN_ITERS:
        raise UsageError(f"--train-iters must be between 1 and {MAX_TRAIN_ITERS}")
    # flags checked before anything is loaded or made (--write-golden makes its directory)
    if args.timeout is not None and not (0 < args.timeout <= MAX_TIMEOUT_S):      # also rejects nan
        raise UsageError(f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0f}")
    _check_jobs(args.jobs)
    if not 1 <= args.ranks_per_core <= 64:
        raise UsageError(f"--ranks-per-core {args.ranks_per_core}: expected a number of ranks from 1 to 64")
    deadline = Deadline(args.budget, started)     # an outside limit counts from the command's start
    for flag, value in (("--golden", args.golden), ("--write-golden", args.write_golden)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag}: empty path")
    if args.megatron_base is not None and (args.golden is not None or args.write_golden is not None):
        raise UsageError("--megatron-base with --golden / --write-golden: goldens hold the runs of one megatron; "
                         "compare two sources without them")
    if args.megatron_base is not None and args.only:     # a run on base is selected with its head run
        args.only = [n[:-len(sources.BASE_SUFFIX)] if n.endswith(sources.BASE_SUFFIX) else n for n in args.only]
    head = sources.resolve("--megatron-head", args.megatron_head) if args.megatron_head is not None else None
    base = sources.resolve("--megatron-base", args.megatron_base) if args.megatron_base is not None else None
    if head is not None:
        sources.use_head(head)      # before load_case: its checks import megatron
    overrides = {"device": args.device, "num_gpus": args.num_gpus, "params_dtype": args.params_dtype}
    try:
        plan = load_case(args.case, only=args.only, inject=args.inject,
                         overrides={**overrides, "training": {"train_iters": args.train_iters}
                                    if args.train_iters is not None else None})
    except UsageError as e:
        # a step the case expects beyond a shortened run is the flag's conflict, not the case file's mistake
        if args.train_iters is None:
            raise
        load_case(args.case, only=args.only, inject=args.inject, overrides=overrides)
        raise UsageError(f"--train-iters {args.train_iters}: {e}") from None
    plan = sources.with_sources(plan, head, base)
    if (plan.megatron_sources or {}).get("same"):
        print(f"bitparity: warning: --megatron-base and head are the same directory "
              f"({plan.megatron_sources['head']['path']}): megatron is compared with itself", file=sys.stderr)
    goldens = None
    if args.golden is not None:
        key = golden.key_for(plan)
        runs = {r.spec.name: (r.config.training.train_iters, trainers.versions(r.config)) for r in plan.runs}
        goldens = golden.GoldenRequest(Path(args.golden), False, key,
                                       golden.load(Path(args.golden), plan.name, runs, key))
    elif args.write_golden is not None:
        key = golden.key_for(plan)
        golden.check_writable(Path(args.write_golden), plan.name, bool(args.only), key, cpu_family())
        goldens = golden.GoldenRequest(Path(args.write_golden), True, key)
    with _out_errors(args.out):
        result = verify(plan, Path(args.out), command="bitparity " + shlex.join(argv), timeout_s=args.timeout,
                        launcher=args.launcher, evidence_all=args.evidence, goldens=goldens, jobs=args.jobs,
                        deadline=deadline, ranks_per_core=args.ranks_per_core, mps=args.mps)
    n_pass = sum(v.verdict == "pass" for v in result.variants)
    cross = result.cross_implementation
    cross_words = f", cross-implementation {cross['verdict']}" if cross else ""
    if result.golden:
        cross_words += f", golden {result.golden['verdict']}"
    if result.not_run:
        cross_words += f", {len(result.not_run)} not run on this megatron (as the case states)"
    print(f"{plan.name}: {n_pass}/{len(result.variants)} pass{cross_words} in {result.elapsed_s:.1f} s; "
          f"report: {Path(args.out) / plan.name / 'index.html'}")
    return 0 if result.all_pass else 1


def _places(texts: list | None) -> list | None:
    """--first-divergence 'k=v,k=v' -> [ExpectedDivergence]; a bad one is a UsageError naming it."""
    if not texts:
        return None
    from pydantic import ValidationError

    from .planning.case_schema import ExpectedDivergence
    known = list(ExpectedDivergence.model_fields)
    out = []
    for text in texts:
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = (x.strip() for x in part.partition("="))
            if not eq:
                raise UsageError(f"--first-divergence {text!r}: {part!r} is not key=value")
            if key not in known:
                raise UsageError(f"--first-divergence {text!r}: unknown key {key!r} (keys: {', '.join(known)})")
            if key in fields:
                raise UsageError(f"--first-divergence {text!r}: {key} given twice")
            try:
                fields[key] = int(value) if key in ("step", "microbatch", "max_ulp") else value
            except ValueError:
                raise UsageError(f"--first-divergence {text!r}: {key} must be an integer, got {value!r}") from None
        try:
            out.append(ExpectedDivergence.model_validate(fields))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "value"
            raise UsageError(f"--first-divergence {text!r}: {where}: {err['msg']}") from None
    return out


def _compare(args, argv) -> int:
    import re

    from . import compare_dirs
    if args.expect == "may_diverge" and not args.first_divergence:
        raise UsageError("--expect may_diverge needs --first-divergence (where B may differ)")
    if args.expect == "bitwise" and args.first_divergence:
        raise UsageError("--first-divergence with --expect bitwise: say --expect may_diverge or diverge")
    places = _places(args.first_divergence)
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", args.name):
        raise UsageError(f"--name {args.name!r}: letters, digits, '.', '_' and '-' only, at most 100, starting "
                         "with a letter or digit")
    with _out_errors(args.out):
        result = compare_dirs.run(Path(args.a), Path(args.b), Path(args.out), "bitparity " + shlex.join(argv),
                                  expect=args.expect, first_divergence=places, name=args.name)
    v = result.variants[-1]
    print(f"{result.case}: {v.verdict} ({v.outcome}); report: {Path(args.out) / result.case / 'index.html'}")
    return 0 if result.all_pass else 1


def _check_jobs(jobs) -> None:
    if jobs is not None and not 1 <= jobs <= 1024:
        raise UsageError(f"--jobs {jobs}: expected a number of runs from 1 to 1024")


def _fuzz(args, argv) -> int:
    from .fuzz import check_out, fuzz, minimal_case_path, write_minimal_case
    from .planning.budget import parse_budget
    from .planning.cases import load_case
    from .verify import verify
    budget = parse_budget(args.budget)
    if args.seed is not None and not 0 <= args.seed < 2 ** 64:
        raise UsageError(f"--seed {args.seed}: use an integer in 0..2^64-1")
    if not 1 <= args.max_pp <= bounds.MAX_WORLD_SIZE:
        raise UsageError(f"--max-pp {args.max_pp}: use 1..{bounds.MAX_WORLD_SIZE} (rank processes on this machine)")
    if not 1 <= args.max_vpp <= 64:
        raise UsageError(f"--max-vpp {args.max_vpp}: use 1..64")
    if args.max_layouts is not None and not 1 <= args.max_layouts <= 100_000:
        raise UsageError(f"--max-layouts {args.max_layouts}: use 1..100000")
    _check_jobs(args.jobs)
    plan = load_case(args.case, overrides={"training": {"reductions": args.reductions}} if args.reductions else None)
    if args.inject is not None:                 # a fault of the case's trainer
        problem = trainers.problem(plan.runs[0].config.model_copy(update={"inject": args.inject}))
        if problem:
            raise UsageError(f"--inject {args.inject}: {problem}")
    if not args.out.strip():
        raise UsageError("--out: empty path")
    out = Path(args.out)
    made_out = not os.path.lexists(out)
    with _out_errors(args.out):
        check_out(plan, out)        # now, not after the search: what it writes on a failure must be writable
        res = fuzz(plan, out, budget, args.seed, args.inject, args.max_pp, args.max_vpp,
                   max_layouts=args.max_layouts, jobs=args.jobs)
    print(f"{plan.name}: tried {res.tried} layouts ({len(res.grids)} distinct stage grids) in {res.elapsed_s:.0f} s "
          f"= {res.per_minute:.1f} layouts/min; a layout's run took {res.compute_s / max(res.tried, 1):.2f} s "
          f"on average, {res.jobs} at a time")
    if res.failure is None and res.tried == 0:      # nothing was verified: not a pass
        raise UsageError(f"--budget {args.budget}: no layout ran within it ({res.elapsed_s:.0f} s went on the "
                         "baseline and on drawing layouts); give a longer budget")
    if res.failure is None:
        print("no layout differed from the baseline")
        return 0
    print(f"minimal failing layout: {res.failure['layout']} (P={res.failure['pp']}): {res.failure['why']}")
    case = minimal_case_path(plan, out)
    try:
        with _out_errors(args.out):
            write_minimal_case(plan, res.failure, out, args.inject)
            print(f"case: {case}", flush=True)
            verify(load_case(case), out, command="bitparity " + shlex.join(["verify", str(case)]))
    except BaseException:           # interrupted (or failed) before its report: nothing written, as promised
        case.unlink(missing_ok=True)
        if made_out:
            with contextlib.suppress(OSError):      # only if empty: a report may have landed meanwhile
                out.rmdir()
        raise
    print(f"report: {out / case.stem / 'index.html'}")
    return 1


@contextlib.contextmanager
def _out_errors(out: str):
    """Turn an OSError under --out into one line naming --out (not "internal error: PermissionError")."""
    try:
        yield
    except OSError as e:
        where = Path(e.filename) if isinstance(e.filename, (str, Path)) else None
        root = Path(out)
        if where is None or not (where == root or root in where.parents):
            raise                               # not about --out: main() names its path
        detail = "" if where == root else f" ({where})"
        raise UsageError(f"--out {out}: {bounds.os_reason(e)}{detail}") from None


def _one_line(text: str) -> str:
    """Escape non-printable characters (ANSI escapes, newlines from a file name) so the error is one line and
    cannot drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bitparity`` console script; returns the exit code.  `argv` None: this process's
    command line (a --budget then counts from the process's start, `harness.STARTED`; once the code is known a
    Ctrl-C no longer interrupts the interpreter's shutdown, `interrupt.done`); else from this call."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            interrupt.done()


def _main(argv: list[str] | None) -> int:
    started = harness.STARTED if argv is None else None
    argv = sys.argv[1:] if argv is None else argv

    # Ctrl-C, SIGTERM (CI cancel, `timeout`): unwind so ranks get reaped
    interrupt.install()
    try:
        args = _parser().parse_args(argv)
        if args.command == "compare":
            return _compare(args, argv)
        if args.command in ("verify", "fuzz"):
            code = _verify(args, argv, started) if args.command == "verify" else _fuzz(args, argv)
            interrupt.check()               # one Python swallowed on the way (harness.running.interrupt)
            return code
        if args.command in ("layout", "schedule"):
            # a reader that stops early (| head) ends a filter quietly, as it ends `ls`
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            return _layout_explain(args) if args.command == "layout" else _schedule_explain(args)
    except UsageError as e:
        print(_one_line(f"bitparity: error: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bitparity: interrupted", file=sys.stderr)
        return 2
    except OSError as e:                       # unreadable / unwritable file: name it
        name = e.filename if e.filename is not None else type(e).__name__
        print(_one_line(f"bitparity: error: {name}: {bounds.os_reason(e)}"), file=sys.stderr)
        return 2
    except Exception as e:                     # a harness bug: still one line and exit 2
        print(_one_line(f"bitparity: internal error: {type(e).__name__}: {e}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
