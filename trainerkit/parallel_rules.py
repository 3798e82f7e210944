"""The divisibility rules of a run's parallel sizes against its model and training (expert, tensor and sequence
parallelism, data-parallel microbatches), checked while planning so that a size megatron or the reference
trainer cannot split is one line before any rank starts.  `trainerkit.config.RunConfig` applies them to every
run config; `harness.planning.cases` to each variant, naming it."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig, ParallelConfig, TrainingConfig


def check_expert_parallel(model: ModelConfig, training: TrainingConfig, parallel: ParallelConfig) -> None:
    """The divisibility rules of expert parallelism (reference_impl/model/expert_parallel.py).

    Raises:
        ValueError: one line naming the violated rule.
    """
    ep, dp = parallel.expert_model_parallel_size, parallel.data_parallel_size
    tp, etp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel
    if tp > 1 or etp > 1:       # megatron's expert grid: ETP x EP x expert-DP over the same ranks as TP x DP
        if (tp * dp) % (etp * ep):
            raise ValueError(f"expert_tensor_parallel_size x expert_model_parallel_size = {etp} x {ep} does not "
                             f"divide tensor_model_parallel_size x data_parallel_size = {tp} x {dp} (megatron's "
                             "expert grid covers the same ranks)")
        if model.num_moe_experts % ep:
            raise ValueError(f"num_moe_experts={model.num_moe_experts} is not divisible by "
                             f"expert_model_parallel_size={ep} (each EP rank owns num_moe_experts/EP experts)")
        return
    if model.num_moe_experts % ep:
        raise ValueError(f"num_moe_experts={model.num_moe_experts} is not divisible by "
                         f"expert_model_parallel_size={ep} (each EP rank owns num_moe_experts/EP experts)")
    if dp > 1:          # Megatron's EP: carved out of DP, each rank dispatches its own microbatch's tokens
        if dp % ep:
            raise ValueError(f"data_parallel_size={dp} is not divisible by expert_model_parallel_size={ep} "
                             "(Megatron carves the EP groups out of data parallelism)")
        return
    tokens = training.seq_length * training.micro_batch_size
    if tokens % ep:
        raise ValueError(f"seq_length*micro_batch_size={tokens} is not divisible by expert_model_parallel_size={ep} "
                         "(each EP rank dispatches an equal contiguous shard of a microbatch's tokens)")


def check_tensor_parallel(model: ModelConfig, training: TrainingConfig, parallel: ParallelConfig) -> None:
    """What tensor (and sequence) parallelism needs of the model (megatron/core/tensor_parallel/layers.py: a
    column-parallel layer splits its output size over the TP ranks, a row-parallel one its input size; the
    vocabulary-parallel embedding the vocabulary; MLA's local-spec down projections are column-parallel, so
    q_lora_rank and kv_lora_rank + qk_pos_emb_head_dim split too; routed experts split over expert TP), checked
    here so a bad size is one line before any rank starts, not megatron's assertion in a rank.

    Raises:
        ValueError: one line naming the size, its value and the parallel size it must be a multiple of."""
    tp, etp, sp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel, parallel.sequence_parallel
    if sp and tp == 1:
        raise ValueError("sequence_parallel splits activations over the tensor-parallel ranks: it needs "
                         "tensor_model_parallel_size > 1")
    if tp > 1 and any(model.moe_layers) and not sp:
        raise ValueError(f"tensor_model_parallel_size={tp} with MoE layers needs sequence_parallel: true (megatron's "
                         "MoE layer refuses to train under TP without it, transformer/moe/moe_layer.py)")
    sizes = [("model.num_attention_heads", model.num_attention_heads, tp, "tensor_model_parallel_size"),
             ("model.vocab_size", model.vocab_size, tp, "tensor_model_parallel_size"),
             ("model.hidden_size", model.hidden_size, tp, "tensor_model_parallel_size"),
             ("model.ffn_hidden_size", model.ffn_hidden_size, tp, "tensor_model_parallel_size"),
             ("model.moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size, tp,
              "tensor_model_parallel_size"),
             ("model.q_lora_rank", model.q_lora_rank, tp, "tensor_model_parallel_size"),
             ("model.kv_lora_rank + model.qk_pos_emb_head_dim", model.kv_lora_rank + model.qk_pos_emb_head_dim, tp,
              "tensor_model_parallel_size"),
             ("model.moe_ffn_hidden_size", model.moe_ffn_hidden_size, etp, "expert_tensor_parallel_size")]
    if sp:
        sizes.append(("training.seq_length", training.seq_length, tp,
                      "tensor_model_parallel_size (sequence_parallel splits each sequence)"))
    for what, value, by, name in sizes:
        if by > 1 and value % by:
            raise ValueError(f"{what}={value} is not a multiple of {name}={by} (megatron splits it over the "
                             "tensor-parallel ranks)")


def check_data_parallel_microbatches(training: TrainingConfig, parallel: ParallelConfig) -> None:
    """Every ``data.empty_microbatches`` entry names a global microbatch of a step (num_microbatches x DP).

    Raises:
        ValueError: one line naming the entry."""
    n = training.num_microbatches * parallel.data_parallel_size
    for step, mb in training.data.empty_microbatches:
        if mb >= n:
            raise ValueError(f"data.empty_microbatches [{step}, {mb}]: a step has global microbatches 0..{n - 1} "
                             "(num_microbatches x data_parallel_size)")
