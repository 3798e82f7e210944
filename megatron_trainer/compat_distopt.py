"""Run megatron-core's distributed optimizer on a CPU-only torch over gloo: point D1 (on top of `compat`'s nine),
applied in the rank when the run has ``use_distributed_optimizer``.

Same rules as `compat`: the point checks that the bug it works around is still in the installed megatron
(`compat._needed`, else recorded in `compat.NOT_NEEDED`) and that the code it patches is still the code it was
written for (`compat._require`); it changes no computation.

* **D1** ``DistributedOptimizer`` (optimizer/distrib_optimizer.py) sorts the parameters it shards by CUDA type
  names (``__init__``: which parameters get an fp32 main copy; ``_build_model_and_main_param_groups``: which
  shard groups they join, anything else raising "Wrapped parameters must be one of torch.cuda.FloatTensor, ..."):
  the methods that compare against them, recompiled from megatron's own source with the CPU type names
  (`compat.CUDA_TYPES`, as point B1 does for the plain mixed-precision optimizer).  Its collectives
  (``reduce_scatter_tensor`` of the gradient buckets, ``all_gather_into_tensor`` of the parameters) run on
  gloo as they are.
"""
from __future__ import annotations

import inspect
import textwrap

from . import compat

POINTS = ("D1",)


def needed(options: dict) -> bool:
    """Whether a run with these megatron options (`RunConfig.megatron`) needs `POINTS` on CPU."""
    return bool(options.get("use_distributed_optimizer"))


def _comparing(cls) -> list[str]:
    """Names of `cls`'s own methods whose source compares a parameter's type with a CUDA type name."""
    out = []
    for name, member in vars(cls).items():
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(fn) and any(cuda in compat._source(fn) for cuda, _ in compat.CUDA_TYPES):
            out.append(name)
    return out


def apply() -> tuple:
    """D1 where its bug is present; returns ``("D1",)`` or ``()``.  Call after `compat.apply`, before the
    optimizer is built.

    Raises:
        compat.CompatError: the methods no longer sort parameters by exactly these type names (one comparison
            of each kind per method at most, and the 16-bit one in every method that has any)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    methods = _comparing(cls)
    if not compat._needed(bool(methods), "D1", "DistributedOptimizer no longer checks CUDA type names"):
        return ()
    for name in methods:
        member = vars(cls)[name]
        source = textwrap.dedent(compat._source(member.__func__ if isinstance(member, classmethod) else member))
        counts = [source.count(cuda) for cuda, _ in compat.CUDA_TYPES]
        compat._require(counts[0] == 1 and counts[1] <= 1, "D1",
                        f"DistributedOptimizer.{name} compares parameter types with CUDA names {counts} times")
        compat.recompile(cls, name, compat.CUDA_TYPES, dopt)
    return ("D1",)
