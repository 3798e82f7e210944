"""Build megatron-core's GPTModel (MLA, MoE, MTP) for one pipeline rank from a bitparity run config.

One model chunk per virtual stage of this rank, as Megatron-LM's ``training.get_model`` /
``gpt_builders.gpt_builder`` build them: the layout string goes to megatron as-is
(``pipeline_model_parallel_layout``), so megatron's own parser and validator decide what each chunk holds;
pre/post-process by ``is_pipeline_first_stage`` / ``is_pipeline_last_stage(ignore_virtual=False)``; the MTP
block spec where the layout puts MTP layers (``get_gpt_mtp_block_spec`` returns None elsewhere), its inner layer
the spec of the *global* last decoder layer (an MTP-only stage's own block spec is empty).  Local (non-TE) specs; plain RoPE.

Then every parameter is renamed to its global name (`global_parameters`) and re-initialised from the case seed
keyed by that name (`trainerkit.init`), as the reference trainer does: Megatron's own init depends on which
parameters a rank builds, which would make every layout start from other weights.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainerkit import names
from trainerkit.config import RunConfig
from trainerkit.fingerprint_shard import Shard

from . import faults, hybrid, options


def transformer_config(cfg: RunConfig):
    """megatron's MLATransformerConfig for `cfg` (Megatron names map one to one; the rest pinned here).

    The case's ``megatron:`` options (`options.for_config`) override any of these.  Pinned, with why:
    ``overlap_p2p_comm=True, batch_p2p_comm=False`` (on gloo megatron's default batched p2p
    pairs the wrong messages at P=2 V=2 and deadlocks at P=4 with a standalone MTP stage; Megatron-LM's
    default with virtual stages anyway); ``rope_type="rope"`` (plain RoPE, as the reference; MLA's default is
    YaRN); the seq aux loss and sigmoid router of DeepSeek-V3 §2.1.2; the alltoall dispatcher; no bias, no
    dropout, RMSNorm, SwiGLU; fp32 router; ``use_cpu_initialization`` (weights are re-initialised anyway).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, par = cfg.model, cfg.parallel
    bf16 = cfg.params_dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    virtual = _virtual_size(cfg)
    # megatron asserts bf16 or fp16 for the MoE 1F1B overlap (TransformerConfig.__post_init__); bitparity also
    # runs it in fp32 on CPU (as the reference trainer does): the config is validated as bf16, then set to fp32.
    # Nothing else in __post_init__ reads bf16 unless disable_bf16_reduced_precision_matmul is set (it is not).
    relax = par.overlap_moe_expert_parallel_comm and not bf16
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.v_head_dim,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, rope_type="rope",
        rotary_base=m.rotary_base, normalization="RMSNorm", layernorm_epsilon=m.layernorm_epsilon,
        qk_layernorm=True, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=m.init_method_std,
        num_moe_experts=m.num_moe_experts, moe_layer_freq=m.moe_layers, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_topk=m.moe_router_topk, moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk, moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_router_load_balancing_type="seq_aux_loss",
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        mtp_num_layers=m.mtp_num_layers or None,
        mtp_loss_scaling_factor=faults.mtp_loss_scaling_factor(cfg.inject, m.mtp_loss_scaling_factor)
        if m.mtp_num_layers else None,
        tensor_model_parallel_size=par.tensor_model_parallel_size, sequence_parallel=par.sequence_parallel,
        expert_tensor_parallel_size=par.expert_tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual, expert_model_parallel_size=par.expert_model_parallel_size,
        pipeline_model_parallel_layout=par.pipeline_model_parallel_layout,
        overlap_p2p_comm=virtual is not None, batch_p2p_comm=False,
        overlap_moe_expert_parallel_comm=par.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=par.delay_wgrad_compute,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16 or relax, use_cpu_initialization=True,
        perform_initialization=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, cross_entropy_loss_fusion=False, deterministic_mode=True,
    )
    # the case's own megatron options (`options`) over bitparity's: Megatron-LM's arguments reach the config by
    # field name
    if cfg.model_class == "hybrid":
        kwargs.update(hybrid.config_fields(cfg))
    mine = options.for_config(cfg, "MLATransformerConfig")
    if "batch_p2p_comm" in mine and "overlap_p2p_comm" not in mine:     # Megatron-LM: batch = not overlap
        mine["overlap_p2p_comm"] = not mine["batch_p2p_comm"] and virtual is not None
    config = MLATransformerConfig(**{**kwargs, **mine})
    if relax:
        config.bf16 = False
    return config


def _virtual_size(cfg: RunConfig):
    """V, or None for V = 1 (megatron's convention: None selects the non-interleaved schedules)."""
    from trainerkit.layout import PipelineLayout

    par, m = cfg.parallel, cfg.model
    layout = PipelineLayout.from_string(par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size,
                                        m.num_layers, m.mtp_num_layers,
                                        megatron_rules_only=par.layout_rules == "megatron")
    v = layout.virtual_pipeline_model_parallel_size
    return v if v > 1 else None


def embedding_ranks(config):
    """Megatron-LM's ``pretrain_gpt.get_embedding_ranks`` for an untied head: the word embedding lives on the
    first stage and on every rank holding MTP layers, and their gradients are all-reduced in that group
    (``finalize_model_grads._allreduce_word_embedding_grads``).  megatron-core's own default
    (``parallel_state.default_embedding_ranks``: first and last rank) leaves a standalone MTP stage out of
    the group, so its embedding replica would never be synchronised."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks

    def ranks(pp_ranks: list) -> list:
        return sorted({pp_ranks[0], *(get_mtp_ranks(pp_ranks, config) if len(pp_ranks) > 1 else [])})
    return ranks


def build_chunks(cfg: RunConfig, config) -> list:
    """GPTModel chunks of this pipeline rank, one per virtual stage in virtual-stage order (fp32 or bf16 on
    the current device; parameters not yet re-initialised); HybridModel's for ``model_class: hybrid``
    (`hybrid.build_chunks`)."""
    if cfg.model_class == "hybrid":
        return hybrid.build_chunks(cfg, config)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.enums import ModelType

    virtual = config.virtual_pipeline_model_parallel_size
    last_layer_spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)[-1]
    chunks = []
    for vp in range(virtual or 1):
        vp_stage = vp if virtual else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
        # None where the layout puts no MTP layer on this (pp rank, virtual stage) (get_mtp_num_layers_to_build)
        mtp = get_gpt_mtp_block_spec(config, last_layer_spec, use_transformer_engine=False, vp_stage=vp_stage) \
            if config.mtp_num_layers else None
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.training.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=int(cfg.model.rotary_base) if float(cfg.model.rotary_base).is_integer() else cfg.model.rotary_base,
            mtp_block_spec=mtp, vp_stage=vp_stage)
        model.model_type = ModelType.encoder_or_decoder
        model.vp_stage = vp_stage
        chunks.append(model)
    return chunks


_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass
class GlobalParam:
    """One parameter of a chunk under its global name.  ``replica``: ``mtp`` for the MTP stage's copy of the
    word embedding when the first stage's embedding lives in another chunk, ``tp{t}`` / ``dp{d}`` / ``edp{k}``
    tags for the copies of other tensor- or data-parallel ranks (TRACE_FORMAT.md).  ``shard``: where this
    rank's tensor-parallel slice sits in the global parameter (`tp_shards`); None for a whole parameter."""

    name: str
    replica: str | None
    param: torch.nn.Parameter
    chunk: int
    shard: Shard | None = None


def tp_shards(model, gated: bool) -> dict:
    """{id(weight): `Shard`} of the tensor-parallel layers of `model` whose weight this rank holds a slice of
    (megatron/core/tensor_parallel/layers.py): ``ColumnParallelLinear`` [out / t, in] along dim 0,
    ``RowParallelLinear`` [out, in / t] along dim 1, ``VocabParallelEmbedding`` [vocab / t, h] along dim 0, each
    at its rank in the layer's own TP group (the expert TP group for routed experts).  With a gated MLP
    (`gated`: SwiGLU) an ``linear_fc1`` slice is two pieces, rows r of the gate half and rows r of the up half
    (megatron/core/transformer/mlp.py ``apply_swiglu_sharded_factory``), so the global parameter is the
    [gate; up] of TP = 1.  The split is read from the layers' sizes, not from the weights' ``partition_dim``
    attributes: megatron sets those only when it initialises the weights itself (``perform_initialization``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    out = {}
    for local, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            dim, whole, part = 0, module.num_embeddings, module.num_embeddings_per_partition
        elif isinstance(module, ColumnParallelLinear):
            dim, whole, part = 0, module.output_size, module.output_size_per_partition
        elif isinstance(module, RowParallelLinear):
            dim, whole, part = 1, module.input_size, module.input_size_per_partition
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or whole == part:
            continue
        rank = _tp_rank(module)
        shape = tuple(weight.shape[:dim]) + (whole,) + tuple(weight.shape[dim + 1:])
        if gated and local.endswith("linear_fc1"):
            half, mine = whole // 2, part // 2
            out[id(weight)] = Shard(shape, dim, rank * mine, ((rank * mine, mine), (half + rank * mine, mine)))
        else:
            out[id(weight)] = Shard(shape, dim, rank * part, ((rank * part, part),))
    return out


def _tp_rank(module) -> int:
    """This rank's place in `module`'s tensor-parallel group (megatron-core >= 0.13 keeps the group on the layer;
    else the model-wide or the expert TP group, by the layer's ``is_expert``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = getattr(module, "tp_group", None)
    if group is not None:
        return dist.get_rank(group)
    return ps.get_expert_tensor_parallel_rank() if getattr(module, "is_expert", False) \
        else ps.get_tensor_model_parallel_rank()


def _layer_ids(model) -> dict[str, int]:
    """{local decoder layer index (as in megatron's parameter names): global layer id} of one chunk (GPT's
    numbering for a HybridModel chunk: `hybrid.layer_ids`)."""
    if not hasattr(model, "decoder"):
        return {}
    if hybrid.is_hybrid(model):
        return hybrid.layer_ids(model)
    return {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


#: The MTP layer's inner transformer layer: ``transformer_layer`` up to megatron-core 0.16, ``mtp_model_layer`` from
#: 0.17 (transformer/multi_token_prediction.py MultiTokenPredictionLayer); the global name keeps the first, so
#: traces of every version compare (`trainerkit.names`).
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+)\.mtp_model_layer\.")


def _global_name(local: str, layers: dict[str, int], experts_per_rank: int, ep_rank: int,
                 is_hybrid: bool = False) -> str:
    m = _DECODER.match(local)
    if m:                   # `layers` already maps a HybridModel's layer to its GPT layer (`hybrid.layer_ids`)
        name = f"decoder.layers.{layers[m.group(1)]}.{m.group(2)}"
    elif is_hybrid:
        name = hybrid.global_name(local)
    else:
        name = _MTP_INNER.sub(r"\1.transformer_layer.", local)
    return _LOCAL_EXPERT.sub(lambda e: f".mlp.experts.{ep_rank * experts_per_rank + int(e.group(1))}.", name)


def global_parameters(chunks: list, experts_per_rank: int, ep_rank: int, dp_rank: int = 0,
                      expert_dp_rank: int = 0, strict: bool = True, tp_rank: int = 0,
                      expert_tp_rank: int = 0) -> list[GlobalParam]:
    """Every parameter of `chunks` (this rank's) under its global name (`trainerkit.names`).

    Megatron names a chunk's decoder layers by local index; the global layer id is the module's
    ``layer_number - 1``.  Routed experts (``SequentialMLP``: ``mlp.experts.local_experts.{i}``) become
    ``mlp.experts.{ep_rank * experts_per_rank + i}``.  A word embedding in a chunk without pre-process is the
    MTP stage's replica.  The MTP inner layer is ``mtp.layers.{k}.transformer_layer`` on every megatron version.
    Data parallelism: on DP rank d > 0 every dense parameter is a replica ``@dp{d}``; on expert-data-parallel
    rank k > 0 (DP > EP) every routed expert is a replica ``@edp{k}`` (`trainerkit.names.ep_replica`).  Tensor
    parallelism: a layer split over the TP ranks gives each its slice (`GlobalParam.shard`, `tp_shards`, the
    same key on every TP rank); a parameter every TP rank holds whole (norms, the router) is on TP rank t > 0
    a replica ``@tp{t}`` (routed experts: ``@etp{t}`` over the expert TP ranks), before its DP tag.

    `strict`: every name must be one of DeepSeek-V3's as bitparity builds the model (`trainerkit.names`); not
    strict (a user's own model in megatron's training loop), other names pass as they are.

    Raises:
        ValueError: strict, and a parameter whose name the mapping does not know (megatron-core changed its naming).
    """
    out = []
    for c, model in enumerate(chunks):
        layers = _layer_ids(model)
        shards = tp_shards(model, bool(getattr(model.config, "gated_linear_unit", False)))
        for local, p in model.named_parameters():
            name = _global_name(local, layers, experts_per_rank, ep_rank, hybrid.is_hybrid(model))
            replica = "mtp" if name == names.EMBEDDING and not model.pre_process else None
            names.family(name, strict=strict)     # strict: raises ValueError for a name the harness cannot place
            expert = names.expert_id(name) is not None
            shard = shards.get(id(p))
            if shard is None:
                replica = names.ep_replica(replica, expert_tp_rank if expert else tp_rank, "etp" if expert else "tp")
            replica = (names.ep_replica(replica, expert_dp_rank, "edp") if expert
                       else names.ep_replica(replica, dp_rank, "dp"))
            out.append(GlobalParam(name, replica, p, c, shard))
    return out


def expert_biases(chunks: list) -> dict[str, torch.Tensor]:
    """{global name: buffer} of the routers' ``expert_bias`` (updated by ``finalize_model_grads``), in
    canonical order."""
    out = {}
    for model in chunks:
        layers = _layer_ids(model)
        for local, buf in model.named_buffers():
            if local.endswith("router.expert_bias"):
                out[_global_name(local, layers, 0, 0, hybrid.is_hybrid(model))] = buf
    return dict(sorted(out.items(), key=lambda kv: names.order_key(kv[0][:-len("expert_bias")] + "weight")))
