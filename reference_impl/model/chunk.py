"""One pipeline stage (a "model chunk" in Megatron) built from the layout, with global parameter names.

A chunk's ``named_parameters()`` are already the global names (``decoder.layers.{global id}.…``), so
traces from different layouts line up by name.  Placement rules (megatron-semantics §2.1-2.2):
the embedding lives on the first stage and, as a replica, on the MTP stage; the decoder's final norm
lives with the last decoder layer; the output head lives on the loss stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .. import faults
from ..config import ModelConfig
from ..layout import PipelineLayout
from .common import RMSNorm, rope_cos_sin
from .layer import TransformerLayer
from .losses import LossOutput, lm_and_mtp_loss
from .mtp import MTPBlock


@dataclass
class Microbatch:
    """One microbatch, identical on every rank: tokens/labels [b, s] int64, loss_mask [b, s] fp32."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    index: int = 0            # microbatch number within the step


class _Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s, b, h] (Megatron's sequence-first layout)."""
        return self.word_embeddings(ids).transpose(0, 1).contiguous()


class StageChunk(nn.Module):
    """The modules of flat stage ``flat`` of ``layout``.

    forward(x, mb): x is the received activation ([s, b, h], or [(1+D)·s, b, h] after the MTP stage) or
    None on the first stage.  Returns the activation to send, or a `LossOutput` on the loss stage.
    """

    def __init__(self, cfg: ModelConfig, layout: PipelineLayout, flat: int, num_microbatches: int,
                 separate_mtp_embedding: bool = False, inject: Optional[str] = None):
        super().__init__()
        self.cfg, self.flat, self.num_microbatches, self.inject = cfg, flat, num_microbatches, inject
        self.symbols = symbols = layout.stages[flat]
        self.has_embedding_input = "E" in symbols
        self.has_mtp = bool(layout.mtp_layer_ids(flat))
        self.has_loss = "L" in symbols
        self.has_final_norm = flat == layout.last_decoder_stage
        self.applies_final_norm = self.has_final_norm and faults.applies_final_norm(inject, layout)
        moe = cfg.moe_layers
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, moe=bool(moe[i]))
                                             for i in layout.decoder_layer_ids(flat)})
        if self.has_final_norm:
            self.decoder.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        if self.has_embedding_input or self.has_mtp:
            self.embedding = _Embedding(cfg)
        if self.has_mtp:
            self.mtp = MTPBlock(cfg, moe=bool(moe[-1]))
            # Canonical reductions on a chunk holding both embedding uses: the MTP lookup gets its own
            # replica so its gradient accumulates apart from the input lookup's, as on any P>1 layout.
            if separate_mtp_embedding and self.has_embedding_input:
                self.mtp_embedding = _Embedding(cfg)
        if self.has_loss:
            self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: dict = {}
        self.probe = None         # reference_impl.probe.Probe when capture == "activations"

    def global_parameters(self):
        """Yield (global name, replica tag or None, parameter) in module order.

        The MTP stage's word embedding (``embedding`` on a non-first MTP stage, ``mtp_embedding`` when a
        separate replica is kept on the first stage) is the logical ``embedding.word_embeddings.weight`` with
        replica tag ``"mtp"``.
        """
        for name, p in self.named_parameters():
            if name.startswith("mtp_embedding."):
                yield "embedding." + name[len("mtp_embedding."):], "mtp", p
            elif name.startswith("embedding.") and self.has_mtp and not self.has_embedding_input:
                yield name, "mtp", p
            else:
                yield name, None, p

    def rope(self, s: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables [s, 1, 1, r/2] in the activation dtype, cached per (s, device, dtype)."""
        key = (s, str(device), dtype)
        if key not in self._rope:
            cos, sin = rope_cos_sin(s, self.cfg.qk_pos_emb_head_dim, self.cfg.rotary_base)
            self._rope[key] = (cos.to(device, dtype), sin.to(device, dtype))
        return self._rope[key]

    def _probe(self, mb: Microbatch, key: str, t: torch.Tensor) -> torch.Tensor:
        return self.probe(mb.index, key, t) if self.probe is not None else t

    def forward(self, x: Optional[torch.Tensor], mb: Microbatch):
        h = self._probe(mb, "embedding.output", self.embedding(mb.tokens)) if self.has_embedding_input else x
        computed = self.has_embedding_input
        cos, sin = self.rope(mb.tokens.shape[1], mb.tokens.device, h.dtype)
        for i, layer in self.decoder.layers.items():
            h = self._probe(mb, f"decoder.layers.{i}.input", h)
            h, computed = self._probe(mb, f"decoder.layers.{i}.output", layer(h, cos, sin)), True
        if self.applies_final_norm:
            h, computed = self._probe(mb, "decoder.final_layernorm.output", self.decoder.final_layernorm(h)), True
        if self.has_mtp:
            h = self._probe(mb, "mtp.input", h)
            embed = self.mtp_embedding if hasattr(self, "mtp_embedding") else self.embedding
            h = faults.mtp_input(self.inject, self.symbols, h)
            h_mtp = faults.mtp_layers_input(self.inject, h, getattr(self.decoder, "final_layernorm", None))
            out = self.mtp(h_mtp, mb.tokens, embed, cos, sin)
            if h_mtp is not h:      # planted fault: only the MTP layers saw the changed h0, the main path keeps h
                out = torch.cat((h, out[h.shape[0]:]), dim=0)
            h, computed = self._probe(mb, "mtp.output", out), True
        if self.has_loss:
            h = self._probe(mb, "head.input", h)
            return lm_and_mtp_loss(self.output_layer, h, mb.labels, mb.loss_mask, self.cfg.mtp_num_layers,
                                   self.cfg.mtp_loss_scaling_factor,
                                   faults.loss_divisor(self.inject, self.num_microbatches), inject=self.inject)
        # An empty stage passes its input on as a new tensor, like Megatron's empty TransformerBlock.
        return h if computed else h.clone()

    def moe_layers(self):
        """All MoE layers of this chunk (decoder and MTP), for the aux-loss scale and expert-bias update."""
        from .moe import MoELayer
        return [m for m in self.modules() if isinstance(m, MoELayer)]
