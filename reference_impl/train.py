"""One pipeline rank's training loop, top to bottom.

build chunks (global names, name-keyed init) -> per step: microbatches -> run the schedule's action list ->
finalize grads (embedding replica sum, expert-bias update; Megatron's ``finalize_model_grads``) -> capture
grads -> grad norm / clip (Megatron's ``get_grad_norm_fp32`` + ``clip_grad_norm``) -> AdamW -> capture params.
Call with torch.distributed already initialised (one process per pipeline rank).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import faults, names
from .capture import FORMAT, TraceWriter, scalar
from .config import RunConfig
from .data import TokenDataset
from .executor import StepExecutor
from .fingerprint import fingerprint_hex
from .init import init_parameters
from .layout import PipelineLayout
from .model.chunk import Microbatch, StageChunk
from .schedule import build_schedule


class RankState:
    """The chunks of one rank and their parameter bookkeeping (global names, replica tags, main_grad)."""

    def __init__(self, cfg: RunConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        par, model = cfg.parallel, cfg.model
        self.layout = PipelineLayout.from_string(par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size,
                                                 model.num_layers, model.mtp_num_layers)
        self.device = torch.device(cfg.device)
        m = cfg.training.num_microbatches
        self.chunks = {s: StageChunk(model, self.layout, s, m) for s in self.layout.stages_of_rank(rank)}
        self.params = []            # (key, name, replica, param) in chunk order
        for chunk in self.chunks.values():
            init_parameters(chunk, model, cfg.training.seed)
            chunk.to(self.device)
            for name, p in chunk.named_parameters():
                replica = chunk.embedding_replica if name == names.EMBEDDING else None
                p.main_grad = torch.zeros_like(p)
                self.params.append((names.replica_key(name, replica), name, replica, p))
            for layer in chunk.moe_layers():
                layer.aux_loss_scale = 1.0 / m

    def header(self) -> dict:
        """The trace header record: parameter inventory with canonical order keys."""
        inventory, within = [], {}
        for key, name, replica, p in self.params:
            sec = names.section_and_layer(name)
            within[sec] = within.get(sec, -1) + 1
            inventory.append({"key": key, "name": name, "replica": replica, "shape": list(p.shape),
                              "dtype": str(p.dtype).replace("torch.", ""), "family": names.family(name),
                              "weight_decay": names.is_matrix(name, p.ndim), "order": [*sec, within[sec]]})
        return {"type": "header", "format": FORMAT, "rank": self.rank, "world_size": dist.get_world_size(),
                "stages": sorted(self.chunks), "params": inventory}

    def buffers(self) -> dict:
        return {f"{name}": fingerprint_hex(buf) for chunk in self.chunks.values()
                for name, buf in chunk.named_buffers() if name.endswith("expert_bias")}


def embedding_group(layout: PipelineLayout):
    """Process group {rank of the first stage, rank of the MTP stage} for the word-embedding replica sum
    (Megatron's embedding group for untied weights).  Every rank must call this (``new_group`` is
    collective).  None when no cross-rank replica exists."""
    if layout.mtp_stage is None:
        return None
    ranks = sorted({layout.rank_of(layout.embedding_stage)[0], layout.rank_of(layout.mtp_stage)[0]})
    group = dist.new_group(ranks) if len(ranks) == 2 else None
    return group, ranks


def sync_embedding_replicas(state: RankState, group_info) -> None:
    """Sum the word-embedding main_grad over its holders once, after the microbatch loop
    (``_allreduce_word_embedding_grads``).  A two-member sum a+b is commutative, so both ranks get the same bits."""
    if group_info is None or group_info[0] is None:
        return
    group, ranks = group_info
    if state.rank not in ranks:
        return
    for _, name, _, p in state.params:
        if name == names.EMBEDDING:
            dist.all_reduce(p.main_grad, group=group)


def grad_norm_megatron(state: RankState) -> torch.Tensor:
    """Megatron's ``get_grad_norm_fp32``: per-rank L2 norm over local non-replica grads, squared, all-reduced
    (sum) over all pipeline ranks, square root.  Returns an fp32 scalar."""
    local = [p.main_grad for _, _, replica, p in state.params if replica is None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local])) if local \
        else torch.zeros((), device=state.device)
    total = norm ** 2
    dist.all_reduce(total)
    return total.sqrt()


def make_optimizer(state: RankState) -> torch.optim.Optimizer:
    """AdamW (β1, β2 from the config), weight decay on matrices only; the single-tensor (non-foreach)
    implementation so each parameter's update depends on nothing but its own tensors."""
    t = state.cfg.training
    decay = [p for _, name, _, p in state.params if names.is_matrix(name, p.ndim)]
    no_decay = [p for _, name, _, p in state.params if not names.is_matrix(name, p.ndim)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                             foreach=False, fused=False)


def train(cfg: RunConfig, rank: int, trace_path: Path) -> None:
    """Run ``cfg.training.train_iters`` steps on pipeline rank `rank`, writing the rank trace to `trace_path`."""
    t = cfg.training
    state = RankState(cfg, rank)
    layout = state.layout
    actions = build_schedule(layout, t.num_microbatches, t.seq_length, t.micro_batch_size,
                             cfg.model.hidden_size)[rank]
    actions = faults.schedule(cfg.inject, actions, layout, rank)
    group_info = embedding_group(layout)
    data = TokenDataset(t.data, t.seed, t.seq_length, t.micro_batch_size, cfg.model.vocab_size)
    executor = StepExecutor(state.chunks, t.num_microbatches, state.device)
    optimizer = make_optimizer(state)
    writer = TraceWriter(trace_path)
    writer.write(state.header())
    writer.write({"type": "init", "params": {k: fingerprint_hex(p) for k, _, _, p in state.params}})
    for step in range(t.train_iters):
        start = time.perf_counter()
        faults.at_step_start(cfg.inject, step, rank, dist.get_world_size())
        mbs = [Microbatch(*(x.to(state.device) for x in data.microbatch(step, m))) for m in range(t.num_microbatches)]
        outs = executor.run(actions, mbs)
        sync_embedding_replicas(state, group_info)
        for chunk in state.chunks.values():
            for layer in chunk.moe_layers():
                layer.router.update_expert_bias()
        faults.after_grads(cfg.inject, step, state.params, cfg.model.num_layers)
        record = {"type": "step", "step": step,
                  "grads": {k: fingerprint_hex(p.main_grad) for k, _, _, p in state.params}}
        record["grad_norm"] = record["clip_coeff"] = None
        if t.clip_grad > 0:
            norm = grad_norm_megatron(state)
            coeff = t.clip_grad / (norm + 1e-6)
            record["grad_norm"], record["clip_coeff"] = scalar(norm), scalar(coeff)
            if coeff < 1.0:
                for *_, p in state.params:
                    p.main_grad.mul_(coeff)
        for *_, p in state.params:
            p.grad = p.main_grad
        optimizer.step()
        for *_, p in state.params:
            p.grad = None
            p.main_grad.zero_()
        record["params"] = {k: fingerprint_hex(p) for k, _, _, p in state.params}
        record["buffers"] = state.buffers()
        if outs:
            record["losses"] = [{"microbatch": m, "lm": scalar(o.lm_loss), "num_tokens": int(o.num_tokens.item()),
                                 "mtp": [scalar(x) for x in o.mtp_losses]} for m, o in enumerate(outs)]
            loss_sum, tokens = outs[0].lm_loss_sum, outs[0].num_tokens
            for o in outs[1:]:                 # left to right in microbatch order
                loss_sum, tokens = loss_sum + o.lm_loss_sum, tokens + o.num_tokens
            record["lm_loss"] = scalar(loss_sum / tokens.clamp(min=1))
        record["time_s"] = time.perf_counter() - start
        writer.write(record)
    writer.write({"type": "end"})
    writer.close()
