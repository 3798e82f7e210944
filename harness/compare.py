"""Bitwise comparison of two canonical traces and localisation of the first divergence.

Walk order (the order in which one training step produces its numbers): steps ascending; within a step,
losses (microbatches ascending; lm then mtp_1..mtp_D; then the reported lm loss) before gradients (canonical
parameter order) before the grad norm (when both runs clip) before parameters after the optimizer step
(canonical order, then buffers such as the expert bias).  The first difference in that order is the first
divergence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .results import FAMILIES, FirstDivergence
from .trace import Trace


@dataclass
class Comparison:
    """bitwise_equal: every compared bit equal.  family_mismatches: {"grad"|"param": [{family: count}] per step}.
    inventory: one line per parameter key present in only one of the runs."""

    bitwise_equal: bool
    first_divergence: Optional[FirstDivergence]
    family_mismatches: dict = field(default_factory=dict)
    inventory: list = field(default_factory=list)
    grad_norm_ulps: list = field(default_factory=list)   # per step: |ulp distance| or None


def ulp_distance(a_hex: str, b_hex: str) -> int:
    """Distance in units in the last place between two IEEE bit patterns of the same width, given as hex
    ('0x3f800000' fp32, 16 digits fp64, 4 digits bf16/fp16): the number of representable values between
    them.  Sign-magnitude bits map to a monotone integer line, so the count crosses zero correctly and
    +0 / -0 are 0 apart.

    Raises:
        ValueError: the two patterns have different widths.
    """
    a, b = a_hex.removeprefix("0x"), b_hex.removeprefix("0x")
    if len(a) != len(b):
        raise ValueError(f"cannot compare {a_hex} and {b_hex}: different widths")
    sign = 1 << (4 * len(a) - 1)

    def ordered(h: str) -> int:
        v = int(h, 16)
        return v if v < sign else sign - v
    return abs(ordered(a) - ordered(b))


def _loss_diffs(base_step, other_step):
    """Yield (microbatch, name, base, other) for the loss entries that differ, in walk order."""
    for b, o in zip(base_step.losses, other_step.losses):
        if b["lm"]["hex"] != o["lm"]["hex"]:
            yield b["microbatch"], "lm", b["lm"], o["lm"]
        for k, (bm, om) in enumerate(zip(b["mtp"], o["mtp"]), start=1):
            if bm["hex"] != om["hex"]:
                yield b["microbatch"], f"mtp_{k}", bm, om
    if len(base_step.losses) != len(other_step.losses):
        yield None, "microbatch count", {"hex": str(len(base_step.losses))}, {"hex": str(len(other_step.losses))}
    bl, ol = base_step.lm_loss, other_step.lm_loss
    if (bl or {}).get("hex") != (ol or {}).get("hex"):
        yield None, "lm loss (reported)", bl or {"hex": "none"}, ol or {"hex": "none"}


def compare(base: Trace, other: Trace) -> Comparison:
    """Compare `other` with `base` bit for bit (fingerprints and loss bits).

    Parameter keys present in only one run are an inventory difference: reported as a `param` divergence
    at step 0 (the runs do not train the same model).  Replica keys (``@mtp``) are compared when both runs
    hold them; a replica that only one layout needs is not an inventory difference.
    """
    primaries = lambda t: [k for k in t.order if t.params[k]["replica"] is None]  # noqa: E731
    missing = [f"{k}: only in the baseline" for k in primaries(base) if k not in other.params]
    missing += [f"{k}: only in the variant" for k in primaries(other) if k not in base.params]
    keys = [k for k in base.order if k in other.params]
    families = {k: base.params[k]["family"] for k in keys}
    first: Optional[FirstDivergence] = None
    if missing:
        first = FirstDivergence(step=0, kind="param", microbatch=None, name=missing[0].split(":")[0],
                                detail=f"parameter inventory differs ({len(missing)}): " + "; ".join(missing[:5]))
    counts = {"grad": [], "param": []}
    norm_ulps = []
    for bs, os_ in zip(base.steps, other.steps):
        for mb, name, b, o in _loss_diffs(bs, os_):
            if first is None:
                first = FirstDivergence(bs.step, "loss", mb, name, f"{name}: baseline {b['hex']} vs {o['hex']}")
        norm_ulps.append(None)
        for kind, b_map, o_map in (("grad", bs.grads, os_.grads), ("param", bs.params, os_.params)):
            if kind == "param" and bs.grad_norm and os_.grad_norm:
                bh, oh = bs.grad_norm["hex"], os_.grad_norm["hex"]
                norm_ulps[-1] = ulp_distance(bh, oh) if len(bh) == len(oh) else None
                if bh != oh and first is None:
                    ulps = f" ({norm_ulps[-1]} ulp)" if norm_ulps[-1] is not None else ""
                    first = FirstDivergence(bs.step, "grad_norm", None, "grad norm",
                                            f"grad norm {bh} vs {oh}{ulps}")
            per_family = dict.fromkeys(FAMILIES, 0)
            for k in keys:
                if b_map.get(k) != o_map.get(k):
                    per_family[families[k]] += 1
                    if first is None:
                        first = FirstDivergence(bs.step, kind, None, k,
                                                f"{kind} fingerprint {b_map.get(k)} vs {o_map.get(k)}")
            if kind == "param":
                for k in sorted(set(bs.buffers) | set(os_.buffers)):
                    if bs.buffers.get(k) != os_.buffers.get(k):
                        per_family["router"] += 1
                        if first is None:
                            first = FirstDivergence(bs.step, "param", None, k,
                                                    f"buffer {bs.buffers.get(k)} vs {os_.buffers.get(k)}")
            counts[kind].append(per_family)
    if len(base.steps) != len(other.steps) and first is None:
        step = min(len(base.steps), len(other.steps))
        first = FirstDivergence(step, "loss", None, "steps",
                                f"baseline has {len(base.steps)} steps, variant {len(other.steps)}")
    return Comparison(bitwise_equal=first is None, first_divergence=first, family_mismatches=counts,
                      inventory=missing, grad_norm_ulps=norm_ulps)
