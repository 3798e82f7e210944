"""ULP evidence for a divergence: re-run the first diverging step of both runs with full dumps of the tensors
involved (safetensors, bounded by a size limit) and measure every difference in ULPs (`harness.judging.ulp`)."""
from __future__ import annotations

from pathlib import Path

from trainerkit.config import DumpConfig, RunConfig

from ..judging.trace import Trace
from ..judging.ulp import tensor_stats
from ..planning.budget import Deadline
from .runner import run_ranks

MAX_TENSORS = 8
MAX_BYTES = 256 << 20


def diverging_keys(ref: Trace, other: Trace, step: int, limit: int = MAX_TENSORS) -> list[str]:
    """Keys whose gradient or updated value differs at `step` (the step number: a resumed run's trace starts
    after its resume point), canonical order, at most `limit`; [] when either trace lacks that step."""
    a = next((s for s in ref.steps if s.step == step), None)
    b = next((s for s in other.steps if s.step == step), None)
    if a is None or b is None:
        return []
    keys = [k for k in ref.order if k in other.params and
            (a.grads.get(k) != b.grads.get(k) or a.params.get(k) != b.params.get(k))]
    return keys[:limit]


def _dump(cfg: RunConfig, keys: list[str], step: int, run_dir: Path, timeout: float, launcher: str,
          deadline: Deadline, shapes: dict) -> dict:
    cfg = cfg.model_copy(update={
        "dump": DumpConfig(step=step, keys=keys, max_bytes=MAX_BYTES), "checkpoint": None,
        "training": cfg.training.model_copy(update={"train_iters": step + 1})})
    out = deadline.run(run_ranks, cfg, run_dir, timeout, launcher)
    if not out.ok:
        raise RuntimeError(out.error.splitlines()[0])
    from trainerkit.capture import read_dumps  # here: it imports torch, which a passing verify never needs
    return read_dumps(run_dir, shapes)


def collect(ref_cfg: RunConfig, cfg: RunConfig, ref: Trace, other: Trace, step: int, work: Path,
            timeout: float, launcher: str, deadline: Deadline = Deadline(None)) -> list[dict]:
    """Per diverging tensor at `step`: {key, what: "grad"|"param", **tensor_stats}.  Raises RuntimeError when
    a re-run fails or the `deadline` (`harness.planning.budget`) leaves it no time (its message says so)."""
    keys = diverging_keys(ref, other, step)
    if not keys:
        return []
    a = _dump(ref_cfg, keys, step, work / "reference", timeout, launcher, deadline, ref.shapes())
    b = _dump(cfg, keys, step, work / "variant", timeout, launcher, deadline, other.shapes())
    rows = []
    for key in keys:
        for what in ("grad", "param"):
            name = f"{what}/{key}"
            if name in a and name in b:
                stats = tensor_stats(a[name], b[name])
                if stats["differing"]:
                    rows.append({"key": key, "what": what, **stats})
    return rows
