"""Optional in-step capture (``capture: activations``): fingerprints of every layer's input and output and
of their gradients, per microbatch, keyed by global names (``decoder.layers.37.output``,
``decoder.layers.37.output.grad``) so layouts compare; and of every stage-boundary tensor on the sender and
the receiver side (keyed by direction, sending stage and microbatch: layout-specific, checked within a run).
"""
from __future__ import annotations

import torch

from trainerkit.fingerprint import fingerprint_hex


class Probe:
    """Collects fingerprints for one step.  ``activations``: {"<mb>/<key>": hex}; ``boundaries``:
    {"<F|B>/<sender stage>/<mb>/<send|recv>": hex}."""

    def __init__(self):
        self.activations: dict = {}
        self.boundaries: dict = {}

    def __call__(self, mb: int, key: str, t: torch.Tensor) -> torch.Tensor:
        """Record `t` under `key` for microbatch `mb`, and its gradient under ``key + ".grad"`` when autograd
        computes it.  Returns `t` unchanged (an identity on the graph)."""
        self.activations[f"{mb}/{key}"] = fingerprint_hex(t)
        if t.requires_grad:
            t.register_hook(lambda g: self.activations.__setitem__(f"{mb}/{key}.grad", fingerprint_hex(g)))
        return t

    def boundary(self, direction: str, sender_stage: int, mb: int, side: str, t: torch.Tensor) -> None:
        """Record a boundary tensor as sent (sender side) or received (receiver side)."""
        self.boundaries[f"{direction}/{sender_stage}/{mb}/{side}"] = fingerprint_hex(t)

    def take(self) -> dict:
        """Return this step's records ({"activations", "boundaries"}) and start empty for the next step."""
        out = {"activations": self.activations, "boundaries": self.boundaries}
        self.activations, self.boundaries = {}, {}
        return out
