"""One pre-norm transformer layer: MLA attention + dense SwiGLU MLP or MoE (Megatron TransformerLayer)."""
from __future__ import annotations

import torch
from torch import nn

from trainerkit.config import ModelConfig

from .attention import MLASelfAttention
from .common import RMSNorm, SwiGLUMLP, fanout
from .moe import MoELayer

# a layer's nodes in forward order (Megatron's TransformerLayerSchedulePlan); backward runs them reversed
SLOTS = ("pre_dispatch", "dispatch", "mlp", "combine", "mtp_post")


class TransformerLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``.  x [s, b, h] -> [s, b, h].

    Parameter names under the layer: ``input_layernorm``, ``self_attention.*``, ``pre_mlp_layernorm``,
    ``mlp.*`` (``mlp.linear_fc1/2`` dense, or ``mlp.router``/``mlp.experts.{e}``/``mlp.shared_experts`` MoE).

    The computation is split into the nodes of Megatron's 1F1B overlap schedule
    (``models/gpt/fine_grained_callables.py::build_transformer_layer_callables``): `nodes` returns them per
    slot (`SLOTS`); each reads and writes a state dict whose key ``"h"`` is the hidden stream [s, b, h].
    `forward` runs them back to back, so the plain and the overlapped schedules share one definition.
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.is_moe = moe
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = MLASelfAttention(cfg)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MoELayer(cfg) if moe else SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def nodes(self, cos: torch.Tensor, sin: torch.Tensor) -> dict:
        """{slot: fn(state)} for the slots this layer uses: pre_dispatch (attention + residual, and for MoE
        the pre-MLP norm, router, shared expert and permute), dispatch and combine (MoE only), mlp (the
        experts, or the whole dense MLP block with its residual)."""
        fns = {"pre_dispatch": lambda st: self._pre_dispatch(st, cos, sin), "mlp": self._mlp}
        if self.is_moe:
            fns.update(dispatch=self.mlp.dispatch, combine=self._combine)
        return {slot: fns[slot] for slot in SLOTS if slot in fns}

    def _pre_dispatch(self, st: dict, cos, sin) -> None:
        to_norm, to_residual = fanout(st["h"], 2)
        h = to_residual + self.self_attention(self.input_layernorm(to_norm), cos, sin)
        if self.is_moe:
            to_norm, h = fanout(h, 2)
            self.mlp.pre_dispatch(st, self.pre_mlp_layernorm(to_norm))
        st["h"] = h

    def _mlp(self, st: dict) -> None:
        if self.is_moe:
            self.mlp.experts_compute(st)
        else:
            to_norm, to_residual = fanout(st["h"], 2)
            st["h"] = to_residual + self.mlp(self.pre_mlp_layernorm(to_norm))

    def _combine(self, st: dict) -> None:
        st["h"] = st["h"] + self.mlp.combine(st)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        st = {"h": x}
        for fn in self.nodes(cos, sin).values():
            fn(st)
        return st["h"]
