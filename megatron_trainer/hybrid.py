"""megatron-core's HybridModel (``megatron/core/models/hybrid/``, megatron-core >= 0.17) for bitparity's DeepSeek-V3.

Megatron builds a HybridModel from a ``hybrid_layer_pattern`` (`trainerkit.hybrid_pattern`) and a stack spec.
Its own spec (``hybrid_layer_specs.hybrid_stack_spec``) is Transformer Engine only ("we had problems getting the
non-TE spec working"); `stack_spec` is the local one, made of the very modules GPTModel's local spec builds
(``gpt_layer_specs.get_gpt_layer_local_spec``): a ``+`` layer is GPT's MLA layer without its MLP, a ``-`` / ``E``
layer is GPT's dense / MoE MLP without its attention (``MLPLayer`` / ``MoETransformerLayer``, as megatron's spec),
the MTP block has GPT's local norms and projection, and its inner layers are the MTP pattern's ``HybridStack``.
So the migration GPTModel -> HybridModel changes the model class, not a module.  Megatron-LM's
``pretrain_hybrid.py`` takes it with ``--spec megatron_trainer.hybrid stack_spec``.

Global names (`global_name`): Hybrid layer j is GPT layer j // 2 (`trainerkit.hybrid_pattern`: each GPT block is
one ``+`` and its ``-`` / ``E``, and only the first holds attention parameters, only the second MLP ones), the
stack's ``final_norm`` is GPT's ``final_layernorm``, and an MTP depth's inner ``mtp_model_layer.layers.{0,1}`` is
GPT's ``transformer_layer``: both models get the same weights from `trainerkit.init` and their traces compare.
"""
from __future__ import annotations

import re

from trainerkit.config import RunConfig
from trainerkit.hybrid_pattern import parse_hybrid_pattern

#: megatron-core's first release with HybridModel (``megatron/core/models/hybrid/``)
FIRST_VERSION = "0.17"
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+)\.mtp_model_layer\.layers\.\d+\.")


def is_hybrid(model) -> bool:
    """Whether a model chunk is megatron's HybridModel (by its pattern attribute: the class moved between
    releases, ``mamba_model`` -> ``hybrid_model``)."""
    return hasattr(model, "hybrid_layer_pattern")


def stack_spec(qk_layernorm: bool = True):
    """The local (non-TE) ``HybridStack`` spec: GPT's local MLA layer split in two (`module docstring`), with the
    MLA's q / kv layernorms as the run's config has them (`qk_layernorm`: bitparity's DeepSeek-V3 always; a job's
    ``--qk-layernorm``, as GPT's local spec takes it from the config).

    Megatron source: ``hybrid_layer_specs.hybrid_stack_spec`` (the TE one it mirrors), ``gpt_layer_specs.
    get_gpt_layer_local_spec`` (the modules), ``backends.LocalSpecProvider`` (the MTP block's norms and
    ``eh_proj``).  Only the layer kinds bitparity builds are set; the others stay megatron's ``IdentityOp``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    # num_experts only selects the MoE module spec: the expert count comes from the config when it is built
    dense = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                     multi_latent_attention=True).submodules
    moe = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                   multi_latent_attention=True).submodules
    backend = LocalSpecProvider()
    norm = backend.layer_norm()
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=backend.column_parallel_linear(), mtp_model_layer=None, layer_norm=norm))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mla_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda)),
        mtp_block_spec=ModuleSpec(module=MultiTokenPredictionBlock,
                                  submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]))))


def problem(cfg: RunConfig) -> str | None:
    """Why the megatron this process imports cannot run `cfg` as a HybridModel, in one line (None when it can):
    it has no HybridModel (before megatron-core 0.17), its own pattern parser (``hybrid_layer_allocation.
    parse_hybrid_pattern``) rejects the pattern, or the run asks for the MoE 1F1B overlap, which megatron's
    schedule runs through the model's ``build_schedule_plan`` (pipeline_parallel/combined_1f1b.py) and HybridModel
    has none (0.19.2, Megatron-LM main of 2026-08-22)."""
    import importlib.util

    import megatron.core
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        return (f"model_class: hybrid: megatron-core {megatron.core.__version__} has no HybridModel "
                f"(megatron/core/models/hybrid/ is megatron-core >= {FIRST_VERSION}'s); a case says so with the "
                f"variant's megatron_versions: [{{versions: '<{FIRST_VERSION}', not_run: '...'}}]")
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern as megatron_parse
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    try:
        megatron_parse(cfg.parallel.hybrid_layer_pattern)
    except ValueError as e:
        return f"megatron-core rejects hybrid_layer_pattern {cfg.parallel.hybrid_layer_pattern!r}: {e}"
    if cfg.parallel.overlap_moe_expert_parallel_comm and not hasattr(HybridModel, "build_schedule_plan"):
        return ("overlap_moe_expert_parallel_comm: megatron's MoE 1F1B overlap builds each microbatch's schedule "
                "with the model's build_schedule_plan (pipeline_parallel/combined_1f1b.py), which this megatron-core's "
                f"HybridModel ({megatron.core.__version__}) does not have: GPTModel only")
    return None


def config_fields(cfg: RunConfig) -> dict:
    """What a HybridModel run's ``MLATransformerConfig`` differs in from GPTModel's, as Megatron-LM's
    ``arguments.py`` makes it from ``--hybrid-layer-pattern``: ``num_layers`` counts Hybrid layers (twice GPT's),
    no ``pipeline_model_parallel_layout`` (the pattern's ``|`` place the layers; V = segments / P),
    ``is_hybrid_model`` (``argument_utils``); ``moe_layer_freq`` per Hybrid layer (1 for ``E``; megatron's hybrid
    path builds from the pattern, the list only keeps the config's own checks consistent)."""
    pattern = parse_hybrid_pattern(cfg.parallel.hybrid_layer_pattern)
    flat = "".join(pattern.segments)
    fields = {"num_layers": len(flat), "moe_layer_freq": [int(c == "E") for c in flat],
              "pipeline_model_parallel_layout": None, "is_hybrid_model": True}
    return fields


def build_chunks(cfg: RunConfig, config) -> list:
    """HybridModel chunks of this pipeline rank, one per virtual stage in virtual-stage order, as Megatron-LM's
    ``hybrid_builders.hybrid_builder`` builds them (untied head, RoPE inside MLA), with `stack_spec`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.enums import ModelType

    virtual = config.virtual_pipeline_model_parallel_size
    spec = stack_spec()
    chunks = []
    for vp in range(virtual or 1):
        vp_stage = vp if virtual else None
        model = HybridModel(
            config=config, hybrid_stack_spec=spec, vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.training.seq_length,
            hybrid_layer_pattern=cfg.parallel.hybrid_layer_pattern,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=int(cfg.model.rotary_base) if float(cfg.model.rotary_base).is_integer()
            else cfg.model.rotary_base, vp_stage=vp_stage)
        model.model_type = ModelType.encoder_or_decoder
        model.vp_stage = vp_stage
        chunks.append(model)
    return chunks


def layer_ids(model) -> dict[str, int]:
    """{local decoder layer index: GPT layer id} of one HybridModel chunk: Hybrid layer j (``layer_number - 1``,
    megatron's global numbering) is GPT layer j // 2."""
    return {str(i): (layer.layer_number - 1) // 2 for i, layer in enumerate(model.decoder.layers)}


def global_name(local: str) -> str:
    """GPT's global name of a HybridModel parameter outside the decoder layers (those are renamed by `layer_ids`,
    as GPT's, in `model._global_name`; routed experts renumbered there too): ``decoder.final_norm`` ->
    ``decoder.final_layernorm``, an MTP depth's inner ``mtp_model_layer.layers.{i}.`` -> ``transformer_layer.``."""
    if local.startswith("decoder.final_norm."):
        return "decoder.final_layernorm." + local[len("decoder.final_norm."):]
    return _MTP_INNER.sub(r"\1.transformer_layer.", local)
