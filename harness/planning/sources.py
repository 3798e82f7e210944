"""Two megatron sources in one case: the first check of Megatron-LM PR #2136 ("deterministic alignment between
main branch and this MR"), the same layouts on a base and a head Megatron, compared bit for bit.

``bitparity verify CASE --megatron-base BASE [--megatron-head HEAD]`` runs the case as its file says with the
head megatron (default: the one the interpreter imports), then every megatron-core run once more with the base
one, named ``<run>@base`` and compared with its head run: ``expect: bitwise``, so the first bit that moved is
named (step, tensor, microbatch) and localised like any other divergence.  The layouts within head are compared
as the case says, as before.  BASE and HEAD are directories holding ``megatron/`` (a Megatron-LM checkout, a git
worktree of one, a copy) or the word ``installed`` (the megatron-core distribution installed in this Python,
whatever is ahead of it on sys.path).

The harness imports the head megatron itself (it validates every run with megatron's own config checks before
anything runs); the base runs are validated by a process that imports the base (`trainers.validate_elsewhere`),
and each base rank puts the base first on its sys.path (``RunConfig.megatron_path``,
`megatron_trainer.source.activate`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from . import expectations, trainers
from .cases import CasePlan, PlannedRun

BASE_SUFFIX = "@base"


def resolve(flag: str, spelled: str) -> dict:
    """The megatron `spelled` on the command line after `flag`: {"spelled", "path", "version", "commit",
    "modified"} (`megatron_trainer.source.megatron_source`).

    Raises:
        UsageError: one line: empty, not a directory, no ``megatron/core/`` in it, or ``installed`` without an
            installed megatron-core."""
    if not spelled.strip():
        raise UsageError(f"{flag}: empty path")
    if spelled == "installed":
        path = trainers.installed_root()
        if path is None:
            raise UsageError(f"{flag} installed: megatron-core is not installed in this Python "
                             "(`pip install -e '.[megatron]'`)")
    else:
        p = Path(spelled)
        if not p.is_dir():
            raise UsageError(f"{flag} {spelled}: {'no such directory' if not p.exists() else 'not a directory'}")
        path = str(p.resolve())
    src = trainers.megatron_source(path)
    if src is None:
        raise UsageError(f"{flag} {spelled}: not a Megatron-LM checkout nor a megatron-core install "
                         "(no megatron/core/ in it)")
    return {"spelled": spelled, **src}


def use_head(head: dict) -> None:
    """Make `head` the megatron this (the harness's) process imports; call before anything imports megatron.

    Raises:
        UsageError: megatron is already imported from elsewhere."""
    try:
        trainers.activate(head["path"])
    except trainers.SourceError as e:
        raise UsageError(f"--megatron-head {head['spelled']}: {e}") from None


def with_sources(plan: CasePlan, head: Optional[dict], base: Optional[dict]) -> CasePlan:
    """`plan` with its megatron-core runs on `head` (None: the interpreter's megatron) and, when `base` is given,
    each of them again on `base` (``<run>@base``, compared with its head run bit for bit).  Every base run is
    validated by megatron's own checks in a process that imports the base.

    Raises:
        UsageError: a base is given but the case has no megatron-core run; a variant of the case is already
            named ``<run>@base``; the base cannot run a run (its version unchecked, megatron's validator
            rejects the layout, it cannot be imported)."""
    if head is None and base is None:
        return plan
    if head is None:        # the interpreter's own megatron (checked installed by load_case's trainers.problem)
        head = {"spelled": None, **(trainers.megatron_source() or {"path": None, "version": None, "commit": None})}
    # with a base, every reproduce command names head too: the interpreter's own megatron may come from a
    # PYTHONPATH the command would not carry
    flags = (["--megatron-base", base["spelled"]] if base else []) + (
        ["--megatron-head", head["spelled"] or head["path"]] if head["spelled"] or (base and head["path"]) else [])
    head_path = head["path"] if head["spelled"] else None
    megatron = [r for r in plan.runs if trainers.runs_megatron(r.config.trainer)]
    if not megatron:
        raise UsageError(f"{plan.path}: {flags[0]}: the case has no megatron-core run (trainer: megatron-core) "
                         "to run on another megatron")
    # each run's expectation for head's megatron version (its megatron_versions entry)
    runs = [expectations.resolve(dataclasses.replace(r, config=r.config.model_copy(update={"megatron_path": head_path})),
                                 head.get("version"))
            if trainers.runs_megatron(r.config.trainer) else r for r in plan.runs]
    sources = {"head": {k: v for k, v in head.items() if k != "spelled"}}
    if base is not None:
        taken = [n for n in [plan.spec.baseline.name] + [v.name for v in plan.spec.variants] if n.endswith(BASE_SUFFIX)]
        if taken:
            raise UsageError(f"{plan.path}: variant {taken[0]!r}: names ending in {BASE_SUFFIX!r} are the runs on "
                             "--megatron-base; rename it")
        twins = []
        for r in megatron:
            name = r.spec.name + BASE_SUFFIX
            spec = r.spec.model_copy(update={"name": name, "compare_to": r.spec.name, "expect": "bitwise",
                                             "first_divergence": None, "signature": None, "repeat": 1,
                                             "megatron_versions": [], "bug": None})
            twins.append(PlannedRun(spec=spec, config=r.config.model_copy(update={"megatron_path": base["path"]}),
                                    layout=r.layout, is_baseline=False, twin_of=r.spec.name))
        _check(twins, base)
        runs += twins
        sources["base"] = {k: v for k, v in base.items() if k != "spelled"}
        # the same directory twice compares megatron with itself: a run-to-run control, not "base vs head"
        sources["same"] = base["path"] == head["path"]
    return dataclasses.replace(plan, runs=runs, megatron_sources=sources, flags=flags)


def _check(twins: list[PlannedRun], base: dict) -> None:
    """Each base run can run: the harness's checks (version, options), then megatron's own validator."""
    where = f"--megatron-base {base['spelled']}"
    for t in twins:
        problem = trainers.problem(t.config)
        if problem:
            raise UsageError(f"{where}: run {t.twin_of!r}: {problem}")
    elsewhere = [t for t in twins if not trainers.imported_here(t.config)]
    if elsewhere:
        try:
            problems = trainers.validate_elsewhere([t.config for t in elsewhere])
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
        for t, problem in zip(elsewhere, problems):
            if problem:
                raise UsageError(f"{where}: run {t.twin_of!r}: {problem}")
