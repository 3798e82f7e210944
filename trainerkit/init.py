"""Parameter initialisation keyed by the global parameter name, so every layout starts from identical weights.

Megatron seeds per pipeline rank (megatron-semantics §7.3), which makes init layout-dependent; here each
tensor draws from its own generator seeded with ``blake2b(seed, global name)``, on the CPU, in fp32.
Distributions follow Megatron's defaults: matrices N(0, std); output projections (``linear_proj``,
``linear_fc2``) N(0, std/sqrt(2·num_layers)) (scaled_init_method_normal); norm weights 1.  Router weights
(``….mlp.router.weight``, decoder and MTP layers alike) use ``moe_router_init_method_std`` when set (a wide std
that makes router top-k ties happen, `config.ModelConfig`), else ``init_method_std``.
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
def init_parameters(module, cfg: ModelConfig, seed: int) -> None:
    """Initialise parameters in place by global name; norms are set to ones, biases to zeros.

    `module`: an ``nn.Module`` whose ``named_parameters()`` are global names, or an iterable of
    (global name, parameter) pairs (replicas pass their logical name, so they start identical).
    """
    scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    named = module.named_parameters() if isinstance(module, nn.Module) else module
    for name, param in named:
        if name.endswith("bias"):         # a user's model in megatron's own loop (bitparity's models have none)
            param.zero_()
            continue
        if param.ndim < 2:
            param.fill_(1.0)
            continue
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = scaled_std
        elif name.endswith("router.weight") and cfg.moe_router_init_method_std is not None:
            std = cfg.moe_router_init_method_std
        else:
            std = cfg.init_method_std
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        # fp32 draws whatever torch's default dtype: with float64 as default, torch draws another sequence
        # (measured: different values from 16 elements on), and the init would depend on the caller
        param.copy_(torch.normal(0.0, std, size=tuple(param.shape), generator=gen, dtype=torch.float32))
