"""Runs one rank's action list for one step: forward/backward of its chunks and the p2p transfers.

Each (chunk, microbatch) is a `model.plan.ChunkPlan`: one autograd graph under the plain schedules, node by
node under the 1F1B overlap (``FB`` actions merge a forward and a backward with `model.plan.run_combined`).

A send immediately followed by a receive is posted with it in one ``batch_isend_irecv`` (Megatron's combined
``send_forward_recv_backward``); any other send is posted alone before the next compute.  NCCL needs this
pairing: it matches p2p ops per peer in posting order (tags are ignored), and a group holding two sends
whose receives sit in different groups of the peer fails.  On gloo, messages also carry a tag made of
(direction, stage, microbatch), so a receive can only ever match its own message.  Every send is checked
against the schedule's shape first (`BoundaryShapeError`): the receiver allocates exactly that shape.  After
each backward the chunk's ``.grad`` is added to
``main_grad`` (fp32), so every parameter accumulates microbatches in ascending order (the schedule
guarantees the order; megatron-semantics §4 "Gradient accumulation").
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from trainerkit.schedule import Action

from . import faults
from .model.chunk import Microbatch, StageChunk
from .model.losses import LossOutput
from .model.plan import ChunkPlan, run_combined


class BoundaryShapeError(RuntimeError):
    """A tensor about to cross a pipeline boundary differs in shape from the schedule's (which both sides use)."""


def _tag(direction: str, sender_stage: int, microbatch: int, num_microbatches: int) -> int:
    return (sender_stage * 2 + (direction == "B")) * num_microbatches + microbatch


def accumulate_main_grads(params: list, num_microbatches: int = 1, inject: Optional[str] = None) -> None:
    """``main_grad += grad`` (fp32, whatever the param dtype) for every parameter of `params` (one chunk's, in
    ``chunk.parameters()`` order) that received a gradient, then drop ``.grad`` (Megatron's DDP
    grad-accumulation hook).  `num_microbatches` and `inject` only matter for the planted fault
    ``rescale_grads_per_microbatch``."""
    for p in params:
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
                 inject: Optional[str] = None, probe=None, overlap: bool = False, delay_wgrad: bool = False):
        self.chunks, self.m, self.transport, self.dtype = chunks, num_microbatches, transport, dtype
        self.inject, self.probe, self.overlap, self.delay_wgrad = inject, probe, overlap, delay_wgrad
        # walked after every backward: listed once (walking the module tree each time cost ~5 % of a step)
        self.params = {s: list(c.parameters()) for s, c in chunks.items()}

    def _check_send(self, a: Action, t: torch.Tensor) -> None:
        """Raises `BoundaryShapeError` naming the boundary when `t`, the tensor `a` sends, does not have the
        schedule's shape.  The receiver allocates the schedule's shape, so gloo would abort it on a bigger
        message ("8192 vs 4096", no context) and fill a smaller one only partly; checking on the sender costs
        no message and moves no bit."""
        if tuple(t.shape) == tuple(a.shape):
            return
        pp = self.transport.pipeline_size
        forward = a.op == "SEND_F"
        receiver = a.stage + 1 if forward else a.stage - 1
        where = lambda s: f"stage {s} (pp rank {s % pp}, virtual stage {s // pp})"  # noqa: E731
        raise BoundaryShapeError(
            f"pipeline boundary shape mismatch: {'forward activation' if forward else 'backward gradient'} of "
            f"microbatch {a.microbatch}, {where(a.stage)} -> {where(receiver)}: receiver expects "
            f"{list(a.shape)} (schedule), sender has {list(t.shape)}")

    def run(self, actions: list[Action], microbatches: list[Microbatch]) -> list[LossOutput]:  # noqa: C901 (one branch per action kind of the schedule)
        """Execute one step's `actions` in order; returns this rank's per-microbatch `LossOutput` s (loss stage).
        Raises `BoundaryShapeError` when a tensor to send differs from the schedule's shape.

        On CPU each compute action's wall time is kept in `self.timings` ([{op, stage, microbatch, start_s,
        end_s}]: `time.perf_counter`, CLOCK_MONOTONIC, one clock for every rank process of the host, so the
        harness can line the ranks up; an FB pair adds b_stage, b_microbatch) for the report's measured
        schedule timeline.  On CUDA the host only queues kernels, so no time is kept
        (`timings` stays empty) rather than a misleading one."""
        self.timings = []
        clock = time.perf_counter if self.transport.device.type == "cpu" else None
        inputs: dict = {}       # (stage, mb) -> received activation (requires grad)
        plans: dict = {}        # (stage, mb) -> ChunkPlan kept for backward
        grads_in: dict = {}     # (stage, mb) -> received output gradient
        grads_out: dict = {}    # (stage, mb) -> gradient of the received activation, to send back
        pending: list = []      # queued sends (tensor, peer, tag)
        works: list = []
        losses: dict[int, LossOutput] = {}

        def begin_forward(stage: int, microbatch: int) -> ChunkPlan:
            x = inputs.pop((stage, microbatch), None)
            chunk = self.chunks[stage]
            mb = faults.loss_input_microbatch(self.inject, microbatch, chunk.has_loss and x is not None)
            plan = ChunkPlan(chunk, x, microbatches[mb], self.dtype, self.overlap, self.delay_wgrad)
            plans[(stage, microbatch)] = plan
            return plan

        def end_forward(stage: int, microbatch: int) -> None:
            out = plans[(stage, microbatch)].output
            if isinstance(out, LossOutput):
                losses[microbatch] = out

        def end_backward(stage: int, microbatch: int, plan: ChunkPlan) -> None:
            accumulate_main_grads(self.params[stage], self.m, self.inject)
            if plan.x is not None:
                grads_out[(stage, microbatch)] = plan.input_grad

        for a in actions:
            key = (a.stage, a.microbatch)
            if a.op in ("F", "B", "FB") and pending:    # sends not followed by a receive go alone
                works += self.transport.batch(pending, None)[1]
                pending = []
            start = clock() if clock and a.op in ("F", "B", "FB") else None
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
                begin_forward(a.stage, a.microbatch).forward()
                end_forward(a.stage, a.microbatch)
            elif a.op == "B":
                plan = plans.pop(key)
                plan.backward(grads_in.pop(key, None))
                end_backward(a.stage, a.microbatch, plan)
            elif a.op == "FB":
                bkey = (a.b_stage, a.b_microbatch)
                f_plan, b_plan = begin_forward(a.stage, a.microbatch), plans.pop(bkey)
                run_combined(f_plan, b_plan, grads_in.pop(bkey, None))
                end_forward(a.stage, a.microbatch)
                end_backward(a.b_stage, a.b_microbatch, b_plan)
            elif a.op == "SEND_F":
                out = plans[key].output.detach()
                self._check_send(a, out)
                if self.probe is not None:
                    self.probe.boundary("F", a.stage, a.microbatch, "send", out)
                pending.append((out, a.peer, _tag("F", a.stage, a.microbatch, self.m)))
            elif a.op == "SEND_B":
                g = grads_out.pop(key)
                self._check_send(a, g)
                if self.probe is not None:
                    self.probe.boundary("B", a.stage, a.microbatch, "send", g)
                pending.append((g, a.peer, _tag("B", a.stage, a.microbatch, self.m)))
            else:
                raise ValueError(f"unknown action {a}")
            if start is not None:
                self.timings.append({"op": a.op, "stage": a.stage, "microbatch": a.microbatch,
                                     "start_s": start, "end_s": clock(),
                                     **({"b_stage": a.b_stage, "b_microbatch": a.b_microbatch} if a.op == "FB" else {})})
        if pending:
            works += self.transport.batch(pending, None)[1]
        for w, _ in works:
            w.wait()
        return [losses[m] for m in sorted(losses)]
