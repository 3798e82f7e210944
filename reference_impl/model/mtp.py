"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron multi_token_prediction.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .common import RMSNorm, roll_left
from .layer import TransformerLayer
from .linear import Linear


class MTPLayer(nn.Module):
    """Depth k: ``final_layernorm(layer(eh_proj(cat([enorm(emb), hnorm(h)], -1))))``.

    h [s, b, h] (post-final-norm main hidden for k=1, else depth k-1's output), emb [s, b, h] (embedding of
    the ids rolled left k times) -> [s, b, h].  Concatenation order [embedding, hidden] as Megatron's
    ``_concat_embeddings``.  The inner layer is MoE iff the global last decoder layer is (Megatron builds it
    from that layer's spec).
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        eps = cfg.layernorm_epsilon
        self.enorm = RMSNorm(cfg.hidden_size, eps)
        self.hnorm = RMSNorm(cfg.hidden_size, eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.transformer_layer = TransformerLayer(cfg, moe=moe)
        self.final_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h, emb, cos, sin):
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))
        return self.final_layernorm(self.transformer_layer(x, cos, sin))


class MTPBlock(nn.Module):
    """All D depths, as Megatron's MultiTokenPredictionBlock.

    forward(h0 [s, b, h], tokens [b, s] int64, embed: ids [b, s] -> [s, b, h]) ->
    ``cat([h0, h1, ..., hD], dim=0)`` of shape [(1+D)·s, b, h].  The ids roll cumulatively: depth k sees
    token i+k at position i, with token id 0 filling the tail.
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, moe) for k in range(cfg.mtp_num_layers)})

    def forward(self, h0, tokens, embed, cos, sin):
        outputs, h, ids = [h0], h0, tokens
        for layer in self.layers.values():
            ids = roll_left(ids)
            h = layer(h, embed(ids), cos, sin)
            outputs.append(h)
        return torch.cat(outputs, dim=0)
