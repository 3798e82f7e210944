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

from trainerkit.config import ModelConfig
from trainerkit.layout import PipelineLayout

from .. import faults
from .common import RMSNorm, rope_cos_sin
from .layer import TransformerLayer
from .losses import lm_and_mtp_loss
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
        self.per_token_loss = False      # Megatron's calculate_per_token_loss (`losses.lm_and_mtp_loss`)
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

    def nodes(self, mb: Microbatch, dtype: torch.dtype, overlap: bool = False) -> tuple:
        """This chunk's computation for microbatch `mb` as schedule nodes (model/plan.py):
        ``(pre, layers, post)`` where `pre` and `post` are fn(state) and `layers` lists, per decoder layer
        then per MTP depth, {slot: fn(state)}.  The state's ``"h"`` enters as the received activation (None on
        the first stage); `post` leaves the result in ``state["out"]``: the activation to send, or a
        `LossOutput` on the loss stage.  dtype: the activation dtype (of the RoPE tables).  `overlap` only
        matters for the planted fault ``overlap_skips_final_norm``."""
        cos, sin = self.rope(mb.tokens.shape[1], mb.tokens.device, dtype)
        layers: list[dict] = []
        ids = list(self.decoder.layers)
        for i, layer in self.decoder.layers.items():
            fns = dict(layer.nodes(cos, sin))
            first, last = fns["pre_dispatch"], list(fns)[-1]
            fns["pre_dispatch"] = self._probed_input(first, mb, f"decoder.layers.{i}.input")
            fns[last] = self._layer_end(fns[last], mb, i, i == ids[-1], overlap)
            layers.append(fns)
        if self.has_mtp:
            embed = self.mtp_embedding if hasattr(self, "mtp_embedding") else self.embedding
            depths = self.mtp.nodes(mb.tokens, embed, cos, sin)
            first = depths[0]["pre_dispatch"]

            def mtp_pre(st):
                self._mtp_begin(st, mb)
                first(st)
            depths[0]["pre_dispatch"] = mtp_pre
            concat = depths[-1]["mtp_post"]

            def mtp_end(st):
                concat(st)
                st["h"] = self._probe(mb, "mtp.output", st["h"])
            depths[-1]["mtp_post"] = mtp_end
            layers += depths
        computed = self.has_embedding_input or bool(layers) or self.applies_final_norm

        def pre(st):
            if self.has_embedding_input:
                st["h"] = self._probe(mb, "embedding.output", self.embedding(mb.tokens))

        def post(st):
            h = st.pop("h")
            if self.has_loss:
                h = self._probe(mb, "head.input", h)
                st["out"] = lm_and_mtp_loss(self.output_layer, h, mb.labels, mb.loss_mask, self.cfg.mtp_num_layers,
                                            self.cfg.mtp_loss_scaling_factor,
                                            faults.loss_divisor(self.inject, self.num_microbatches),
                                            inject=self.inject, per_token=self.per_token_loss)
            else:
                # an empty stage passes its input on as a new tensor, like Megatron's empty TransformerBlock
                st["out"] = h if computed else h.clone()
        return pre, layers, post

    def _probed_input(self, fn, mb: Microbatch, key: str):
        def wrapped(st):
            st["h"] = self._probe(mb, key, st["h"])
            fn(st)
        return wrapped

    def _layer_end(self, fn, mb: Microbatch, i: str, last_decoder_layer: bool, overlap: bool):
        """The layer's last node + output probe, and after the chunk's last decoder layer the decoder's final
        norm (Megatron applies it in that layer's combine node)."""
        def wrapped(st):
            fn(st)
            st["h"] = self._probe(mb, f"decoder.layers.{i}.output", st["h"])
            if last_decoder_layer and self.applies_final_norm and not faults.overlap_skips_final_norm(
                    self.inject, overlap):
                st["h"] = self._probe(mb, "decoder.final_layernorm.output", self.decoder.final_layernorm(st["h"]))
        return wrapped

    def _mtp_begin(self, st: dict, mb: Microbatch) -> None:
        """h0 for the MTP depths and the output concatenation (planted faults may make them differ)."""
        h = self._probe(mb, "mtp.input", st["h"])
        h = faults.mtp_input(self.inject, self.symbols, h)
        h_mtp = faults.mtp_layers_input(self.inject, h, getattr(self.decoder, "final_layernorm", None))
        st["h"] = h
        if h_mtp is h:
            self.mtp.begin(st)
        else:           # planted fault: only the MTP layers see the changed h0, the main path keeps h
            st["h"], st["mtp.0"] = h_mtp, h

    def forward(self, x: Optional[torch.Tensor], mb: Microbatch):
        """Run the nodes back to back (one autograd graph): returns the activation to send or a `LossOutput`."""
        dtype = x.dtype if x is not None else self.embedding.word_embeddings.weight.dtype
        pre, layers, post = self.nodes(mb, dtype)
        st = {"h": x}
        pre(st)
        for fns in layers:
            for fn in fns.values():
                fn(st)
        post(st)
        return st["out"]

    def moe_layers(self):
        """All MoE layers of this chunk (decoder and MTP), for the aux-loss scale and expert-bias update."""
        from .moe import MoELayer
        return [m for m in self.modules() if isinstance(m, MoELayer)]
