"""What megatron's MoE 1F1B overlap actually ran on this rank, per step: merged forward+backward steps and
delayed weight-gradient calls.

With ``overlap_moe_expert_parallel_comm`` megatron's schedules (pipeline_parallel/combined_1f1b.py) call
``combined_forward_backward_step`` for every compute action, with a forward microbatch, a backward one, or both:
only the calls with both run one microbatch's forward merged with another's backward, node by node.  Which
ranks merge anything depends on P, V and the microbatch count (measured: at P=4 V=2 with 4 microbatches pp ranks
0 and 1 merge nothing), so a variant that claims to test the overlap must show that it did.
``delay_wgrad_compute`` defers the weight gradients to ``backward_dw`` calls, counted at the linears.
"""
from __future__ import annotations

import functools
import inspect


class OverlapCounter:
    """Counts, until `take`: ``merged`` (combined_forward_backward_step calls with both a forward model chunk
    and a backward one), ``forward_only`` / ``backward_only`` (the other calls) and ``backward_dw`` (the linears'
    delayed weight-gradient calls)."""

    def __init__(self):
        self.counts = {"merged": 0, "forward_only": 0, "backward_only": 0, "backward_dw": 0}

    def install(self) -> None:
        """Wrap megatron's combined step and the linears' ``backward_dw`` (call once per rank, after the compat
        points, before the first step).

        Raises:
            RuntimeError: combined_forward_backward_step no longer takes f_model and b_model."""
        from megatron.core.pipeline_parallel import combined_1f1b
        from megatron.core.tensor_parallel import layers

        step = combined_1f1b.combined_forward_backward_step
        sig = inspect.signature(step)
        if not {"f_model", "b_model"} <= set(sig.parameters):
            raise RuntimeError("megatron's combined_forward_backward_step no longer takes f_model / b_model: update "
                               "megatron_trainer/coverage.py")

        @functools.wraps(step)
        def counted(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs).arguments
            f, b = bound.get("f_model") is not None, bound.get("b_model") is not None
            self.counts["merged" if f and b else "forward_only" if f else "backward_only"] += 1
            return step(*args, **kwargs)
        combined_1f1b.combined_forward_backward_step = counted
        for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
            dw = getattr(cls, "backward_dw", None)
            if dw is not None and not getattr(dw, "_bitparity_counted", False):
                cls.backward_dw = self._count_dw(dw)

    def _count_dw(self, dw):
        @functools.wraps(dw)
        def counted(module, *args, **kwargs):
            self.counts["backward_dw"] += 1
            return dw(module, *args, **kwargs)
        counted._bitparity_counted = True
        return counted

    def take(self) -> dict:
        """The counts since the last `take` (a step's), then zero."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return out
