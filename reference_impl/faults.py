"""Planted faults (test-only; never on by default) that prove the harness detects and localises bugs.

Selected with ``RunConfig.inject`` (the harness's ``--inject NAME`` or a variant's ``inject:`` key; the
harness never plants one in the baseline).  Each is a deliberate bug of the kind users hit, switched on at
one well-defined place by a one-line hook in the trainer; with ``inject=None`` every hook is the identity.

Numerics (the harness must report ``fail`` at the stated first divergence):

* ``reset_optimizer_on_resume``: a resumed run drops the checkpoint's AdamW state (restarts its moments),
  -> what it loaded differs in ``optimizer_state`` at the checkpoint's step (the trace's ``resumed`` record).
* ``nondeterministic_grad``: XOR the low mantissa bits of that same gradient element with the rank's process
  id, so two runs of one configuration differ (a run-to-run nondeterminism, for the ``repeat:`` control).
* ``grad_bit_flip``: flip the lowest mantissa bit of element 0 of the gradient of the last decoder layer's
  ``self_attention.linear_q_down_proj.weight`` at step 0 (after accumulation, before capture).
  -> step 0 grad of that parameter.
* ``swap_backward_microbatches``: the stage holding the last decoder layer runs the backward of microbatches 1
  and 2 in swapped order, so its parameters accumulate ``(g0 + g2) + g1`` instead of ``(g0 + g1) + g2``.
  -> step 0 grad of a parameter of that stage.
* ``skip_final_norm_standalone``: when the MTP layer is standalone (not on the loss rank), the last decoder
  stage does not apply ``decoder.final_layernorm``: the main head and the MTP layer both get un-normed h.
  Inactive when MTP sits with the loss.  -> step 0 loss ``lm``, microbatch 0.
* ``double_final_norm_mtp``: the MTP stage applies the final-norm op once more to h0 before the MTP layers
  (the stage's ``decoder.final_layernorm`` when it holds it, else a weightless RMSNorm); the main path keeps
  the once-normed h0.  -> step 0 loss ``mtp_1``, microbatch 0.
* ``unsynced_embedding_replica``: the word-embedding gradients of the first stage and of the MTP stage's
  replica are never summed (the embedding group's all-reduce is skipped).  -> step 0 grad
  ``embedding.word_embeddings.weight``; the replica no longer matches its original (replica check).
* ``mtp_loss_main_mask_count``: the depth-k MTP loss is divided by the main loss mask's token count instead
  of its own rolled mask's.  -> step 0 loss ``mtp_1``, microbatch 0.
* ``rescale_grads_per_microbatch``: every backward seed (the lm objective, the MTP and aux-loss scales) is
  left undivided by num_microbatches, and each microbatch's gradient is divided by num_microbatches as it
  is added to ``main_grad`` instead.  Mathematically the same; the bits differ only when num_microbatches
  is not a power of two (scaling by 2^-k is exact in IEEE arithmetic).  -> step 0 grad.
* ``grad_norm_counts_replica``: the grad norm counts the embedding replica's gradient as well (only
  observable with ``clip_grad > 0``).  -> step 0 grad_norm.
* ``wrong_microbatch_activation``: at the boundary into the loss stage, the activations received for
  microbatches 1 and 2 are attached to each other's microbatch (each is scored against the other one's
  labels and mask).  -> step 0 loss ``lm``, microbatch 1.
* ``overlap_skips_final_norm``: with the 1F1B overlap schedule on, the last node of the last decoder layer
  skips ``decoder.final_layernorm`` (the node-split path forgets the norm that the plain path applies; users
  report this shape of bug): the main head and the MTP layer both get un-normed h.  Inactive without
  overlap.  -> step 0 loss ``lm``, microbatch 0.
* ``ep_unsorted_dispatch``: with expert parallelism (EP > 1), each expert receives its tokens ordered by
  source EP rank in reverse (the last rank's shard first) instead of in ascending token order; the rows go
  back to the right tokens, so only the order inside each expert's GEMM moves (a dispatcher that forgets
  ``sort_chunks_by_idxs``'s order).  Inactive with EP = 1.  -> step 0 grad of a routed expert's weight
  (the weight gradient sums the same rows in another order), or a step 0 loss on a BLAS that rounds a GEMM
  row by its position (MKL with MKL_CBWR=COMPATIBLE); none if every such sum happens to round alike.
* ``renorm_when_mtp_alone``: a stage holding only the MTP layer(s) normalises its input again (an extra,
  weightless RMSNorm on h0) — a layout-dependent bug that only some layouts trigger, for the fuzzer.

Structure:

* ``wrong_wd_group``: ``output_layer.weight`` is put into the optimizer's no-decay group (and the trace
  header says so).  -> parameter inventory differs: ``inventory`` at step 0 naming ``output_layer.weight``.

Process faults (for the watchdog):

* ``crash_rank``: the last pipeline rank raises at step 0 (a crashed rank).
* ``hang_rank``: the last pipeline rank sleeps forever at step 0 (a hung rank).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FAULTS = ("grad_bit_flip", "nondeterministic_grad", "reset_optimizer_on_resume", "swap_backward_microbatches", "skip_final_norm_standalone", "double_final_norm_mtp", "overlap_skips_final_norm",
          "unsynced_embedding_replica", "mtp_loss_main_mask_count", "rescale_grads_per_microbatch",
          "grad_norm_counts_replica", "wrong_microbatch_activation", "ep_unsorted_dispatch", "renorm_when_mtp_alone",
          "wrong_wd_group",
          "crash_rank", "hang_rank")

#: The matrix `wrong_wd_group` moves into the no-decay group.
WRONG_WD_TARGET = "output_layer.weight"


class FaultError(ValueError):
    """Unknown fault name."""


def check(name):
    """Raise `FaultError` unless `name` is None or a known fault."""
    if name is not None and name not in FAULTS:
        raise FaultError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")


def _weightless_norm(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    import torch  # torch only where a fault acts: the harness imports this module to validate fault names
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


# --- schedule and process ------------------------------------------------------------------------------

def schedule(name, actions, layout, rank):
    """Apply schedule faults to this rank's action list (the list is already dry-run-checked clean)."""
    if name != "swap_backward_microbatches" or layout.rank_of(layout.last_decoder_stage)[0] != rank:
        return actions
    stage = layout.last_decoder_stage
    block = lambda mb: [i for i, a in enumerate(actions)  # noqa: E731  (RECV_B, B, SEND_B are adjacent)
                        if a.op in ("RECV_B", "B", "SEND_B") and a.stage == stage and a.microbatch == mb]
    out = list(actions)
    for i, j in zip(block(1), block(2)):
        out[i], out[j] = actions[j], actions[i]
    return out


def at_step_start(name, step, rank, world_size):
    """Crash/hang faults, on the last rank at step 0."""
    if step == 0 and rank == world_size - 1:
        if name == "crash_rank":
            raise RuntimeError("planted fault crash_rank")
        if name == "hang_rank":
            while True:
                time.sleep(60)


# --- model forward -------------------------------------------------------------------------------------

def applies_final_norm(name, layout) -> bool:
    """False when ``skip_final_norm_standalone`` drops the final norm (standalone MTP layouts only)."""
    return not (name == "skip_final_norm_standalone" and layout.mtp_standalone)


def overlap_skips_final_norm(name, overlap: bool) -> bool:
    """True under ``overlap_skips_final_norm`` on the overlapped (node-by-node) path."""
    return name == "overlap_skips_final_norm" and overlap


def ep_unsorted_dispatch(name) -> bool:
    """True under ``ep_unsorted_dispatch``: MoE layers order each expert's received rows by source in reverse
    (`model.expert_parallel.sort_chunks`; no effect with EP = 1)."""
    return name == "ep_unsorted_dispatch"


def mtp_input(name, symbols, h):
    """MTP-input faults: ``renorm_when_mtp_alone`` on a stage that holds nothing but MTP layers."""
    if name == "renorm_when_mtp_alone" and set(symbols) == {"m"}:
        return _weightless_norm(h)
    return h


def mtp_layers_input(name, h, final_norm):
    """The hidden state the MTP *layers* see (h0 itself unless ``double_final_norm_mtp``, which normalises it
    again with the stage's final norm module, or a weightless RMSNorm when the stage does not hold it).
    The caller keeps the original h0 for the main path when this returns a different tensor."""
    if name != "double_final_norm_mtp":
        return h
    return final_norm(h) if final_norm is not None else _weightless_norm(h)


def loss_input_microbatch(name, microbatch, received_on_loss_stage: bool) -> int:
    """The microbatch whose labels score the activation of `microbatch` on the loss stage:
    ``wrong_microbatch_activation`` swaps 1 and 2 where the loss stage receives its input."""
    if name == "wrong_microbatch_activation" and received_on_loss_stage:
        return {1: 2, 2: 1}.get(microbatch, microbatch)
    return microbatch


# --- losses and gradient scaling ------------------------------------------------------------------------

def mtp_token_count_mask(name, mtp_mask, loss_mask):
    """The mask whose sum normalises an MTP loss: its own rolled mask, or the main one under
    ``mtp_loss_main_mask_count``."""
    return loss_mask if name == "mtp_loss_main_mask_count" else mtp_mask


def loss_divisor(name, num_microbatches: int) -> int:
    """What the backward seeds (objective, MTP and aux-loss scales) are divided by: num_microbatches, or 1
    under ``rescale_grads_per_microbatch`` (which divides each microbatch's gradient instead)."""
    return 1 if name == "rescale_grads_per_microbatch" else num_microbatches


def microbatch_grad(name, grad, num_microbatches: int):
    """The term one microbatch adds to ``main_grad``: the grad, or grad / num_microbatches under
    ``rescale_grads_per_microbatch``."""
    return grad / num_microbatches if name == "rescale_grads_per_microbatch" else grad


# --- reductions and optimizer ----------------------------------------------------------------------------

def syncs_embedding_replica(name) -> bool:
    """False under ``unsynced_embedding_replica``: the embedding holders' gradients are never summed."""
    return name != "unsynced_embedding_replica"


def norm_counts_replicas(name) -> bool:
    """True under ``grad_norm_counts_replica``: the grad norm includes replica gradients."""
    return name == "grad_norm_counts_replica"


def weight_decay(name, param_name, decay: bool) -> bool:
    """Whether `param_name` is in the decay group: `decay`, except ``WRONG_WD_TARGET`` under ``wrong_wd_group``."""
    return False if name == "wrong_wd_group" and param_name == WRONG_WD_TARGET else decay


def after_grads(name, step, params, num_layers):
    """Gradient faults, applied to the accumulated main_grads before capture.  params: (key, name, replica, p)."""
    if name not in ("grad_bit_flip", "nondeterministic_grad") or step != 0:
        return
    import torch
    target = f"decoder.layers.{num_layers - 1}.self_attention.linear_q_down_proj.weight"
    for key, _, _, p, _ in params:
        if key == target:
            with torch.no_grad():
                flat = p.main_grad.view(-1).view(torch.int32)
                flat[0] ^= 1 if name == "grad_bit_flip" else (os.getpid() & 0xFFFF) | 1


def after_resume(name, optimizer):
    """Resume faults: ``reset_optimizer_on_resume`` forgets the loaded optimizer state."""
    if name == "reset_optimizer_on_resume":
        optimizer.state.clear()
