"""Parameter initialisation keyed by the global parameter name, so every layout starts from identical weights.

Megatron seeds per pipeline rank (megatron-semantics §7.3), which makes init layout-dependent; here each
tensor draws from its own generator seeded with ``blake2b(seed, global name)``, on the CPU, in fp32.
Distributions follow Megatron's defaults: matrices N(0, std); output projections (``linear_proj``,
``linear_fc2``) N(0, std/sqrt(2·num_layers)) (scaled_init_method_normal); norm weights 1.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from .config import ModelConfig


def name_seed(seed: int, name: str) -> int:
    """63-bit generator seed for one global parameter name."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter of `module` in place, by its (global) name; norms are left at ones."""
    scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    for name, param in module.named_parameters():
        if param.ndim < 2:
            param.fill_(1.0)
            continue
        std = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_method_std
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        param.copy_(torch.normal(0.0, std, size=tuple(param.shape), generator=gen))
