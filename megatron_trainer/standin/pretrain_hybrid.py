"""A stand-in for Megatron-LM's ``pretrain_hybrid.py`` where only the megatron-core wheel is installed (>= 0.17:
the wheel carries ``megatron.training`` and ``HybridModelConfig``, the checkout's root scripts it does not).

Same main block as Megatron-LM's ``pretrain_hybrid.py`` (``parse_and_validate_args``, ``hybrid_config_from_args``
(``--spec`` names the stack spec: ``megatron_trainer.hybrid_spec hybrid_stack_spec`` without Transformer Engine),
``pretrain_cfg_container_from_args``, ``pretrain(full_config, datasets provider, ModelType.encoder_or_decoder,
forward_step)``, megatron's default embedding ranks: HybridModel builds MTP on the last stage).  The batch, the
forward step and the loss function are the GPT stand-in's (`pretrain_gpt`: pretrain_hybrid's for CP = 1 without
packed sequences).  Run it as the training script of ``python -m megatron_trainer.pretrain``; with a Megatron-LM
checkout, run the checkout's own ``pretrain_hybrid.py`` instead.
"""
from __future__ import annotations

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import hybrid_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from pretrain_gpt import datasets_provider, forward_step  # the stand-in beside this file

if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, hybrid_config_from_args(args)), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)
