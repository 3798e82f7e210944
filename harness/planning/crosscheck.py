"""The cross-implementation check of a case (``cross_implementation:``), planned: it names a planned variant and a
step both trainers start alike, the other trainer can run that variant (or ``against`` names another run of the
same trainer), and where its variant is not made or crashes on this megatron the check says ``not_run`` there too.
`harness.planning.cases` calls it with the planned runs; `harness.judging.crossimpl` runs and measures it."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..judging.crossimpl import on_other_trainer
from . import expectations, trainers
from .case_schema import CaseSpec


def check_cross_implementation(path: Path, spec: CaseSpec, runs: list, names: list, not_run: list = ()) -> None:
    """The cross-implementation run names a planned variant, a step it runs, and the other trainer can run it;
    where its variant (or ``against``) is not made or is stated to crash on this megatron, the check's own
    ``megatron_versions`` entry says ``not_run`` too."""
    x = spec.cross_implementation
    if x is None:
        return
    where = f"{path}: cross_implementation"
    name = x.variant or spec.baseline.name
    if name not in names:
        raise UsageError(f"{where}: variant {name!r} is not a variant")
    cannot = {r.spec.name: r.not_run for r in not_run} | {r.spec.name: f"stated to crash: {r.spec.crash!r}"
                                                        for r in runs if getattr(r.spec, "crash", None)}
    blocked = next((n for n in (name, x.against) if n in cannot), None)
    entry, _ = _version_entry(x, list(runs) + list(not_run))
    if blocked is not None:
        if entry is None or entry.not_run is None:
            raise UsageError(f"{where}: variant {blocked!r} is not run or crashes on this megatron "
                             f"({cannot[blocked]}): give the check a megatron_versions entry with not_run there too")
        return
    if entry is not None and entry.not_run is not None:
        raise UsageError(f"{where}: its megatron_versions entry ({entry.versions}) says not_run, but its variant "
                         f"{name!r} runs here")
    run = next((r for r in runs if r.spec.name == name), None)
    if run is None:             # left out by --only: the cross-implementation run is skipped with it
        return
    if x.step >= run.config.training.train_iters:
        raise UsageError(f"{where}: step {x.step} >= train_iters {run.config.training.train_iters} of {name!r}")
    if x.step != 0:
        raise UsageError(f"{where}: step {x.step}: only step 0 starts both trainers from identical weights; after "
                         "one update they already differ (Adam turns a few ULP of gradient into up to a whole lr), so "
                         "a later step's gradients are taken at other weights and the ULP bound means nothing")
    if run.config.model.moe_router_init_method_std is not None:
        raise UsageError(f"{where}: model.moe_router_init_method_std makes router top-k ties, and the trainers break "
                         "them differently by design (reference: the lower expert index; megatron-core: torch.topk, "
                         "whose order among equal values is unspecified): compare a case without it")
    for i, e in enumerate([x] + list(x.megatron_versions)):
        at = where + ("" if i == 0 else f".megatron_versions[{i - 1}] ({e.versions})")
        for key, places in (("first_beyond_bound", [e.first_beyond_bound]),
                            ("more_bugs", [m.beyond_bound for m in e.more_bugs])):
            for j, place in enumerate(p for p in places if p is not None):
                if e.expect != "disagree":
                    raise UsageError(f"{at}: {key} is only meaningful with expect: disagree")
                expectations.check_place_name(f"{at}: {key}" + (f"[{j}].beyond_bound" if key == "more_bugs"
                                                                 else ""), place, spec.model)
    mine = run.config.model_copy(update={"params_dtype": x.params_dtype})
    if x.against is not None:
        _check_against(where, x.against, name, runs, names, mine)
        return
    other = on_other_trainer(mine)
    problem = trainers.problem(mine) or trainers.problem(other)
    if problem:
        raise UsageError(f"{where}: variant {name!r} cannot run on the other trainer: {problem}")


def stated_not_run(spec: CaseSpec, runs: list) -> str:
    """Why the case's cross-implementation check is not made on the megatron its runs import: its
    ``megatron_versions`` entry's ``not_run`` with the version (`check_cross_implementation` made sure the entry
    says so exactly where its variant is not run or crashes), or "" (made, or the case has no such check).

    runs: the planned runs, those not run on this megatron included (`harness.planning.cases.PlannedRun`)."""
    if spec.cross_implementation is None:
        return ""
    entry, version = _version_entry(spec.cross_implementation, runs)
    return f"{entry.not_run} (megatron-core {version}; the case says so)" if entry and entry.not_run else ""


def _version_entry(x, runs: list) -> tuple:
    """(the check's ``megatron_versions`` entry for the megatron-core the megatron runs import, or None; that
    version, or None where no run imports megatron)."""
    version = next((trainers.megatron_version(r.config.megatron_path) for r in runs
                    if trainers.runs_megatron(r.config.trainer)), None)
    return expectations.entry_for(x, version), version


def _check_against(where: str, against: str, name: str, runs: list, names: list, mine) -> None:
    """``against``: another planned variant, run by the same trainer (the same computation by another parallel
    implementation), in the check's dtype.

    Raises:
        UsageError: it names no variant, the chosen one itself, or one of another trainer (a variant left out
            by ``--only`` skips the check, as its own variant does)."""
    if against not in names:
        raise UsageError(f"{where}: against: {against!r} is not a variant")
    if against == name:
        raise UsageError(f"{where}: against: {against!r} is the variant itself")
    other = next((r for r in runs if r.spec.name == against), None)
    if other is None:           # left out by --only: the check is skipped with it, as with its own variant
        return
    if other.config.trainer != mine.trainer:
        raise UsageError(f"{where}: against: {against!r} runs on {other.config.trainer}, {name!r} on "
                         f"{mine.trainer}: without the other trainer, compare one trainer's two runs")
    problem = trainers.problem(mine) or trainers.problem(other.config.model_copy(
        update={"params_dtype": mine.params_dtype}))
    if problem:
        raise UsageError(f"{where}: {problem}")
