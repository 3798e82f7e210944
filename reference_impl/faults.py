"""Planted faults (test-only; never on by default) that prove the harness detects and localises bugs.

Selected with ``RunConfig.inject`` (the harness's ``--inject NAME`` or a variant's ``inject:`` key).
Each is a deliberate bug of the kind users hit, switched on at one well-defined place:

* ``grad_bit_flip``: flip the lowest mantissa bit of element 0 of the gradient of the last decoder layer's
  ``self_attention.linear_q_down_proj.weight`` at step 0 (after accumulation, before capture).
* ``swap_backward_microbatches``: the stage holding the last decoder layer runs the backward of microbatches 1
  and 2 in swapped order, so its parameters accumulate ``(g0 + g2) + g1`` instead of ``(g0 + g1) + g2``.
* ``renorm_when_mtp_alone``: a stage holding only the MTP layer(s) normalises its input again (an extra,
  weightless RMSNorm on h0) — a layout-dependent bug that only some layouts trigger, for the fuzzer.
* ``crash_rank``: the last pipeline rank raises at step 0 (a crashed rank, for the watchdog).
* ``hang_rank``: the last pipeline rank sleeps forever at step 0 (a hung rank, for the watchdog).
"""
from __future__ import annotations

import time

import torch

FAULTS = ("grad_bit_flip", "swap_backward_microbatches", "renorm_when_mtp_alone", "crash_rank", "hang_rank")


class FaultError(ValueError):
    """Unknown fault name."""


def check(name):
    """Raise `FaultError` unless `name` is None or a known fault."""
    if name is not None and name not in FAULTS:
        raise FaultError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")


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


@torch.no_grad()
def after_grads(name, step, params, num_layers):
    """Gradient faults, applied to the accumulated main_grads before capture.  params: (key, name, replica, p)."""
    if name != "grad_bit_flip" or step != 0:
        return
    target = f"decoder.layers.{num_layers - 1}.self_attention.linear_q_down_proj.weight"
    for key, _, _, p, _ in params:
        if key == target:
            flat = p.main_grad.view(-1).view(torch.int32)
            flat[0] ^= 1


def mtp_input(name, symbols, h):
    """MTP-input faults: ``renorm_when_mtp_alone`` on a stage that holds nothing but MTP layers."""
    if name == "renorm_when_mtp_alone" and set(symbols) == {"m"}:
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    return h
