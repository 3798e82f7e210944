"""A stand-in for Megatron-LM's ``pretrain_gpt.py`` where only the megatron-core wheel is installed (>= 0.17:
the wheel carries ``megatron.training``, the checkout's root scripts it does not).

Same main block as Megatron-LM's ``pretrain_gpt.py`` of core_r0.19 (``parse_and_validate_args``,
``gpt_config_from_args``, ``pretrain_cfg_container_from_args``, ``pretrain(full_config, datasets provider,
ModelType.encoder_or_decoder, forward_step, get_embedding_ranks=...)``): megatron's own training loop, model
builder, mock dataset and MTP embedding ranks.  The forward step and loss function are pretrain_gpt's for
CP = 1 without packed sequences (the capture refuses CP > 1), any TP (every TP rank reads the batch itself, where
Megatron-LM's reads it on TP rank 0 and broadcasts the same tensors): the batch is read on the stages that
need it (first, last, MTP), ``loss_func`` returns ``(sum(CE * mask), num_tokens, {"lm loss": [sum, tokens]})``.
Run it as the training script of ``python -m megatron_trainer.pretrain``; with a Megatron-LM checkout, run the
checkout's own ``pretrain_gpt.py`` instead.
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks, mtp_on_this_rank
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args


def _needs_batch(vp_stage) -> bool:
    """pretrain_gpt.is_dataset_built_on_rank, on every TP rank (module docstring): the first and last stage and a stage holding MTP."""
    config = core_transformer_config_from_args(get_args())
    first = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return first or last or mtp_on_this_rank(layout=config.pipeline_model_parallel_layout,
                                             mtp_num_layers=config.mtp_num_layers, ignore_virtual=False,
                                             vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) [b, s] of the next microbatch on the device, or
    Nones on a stage that needs none."""
    if not _needs_batch(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    return tuple(batch[k].to(device) if batch.get(k) is not None else None
                 for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """pretrain_gpt.loss_func: per-token losses [b, s] -> (sum(CE * mask) fp32, num_tokens int, report)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """pretrain_gpt.forward_step (CP = 1): the model's per-token losses and the loss function; under the
    MoE 1F1B overlap the chunk's schedule plan."""
    from megatron.core.utils import get_attr_wrapped_model
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask, model=model)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, model=model)


def datasets_provider(num_samples, vp_stage=None):
    """megatron's MockGPTDataset (``--mock-data``) for train / valid / test, built on the stages that read it."""
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                              blend_per_split=None, split=args.split, path_to_cache=args.data_cache_path,
                              tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                              create_attention_mask=args.create_attention_mask_in_dataloader,
                              mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, partial(_needs_batch, vp_stage),
                                         config).build()


def get_embedding_ranks(pp_ranks):
    """pretrain_gpt.get_embedding_ranks: the first stage, the last (tied embeddings) and the MTP stages."""
    args = get_args()
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        if not args.untie_embeddings_and_output_weights:
            ranks.append(pp_ranks[-1])
        ranks.extend(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(set(ranks))


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets_provider,
             ModelType.encoder_or_decoder, forward_step, get_embedding_ranks=get_embedding_ranks)
