"""HybridModel with megatron's local (non-TE) modules: point H1 (on top of `compat`'s nine), applied in the rank
of a ``model_class: hybrid`` run on every device without Transformer Engine (it is about the specs, not the CPU).

Same rules as `compat`: the point checks that the limitation it works around is still in the installed megatron
(`compat._needed`, else recorded in `compat.NOT_NEEDED`) and that the code it patches is still the code it was
written for (`compat._require`); it changes no computation.

* **H1** ``HybridStack.__init__`` (models/hybrid/hybrid_block.py) builds its final norm as ``TENorm`` whatever
  the stack spec says (the spec has no field for it), and ``TENorm`` raises ImportError without Transformer
  Engine: no HybridModel with a post-process stage can be built from local modules.  H1 makes the name
  ``TENorm`` in that module the norm GPTModel's local spec builds its final layernorm with
  (``gpt_layer_specs.LNImpl``: Apex's FusedLayerNorm, else ``WrappedTorchNorm``), the same class, built with the
  same arguments (config, hidden_size, eps).
"""
from __future__ import annotations

from . import compat

POINTS = ("H1",)


def needed(model_class: str) -> bool:
    """Whether a run of `model_class` needs `POINTS`: a HybridModel without Transformer Engine."""
    return model_class == "hybrid" and not compat._have_te()


def apply() -> tuple:
    """H1 where ``HybridStack`` still builds ``TENorm`` unconditionally; returns ``("H1",)`` or ``()``.  Call
    after `compat.apply`, before the model is built.

    Raises:
        compat.CompatError: hybrid_block.py no longer imports ``TENorm`` at module level, or GPT's local spec
            has no ``LNImpl``."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.hybrid import hybrid_block

    source = compat._source(hybrid_block.HybridStack.__init__)
    if not compat._needed("self.final_norm = TENorm(" in source, "H1",
                          "HybridStack builds its final norm from the spec"):
        return ()
    compat._require(hasattr(hybrid_block, "TENorm") and hasattr(gpt_layer_specs, "LNImpl"), "H1",
                    "hybrid_block has no module-level TENorm, or gpt_layer_specs no LNImpl")
    hybrid_block.TENorm = gpt_layer_specs.LNImpl
    return POINTS
