"""What a variant's `expect` / `first_divergence` may say, checked against the case before anything runs.

An allowed place that can never match (a step past ``train_iters``, a parameter the model does not have, a
loss the run does not compute) would pass silently wherever the run happens to be bitwise equal, so a typo
would never be caught: every such place is a one-line `UsageError`.  The names are the trace's
(`harness.judging.compare`): losses ``lm``, ``mtp_1``..``mtp_D``, ``lm loss (reported)``, ``microbatch count``;
``grad norm``; global parameter names (`trainerkit.names`) for grad, param and inventory, buffer names (the
routers' ``expert_bias``, `trainerkit.names.is_buffer`) for buffer.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from trainerkit import names
from trainerkit.config import ModelConfig, TrainingConfig

from ..errors import UsageError

_SCALAR_ULP_KINDS = ("loss", "grad_norm")


def _loss_names(model: ModelConfig) -> set[str]:
    return {"lm", "lm loss (reported)", "microbatch count"} | {f"mtp_{k}" for k in range(1, model.mtp_num_layers + 1)}


def _parameter_problem(name: str, model: ModelConfig) -> str:
    """'' when `name` can be a global parameter / buffer name of this model (a replica key such as
    ``embedding.word_embeddings.weight@mtp`` included), else why not."""
    name = name.split("@", 1)[0]
    try:
        names.family(name)
        section, layer = names.section_and_layer(name)
    except ValueError:
        return "is not a parameter name of the model (e.g. decoder.layers.3.mlp.router.weight)"
    if name.startswith("decoder.layers.") and layer >= model.num_layers:
        return f"names decoder layer {layer}, but the model has {model.num_layers} (0..{model.num_layers - 1})"
    if name.startswith("mtp.layers.") and layer >= model.mtp_num_layers:
        return f"names MTP layer {layer}, but mtp_num_layers is {model.mtp_num_layers}"
    return ""


def check(where: str, expect: str, wants, is_baseline: bool, model: ModelConfig, training: TrainingConfig,
          signature=None, replica_drift=None) -> None:
    """Validate one variant's expectation (`wants`: its `first_divergence` list or None).

    Raises:
        UsageError: the baseline carries an expectation; first_divergence with ``bitwise``; ``may_diverge``
            without a place, or an empty list; max_ulp on a kind without one bit pattern per run; a step
            >= train_iters, a microbatch >= num_microbatches, a name that no run of this model can produce;
            the same for the places of a `signature` (`harness.judging.signature`), which needs may_diverge or diverge;
            a `replica_drift` name without a replica tag (``@mtp``) or not of the model, a step >= train_iters.
    """
    if is_baseline and (expect != "bitwise" or wants or replica_drift):
        raise UsageError(f"{where}: the baseline cannot carry an expectation")
    if wants is not None and expect == "bitwise":
        raise UsageError(f"{where}: first_divergence is only meaningful with expect: may_diverge or diverge")
    if expect == "may_diverge" and wants is None:
        raise UsageError(f"{where}: expect: may_diverge needs first_divergence (where the run may differ: "
                         "at least its kind)")
    if wants is not None and not wants:
        raise UsageError(f"{where}: first_divergence is an empty list: name at least one place")
    if expect == "not_finite":
        if signature is not None:
            raise UsageError(f"{where}: signature is not meaningful with expect: not_finite (its comparison is not "
                             "judged)")
        odd = next((w for w in wants or [] if w.kind not in _SCALAR_ULP_KINDS or w.max_ulp is not None), None)
        if odd is not None:
            raise UsageError(f"{where}: expect: not_finite places the first NaN / inf at a loss or the grad norm "
                             f"(kind loss or grad_norm, no max_ulp), not {odd.kind}")
    if signature is not None:
        _check_signature(where, expect, signature, model, training, wants)
    if replica_drift is not None and not replica_drift:
        raise UsageError(f"{where}: replica_drift is an empty list: name the replica that drifts")
    for i, drift in enumerate(replica_drift or []):
        at = f"{where}: replica_drift" + (f"[{i}]" if len(replica_drift) > 1 else "")
        if "@" not in drift.name:
            raise UsageError(f"{at}.name {drift.name!r}: a replica is named with its tag, e.g. "
                             "embedding.word_embeddings.weight@mtp")
        problem = _parameter_problem(drift.name, model)
        if problem:
            raise UsageError(f"{at}.name {drift.name!r} {problem}")
        if drift.step is not None and drift.step >= training.train_iters:
            raise UsageError(f"{at}.step {drift.step}: the run has steps 0..{training.train_iters - 1}")
    for i, want in enumerate(wants or []):
        at = f"{where}: first_divergence" + (f"[{i}]" if len(wants) > 1 else "")
        if want.max_ulp is not None and want.kind not in _SCALAR_ULP_KINDS:
            raise UsageError(f"{at}.max_ulp applies to kind loss or grad_norm, not {want.kind}")
        _check_place(at, want, ("step",), model, training)
        if want.microbatch is not None and want.microbatch >= training.num_microbatches:
            raise UsageError(f"{at}.microbatch {want.microbatch}: the run has microbatches "
                             f"0..{training.num_microbatches - 1}")


def _check_place(at: str, place, step_fields: tuple, model: ModelConfig, training: TrainingConfig) -> None:
    """A place (a `first_divergence` entry or a `signature` place) names steps the run has and a name its kind
    can have; a place without a kind (signature only) may name a loss or a parameter."""
    for field in step_fields:
        step = getattr(place, field)
        if step is not None and step >= training.train_iters:
            raise UsageError(f"{at}.{field} {step}: the run has steps 0..{training.train_iters - 1}")
    name, kind = place.name, place.kind
    if name is None:
        return
    if kind is None:
        kind = "loss" if name in _loss_names(model) else "buffer" if names.is_buffer(name) else "grad"
    if kind == "loss" and name not in _loss_names(model):
        raise UsageError(f"{at}.name {name!r}: a loss is one of {', '.join(sorted(_loss_names(model)))}")
    if kind == "grad_norm" and name != "grad norm":
        raise UsageError(f"{at}.name {name!r}: the grad norm is named 'grad norm' (or leave name out)")
    # a buffer differs as kind buffer only (harness.judging.compare): under another kind its name could never match
    if kind in ("grad", "optimizer_state", "param", "inventory") and names.is_buffer(name):
        raise UsageError(f"{at}.name {name!r} is a buffer (the router's expert bias: no gradient, not a "
                         f"parameter), not kind {kind}: write kind: buffer")
    if kind == "buffer" and not names.is_buffer(name):
        raise UsageError(f"{at}.name {name!r}: kind buffer names a router's expert bias "
                         "(e.g. decoder.layers.3.mlp.router.expert_bias)")
    if kind in ("grad", "optimizer_state", "param", "inventory", "buffer"):
        problem = _parameter_problem(name, model)
        if problem:
            raise UsageError(f"{at}.name {name!r} {problem}")


def _covers(place, want) -> bool:
    """Whether signature `place` can include the allowed first divergence `want` (at some step: a place
    ``{step: 0}`` meets ``{kind: grad}`` at any step)."""
    def same(a, b):
        return a is None or b is None or a == b
    step_ok = (place.step is None or want.step is None or want.step == place.step) and \
        (place.from_step is None or want.step is None or want.step >= place.from_step)
    return step_ok and same(place.kind, want.kind) and same(place.name, want.name) and \
        (place.family is None or want.name is None or names.family(want.name.split("@")[0]) == place.family)


def _check_signature(where: str, expect: str, places, model: ModelConfig, training: TrainingConfig,
                     wants=None) -> None:
    if expect == "bitwise":
        raise UsageError(f"{where}: signature is only meaningful with expect: may_diverge or diverge")
    if not places:
        raise UsageError(f"{where}: signature is an empty list: name at least one place that may differ")
    for i, p in enumerate(places):
        _check_place(f"{where}: signature[{i}]", p, ("step", "from_step"), model, training)
    for i, want in enumerate(wants or []):
        if want.kind != "inventory" and not any(_covers(p, want) for p in places):
            raise UsageError(f"{where}: signature does not include first_divergence"
                             f"{f'[{i}]' if len(wants) > 1 else ''} ({want.kind} {want.name or '(any)'}, "
                             f"{'any step' if want.step is None else f'step {want.step}'}): the run could never pass")


def check_specifiers(versions: str) -> str:
    """`versions` when it is a PEP 440 specifier set (``"<0.17"``, ``">=0.17,<0.20"``); a pydantic validator.

    Raises:
        ValueError: one line naming the text."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    try:
        parsed = SpecifierSet(versions)
    except InvalidSpecifier:
        parsed = None
    if not parsed:          # "" / " " / "," parse to the empty set, which matches every version
        raise ValueError(f"{versions!r} is not a PEP 440 version specifier (e.g. '<0.17' or '>=0.17,<0.20')")
    return versions


def check_place_name(where: str, name: str, model: ModelConfig) -> None:
    """A cross-implementation place: ``loss`` or a parameter of `model` (its gradient).

    Raises:
        UsageError: one line naming `where` and the name."""
    problem = "" if name == "loss" else _parameter_problem(name, model)
    if problem:
        raise UsageError(f"{where} {name!r}: name 'loss' or a parameter; it {problem}")


def entry_for(declared, version: Optional[str]):
    """The `megatron_versions` entry of variant spec `declared` that holds on megatron-core `version` (the first
    whose specifiers contain it), or None (no entry matches, no entries, or no megatron: `version` None)."""
    if version is None or not declared.megatron_versions:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return next((e for e in declared.megatron_versions if SpecifierSet(e.versions).contains(v, prereleases=True)), None)


def resolve(run, version: Optional[str]):
    """Planned run `run` with the expectation that holds on megatron-core `version` (`entry_for`) in its spec;
    the spec as written stays in ``run.declared``.  Resolving again (another megatron) starts from it."""
    declared = run.declared or run.spec
    entry = entry_for(declared, version)
    spec = declared if entry is None else declared.model_copy(update={
        "expect": entry.expect or "bitwise", "crash": entry.crash,
        "first_divergence": entry.first_divergence, "signature": entry.signature,
        "replica_drift": entry.replica_drift, "bug": entry.bug if entry.bug is not None else declared.bug})
    return dataclasses.replace(run, spec=spec, declared=declared)


def bugs_elsewhere(declared, applied) -> list[str]:
    """The bugs `declared`'s other `megatron_versions` entries state (not `applied`, not the run's own), as
    ``"<bug> (megatron-core <versions>)"``: what the report lists as passing on this run's megatron."""
    own = applied.bug if applied is not None and applied.bug else declared.bug
    # a cross-implementation entry may state more bugs than one (`harness.judging.crossimpl.StatedBug`)
    return [f"{bug} (megatron-core {e.versions})" for e in declared.megatron_versions if e is not applied
            for bug in [e.bug, *(m.bug for m in getattr(e, "more_bugs", ()))] if bug and bug != own]


def not_run(run, version: Optional[str]):
    """Planned run `run` marked not made (``not_run``: the reason, the version and "as the case states") when its
    `megatron_versions` entry for megatron-core `version` says ``not_run``; else None."""
    entry = entry_for(run.spec, version)
    if entry is None or entry.not_run is None:
        return None
    return dataclasses.replace(run, declared=run.spec,
                               not_run=f"{entry.not_run} (megatron-core {version}; the case says so)")


def split_not_run(path, runs: list) -> tuple[list, list]:
    """(runs to make, runs not made on this megatron) of a planned case; what is compared with, or resumes from,
    a run not made is not made either, and what needs a run stated to crash (``crash``) crashes with it: the case
    must say so for it too.

    Raises:
        UsageError: a run that would be made is compared with, or resumes from, one that is not, or one stated to
            crash without stating it; the baseline stated to crash."""
    skipped = {r.spec.name: r.not_run for r in runs if r.not_run}
    crashing = {r.spec.name: r.spec.crash for r in runs if not r.not_run and getattr(r.spec, "crash", None)}
    base = runs[0].spec.name
    if base in crashing:
        raise UsageError(f"{path}: baseline {base!r}: crash: the baseline is every run's reference; state the crash "
                         "on a variant")
    for r in runs:
        for n in (r.spec.compare_to or (None if r.is_baseline else base),
                  r.spec.resume.variant if r.spec.resume else None):
            if n in skipped and not r.not_run:
                raise UsageError(f"{path}: variant {r.spec.name!r} needs {n!r}, which is not made on this megatron "
                                 f"({skipped[n]}): give {r.spec.name!r} the same megatron_versions entry (not_run)")
            if n in crashing and not (r.not_run or getattr(r.spec, "crash", None)):
                raise UsageError(f"{path}: variant {r.spec.name!r} needs {n!r}, which the case states crashes on this "
                                 f"megatron ({crashing[n]!r}): state that crash for {r.spec.name!r} too")
    return [r for r in runs if not r.not_run], [r for r in runs if r.not_run]
