"""Sequence parallelism with megatron's local (non-TE) layer specs: point S1 (on top of `compat`'s nine), applied
in the rank when the run has ``sequence_parallel``, on every device (it is about the specs, not the CPU).

Same rules as `compat`: the point checks that the limitation it works around is still in the installed megatron
(`compat._needed`, else recorded in `compat.NOT_NEEDED`) and that the code it patches is still the code it was
written for (`compat._require`); it changes no computation.

* **S1** ``WrappedTorchNorm`` (transformer/torch_norm.py), the local spec's norm without Apex, asserts
  ``not config.sequence_parallel``: megatron's norms for sequence parallelism are Apex's ``FusedLayerNorm`` and
  TE's ``TENorm``, neither of which a CPU (or a GPU without them) has.  What those do for SP and torch's norm
  does not: mark the weight ``sequence_parallel`` (fusions/fused_layer_norm.py), so that
  ``finalize_model_grads`` all-reduces its gradient over the TP group (each TP rank saw only its part of the
  sequence).  S1 builds torch's norm with the assertion passed and marks the weight the same way; the forward is
  torch's ``RMSNorm`` as without SP (the arithmetic of an SP run's norms is then torch's, not Apex's or TE's).
"""
from __future__ import annotations

import functools

from . import compat

POINTS = ("S1",)


def needed(sequence_parallel: bool) -> bool:
    """Whether a run needs `POINTS` (its ``sequence_parallel``)."""
    return bool(sequence_parallel)


def apply() -> tuple:
    """S1 where megatron's torch norm still refuses sequence parallelism; returns ``("S1",)`` or ``()``.  Call
    after `compat.apply`, before the model is built.

    Raises:
        compat.CompatError: ``WrappedTorchNorm`` is no longer built by a ``__new__`` that reads
            ``config.sequence_parallel``."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    source = compat._source(cls.__new__)
    if not compat._needed("not config.sequence_parallel" in source, "S1",
                          "WrappedTorchNorm accepts sequence parallelism"):
        return ()
    if getattr(cls.__new__, "_bitparity_s1", False):
        return POINTS
    compat._require("config" in source and "def __new__" in source, "S1",
                    "WrappedTorchNorm.__new__ no longer takes the config")
    original = cls.__new__

    @functools.wraps(original)
    def __new__(klass, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        if not config.sequence_parallel:
            return original(klass, *args, **kwargs)
        # the assertion reads the flag at build time only: the norm module keeps no reference to it
        config.sequence_parallel = False
        try:
            norm = original(klass, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm
    __new__._bitparity_s1 = True
    cls.__new__ = staticmethod(__new__)
    return POINTS
