"""Multi-head Latent Attention with decoupled RoPE (DeepSeek-V3 §2.1.1; Megatron MLASelfAttention)."""
from __future__ import annotations

import math

import torch
from torch import nn

from trainerkit.config import ModelConfig

from .common import RMSNorm, apply_rope
from .linear import Linear


class MLASelfAttention(nn.Module):
    """Causal MLA.  Input x [s, b, h] fp32, RoPE tables [s, 1, 1, r/2] (`rope_cos_sin`) -> output [s, b, h].

    Queries: ``W_UQ · RMSNorm(W_DQ x)`` -> per head [d_qk nope | r rope]; keys/values from the compressed
    ``c_kv = RMSNorm(W_DKV x)[:kv_lora]`` via ``W_UKV``; the rope part of the key is one shared head
    taken from the last r columns of ``W_DKV x``.  RoPE as megatron's MLA with ``rope_type="rope"``
    (multi_latent_attention.py, ``MLASelfAttention.get_query_key_value_tensors`` ->
    ``qkv_up_proj_and_rope_apply``): `apply_rope` on q_pos_emb [s, b, n, r] and on k_pos_emb [s, b, 1, r],
    which is then expanded to n heads; the roped parts stay de-interleaved.  Softmax scale
    ``mscale**2 / sqrt(d_qk + r)`` with mscale = 1 (``MLASelfAttention.__init__``: ``_yarn_get_mscale``
    is 1 for megatron's default ``mscale_all_dim=0``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, dq, r, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.n, self.dq, self.r, self.dv, self.kv_lora = n, dq, r, dv, cfg.kv_lora_rank
        h = cfg.hidden_size
        self.linear_q_down_proj = Linear(h, cfg.q_lora_rank)
        self.q_layernorm = RMSNorm(cfg.q_lora_rank, cfg.layernorm_epsilon)
        self.linear_q_up_proj = Linear(cfg.q_lora_rank, n * (dq + r))
        self.linear_kv_down_proj = Linear(h, cfg.kv_lora_rank + r)
        self.kv_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.layernorm_epsilon)
        self.linear_kv_up_proj = Linear(cfg.kv_lora_rank, n * (dq + dv))
        self.linear_proj = Linear(n * dv, h)
        self.scale = 1.0 / math.sqrt(dq + r)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x))).view(s, b, self.n, self.dq + self.r)
        q_nope, q_pe = q.split([self.dq, self.r], dim=-1)
        kv_c, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora, self.r], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(kv_c)).view(s, b, self.n, self.dq + self.dv)
        k_nope, v = kv.split([self.dq, self.dv], dim=-1)
        # rope on the shared key head once, then broadcast to every head (megatron: unsqueeze(-2), apply, expand)
        q = torch.cat((q_nope, apply_rope(q_pe, cos, sin)), dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin).expand(s, b, self.n, self.r)
        k = torch.cat((k_nope, k_pe), dim=-1)
        # [b, n, s, d] for batched matmuls
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")).float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, self.n * self.dv)
        return self.linear_proj(out)
