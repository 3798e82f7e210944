"""Runs one rank's action list for one step: forward/backward of its chunks and the p2p transfers.

A send immediately followed by a receive is posted with it in one ``batch_isend_irecv`` (Megatron's combined
``send_forward_recv_backward``); any other send is posted alone before the next compute.  NCCL needs this
pairing: it matches p2p ops per peer in posting order (tags are ignored), and a group holding two sends
whose receives sit in different groups of the peer fails.  On gloo, messages also carry a tag made of
(direction, stage, microbatch), so a receive can only ever match its own message.  After each backward the chunk's ``.grad`` is added to
``main_grad`` (fp32), so every parameter accumulates microbatches in ascending order (the schedule
guarantees the order; megatron-semantics §4 "Gradient accumulation").
"""
from __future__ import annotations

from typing import Optional

import torch

from . import faults
from .model.chunk import Microbatch, StageChunk
from .model.losses import LossOutput
from .schedule import Action


def _tag(direction: str, sender_stage: int, microbatch: int, num_microbatches: int) -> int:
    return (sender_stage * 2 + (direction == "B")) * num_microbatches + microbatch


def accumulate_main_grads(chunk: StageChunk, num_microbatches: int = 1, inject: Optional[str] = None) -> None:
    """``main_grad += grad`` (fp32, whatever the param dtype) for every parameter that received a gradient,
    then drop ``.grad`` (Megatron's DDP grad-accumulation hook).  `num_microbatches` and `inject` only
    matter for the planted fault ``rescale_grads_per_microbatch``."""
    for p in chunk.parameters():
        if p.grad is not None:
            grad = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
            p.main_grad.add_(faults.microbatch_grad(inject, grad, num_microbatches))
            p.grad = None


class StepExecutor:
    """Executes a list of `Action` for the chunks of one rank.

    chunks: flat stage index -> `StageChunk`.  ``run(actions, microbatches)`` returns the `LossOutput` of
    each microbatch computed on this rank (loss stage only), in microbatch order.  `inject`: a planted fault
    (`reference_impl.faults`).
    """

    def __init__(self, chunks: dict[int, StageChunk], num_microbatches: int, transport, dtype: torch.dtype,
                 inject: Optional[str] = None, probe=None):
        self.chunks, self.m, self.transport, self.dtype = chunks, num_microbatches, transport, dtype
        self.inject, self.probe = inject, probe

    def run(self, actions: list[Action], microbatches: list[Microbatch]) -> list[LossOutput]:
        """Execute one step's `actions` in order; returns this rank's per-microbatch `LossOutput` s (loss stage)."""
        inputs: dict = {}       # (stage, mb) -> received activation (requires grad)
        stash: dict = {}        # (stage, mb) -> (input, output) kept for backward
        grads_in: dict = {}     # (stage, mb) -> received output gradient
        pending: list = []      # queued sends (tensor, peer, tag)
        works: list = []
        losses: dict[int, LossOutput] = {}
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.op in ("F", "B") and pending:          # sends not followed by a receive go alone
                works += self.transport.batch(pending, None)[1]
                pending = []
            if a.op == "RECV_F" or a.op == "RECV_B":
                direction, sender = ("F", a.stage - 1) if a.op == "RECV_F" else ("B", a.stage + 1)
                tag = _tag(direction, sender, a.microbatch, self.m)
                buf, sent = self.transport.batch(pending, (a.shape, self.dtype, a.peer, tag))
                works += sent
                pending = []
                if self.probe is not None:
                    self.probe.boundary(direction, sender, a.microbatch, "recv", buf)
                if a.op == "RECV_F":
                    inputs[key] = buf.requires_grad_()
                else:
                    grads_in[key] = buf
            elif a.op == "F":
                x = inputs.pop(key, None)
                chunk = self.chunks[a.stage]
                mb = faults.loss_input_microbatch(self.inject, a.microbatch, chunk.has_loss and x is not None)
                out = chunk(x, microbatches[mb])
                stash[key] = (x, out)
                if isinstance(out, LossOutput):
                    losses[a.microbatch] = out
            elif a.op == "SEND_F":
                out = stash[key][1].detach()
                if self.probe is not None:
                    self.probe.boundary("F", a.stage, a.microbatch, "send", out)
                pending.append((out, a.peer, _tag("F", a.stage, a.microbatch, self.m)))
            elif a.op == "B":
                x, out = stash.pop(key)
                if isinstance(out, LossOutput):
                    torch.autograd.backward(out.objective)
                else:
                    torch.autograd.backward(out, grads_in.pop(key))
                accumulate_main_grads(self.chunks[a.stage], self.m, self.inject)
                if x is not None:
                    stash[("grad",) + key] = x.grad
            elif a.op == "SEND_B":
                g = stash.pop(("grad",) + key)
                if self.probe is not None:
                    self.probe.boundary("B", a.stage, a.microbatch, "send", g)
                pending.append((g, a.peer, _tag("B", a.stage, a.microbatch, self.m)))
            else:
                raise ValueError(f"unknown action {a}")
        if pending:
            works += self.transport.batch(pending, None)[1]
        for w, _ in works:
            w.wait()
        return [losses[m] for m in sorted(losses)]
