"""Save and resume a megatron-core run with megatron's own distributed checkpoint (``dist_checkpointing``,
``torch_dist`` format), as Megatron-LM's ``training/checkpointing.py`` (``generate_state_dict``,
``save_checkpoint``, ``load_checkpoint``) does it:

* ``model`` (``model{i}`` per virtual stage when V > 1): each GPTModel chunk's ``sharded_state_dict`` — global
  keys (layer numbers with the pipeline offset, experts by global index, TP slices by offset), so a checkpoint
  saved under one P / V / EP / TP / DP loads under another; megatron reshards on load;
* ``optimizer``: ``optimizer.sharded_state_dict(model)`` — Adam's ``exp_avg`` / ``exp_avg_sq``, the fp32 main
  params, the step; under the distributed optimizer in the sharding type Megatron-LM picks
  (``_build_sharded_state_dict_metadata``): ``dp_reshardable`` (default; reshards along DP only) or
  ``fully_reshardable`` (megatron option ``dist_ckpt_optim_fully_reshardable``; any layout);
* ``opt_param_scheduler``, ``iteration``, ``consumed_train_samples`` (Megatron-LM keeps it in ``args``: the data
  position; this trainer's data iterator starts from it) and ``rng_state`` (a ShardedObject per (pp, tp) rank,
  ``get_rng_state``; loaded only under the same P and TP, as Megatron-LM does).

The checkpoint content metadata records the sharding type, so a load asks for the layout it was saved in.
"""
from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint_rules import sharding_type
from .optimizer_view import chained

#: Megatron-LM's ``_build_sharded_state_dict_metadata`` keys besides the sharding type.
_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class CheckpointError(RuntimeError):
    """A checkpoint megatron cannot load into this run (one line, naming the checkpoint and the reason)."""


def _metadata(kind: str | None) -> dict:
    from megatron.core import parallel_state as ps
    return {**({"distrib_optim_sharding_type": kind} if kind else {}), **_METADATA,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _rng_state(device: torch.device):
    """This rank's RNG state as Megatron-LM's ``get_rng_state`` saves it (``data_parallel_random_init`` off: one
    state per (pp, tp) rank, DP ranks are replicas)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state() if device.type == "cuda" else None,
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state],
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _set_rng_state(state: dict, device: torch.device) -> None:
    from megatron.core import tensor_parallel
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if device.type == "cuda" and state["cuda_rng_state"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _fresh_distributed_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam state before a load.  Without Apex or TE
    (bitparity's local specs, on every device) megatron's inner optimizer is torch's Adam, whose state appears at
    its first step, and ``DistributedOptimizer.state_dict`` asserts one common ``step`` in it
    (distrib_optimizer.py ``state_dict``: ``assert len(steps) == 1``): a fresh run cannot build the state dict
    it loads into.  megatron's own ``_init_optimizer_states_with_dummy_values`` (an Adam step on zero gradients,
    which it runs for its fully-sharded format) makes the state; the load then overwrites every value it set:
    the moments, the step, the fp32 main parameters (and, for fp32 models, the parameters they are views of)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for opt in chained(optimizer):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_step_kept():
    """While loading: the distributed optimizer's ``_set_main_param_and_optimizer_states`` copies every tensor of
    a parameter's Adam state from the checkpoint's, ``step`` included, but the checkpoint's per-parameter state
    has no ``step`` (megatron keeps it in the param groups and sets it first, `load_state_dict`): with torch's
    Adam (no Apex / TE: a tensor ``step`` in every state) the ``fully_reshardable`` load raises KeyError 'step'
    (distrib_optimizer.py, 0.16 to main).  The already-set ``step`` is handed back as its own source, a copy onto
    itself; every other tensor is copied as megatron does."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            step = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order], {}).get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)
    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter's Adam state its own ``step`` tensor after a load.  Without Apex / TE the distributed
    optimizer's ``load_state_dict`` puts ONE step tensor into every parameter's state (distrib_optimizer.py:
    ``step = torch.tensor(...)``; ``for s in state_dict_state.values(): s["step"] = step``, 0.16 to main) and
    torch's ``Optimizer.load_state_dict`` keeps ``step`` as it is (not copied unless fused / capturable), so
    Adam's in-place ``step += 1`` then adds once per parameter to the one shared counter: every parameter but
    the first is bias-corrected with a wrong step count from the first step after the resume (measured: 129 of
    131 parameters differ after it, moments equal).  Copies with the loaded value restore per-parameter steps."""
    import torch
    for opt in chained(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _state_dict(r, kind: str, is_loading: bool, device: torch.device, with_rng: bool) -> dict:
    """Megatron-LM's ``generate_state_dict`` for rank `r` (`train.MegatronRank`)."""
    sd: dict = {}
    for i, chunk in enumerate(r.chunks):
        sd["model" if len(r.chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=_metadata(kind))
    sd["optimizer"] = r.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=_metadata(kind))
    sd["opt_param_scheduler"] = r.scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_state(device)
    return sd


def _in_process_write_results() -> None:
    """Give megatron's checkpoint writer an in-process results queue.  ``FileSystemWriterAsync`` otherwise makes
    one through ``multiprocessing.Manager()`` (a spawned server process, for its asynchronous save), which a
    harness rank cannot start: the ranks are daemonic processes (`harness.running.runner`), so that every one dies
    with the harness.  This save is synchronous: its writer threads and the caller share the process, and a
    ``queue.Queue`` carries the same results (megatron/core/dist_checkpointing/strategies/filesystem_async.py,
    the module global ``_results_queue``, 0.16 to main)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron's filesystem_async has no _results_queue: update megatron_trainer/checkpoint.py")
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def _children_allowed():
    """Let this daemonic rank process start child processes for the length of a save.  megatron-core 0.16's
    writer forks one process per write bucket (filesystem_async.py ``write_preloaded_data_multiproc``), and
    multiprocessing refuses children to a daemonic process (the harness's ranks are daemonic, `_in_process_write_results`).
    The save is synchronous: the writer joins its workers before it returns, so none outlives this block."""
    import multiprocessing
    proc = multiprocessing.current_process()
    was = proc._config.get("daemon")
    proc._config["daemon"] = False
    try:
        yield
    finally:
        proc._config["daemon"] = was


def save(r, directory: Path, step: int, consumed_train_samples: int, cfg, device: torch.device) -> None:
    """Write rank `r`'s part of the checkpoint after `step` completed into `directory` (every rank calls it with
    the same directory; rank 0 creates it).  Content metadata: the sharding type, the step, the (P, TP) the RNG
    state was saved under."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    _in_process_write_results()
    kind = sharding_type(cfg)
    sd = _state_dict(r, kind, is_loading=False, device=device, with_rng=True)
    sd.update(iteration=step, consumed_train_samples=consumed_train_samples, checkpoint_version=3.0)
    grid = [ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()]
    with _children_allowed():
        dist_checkpointing.save(sd, str(directory),
                                sharded_strategy=get_default_save_sharded_strategy("torch_dist"),
                                content_metadata={**_METADATA, "distrib_optim_sharding_type": kind,
                                                  "bitparity_rng_grid": grid})
    dist.barrier()


def load(r, directory: Path, cfg, device: torch.device) -> tuple[int, int]:
    """Load `directory` into rank `r`: model chunks, optimizer (state and fp32 main params), scheduler, and the RNG
    state when the checkpoint was saved under this run's P and TP; returns (the checkpoint's step, its
    consumed_train_samples).

    Raises:
        CheckpointError: no megatron checkpoint in `directory`; saved in ``dp_reshardable`` and loaded under
            another layout than DP (Megatron-LM refuses it too: save with ``dist_ckpt_optim_fully_reshardable``)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointError(f"{directory}: not a megatron distributed checkpoint")
    meta = dist_checkpointing.load_content_metadata(str(directory)) or {}
    kind = meta.get("distrib_optim_sharding_type")
    grid = [ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()]
    same_grid = meta.get("bitparity_rng_grid") == grid
    _fresh_distributed_state(r.optimizer)
    sd = _state_dict(r, kind, is_loading=True, device=device, with_rng=same_grid)
    sd.update(iteration=0, consumed_train_samples=0, checkpoint_version=0.0)
    loaded = dist_checkpointing.load(sd, str(directory), strict="assume_ok_unexpected")
    for i, chunk in enumerate(r.chunks):
        chunk.load_state_dict(loaded["model" if len(r.chunks) == 1 else f"model{i}"], strict=True)
    # no_grad: megatron's dp_reshardable load copies into the fp32 main parameters outside it, and with fp32
    # parameters those are views of the parameters (leaves that require grad): torch refuses the in-place copy
    with torch.no_grad(), _torch_adam_step_kept():
        r.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(r.optimizer)
    r.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if same_grid:
        _set_rng_state(loaded["rng_state"][0], device)
    return int(loaded["iteration"]), int(loaded["consumed_train_samples"])
