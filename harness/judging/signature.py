"""Divergence signatures: *everything* an expected divergence may change, not only where it starts.

A ``may_diverge`` / ``diverge`` variant names where its first divergence may be (`first_divergence`); checking
only that first place lets a second bug through behind an expected one (a P=1-only wrong MTP loss scale
behind P=1's expected embedding-gradient rounding).  A signature is a list of places that may differ; any
difference outside it fails the variant and is listed in the report (`VariantResult.outside_signature`).

Case syntax (a variant key, only with ``may_diverge`` / ``diverge``)::

    signature:                       # replaces the default below
      - {step: 0, kind: grad, name: embedding.word_embeddings.weight}
      - {step: 0, kind: param, family: embedding/head}
      - {from_step: 1}               # anything from step 1 on

Fields left out match anything; ``name`` matches a trace key without its replica tag (``@mtp``, ``@ep1``);
``family`` is `trainerkit.names.family`.

The default signature is derived from `first_divergence` (the reason the case gives) and the step `s` where
the run first differs: at `s`, each allowed place and what it changes within the same step; after `s`,
anything (the update carries any difference into every later number).  Within one step (dataflow order,
`harness.judging.compare`): a differing loss changes the whole backward (everything at `s`); a differing gradient
``X`` changes the grad norm, ``X``'s Adam moments and update and, when the runs clip, every moment and update
(the clip coefficient); a differing gradient of unnamed tensors changes the norm and every update; the grad norm
changes every update (when clipping); a moment (kind ``optimizer_state``) changes its parameter's update; a
parameter or a buffer (the routers' expert bias) changes only itself; an inventory difference changes
everything.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from trainerkit import names

from .compare import Comparison, Difference
from .results import DivergenceKind

#: At most this many lines of differences outside the signature are kept (then "… and N more").
MAX_LINES = 20


class SignaturePlace(BaseModel):
    """One place that may differ; a field left out (None) matches anything."""

    model_config = ConfigDict(extra="forbid")
    step: Optional[StrictInt] = Field(None, ge=0)
    from_step: Optional[StrictInt] = Field(None, ge=0)       # this step and every later one
    kind: Optional[DivergenceKind] = None
    name: Optional[str] = Field(None, max_length=300)
    family: Optional[Literal[names.FAMILIES]] = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.step is not None and self.from_step is not None:
            raise ValueError("step and from_step together: give one (step: exactly that step; from_step: it and later)")
        if self.kind == "grad_norm" and self.name not in (None, "grad norm"):
            raise ValueError("kind grad_norm has no parameter name (the grad norm is 'grad norm')")
        if self.kind in ("loss", "grad_norm") and self.family is not None:
            raise ValueError(f"kind {self.kind} has no parameter family")
        if self.name is not None and self.family is not None and _family(self.name) != self.family:
            raise ValueError(f"name {self.name!r} is of family {_family(self.name)!r}, not {self.family!r}")
        return self


def _family(key: str) -> Optional[str]:
    try:
        return names.family(key.split("@", 1)[0])
    except ValueError:           # a loss, the grad norm, a pseudo-name such as "steps"
        return None


def matches(place: SignaturePlace, d: Difference) -> bool:
    """Whether difference `d` lies inside `place`."""
    return ((place.step is None or d.step == place.step)
            and (place.from_step is None or d.step >= place.from_step)
            and (place.kind is None or d.kind == place.kind)
            and (place.name is None or d.name.split("@", 1)[0] == place.name)
            and (place.family is None or _family(d.name) == place.family))


def default_signature(wants: list, step: int, clipping: bool) -> list[SignaturePlace]:
    """The signature implied by the allowed first divergences `wants` (`harness.planning.cases.ExpectedDivergence`)
    when the run first differs at `step`, and whether the runs clip (module docstring)."""
    places = [SignaturePlace(from_step=step + 1)]
    for w in wants:
        at = w.step if w.step is not None else step
        if w.kind in ("inventory", "loss"):
            return [SignaturePlace(from_step=min(at, step))]
        if w.kind == "grad":
            name = None if clipping or w.name is None else w.name
            places += [SignaturePlace(step=at, kind="grad", name=w.name), SignaturePlace(step=at, kind="grad_norm"),
                       SignaturePlace(step=at, kind="optimizer_state", name=name),
                       SignaturePlace(step=at, kind="param", name=name)]
        elif w.kind == "grad_norm":
            places += [SignaturePlace(step=at, kind="grad_norm")] + \
                ([SignaturePlace(step=at, kind="optimizer_state"), SignaturePlace(step=at, kind="param")]
                 if clipping else [])
        elif w.kind == "optimizer_state":           # the moments step the parameter
            places += [SignaturePlace(step=at, kind="optimizer_state", name=w.name),
                       SignaturePlace(step=at, kind="param", name=w.name)]
        else:                                       # param or buffer
            places.append(SignaturePlace(step=at, kind=w.kind, name=w.name))
    return places


def describe(d: Difference) -> str:
    """'step 0 grad mtp.layers.0.eh_proj.weight' / 'step 1 loss mtp_1 (microbatch 2)'."""
    return f"step {d.step} {d.kind} {d.name}" + (f" (microbatch {d.microbatch})" if d.microbatch is not None else "")


def outside(cmp: Comparison, spec, clipping: bool) -> list[Difference]:
    """The differences of `cmp` outside the variant's signature (its `signature`, else the default derived
    from its `first_divergence`), in walk order; [] when the runs are equal or the variant states no place
    (``diverge`` without `first_divergence`)."""
    if cmp.first_divergence is None:
        return []
    places = spec.signature or (default_signature(spec.first_divergence, cmp.first_divergence.step, clipping)
                                if spec.first_divergence else None)
    if not places:
        return []
    return [d for d in cmp.differences if not any(matches(p, d) for p in places)]


def lines(diffs: list[Difference]) -> list[str]:
    """One line per difference (`describe`), at most `MAX_LINES`, then '… and N more'."""
    shown = [describe(d) for d in diffs[:MAX_LINES]]
    return shown + ([f"… and {len(diffs) - MAX_LINES} more"] if len(diffs) > MAX_LINES else [])


def judge(verdict: tuple[str, str, str], spec, cmp: Optional[Comparison], clipping: bool) -> tuple[str, str, str, list]:
    """`harness.judging.judge.judge`'s (verdict, outcome, reason) with the signature applied: a passing
    ``may_diverge`` / ``diverge`` variant that differs outside its signature fails.  Returns the four-tuple
    (verdict, outcome, reason, the `Difference` s outside)."""
    if cmp is None or verdict[0] != "pass" or spec.expect in ("bitwise", "not_finite"):
        return (*verdict, [])
    out = outside(cmp, spec, clipping)
    if not out:
        return (*verdict, [])
    return "fail", "unexpected difference", \
        f"{verdict[2]}, but it also differs outside its signature ({len(out)}): {describe(out[0])}", out
