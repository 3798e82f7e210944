"""One pre-norm transformer layer: MLA attention + dense SwiGLU MLP or MoE (Megatron TransformerLayer)."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import MLASelfAttention
from .common import RMSNorm, SwiGLUMLP
from .moe import MoELayer


class TransformerLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``.  x [s, b, h] -> [s, b, h].

    Parameter names under the layer: ``input_layernorm``, ``self_attention.*``, ``pre_mlp_layernorm``,
    ``mlp.*`` (``mlp.linear_fc1/2`` dense, or ``mlp.router``/``mlp.experts.{e}``/``mlp.shared_experts`` MoE).
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = MLASelfAttention(cfg)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MoELayer(cfg) if moe else SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.pre_mlp_layernorm(h))
