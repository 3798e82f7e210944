"""One pipeline rank's training loop, top to bottom.

build chunks (global names, name-keyed init) -> per step: microbatches -> run the schedule's action list ->
finalize grads (embedding replica sum, expert-bias update; Megatron's ``finalize_model_grads``) -> capture
grads -> grad norm / clip (Megatron's ``get_grad_norm_fp32`` + ``clip_grad_norm``) -> AdamW -> capture params.
Call with torch.distributed already initialised (one process per rank: P x EP of them).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trainerkit import names
from trainerkit.capture import FORMAT, CaptureClock, TraceWriter, dump_tensors, scalar
from trainerkit.config import RunConfig
from trainerkit.data import TokenDataset
from trainerkit.fingerprint import PendingHex, fingerprint_hex_many, fingerprint_hex_many_async
from trainerkit.init import init_parameters
from trainerkit.layout import PipelineLayout
from trainerkit.names import OPTIMIZER_STATES
from trainerkit.schedule import build_schedule

from . import checkpoint, faults
from .executor import StepExecutor
from .model.chunk import Microbatch, StageChunk
from .model.expert_parallel import ExpertParallel
from .model.losses import scale_by_tokens
from .model.moe import Router
from .optimizer import AdamW
from .probe import Probe
from .reductions import EmbeddingSync, clip, grad_norm, reported_lm_loss


class RankState:
    """The chunks of one rank and their parameter bookkeeping.

    ``rank`` is the global rank; ``pp_rank, ep_rank = divmod(rank, EP)`` (world = P x EP, Megatron's order
    with TP = CP = 1; `model.expert_parallel`).  The EP ranks of a pipeline rank hold the same chunks, except
    that each keeps only its own routed experts (``ep``: the `ExpertParallel` group, None for EP = 1).

    ``params``: (key, global name, replica tag, parameter, canonical order key) per parameter, in chunk order;
    each parameter carries an fp32 ``main_grad``.  Non-expert parameters of EP rank r > 0 are replicas tagged
    ``ep{r}`` (`names.ep_replica`).  The canonical order key (`names.order_key`) is a function of the name
    alone, so it depends on neither the layout nor EP.  ``weight_decay``: key -> whether it is in the optimizer's decay group (the one
    source for both the optimizer and the trace header).
    """

    def __init__(self, cfg: RunConfig, rank: int, transport):
        self.cfg, self.rank, self.transport = cfg, rank, transport
        par, model, t = cfg.parallel, cfg.model, cfg.training
        ep_size = par.expert_model_parallel_size
        self.pp_rank, self.ep_rank = divmod(rank, ep_size)
        self.layout = PipelineLayout.from_string(par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size,
                                                 model.num_layers, model.mtp_num_layers)
        self.device = transport.device
        self.dtype = getattr(torch, cfg.params_dtype)
        # collective (dist.new_group on every rank, same order): before any other group is made
        self.ep = ExpertParallel.build(par.pipeline_model_parallel_size, ep_size, rank, transport.staged,
                                       transport.host_channel_store, transport.timeout_s) if ep_size > 1 else None
        separate = t.reductions == "canonical"
        self.chunks = {s: StageChunk(model, self.layout, s, t.num_microbatches, separate, cfg.inject)
                       for s in self.layout.stages_of_rank(self.pp_rank)}
        self.params = []
        self.weight_decay: dict[str, bool] = {}
        for chunk in self.chunks.values():
            named = list(chunk.global_parameters())
            chunk.per_token_loss = bool(cfg.megatron_option("calculate_per_token_loss", False))
            for layer in chunk.moe_layers():
                # per-token loss: megatron multiplies the aux loss by the microbatch's token count (the router's
                # activation.shape[0]: no padding mask is passed) and divides every gradient by the step's loss
                # token count (moe/router.py attach_and_log_load_balancing_loss, finalize_model_grads)
                layer.aux_loss_scale = float(t.seq_length * t.micro_batch_size) if chunk.per_token_loss else \
                    1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches)
                layer.set_expert_parallel(self.ep, faults.ep_unsorted_dispatch(cfg.inject))
            kept = {id(p) for p in chunk.parameters()}
            named = [(name, replica, p) for name, replica, p in named if id(p) in kept]
            init_parameters(((name, p) for name, _, p in named), model, t.seed)
            chunk.to(self.device, self.dtype)
            for name, replica, p in named:
                if names.expert_id(name) is None:
                    replica = names.ep_replica(replica, self.ep_rank)
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                # fp32 master weights for the optimizer (Megatron's bf16 optimizer); fp32 params are their own
                p.master = p if p.dtype == torch.float32 else p.detach().float().clone()
                key = names.replica_key(name, replica)
                self.params.append((key, name, replica, p, names.order_key(name)))
                self.weight_decay[key] = faults.weight_decay(cfg.inject, name, names.is_matrix(name, p.ndim))

    def header(self) -> dict:
        """The trace header record: parameter inventory with canonical order keys."""
        inventory = [{"key": key, "name": name, "replica": replica, "shape": list(p.shape),
                      "dtype": str(p.dtype).replace("torch.", ""), "family": names.family(name),
                      "weight_decay": self.weight_decay[key], "order": list(order)}
                     for key, name, replica, p, order in self.params]
        return {"type": "header", "format": FORMAT, "rank": self.rank, "world_size": dist.get_world_size(),
                "pp_rank": self.pp_rank, "ep_rank": self.ep_rank,
                "expert_model_parallel_size": self.cfg.parallel.expert_model_parallel_size,
                "stages": sorted(self.chunks), "params": inventory,
                "reductions": self.cfg.training.reductions, "device": str(self.device),
                "params_dtype": self.cfg.params_dtype, "transport": self.transport.description,
                "settings": self.transport.settings}

    def fingerprints(self, attr: str) -> "PendingHex | None":
        """Fingerprints of every parameter's fp32 master value (attr "master") or main_grad, in `self.params`
        order (`resolve` turns them into {key: fingerprint}); None when capture is "losses".  On CUDA the
        kernels are queued on the current stream and nothing waits for them here, so capture does not stall
        the step: the optimizer's and zeroing kernels queue behind them."""
        if self.cfg.capture == "losses":
            return None
        return fingerprint_hex_many_async([getattr(p, attr) for _, _, _, p, _ in self.params])

    def state_fingerprints(self, optimizer) -> dict:
        """{`OPTIMIZER_STATES` name: `fingerprints`-like pending result} of Adam's moments of every parameter's
        master (`optimizer.AdamW`'s state), in `self.params` order; {} when capture is "losses".  A parameter
        without state yet (a resumed run that did not load it) has Adam's initial moments: zeros."""
        if self.cfg.capture == "losses":
            return {}
        return {name: fingerprint_hex_many_async([optimizer.state[p.master][name] if p.master in optimizer.state
                                                  else torch.zeros_like(p.master) for _, _, _, p, _ in self.params])
                for name in OPTIMIZER_STATES}

    def resolve(self, pending: "PendingHex | None") -> dict:
        """{key: fingerprint} of `fingerprints`' result (waits for the device)."""
        return {} if pending is None else dict(zip((key for key, *_ in self.params), pending.hex()))

    def dump_tensors(self, attr: str, prefix: str) -> dict:
        """{prefix/key: CPU copy} of the dump keys this rank holds (`RunConfig.dump`), within max_bytes."""
        return dump_tensors(self.cfg.dump, ((key, getattr(p, attr)) for key, _, _, p, _ in self.params), prefix)

    def named_buffers(self):
        """(global name, tensor) of the state buffers that persist across steps (router expert bias)."""
        return [(name, buf) for chunk in self.chunks.values() for name, buf in chunk.named_buffers()
                if name.endswith("expert_bias")]

    def buffers(self) -> dict:
        """{global name: fingerprint} of the persistent buffers (router expert bias)."""
        bufs = self.named_buffers()
        return dict(zip((n for n, _ in bufs), fingerprint_hex_many([b for _, b in bufs])))

    def router_ties(self) -> dict:
        """{router global name (``decoder.layers.1.mlp.router``, ``mtp.layers.0.transformer_layer.mlp.router``):
        {"topk": n, "group": n}} for the routers this rank holds: the tokens of this step whose expert / group
        selection a tie decided (`model.moe.Router.take_ties`, which resets the counts).  A diagnostic for the
        trace, not a compared buffer: it says whether a tie-break difference could have moved a bit."""
        return {name: module.take_ties() for chunk in self.chunks.values()
                for name, module in chunk.named_modules() if isinstance(module, Router)}


def make_optimizer(state: RankState) -> AdamW:
    """AdamW (β1, β2 from the config), weight decay on matrices only (`optimizer.AdamW`: one tensor at a time,
    the same bits on every CPU and GPU)."""
    t = state.cfg.training
    decay = [p.master for key, _, _, p, _ in state.params if state.weight_decay[key]]
    no_decay = [p.master for key, _, _, p, _ in state.params if not state.weight_decay[key]]
    return AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                 lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def train(cfg: RunConfig, rank: int, trace_path: Path, transport) -> None:
    """Run ``cfg.training.train_iters`` steps on global rank `rank` (pipeline rank ``rank // EP``, EP rank
    ``rank % EP``), writing the rank trace to `trace_path`.

    transport: this rank's `transport.Transport` (process group already initialised).  Every EP rank of a
    pipeline rank runs the same action list on the same microbatches (peers are mapped into its EP column by
    the transport)."""
    t = cfg.training
    state = RankState(cfg, rank, transport)
    layout = state.layout
    actions = build_schedule(layout, t.num_microbatches, t.seq_length, t.micro_batch_size,
                             cfg.model.hidden_size, cfg.parallel.overlap_moe_expert_parallel_comm)[state.pp_rank]
    actions = faults.schedule(cfg.inject, actions, layout, state.pp_rank)
    sync_embedding = EmbeddingSync(layout, state.pp_rank, state.params, transport, cfg.inject)
    data = TokenDataset(t.data, t.seed, t.seq_length, t.micro_batch_size, cfg.model.vocab_size)
    probe = Probe() if cfg.capture == "activations" else None
    for chunk in state.chunks.values():
        chunk.probe = probe
    executor = StepExecutor(state.chunks, t.num_microbatches, transport, state.dtype, cfg.inject, probe,
                            cfg.parallel.overlap_moe_expert_parallel_comm, cfg.parallel.delay_wgrad_compute)
    optimizer = make_optimizer(state)
    writer = TraceWriter(trace_path)
    writer.write(state.header())
    writer.write({"type": "init", "params": state.resolve(state.fingerprints("master"))})
    first_step = 0
    if cfg.resume_from is not None:
        first_step = checkpoint.load(state, optimizer, Path(cfg.resume_from)) + 1
        faults.after_resume(cfg.inject, optimizer)
        # what was loaded, before the first step: the harness compares it with the saving run's state
        moments = state.state_fingerprints(optimizer)
        writer.write({"type": "resumed", "step": first_step - 1, "params": state.resolve(state.fingerprints("master")),
                      **{name: state.resolve(pending) for name, pending in moments.items()},
                      "buffers": state.buffers()})
    clock = CaptureClock()
    for step in range(first_step, t.train_iters):
        start = time.perf_counter()
        clock.begin_step()
        faults.at_step_start(cfg.inject, step, rank, dist.get_world_size())
        mbs = [Microbatch(*(x.to(state.device) for x in data.microbatch(step, m)), index=m)
               for m in range(t.num_microbatches)]
        outs = executor.run(actions, mbs)
        sync_embedding()
        if cfg.megatron_option("calculate_per_token_loss", False):
            scale_by_tokens([p.main_grad for *_, p, _ in state.params], int(sum(mb.loss_mask.sum() for mb in mbs)))
        for chunk in state.chunks.values():
            for layer in chunk.moe_layers():
                layer.router.update_expert_bias()
        faults.after_grads(cfg.inject, step, state.params, cfg.model.num_layers)
        dumping = cfg.dump is not None and cfg.dump.step == step
        dump = state.dump_tensors("main_grad", "grad") if dumping else {}
        with clock.capture():
            grads = state.fingerprints("main_grad")
        record = {"type": "step", "step": step, "grads": None, "grad_norm": None, "clip_coeff": None,
                  "clipped": None}
        if t.clip_grad > 0:
            norm = grad_norm(t.reductions, state.params, transport, cfg.inject)
            coeff, clipped = clip(norm, t.clip_grad, state.params)
            record.update(grad_norm=scalar(norm), clip_coeff=scalar(coeff), clipped=clipped)
        for *_, p, _ in state.params:
            p.master.grad = p.main_grad
        optimizer.step()
        with torch.no_grad():
            for *_, p, _ in state.params:
                p.master.grad = None
                p.main_grad.zero_()
                if p.master is not p:
                    p.copy_(p.master)
        with clock.capture():
            params = state.fingerprints("master")
            moments = state.state_fingerprints(optimizer)
        if dumping:
            dump.update(state.dump_tensors("master", "param"))
            save_file(dump, str(trace_path.with_name(f"rank{rank}.dump.safetensors")))
        timing = clock.end_step()
        # waits for the device to finish the step (not capture time); then the small rest of the capture
        record["grads"], record["params"] = state.resolve(grads), state.resolve(params)
        record.update({name: state.resolve(pending) for name, pending in moments.items()})
        with clock.capture():
            record["buffers"] = state.buffers()
            record["router_ties"] = state.router_ties()
        record["actions"] = executor.timings
        if outs:
            record["losses"] = [{"microbatch": m, "lm": scalar(o.lm_loss), "num_tokens": int(o.num_tokens.item()),
                                 "mtp": [scalar(x) for x in o.mtp_losses]} for m, o in enumerate(outs)]
            record["lm_loss"] = scalar(reported_lm_loss(outs))
        if probe is not None:
            record.update(probe.take())
        record["time_s"] = time.perf_counter() - start
        record.update(timing.fields(), capture_s=clock.host_s)
        writer.write(record)
        if cfg.checkpoint is not None and cfg.checkpoint.step == step:
            checkpoint.save(state, optimizer, Path(cfg.checkpoint.dir), step)
    writer.write({"type": "end"})
    writer.close()
