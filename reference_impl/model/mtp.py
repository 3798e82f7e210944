"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron multi_token_prediction.py)."""
from __future__ import annotations

import torch
from torch import nn

from trainerkit.config import ModelConfig

from .common import RMSNorm, fanout, roll_left
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

    def nodes(self, depth: int, last: bool, ids, embed, cos, sin) -> dict:
        """{slot: fn(state)} of depth `depth` (0-based) as Megatron's ``build_mtp_layer_callables``:
        pre_dispatch = embedding of the rolled ids `ids` [b, s] (via `embed`), enorm / hnorm / concat /
        eh_proj, then the inner layer's pre_dispatch; the inner layer's dispatch / mlp / combine; mtp_post =
        final_layernorm, stored as ``state["mtp.{depth + 1}"]`` for the output concatenation and (unless
        `last`) passed on as the next depth's hidden input ``state["h"]``."""
        fns = self.transformer_layer.nodes(cos, sin)
        inner_pre = fns["pre_dispatch"]

        def pre_dispatch(st):
            st["h"] = self.eh_proj(torch.cat((self.enorm(embed(ids)), self.hnorm(st["h"])), dim=-1))
            inner_pre(st)

        def mtp_post(st):
            out = self.final_layernorm(st.pop("h"))
            if last:
                st[f"mtp.{depth + 1}"] = out
            else:       # the next depth's hidden input and the concatenation both consume it
                st["h"], st[f"mtp.{depth + 1}"] = fanout(out, 2)

        return {**fns, "pre_dispatch": pre_dispatch, "mtp_post": mtp_post}

    def forward(self, h, emb, cos, sin):
        st = {"h": h}
        for fn in self.nodes(0, True, None, lambda _ids: emb, cos, sin).values():
            fn(st)
        return st["mtp.1"]


class MTPBlock(nn.Module):
    """All D depths, as Megatron's MultiTokenPredictionBlock.

    forward(h0 [s, b, h], tokens [b, s] int64, embed: ids [b, s] -> [s, b, h]) ->
    ``cat([h0, h1, ..., hD], dim=0)`` of shape [(1+D)·s, b, h].  The ids roll cumulatively: depth k sees
    token i+k at position i, with token id 0 filling the tail.
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, moe) for k in range(cfg.mtp_num_layers)})

    def nodes(self, tokens, embed, cos, sin) -> list[dict]:
        """Per depth, {slot: fn(state)} (`MTPLayer.nodes`).  Expects ``state["h"]`` = the hidden input of
        depth 1 and ``state["mtp.0"]`` = h0 for the concatenation (`begin`); the last depth leaves
        ``state["h"] = cat([h0, h1, ..., hD])`` [(1+D)·s, b, h]."""
        out, ids, n = [], tokens, len(self.layers)
        for k, layer in enumerate(self.layers.values()):
            ids = roll_left(ids)
            out.append(layer.nodes(k, k == n - 1, ids, embed, cos, sin))
        concat = out[-1]["mtp_post"]

        def mtp_post_and_concat(st):
            concat(st)
            st["h"] = torch.cat([st.pop(f"mtp.{k}") for k in range(n + 1)], dim=0)

        out[-1]["mtp_post"] = mtp_post_and_concat
        return out

    @staticmethod
    def begin(st: dict) -> None:
        """h0 = ``state["h"]`` feeds both depth 1 and the concatenation: fan it out."""
        st["h"], st["mtp.0"] = fanout(st["h"], 2)

    def forward(self, h0, tokens, embed, cos, sin):
        st = {"h": h0}
        self.begin(st)
        for fns in self.nodes(tokens, embed, cos, sin):
            for fn in fns.values():
                fn(st)
        return st["h"]
