"""The capture installed around Megatron-LM's own training loop (``megatron.training.training``), from outside.

Nothing of the checkout is edited.  `install` wraps, before the training script imports them:

* ``training.train_step`` (looked up by ``train()`` at every iteration): on the first call it writes the header
  (global names from megatron's layer numbering and pp / vp / ep / dp ranks, `model.global_parameters`, the same
  as the megatron trainer's) and the initial values; every call opens a step, wraps
  - the ``forward_step_func``'s loss function, to record each microbatch's ``(loss sum, num_tokens)`` as
    ``pretrain_gpt.loss_func`` returns them (its first two values), and each MTP depth's loss as megatron logs
    it (`train.record_mtp_losses`);
  - the ``forward_backward_func``, to forget a forward-backward that megatron's rerun state machine repeats;
  - ``optimizer.step`` for this call: gradients (``main_grad``, after ``finalize_model_grads``) fingerprinted
    before it (clipping scales them in place), parameters (the fp32 masters in bf16), router ``expert_bias``,
    grad norm and clip coefficient after it;
  and takes megatron's reported ``lm loss`` (train_step's return: summed over microbatches, all-reduced over
  the data-parallel group by megatron) on the last pipeline stage.
* the rank's trace is closed (`finish`) when the script returns.
* a job that loaded a checkpoint (``--load``; megatron's ``args.iteration`` N > 0 at the first step) writes to
  ``DIR/iter{N:07d}/`` (`trainerkit.capture.segment_dir`), numbers its steps from N, is not re-initialised, and
  first records what it loaded (the trace's ``resumed`` record, `trainerkit.capture.RankCapture.resumed`).

`trainerkit.capture.RankCapture` writes the trace: no collective of bitparity's own, fingerprints on the device.
Under ``--use-distributed-optimizer`` each DP rank traces its ranges of the gradients, fp32 main copies and Adam
moments as partial fingerprints (`optimizer_view.Traced`, as the megatron trainer does), which `bitparity
compare` composes.  Refused at the first step, one line (`CaptureRefused`): tensor and context parallelism.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from trainerkit.capture import RankCapture, microbatch_losses, scalar, segment_dir

from . import optimizer_view
from . import train as megatron_train
from .model import expert_biases, global_parameters


class CaptureRefused(RuntimeError):
    """The run uses something the capture cannot trace (the message names the megatron argument)."""


#: megatron arguments (``get_args()``) under which a rank holds only part of a tensor: (attribute, flag, why).
#: Tensor parallelism (TP, SP, expert TP) and the distributed optimizer are traced by shard (`model.tp_shards`,
#: `optimizer_view`); context parallelism is not.
_SHARDED = (("context_parallel_size", "--context-parallel-size",
             "a rank holds part of each sequence's activations and losses"),)


def refusal(argv: list) -> Optional[str]:
    """Why the capture cannot trace a run with the training arguments `argv` (megatron's flags, as typed), before
    megatron starts (megatron's parser takes no abbreviations); None when it can.  The first step checks the parsed
    arguments again (`CaptureRefused`), for values that arrive another way (a YAML config)."""
    for attr, flag, why in _SHARDED:
        for i, word in enumerate(argv):
            name, eq, value = word.partition("=")
            if name != flag:
                continue
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.strip() not in ("1", ""):
                return f"bitparity capture: {flag} {value} is not supported: {why}"
    return None


class _Recorder:
    """The step's per-microbatch losses as the user's loss function returned them; `mtp` filled by the MTP hook."""

    def __init__(self):
        self.lm: list = []
        self.mtp: list = []

    def clear(self) -> None:
        self.lm, self.mtp = [], []

    def wrap_forward_step(self, forward_step_func):
        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            output, loss_func = forward_step_func(*args, **kwargs)
            return output, self._wrap_loss(loss_func)
        return forward_step

    def _wrap_loss(self, loss_func):
        @functools.wraps(loss_func)
        def recorded(*args, **kwargs):
            out = loss_func(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 3:       # (loss sum, num_tokens, report): pretrain_gpt's
                self.lm.append((out[0].detach().clone().float().view(()), out[1].detach().clone().view(())))
            else:                                              # (mean loss, report): one token count of 1
                self.lm.append((out[0].detach().clone().float().view(()), torch.ones((), dtype=torch.int)))
            return out
        return recorded


class _Capture:
    """One rank's capture state across ``train_step`` calls."""

    def __init__(self, out_dir: Path, argv: list, init_seed: Optional[int] = None):
        self.out_dir, self.argv, self.init_seed = out_dir, argv, init_seed
        self.capture: Optional[RankCapture] = None
        self.recorder = _Recorder()
        self.step = 0
        self.started = time.perf_counter()
        self.traced: Optional[optimizer_view.Traced] = None
        self.buffers: dict = {}

    def first_step(self, model: list, optimizer) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model
        from megatron.training import get_args

        args = get_args()
        for attr, flag, why in _SHARDED:
            value = getattr(args, attr, None)
            if value not in (None, False, 1):
                raise CaptureRefused(f"bitparity capture: {flag} {value} is not supported: {why}")
        chunks = [unwrap_model(m) for m in model]
        ep = ps.get_expert_model_parallel_world_size()
        params = global_parameters(chunks, args.num_experts // ep if args.num_experts else 0,
                                   ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank(),
                                   ps.get_expert_data_parallel_rank(), strict=False,
                                   tp_rank=ps.get_tensor_model_parallel_rank(),
                                   expert_tp_rank=ps.get_expert_tensor_parallel_rank())
        # megatron's completed iterations before this job (> 0: it loaded a checkpoint, --load): this job's first
        # step is that iteration, and its weights are the checkpoint's, not re-initialised
        start = int(getattr(args, "iteration", 0) or 0)
        if self.init_seed is not None and start == 0:
            _reinitialise(params, optimizer, args, self.init_seed)
        self.traced = optimizer_view.traced(optimizer, params)
        self.buffers = expert_biases(chunks)
        self.mtp_num_layers = args.mtp_num_layers or 0
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        # every TP rank of the loss stage has the whole loss: TP rank 0 records it
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
        self.clip_grad = args.clip_grad
        rank = dist.get_rank()
        path = segment_dir(self.out_dir, start) / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)                 # a trace of an earlier run in the same directory
        header = {**megatron_train.rank_fields(chunks, self.traced, strict=False),
                  **_header(args, params, time.perf_counter() - self.started, self.argv)}
        header["settings"]["first_iteration"] = start
        self.capture = RankCapture(path, header)
        self.capture.initial(self.traced.values())
        if start > 0:       # what the job loaded, checked against what the saving job held after that step
            self.capture.resumed(start - 1, self.traced.values(), self.traced.loaded_states(optimizer),
                                 self.buffers)
        self.step = start
        if self.mtp_num_layers:
            megatron_train.record_mtp_losses(self.recorder)

    def finish(self) -> None:
        if self.capture is not None:
            self.capture.close()


@torch.no_grad()
def _reinitialise(params: list, optimizer, args, seed: int) -> None:
    """``--bitparity-init SEED``: every parameter re-initialised by its global name (`trainerkit.init`: the
    same weights whatever the layout; megatron seeds by pipeline rank, megatron-semantics §7.3) with megatron's
    ``--init-method-std`` and ``--num-layers``, and what the optimizer steps from them: the fp32 master copies
    (bf16), under the distributed optimizer this rank's fp32 range of each; a TP slice is cut from the whole
    parameter (`train.initialise`)."""
    cfg = SimpleNamespace(init_method_std=args.init_method_std, num_layers=_gpt_num_layers(args),
                          moe_router_init_method_std=None)
    megatron_train.initialise(params, cfg, seed)
    ranges, masters = optimizer_view.owned_ranges(optimizer), optimizer_view.master_params(optimizer)
    for gp in params:
        master = masters.get(id(gp.param))
        if master is None:
            continue
        r = ranges.get(id(gp.param))
        master.copy_((r.of(gp.param) if r is not None else gp.param).float())


def _gpt_num_layers(args) -> int:
    """The decoder layer count the output projections' init is scaled by (`trainerkit.init`): ``--num-layers``,
    or for a HybridModel (``--hybrid-layer-pattern``, where megatron counts every Hybrid layer) its main pattern's
    attention layers, GPT's ``num_layers`` of the same blocks, so a GPT job and its Hybrid migration start from
    the same weights."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return args.num_layers
    main = pattern.split("/")[0]
    return max(1, sum(main.count(c) for c in "+*D"))


def _header(args, params, setup_s, argv) -> dict:
    """The header's fields beyond the rank's identity (`train.rank_fields`): device, dtype, transport, and the
    settings of megatron's own loop (its command line, layout, microbatches)."""
    import megatron.core

    device = next(iter(params)).param.device if params else torch.device("cpu")
    return {"reductions": "megatron", "device": str(device),
            "params_dtype": "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
            "transport": dist.get_backend(), "trainer": "megatron-core", "setup_s": setup_s,
            "settings": {"training_loop": "megatron.training.pretrain", "argv": list(argv),
                         "megatron_core": megatron.core.__version__,
                         "megatron_path": str(Path(megatron.core.__path__[0]).resolve().parent.parent),
                         "pipeline_model_parallel_layout": _layout_text(args),
                         "hybrid_layer_pattern": getattr(args, "hybrid_layer_pattern", None),
                         "num_microbatches": _num_microbatches(), "micro_batch_size": args.micro_batch_size,
                         "train_iters": args.train_iters, "mtp_num_layers": args.mtp_num_layers or 0}}


def _layout_text(args) -> Optional[str]:
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    return None if layout is None else str(layout)


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    return get_num_microbatches()


_state: Optional[_Capture] = None


def install(out_dir: Path, argv: list, init_seed: Optional[int] = None) -> None:
    """Wrap ``megatron.training.training.train_step`` so that every training step of this process writes its
    record to ``out_dir/rank{r}.jsonl`` (r: the global rank).  Call before the training script runs; `finish`
    after it.  `argv`: the training command line, recorded in the header.  `init_seed`: re-initialise the
    parameters by global name before the first step (`_reinitialise`), so that two layouts start equal."""
    global _state
    from megatron.training import training

    _state = _Capture(Path(out_dir), argv, init_seed)
    original = training.train_step

    @functools.wraps(original)
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, *args, **kwargs):
        state = _state
        if state.capture is None:
            state.first_step(model, optimizer)
        start = time.perf_counter()
        state.capture.begin_step(state.step)
        state.recorder.clear()

        @functools.wraps(forward_backward_func)
        def forward_backward(*fb_args, **fb_kwargs):
            state.recorder.clear()              # a forward-backward the rerun state machine repeats
            return forward_backward_func(*fb_args, **fb_kwargs)

        step = optimizer.step

        @functools.wraps(step)
        def optimizer_step(*s_args, **s_kwargs):
            state.capture.grads(state.traced.grads())
            result = step(*s_args, **s_kwargs)
            _, norm, _ = result
            if state.clip_grad > 0 and norm is not None:
                state.capture.set(**megatron_train.clip_record(norm, state.clip_grad))
            state.capture.optimizer_state(state.traced.states(optimizer))
            state.capture.params(state.traced.values())
            state.capture.buffers(state.buffers)
            return result

        optimizer.step = optimizer_step
        try:
            result = original(state.recorder.wrap_forward_step(forward_step_func), data_iterator, model, optimizer,
                              opt_param_scheduler, config, forward_backward, *args, **kwargs)
        finally:
            del optimizer.step                  # the instance attribute: the class's step again
        loss_reduced = result[0]
        if state.last_stage:
            reported = loss_reduced.get("lm loss") if isinstance(loss_reduced, dict) else None
            state.capture.set(losses=microbatch_losses(state.recorder.lm, state.recorder.mtp, state.mtp_num_layers,
                                                       state.dp_size, state.dp_rank),
                              lm_loss=scalar(reported.detach().float().view(())) if reported is not None else None)
        state.capture.end_step(time.perf_counter() - start)
        state.step += 1
        return result

    training.train_step = train_step


def finish() -> int:
    """Close this process's trace (the ``end`` record; waits for the writer thread); returns how many training
    steps it captured (0: the script ran no megatron training step, nothing was written).

    Raises:
        trainerkit.capture.CaptureError: the trace could not be written."""
    if _state is None:
        return 0
    _state.finish()
    return _state.step
