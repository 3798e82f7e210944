"""Planted defects of the megatron-core trainer (test-only, `RunConfig.inject`): real changes to what megatron
computes, so the tests can prove that a check fails when the trainer is broken.

* ``skip_mtp_embedding_sync``: ``finalize_model_grads`` without the word-embedding all-reduce between the first
  stage and the MTP stage (``_allreduce_word_embedding_grads``): the MTP stage's embedding replica keeps its own
  gradient and then drifts from the first stage's embedding.  Every layout whose MTP layer is not on the first
  stage's rank holds such a replica (every P > 1 layout, MTP with the loss included), so all of them are
  affected; P = 1 has one embedding.
* ``default_embedding_group``: megatron-core's default embedding group (first and last pipeline rank) instead
  of Megatron-LM's (first rank and the MTP ranks, `model.embedding_ranks`): the mistake a megatron-core user
  makes who builds the parallel state without ``get_embedding_ranks``.  Affects layouts whose MTP stage is not
  on the last pipeline rank: there the replica is never synchronised, and the last rank, which holds no
  embedding, all-reduces its untied ``output_layer.weight`` gradient (same shape) with the first stage's
  embedding gradient, corrupting both.
* ``mtp_loss_scale_doubled``: the MTP loss enters the objective with twice ``mtp_loss_scaling_factor`` (a wrong
  scale applied the same way on every layout: every layout comparison passes; only an independent
  implementation, `harness.judging.crossimpl`, sees the gradients move).
"""
from __future__ import annotations

from typing import Callable, Optional

NAMES = ("skip_mtp_embedding_sync", "default_embedding_group", "mtp_loss_scale_doubled")


def mtp_loss_scaling_factor(inject: Optional[str], factor: Optional[float]) -> Optional[float]:
    """The MTP loss scale handed to megatron's config (None without MTP)."""
    return 2 * factor if inject == "mtp_loss_scale_doubled" and factor is not None else factor


def embedding_ranks(inject: Optional[str], ranks: Callable) -> Optional[Callable]:
    """The ``get_embedding_ranks`` handed to megatron's ``initialize_model_parallel`` (None: its default)."""
    return None if inject == "default_embedding_group" else ranks


def finalize(inject: Optional[str], finalize_model_grads: Callable) -> Callable:
    """megatron's ``finalize_model_grads``, or the planted defect's version of it."""
    if inject != "skip_mtp_embedding_sync":
        return finalize_model_grads
    import importlib
    # the submodule, not the function of the same name that megatron.core.distributed re-exports
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    def without_embedding_sync(*args, **kwargs):
        original = module._allreduce_word_embedding_grads
        module._allreduce_word_embedding_grads = lambda *a, **k: None
        try:
            return finalize_model_grads(*args, **kwargs)
        finally:
            module._allreduce_word_embedding_grads = original
    return without_embedding_sync
