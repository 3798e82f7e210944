"""Which megatron-core checkpoints a run can resume from, decided while planning (no rank starts for a resume
megatron cannot load), and the distributed optimizer's checkpoint format (`sharding_type`).  The save and load
themselves are `megatron_trainer.checkpoint`'s."""
from __future__ import annotations

from trainerkit.layout import PipelineLayout


def sharding_type(cfg) -> str | None:
    """The distributed optimizer's checkpoint format Megatron-LM uses for `cfg` (`RunConfig`):
    ``fully_reshardable`` with the megatron option ``dist_ckpt_optim_fully_reshardable``, else
    ``dp_reshardable``; None without the distributed optimizer (megatron/training/checkpointing.py
    ``_build_sharded_state_dict_metadata``: the key is set only with it, and its presence makes a chained
    optimizer prefix its sub-optimizers' keys)."""
    if not cfg.megatron.get("use_distributed_optimizer", False):
        return None
    return "fully_reshardable" if cfg.megatron.get("dist_ckpt_optim_fully_reshardable", False) else "dp_reshardable"


def resume_problem(saver, resumer) -> str | None:
    """Why a megatron-core run with config `resumer` cannot load the checkpoint of the run with config `saver`
    (both `RunConfig`), in one line; None when it can.  Refused while planning, so that no rank starts:

    * another model class (GPTModel / HybridModel): their checkpoints key the layers differently;
    * another DP: bitparity's ``num_microbatches`` is per DP rank, so another DP is another global batch;
    * ``dist_ckpt_optim_fully_reshardable`` on a saver without the distributed optimizer (it would do nothing);
    * one with the distributed optimizer and one without: their optimizer state dicts differ in kind (measured:
      ``Could not find parameter group with key ...`` on load);
    * ``dp_reshardable`` (Megatron-LM's default format) under another layout, TP, EP or ETP: its buffers are
      keyed by the saving layout's bucket structure (Megatron-LM's ``load_checkpoint`` refuses another TP or P;
      another V fails in megatron's load, measured);
    * a MoE model at EP = 1 on one side and EP > 1 on the other: megatron builds one optimizer at EP 1 and a
      chain of two (dense, expert) at EP > 1, and a checkpoint loads into a chain of its own length only
      (measured, plain and distributed: ``Expected 2 entries in state dict, but got 4``);
    * the distributed optimizer at EP > 1 on a layout with a pipeline rank that holds no MoE layer: that rank's
      expert optimizer is empty, and without Apex / TE ``DistributedOptimizer.state_dict`` asserts one common
      Adam step in a state it has none of (measured, save and load)."""
    a, b = saver.parallel, resumer.parallel
    if saver.model_class != resumer.model_class:
        return (f"a {saver.model_class} checkpoint into a {resumer.model_class} run: GPTModel and HybridModel key "
                "their layers differently (Hybrid layer j is GPT layer j // 2); resume within one model class")
    if a.data_parallel_size != b.data_parallel_size:
        return (f"data_parallel_size {a.data_parallel_size} -> {b.data_parallel_size}: bitparity's num_microbatches "
                "is per DP rank, so another DP trains another global batch: the resumed run would continue another "
                "training than the one saved; resume under the saver's DP")
    distopt = [c.megatron.get("use_distributed_optimizer", False) for c in (saver, resumer)]
    if saver.megatron.get("dist_ckpt_optim_fully_reshardable", False) and not distopt[0]:
        return ("dist_ckpt_optim_fully_reshardable is the distributed optimizer's checkpoint format: the saving run "
                "has no use_distributed_optimizer, so it would save nothing differently")
    if distopt[0] != distopt[1]:
        return ("a run with the distributed optimizer and one without cannot resume from each other's checkpoint "
                "(megatron's optimizer state dicts differ in kind); set use_distributed_optimizer alike")
    if distopt[0] and sharding_type(saver) == "dp_reshardable" and _grid(a) != _grid(b):
        return ("the distributed optimizer's dp_reshardable checkpoint (Megatron-LM's default) reshards along DP "
                "only: its buffers are keyed by the saving layout's buckets (measured under another V: 'Global "
                "shape mismatch'; Megatron-LM refuses another TP or P); save it with the megatron option "
                "dist_ckpt_optim_fully_reshardable: true")
    for c in (saver, resumer):
        bare = _ranks_without_experts(c)
        if c.megatron.get("use_distributed_optimizer", False) and c.parallel.expert_model_parallel_size > 1 and bare:
            return (f"layout {c.parallel.pipeline_model_parallel_layout!r}: pipeline rank {bare[0]} holds no MoE "
                    "layer, and without Apex / TE megatron's distributed optimizer cannot write or read the state "
                    "of its empty expert optimizer (DistributedOptimizer.state_dict: assert len(steps) == 1, "
                    "measured); give every pipeline rank a MoE layer")
    if saver.model.num_moe_experts and (a.expert_model_parallel_size == 1) != (b.expert_model_parallel_size == 1):
        return (f"expert_model_parallel_size {a.expert_model_parallel_size} -> {b.expert_model_parallel_size}: "
                "megatron builds one optimizer at EP 1 and two (dense, expert) at EP > 1, and loads a checkpoint "
                "into a chain of its own length only; resume between EP sizes > 1")
    return None


def _ranks_without_experts(cfg) -> list[int]:
    """The pipeline ranks of `cfg`'s layout whose stages hold no MoE layer (decoder or MTP; MTP layers are MoE
    when the model's last decoder layer is); [] for a dense model."""
    m, par = cfg.model, cfg.parallel
    if not m.num_moe_experts:
        return []
    layout = PipelineLayout.from_string(par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size,
                                        m.num_layers, m.mtp_num_layers)
    moe = m.moe_layers
    return [r for r in range(par.pipeline_model_parallel_size)
            if not any(moe[i] for flat in layout.stages_of_rank(r) for i in layout.decoder_layer_ids(flat))
            and not (moe[-1] and any(layout.mtp_layer_ids(flat) for flat in layout.stages_of_rank(r)))]


def _grid(par) -> tuple:
    """What a ``dp_reshardable`` checkpoint's bucket structure depends on besides DP."""
    return (par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size, par.tensor_model_parallel_size,
            par.expert_model_parallel_size, par.expert_tensor_parallel)
