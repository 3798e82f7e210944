"""One rank of a megatron-core training run, top to bottom, writing the bitparity trace (TRACE_FORMAT.md).

megatron does the training: its parallel state, GPTModel chunks (`model.build_chunks`), DDP with fp32
``main_grad`` buffers, ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved, chosen by megatron
from P and V), ``finalize_model_grads`` (embedding all-reduce between the first and the MTP stage, expert-bias
update), ``get_megatron_optimizer`` (Adam, its grad norm and ``clip_grad``).  This module only feeds it the
case's data and reads what it computed:

* per microbatch, on the loss stage: the lm loss (``sum(CE * mask) / num_tokens``, from megatron's per-token
  losses in the loss function) and each MTP depth's loss (as megatron hands it to
  ``MTPLossLoggingHelper.save_loss_to_tracker``);
* after the schedule (which ends in ``finalize_model_grads``): every parameter's ``main_grad`` by global name;
* after ``optimizer.step()``: every parameter, the routers' ``expert_bias``, and the grad norm megatron used
  for clipping (a Python float: fp32 sum of squares, square root in float64; `clip_grads.get_grad_norm_fp32`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trainerkit.capture import RankCapture, dump_tensors, float64_scalar, microbatch_losses, param_entry, scalar
from trainerkit.config import RunConfig
from trainerkit.data import TokenDataset
from trainerkit.fingerprint_shard import take
from trainerkit.init import init_parameters

from . import checkpoint, compat, faults, options
from .coverage import OverlapCounter
from .model import build_chunks, embedding_ranks, expert_biases, global_parameters, transformer_config
from .optimizer_view import Traced, traced


class LossRecorder:
    """Per-microbatch losses of the loss stage, in the order megatron computes them (microbatch order)."""

    def __init__(self):
        self.lm: list[tuple[torch.Tensor, torch.Tensor]] = []     # (sum(CE * mask), num_tokens) per microbatch
        self.mtp: list[torch.Tensor] = []                          # per microbatch x depth, in call order

    def loss_func(self, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        """Megatron-LM's ``pretrain_gpt.loss_func``: per-token losses [b, s] fp32 -> (sum(CE * mask),
        num_tokens, report); megatron's schedule divides by num_tokens and num_microbatches."""
        losses = output_tensor.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        self.lm.append((loss.detach().clone(), num_tokens))
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def take(self, mtp_num_layers: int, dp_group=None) -> tuple[list, dict]:
        """The step's ``losses`` records, keyed by global microbatch (``m * DP + dp_rank`` over `dp_group`, the
        loss stage's data-parallel group; None: DP = 1), and the reported ``lm_loss``: sum of loss sums / sum of
        token counts over the global batch, left to right in global microbatch order, as the reference trainer
        reports it (the DP ranks' sums are gathered first, so DP = 2 reports what DP = 1 does); clears the
        recorder.  With `dp_group`, every rank of it must call this (a collective)."""
        dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        out = microbatch_losses(self.lm, self.mtp, mtp_num_layers, dp_size, dp_rank)
        pairs = [(s.view(1), n.view(1).to(s.dtype)) for s, n in self.lm]
        if pairs and dp_size > 1:
            mine = torch.cat([torch.cat(p) for p in pairs])          # [2 M]: s_0, n_0, s_1, n_1, ...
            every = [torch.empty_like(mine) for _ in range(dp_size)]
            dist.all_gather(every, mine, group=dp_group)
            pairs = [(every[d][2 * m:2 * m + 1], every[d][2 * m + 1:2 * m + 2])
                     for m in range(len(self.lm)) for d in range(dp_size)]     # global microbatch order
        loss_sum, tokens = None, None
        for s, n in pairs:
            loss_sum, tokens = (s, n) if loss_sum is None else (loss_sum + s, tokens + n)
        reported = scalar((loss_sum / tokens.clamp(min=1)).view(())) if pairs else None
        self.lm, self.mtp = [], []
        return out, reported


#: MTPLossLoggingHelper's per-depth logging hook, by megatron-core version: ``save_loss_to_tracker(loss, layer_number,
#: num_layers, ...)`` up to 0.18, ``save_metrics_to_tracker(loss, correct, total, layer_number, ...)`` from 0.19
#: (transformer/multi_token_prediction.py); the loss is the first argument of both.
MTP_LOSS_HOOKS = ("save_metrics_to_tracker", "save_loss_to_tracker")


def record_mtp_losses(recorder) -> None:
    """Capture each MTP depth's loss as megatron logs it (`MTP_LOSS_HOOKS`: called once per depth per microbatch
    in GPTModel's forward on the loss stage) into ``recorder.mtp`` (a list; `LossRecorder`, or the capture of
    megatron's own loop, `pretrain_hooks`), then let megatron log it too.

    Raises:
        RuntimeError: the installed megatron has neither hook (the MTP losses could not be captured)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    name = next((n for n in MTP_LOSS_HOOKS if hasattr(MTPLossLoggingHelper, n)), None)
    if name is None:
        raise RuntimeError(f"megatron's MTPLossLoggingHelper has none of {', '.join(MTP_LOSS_HOOKS)}: the MTP "
                           "losses cannot be captured; update megatron_trainer/train.py MTP_LOSS_HOOKS")
    original = getattr(MTPLossLoggingHelper, name)

    def save(loss, *args, **kwargs):
        recorder.mtp.append(loss.detach().clone().float())
        return original(loss, *args, **kwargs)
    setattr(MTPLossLoggingHelper, name, staticmethod(save))


def _batches(data: TokenDataset, consumed_train_samples: int, num_microbatches: int, device, dp_size: int = 1,
             dp_rank: int = 0):
    """Iterator over this DP rank's microbatches of the step that starts after `consumed_train_samples` samples
    (Megatron-LM's data position, ``args.consumed_train_samples``: it is what a resumed run continues from) as
    megatron's forward step takes them: global microbatch ``m * dp_size + dp_rank`` of the global batch for
    m < num_microbatches (Megatron-LM's data loader hands each DP rank its own slice of the global batch)."""
    first = consumed_train_samples // data.b
    per_step = num_microbatches * dp_size
    for m in range(num_microbatches):
        g = first + m * dp_size + dp_rank
        tokens, labels, mask = (x.to(device) for x in data.microbatch(g // per_step, g % per_step))
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        yield tokens, labels, mask, positions


def _forward_step(recorder: LossRecorder, data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward step: every chunk gets the batch (first stage: tokens; MTP stage: tokens and positions
    for its embedding; loss stage: labels and mask); megatron feeds hidden states between stages itself.  Under
    the MoE 1F1B overlap megatron asks for the chunk's schedule plan instead of its output
    (``return_schedule_plan``; Megatron-LM pretrain_gpt.forward_step: ``model.build_schedule_plan``)."""
    tokens, labels, mask, positions = next(data_iterator)
    if return_schedule_plan:
        return (model.build_schedule_plan(tokens, positions, None, labels=labels, loss_mask=mask),
                partial(recorder.loss_func, mask))
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    return output, partial(recorder.loss_func, mask)


@dataclass
class MegatronRank:
    """One rank's megatron objects and their bookkeeping: ``chunks`` (GPTModel per virtual stage), ``model``
    (their DDP wrappers), ``optimizer`` / ``scheduler``, and ``traced``: the parameters it traces under their
    global names and keys, with what the optimizer steps for each (`optimizer_view.Traced`)."""

    config: object
    chunks: list
    model: list
    optimizer: object
    scheduler: object
    traced: Traced


def build(cfg: RunConfig, device: torch.device) -> MegatronRank:
    """Megatron's parallel state (TP = 1, P and V from the layout, Megatron-LM's embedding group), the model
    chunks re-initialised by global name, DDP (fp32 grad buffers: ``main_grad``), ``get_megatron_optimizer``
    (Adam; megatron's distributed optimizer with ``use_distributed_optimizer``) and an
    ``OptimizerParamScheduler`` at constant lr and weight decay."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t, m, par = cfg.training, cfg.model, cfg.parallel
    config = transformer_config(cfg)
    ps.initialize_model_parallel(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                 virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
                                 expert_model_parallel_size=par.expert_model_parallel_size,
                                 expert_tensor_parallel_size=par.expert_tensor_parallel,
                                 # the distributed optimizer's instances split the DP group (partial DP
                                 # groups for the reduce-scatter, an all-reduce across instances)
                                 num_distributed_optimizer_instances=cfg.megatron.get(
                                     "num_distributed_optimizer_instances", 1),
                                 get_embedding_ranks=faults.embedding_ranks(cfg.inject, embedding_ranks(config)
                                                                            if options.loop(cfg)["get_embedding_ranks"]
                                                                            == "pretrain_gpt" else None))
    if ps.get_data_parallel_world_size() != par.data_parallel_size:
        raise RuntimeError(f"megatron made data_parallel_size {ps.get_data_parallel_world_size()}, the run asks for "
                           f"{par.data_parallel_size}")
    if device.type == "cuda":
        # megatron's CUDA RNG tracker must know its states before any forward forks them (dropout is 0, so no
        # bit depends on them); on CPU the compat layer makes the tracker inert
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(t.seed)
    chunks = [c.to(device) for c in build_chunks(cfg, config)]
    params = global_parameters(chunks, m.num_moe_experts // par.expert_model_parallel_size,
                               ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank(),
                               ps.get_expert_data_parallel_rank(), tp_rank=ps.get_tensor_model_parallel_rank(),
                               expert_tp_rank=ps.get_expert_tensor_parallel_rank())
    initialise(params, m, t.seed)
    ddp_config = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                                                  "use_distributed_optimizer": False,
                                                  **options.for_config(cfg, "DistributedDataParallelConfig")})
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=_float16(config, c),
                                     disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**{"optimizer": "adam", "lr": t.lr, "min_lr": t.lr, "weight_decay": t.weight_decay,
                           "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2, "adam_eps": t.adam_eps,
                           "clip_grad": t.clip_grad, "bf16": cfg.params_dtype == "bfloat16",
                           "params_dtype": config.params_dtype, "use_distributed_optimizer": False,
                           **options.for_config(cfg, "OptimizerConfig")}), model)
    # Megatron-LM's training loop steps an OptimizerParamScheduler after every update; it is also what turns the
    # parameter groups' wd_mult (0 for norms and biases: optimizer.get_standard_config_overrides) into the
    # groups' weight_decay.  Without it torch's AdamW would decay every parameter at config.weight_decay.
    scheduler = options.scheduler(optimizer, cfg)
    config.finalize_model_grads_func = faults.finalize(cfg.inject, finalize_model_grads)
    config.grad_scale_func = optimizer.scale_loss
    return MegatronRank(config=config, chunks=chunks, model=model, optimizer=optimizer, scheduler=scheduler,
                        traced=traced(optimizer, params))


@torch.no_grad()
def initialise(params: list, model_cfg, seed: int) -> None:
    """Every parameter of `params` (`model.GlobalParam`) from the case seed by its global name
    (`trainerkit.init`), as the reference trainer initialises it: replicas take their logical name's values (the
    MTP stage's embedding starts equal to the first stage's), a tensor-parallel slice is cut from the whole
    parameter drawn at its global shape (`fingerprint_shard.take`), so every TP size starts from the same weights."""
    for gp in params:
        if gp.shard is None:
            init_parameters([(gp.name, gp.param)], model_cfg, seed)
            continue
        whole = torch.empty(gp.shard.global_shape, dtype=gp.param.dtype)
        init_parameters([(gp.name, whole)], model_cfg, seed)
        gp.param.copy_(take(whole, gp.shard))


def _float16(config, chunk):
    """Megatron-LM's ``training.get_model``: in bf16 / fp16 each chunk is wrapped in ``Float16Module``, which casts
    every parameter (the norms' too: torch's RMSNorm of the local spec is built in fp32) and the first stage's
    inputs to the model dtype and the last stage's outputs back to fp32.  The parameters stay the same objects
    (``nn.Module._apply`` converts their data in place), so the global names taken from `chunk` still hold."""
    if not (config.bf16 or config.fp16):
        return chunk
    from megatron.core.transformer.module import Float16Module
    return Float16Module(config, chunk)


def rank_fields(chunks: list, tr: Traced, strict: bool = True) -> dict:
    """The trace header's identity fields of this rank (TRACE_FORMAT.md), from megatron's parallel state: global
    rank and world size, pp / ep / dp ranks and sizes, the flat stages its `chunks` hold (vp * P + pp rank), and
    ``params`` (`param_entry` of each traced parameter under its key, with its weight decay and, under the
    distributed optimizer, the range of it this rank traces; `strict`: names must be DeepSeek-V3's,
    `trainerkit.names`)."""
    from megatron.core import parallel_state as ps
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pp_rank": pp_rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(), "data_parallel_size": ps.get_data_parallel_world_size(),
            "stages": [vp * pp + pp_rank for vp in range(len(chunks))],
            "params": [param_entry(k, gp.name, gp.replica, gp.param, tr.decay[id(gp.param)], strict=strict, shard=shard)
                       for k, gp, shard in zip(tr.keys, tr.params, tr.shards())]}


def header(cfg: RunConfig, device: torch.device, r: MegatronRank, setup_s: float) -> dict:
    """The trace header's fields (TRACE_FORMAT.md; `trainerkit.capture.RankCapture`) of this rank."""
    import megatron.core

    return {**rank_fields(r.chunks, r.traced), "reductions": "megatron",
            "device": str(device),
            "params_dtype": cfg.params_dtype,
            "transport": "gloo" if device.type == "cpu" else "nccl", "trainer": "megatron-core",
            "setup_s": setup_s,
            "settings": {"overlap_p2p_comm": r.config.overlap_p2p_comm, "batch_p2p_comm": r.config.batch_p2p_comm,
                         # `bitparity compare` judges overlap coverage from the trace alone (harness.judging.judge)
                         "overlap_moe_expert_parallel_comm": cfg.parallel.overlap_moe_expert_parallel_comm,
                         "megatron_core": megatron.core.__version__,
                         "megatron_path": str(Path(megatron.core.__path__[0]).resolve().parent.parent),
                         "compat_not_needed": dict(compat.NOT_NEEDED),
                         # the case's megatron options as the built configs hold them (options.read_back)
                         "megatron_options": options.read_back(cfg, {
                             "MLATransformerConfig": r.config, "OptimizerConfig": getattr(r.optimizer, "config", None),
                             "DistributedDataParallelConfig": r.model[0].ddp_config, "scheduler": r.scheduler,
                             "embedding_ranks": _embedding_ranks()})}}


def train(cfg: RunConfig, rank: int, trace_path: Path, device: torch.device, started: float | None = None) -> None:
    """Run ``cfg.training.train_iters`` steps of megatron-core on pipeline rank `rank` (world = P; torch
    distributed already initialised), writing the rank trace to `trace_path`.  `started`: the rank's
    ``time.perf_counter()`` at process entry; the header's ``setup_s`` counts from there to the first step
    (process group, parallel state, model build and init, DDP, optimizer)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    started = time.perf_counter() if started is None else started
    t, m = cfg.training, cfg.model
    r = build(cfg, device)
    recorder = LossRecorder()
    record_mtp_losses(recorder)
    overlap = cfg.parallel.overlap_moe_expert_parallel_comm
    counter = OverlapCounter()
    if overlap:
        counter.install()
    forward_backward = get_forward_backward_func()
    data = TokenDataset(t.data, t.seed, t.seq_length, t.micro_batch_size, m.vocab_size)
    buffers = expert_biases(r.chunks)
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    capture = RankCapture(trace_path, header(cfg, device, r, time.perf_counter() - started),
                          fingerprints=cfg.capture != "losses")
    tr = r.traced
    capture.initial(tr.values())
    global_batch = t.num_microbatches * dp_size * t.micro_batch_size
    first_step, consumed = 0, 0
    if cfg.resume_from is not None:
        done, consumed = checkpoint.load(r, Path(cfg.resume_from), cfg, device)
        first_step = done + 1
        capture.resumed(done, tr.values(), tr.loaded_states(r.optimizer), buffers)
    for step in range(first_step, t.train_iters):
        start = time.perf_counter()
        capture.begin_step(step)
        for chunk in r.model:
            chunk.zero_grad_buffer()
        r.optimizer.zero_grad()
        iterators = [_batches(data, consumed, t.num_microbatches, device, dp_size, dp_rank) for _ in r.chunks]
        forward_backward(forward_step_func=partial(_forward_step, recorder),
                         data_iterator=iterators if len(iterators) > 1 else iterators[0], model=r.model,
                         num_microbatches=t.num_microbatches, seq_length=t.seq_length,
                         micro_batch_size=t.micro_batch_size, forward_only=False)
        main_grads = tr.grads()
        capture.grads(main_grads)
        dumping = cfg.dump is not None and cfg.dump.step == step
        shards = tr.shards()
        dump = dump_tensors(cfg.dump, zip(tr.keys, main_grads), "grad", shards) if dumping else {}
        ok, norm, _ = r.optimizer.step()
        if not ok:
            raise RuntimeError(f"step {step}: megatron's optimizer skipped the update (inf/nan in the gradients)")
        r.scheduler.step(increment=1)
        if t.clip_grad > 0:
            capture.set(**clip_record(norm, t.clip_grad))
        values = tr.values()
        capture.optimizer_state(tr.states(r.optimizer))
        capture.params(values)
        if dumping:
            dump.update(dump_tensors(cfg.dump, zip(tr.keys, values), "param", shards))
            save_file(dump, str(trace_path.with_name(f"rank{rank}.dump.safetensors")))
        capture.buffers(buffers)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            losses, lm_loss = recorder.take(m.mtp_num_layers, ps.get_data_parallel_group() if dp_size > 1 else None)
            if ps.get_tensor_model_parallel_rank() == 0:      # every TP rank has the whole loss: recorded once
                capture.set(losses=losses, lm_loss=lm_loss)
        if overlap:
            capture.set(overlap=counter.take())
        capture.end_step(time.perf_counter() - start)
        consumed += global_batch
        if cfg.checkpoint is not None and cfg.checkpoint.step == step:
            checkpoint.save(r, Path(cfg.checkpoint.dir), step, consumed, cfg, device)
    capture.close()


def clip_record(norm: float, clip_grad: float) -> dict:
    """The step record's ``grad_norm``, ``clip_coeff`` and ``clipped`` from the grad norm megatron's optimizer
    returned: clip_grads.clip_grad_by_total_norm_fp32's coefficient ``clip_grad / (norm + 1e-6)``, in the same
    float64 arithmetic (applied when < 1)."""
    coeff = clip_grad / (norm + 1.0e-6)
    return {"grad_norm": float64_scalar(norm), "clip_coeff": float64_scalar(coeff), "clipped": coeff < 1.0}


def _embedding_ranks():
    """The global ranks of this rank's embedding group as megatron's parallel state holds them (None when this
    rank is in none)."""
    from megatron.core import parallel_state as ps
    ranks = getattr(ps, "_EMBEDDING_GLOBAL_RANKS", None)
    return list(ranks) if ranks is not None else None
