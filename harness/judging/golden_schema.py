"""The shape of a golden trace file (`harness.judging.golden`'s ``runs/*.json``), checked when the goldens are loaded,
before anything runs: whatever passes here, `harness.judging.compare` can compare without failing (pydantic models of
the fields it reads; types strict, no stray keys in a step)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Scalar(BaseModel):
    """{hex, value} of a loss / grad norm (`trainerkit.capture.scalar`)."""
    model_config = ConfigDict(extra="allow")
    hex: StrictStr
    value: Optional[float] = None


class _Loss(_Strict):
    microbatch: StrictInt
    lm: _Scalar
    mtp: list[_Scalar]
    num_tokens: StrictInt


class _Param(BaseModel):
    """A parameter's inventory entry: what compare and the dataflow order read (other fields kept as is)."""
    model_config = ConfigDict(extra="allow")
    key: StrictStr
    name: StrictStr
    replica: Optional[StrictStr]
    family: StrictStr
    order: list[StrictInt]


class _Step(_Strict):
    step: StrictInt
    losses: list[_Loss] = []
    lm_loss: Optional[_Scalar] = None
    grad_norm: Optional[_Scalar] = None
    clip_coeff: Optional[_Scalar] = None
    clipped: Optional[StrictBool] = None
    grads: dict[StrictStr, StrictStr] = {}
    params: dict[StrictStr, StrictStr] = {}
    exp_avg: dict[StrictStr, StrictStr] = {}
    exp_avg_sq: dict[StrictStr, StrictStr] = {}
    buffers: dict[StrictStr, StrictStr] = {}


class _GoldenTrace(_Strict):
    format: StrictStr
    params: dict[StrictStr, _Param]
    order: list[StrictStr]
    init: dict[StrictStr, StrictStr]
    steps: list[_Step]


def trace_problem(raw: object) -> str:
    """Why `raw` is not a golden trace that `check` can compare without failing ('' when it is)."""
    try:
        t = _GoldenTrace.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        return f"{'.'.join(map(str, err['loc'])) or 'top level'}: {err['msg']}"
    if t.format != "bitparity-trace/2":
        return f"format {t.format!r} is not bitparity-trace/2"
    keys = set(t.params)
    if sorted(t.order) != sorted(keys):
        return "order does not list exactly the parameters of params"
    if set(t.init) - keys:
        return f"init names {sorted(set(t.init) - keys)[0]!r}, which is not in params"
    for st in t.steps:
        for field in ("grads", "params"):
            extra = set(getattr(st, field)) - keys
            if extra:
                return f"step {st.step} {field} names {sorted(extra)[0]!r}, which is not in params"
    return ""
