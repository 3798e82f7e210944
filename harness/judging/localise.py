"""Walk the in-step fingerprints (``capture: activations``) to the first tensor that differs.

Forward: microbatches ascending; within one, components in forward order (embedding, decoder layers by
global id, final norm, MTP, head input), each component's input before its output.  The first differing
output whose input matches names the component that computed differently ("inputs equal, output
differs"); a differing input whose producer's output matched means the tensor changed between two
components (a transport or stage-boundary bug).  Backward: the same walk over gradients in reverse order.
Within one run, every boundary tensor's receiver-side fingerprint must equal its sender-side one.
"""
from __future__ import annotations

import re
from typing import Optional

from .trace import Trace

_COMPONENT = re.compile(r"^(embedding|decoder\.layers\.(\d+)|decoder\.final_layernorm|mtp|head)\.(input|output)$")
_SECTION = {"embedding": 0, "decoder.layers": 1, "decoder.final_layernorm": 2, "mtp": 3, "head": 4}


def _forward_key(key: str) -> tuple:
    m = _COMPONENT.match(key)
    comp = m.group(1)
    section = _SECTION["decoder.layers" if m.group(2) is not None else comp]
    return section, int(m.group(2) or 0), 0 if m.group(3) == "input" else 1


def _words(key: str) -> str:
    comp, _, io = key.rpartition(".")
    comp = comp.replace("decoder.layers.", "decoder layer ").replace("decoder.final_layernorm", "final norm")
    return f"{comp} {io}"


def boundary_mismatches(trace: Trace) -> list[str]:
    """Messages whose received bits differ from the sent bits (within one run)."""
    out = []
    for st in trace.steps:
        for key, sent in st.boundaries.items():
            if key.endswith("/send"):
                got = st.boundaries.get(key[:-5] + "/recv")
                if got is not None and got != sent:
                    d, stage, mb, _ = key.split("/")
                    out.append(f"step {st.step} microbatch {mb}: {'activation' if d == 'F' else 'gradient'} sent by "
                               f"stage {stage} arrived with different bits")
    return out


def localise(ref: Trace, other: Trace, step: int) -> Optional[dict]:
    """{step, microbatch, tensor, direction, message} for the first differing in-step tensor at `step`, or
    None when either run has no activation capture or nothing differs there."""
    a = next((s.activations for s in ref.steps if s.step == step), {})
    b = next((s.activations for s in other.steps if s.step == step), {})
    common = set(a) & set(b)
    if not common:
        return None
    only = sorted((k for k in set(a) ^ set(b) if _COMPONENT.match(k.split("/", 1)[1])),
                  key=lambda k: (int(k.split("/", 1)[0]), _forward_key(k.split("/", 1)[1])))
    if only:                      # a component that ran in one run only (a skipped or extra layer / norm)
        mb, key = only[0].split("/", 1)
        side = "reference" if only[0] in a else "variant"
        return {"step": step, "microbatch": int(mb), "tensor": key, "direction": "forward",
                "message": f"{_words(key)}, microbatch {mb}, step {step}: computed in the {side} only"}
    mbs = sorted({int(k.split("/", 1)[0]) for k in common})
    for direction in ("forward", "backward"):
        for mb in mbs:
            keys = [k.split("/", 1)[1] for k in common if k.startswith(f"{mb}/")]
            comps = sorted((k for k in keys if _COMPONENT.match(k)), key=_forward_key)
            if direction == "backward":
                comps = [k + ".grad" for k in reversed(comps) if k + ".grad" in keys]
            prev = None
            for key in comps:
                if a[f"{mb}/{key}"] != b[f"{mb}/{key}"]:
                    what = _words(key.removesuffix(".grad")) + (" gradient" if direction == "backward" else "")
                    if prev is None or a[f"{mb}/{prev}"] == b[f"{mb}/{prev}"]:
                        same_comp = prev is not None and prev.split(".input")[0].split(".output")[0] == \
                            key.split(".input")[0].split(".output")[0]
                        if direction == "backward":
                            how = "output gradient equal, input gradient differs" if same_comp else \
                                "differs although the gradient before it matched"
                        else:
                            how = "inputs equal, output differs" if same_comp else \
                                "differs although the tensor before it matched"
                    else:
                        how = "differs"
                    return {"step": step, "microbatch": mb, "tensor": key, "direction": direction,
                            "message": f"{what}, microbatch {mb}, step {step}: {how}"}
                prev = key
    return None
