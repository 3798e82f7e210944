"""Language-model and MTP losses as Megatron's defaults (megatron-semantics §2.5 and §4).

All computed on the loss stage with the one untied output head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from .. import faults
from .common import LossAutoScaler, roll_left


@dataclass
class LossOutput:
    """Per-microbatch results.  ``objective`` is the scalar to backpropagate (already / num_microbatches);
    the rest are detached fp32 scalars for capture."""

    objective: torch.Tensor
    lm_loss_sum: torch.Tensor      # sum(CE * mask)
    num_tokens: torch.Tensor       # sum(mask)
    lm_loss: torch.Tensor          # lm_loss_sum / clamp(num_tokens, 1)
    mtp_losses: list               # per depth k: sum(CE_k * mask_k) / clamp(num_tokens_k, 1)


def token_ce(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, s] fp32 from hidden [s, b, h] and labels [b, s]."""
    logits = head(hidden).float()                                  # [s, b, V]
    s, b, v = logits.shape
    ce = F.cross_entropy(logits.reshape(s * b, v), labels.t().reshape(s * b), reduction="none")
    return ce.view(s, b).t()


def lm_and_mtp_loss(head, hidden, labels, loss_mask, mtp_num_layers: int, mtp_loss_scaling_factor: float,
                    num_microbatches: int, inject: Optional[str] = None, per_token: bool = False) -> LossOutput:
    """Megatron's ``process_mtp_loss`` then the main loss, in that forward order.

    hidden [(1+D)·s, b, h]: chunk 0 feeds the main loss, chunk k the depth-k loss against labels and mask
    rolled left k times.  The MTP loss ``(factor/D)·sum(CE_k·mask_k)/num_tokens_k`` enters through an identity
    node on chunk 0 with backward seed 1/num_microbatches; the objective is
    ``sum(CE·mask)/clamp(num_tokens,1)/num_microbatches``.  `inject`: a planted fault (`reference_impl.faults`).

    `per_token` (Megatron's ``calculate_per_token_loss``): nothing is divided here; the objective is
    ``sum(CE·mask)`` and the MTP loss ``(factor/D)·sum(CE_k·mask_k)·(num_tokens/clamp(num_tokens_k, 1))`` with
    seed 1, so that once every gradient is divided by the step's main-loss token count (`scale_by_tokens`)
    each depth weighs its own tokens as DeepSeek-V3 §2.2 states (Megatron-LM a22c40e8d6, #3159: before it, the
    MTP gradients were divided by the main loss's token count instead of their own).
    """
    chunks = torch.chunk(hidden, 1 + mtp_num_layers, dim=0)
    h0 = chunks[0]
    mtp_labels, mtp_mask, mtp_losses = labels, loss_mask, []
    for k in range(1, 1 + mtp_num_layers):
        mtp_labels, mtp_mask = roll_left(mtp_labels), roll_left(mtp_mask)
        num_k = faults.mtp_token_count_mask(inject, mtp_mask, loss_mask).sum().clamp(min=1)
        sum_k = (token_ce(head, chunks[k], mtp_labels) * mtp_mask).sum()
        loss_k = sum_k / num_k
        mtp_losses.append(loss_k.detach())
        if per_token:
            h0 = LossAutoScaler.apply(h0, (mtp_loss_scaling_factor / mtp_num_layers) * sum_k * (loss_mask.sum() / num_k),
                                      1.0)
        else:
            h0 = LossAutoScaler.apply(h0, (mtp_loss_scaling_factor / mtp_num_layers) * loss_k, 1.0 / num_microbatches)
    loss_sum = (token_ce(head, h0, labels) * loss_mask).sum()
    num_tokens = loss_mask.sum()
    lm_loss = loss_sum / num_tokens.clamp(min=1)
    return LossOutput(objective=loss_sum if per_token else lm_loss / num_microbatches, lm_loss_sum=loss_sum.detach(),
                      num_tokens=num_tokens.detach(), lm_loss=lm_loss.detach(), mtp_losses=mtp_losses)


def scale_by_tokens(main_grads, num_tokens: int) -> None:
    """Divide every gradient by the step's main-loss token count, as Megatron's ``finalize_model_grads`` does
    under ``calculate_per_token_loss`` (``scaling = 1.0 / num_tokens``: an fp32 factor from the int token count,
    multiplied into each ``main_grad``).  `main_grads`: fp32 tensors, scaled in place."""
    if num_tokens <= 0:         # megatron skips the scaling then (finalize_model_grads: `if num_tokens > 0`)
        return
    scaling = 1.0 / torch.tensor(num_tokens, dtype=torch.int)
    for g in main_grads:
        g.mul_(scaling.to(g.device))
