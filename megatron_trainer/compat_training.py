"""Megatron-LM's own training loop (``megatron.training``: ``pretrain``, ``train``, ``train_step``) on a CPU-only
torch over gloo: six points beyond `compat`'s nine, applied in the rank process before ``pretrain`` runs.

Measured with Megatron-LM's ``pretrain_gpt.py`` (core_r0.19.0 at f8837c04ef, megatron-core 0.19.2's
``megatron.training``; MoE + MTP + MLA, P = 2, ``--distributed-backend gloo --mock-data``): with `compat`'s points
the model builds and runs; the loop around it stops in five places, all device plumbing:

* T1 ``training.pretrain`` calls ``initialize_megatron`` without its ``allow_no_cuda`` ("should not be set unless
  using megatron for cpu only"), which asserts CUDA: passed.
* T2 ``initialize._initialize_distributed`` builds the model-parallel groups only when ``torch.cuda.device_count()
  > 0`` (and sets the CUDA device): the initialize module sees one device and an inert ``set_device``.
* T3 ``training.set_jit_fusion_options`` warms up the fused kernels with CUDA tensors: skipped (nothing of it
  enters a computation; the fusions are off in a bitparity run).
* T4 the rerun state machine (``core/rerun_state_machine.py``) saves and restores ``torch.cuda`` RNG states
  around every step: an empty state on CPU (no CUDA generator is ever used there).
* T5 ``device='cuda'`` tensor factories throughout ``megatron.training`` (loss and timer reductions, the rerun
  machine's flags) and the ``megatron.core`` modules the loop imports beyond the model: every loaded megatron
  module that names the device gets `compat`'s CPU torch (point 6 widened), at the moment ``pretrain`` starts.
* T6 with TP or CP > 1, ``arguments.validate_args`` reads the CUDA architecture (``get_device_arch_version``)
  to decide whether ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is required (a CUDA stream-scheduling setting that orders
  the TP collectives before compute on Hopper and older): a CPU has no architecture (0) and no streams, so the
  rank's environment gets the setting megatron asks for (``setdefault``, a user's own value stays).

And one point on every device, about the megatron-core wheel (>= 0.17 ships ``megatron.training``):

* W1 ``initialize._compile_dependencies`` runs ``make`` in ``megatron/core/datasets`` (``datasets.utils.
  compile_helpers``) on rank 0 and exits when it fails; the wheel ships the built ``helpers_cpp`` extension but
  not the Makefile, so every run of the wheel's training loop ends there.  Where the Makefile is missing and the
  built extension imports, there is nothing to compile: skipped.  (A checkout has the Makefile and compiles;
  that needs ``pybind11``, the `megatron` extra of bitparity installs it.)

No point changes a computation.  Each checks that the code it patches is still there (`compat.CompatError`
names the point otherwise) and records itself in `compat.NOT_NEEDED` when megatron no longer needs it.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import types

import torch

from . import compat

POINTS = ("T1", "T2", "T3", "T4", "T5", "T6")     # on CPU
WHEEL_POINTS = ("W1",)                        # on every device


class _CpuCuda(types.SimpleNamespace):
    """The ``torch.cuda`` the patched megatron.training modules see: one device (T2), inert device selection,
    empty RNG states (T4); everything else is torch.cuda's own."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cpu_cuda() -> _CpuCuda:
    return _CpuCuda(device_count=lambda: 1, set_device=lambda *a, **k: None, set_stream=lambda *a, **k: None,
                    get_rng_state=lambda *a, **k: torch.empty(0, dtype=torch.uint8),
                    set_rng_state=lambda *a, **k: None)


class _CpuTrainingTorch(compat._CpuTorch):
    """`compat._CpuTorch` (device='cuda' factories on the CPU) whose ``cuda`` is `_CpuCuda`."""

    def __getattr__(self, name):
        if name == "cuda":
            return _CPU_CUDA
        return super().__getattr__(name)


_CPU_CUDA = _cpu_cuda()
_applied: tuple = ()


def apply(device_type: str = "cpu") -> tuple:
    """Apply W1 and, on CPU, T1-T4 now and T5 when ``pretrain`` starts (idempotent); returns the points applied.
    Call in the rank after `compat.apply`, before the training script imports ``megatron.training``'s names.

    Raises:
        compat.CompatError: a point's code is no longer where megatron had it.
    """
    global _applied
    if _applied:
        return _applied
    import megatron.training
    from megatron.core import rerun_state_machine as rsm
    from megatron.training import initialize, training

    applied = list(_wheel_helpers())
    if device_type != "cpu":
        _applied = tuple(applied)
        return _applied
    # T1
    init = training.initialize_megatron
    compat._require("allow_no_cuda" in inspect.signature(init).parameters, "T1",
                    "initialize_megatron takes no allow_no_cuda")
    if compat._needed("allow_no_cuda" not in compat._source(training.pretrain), "T1",
                      "pretrain passes allow_no_cuda itself"):
        @functools.wraps(init)
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return init(*args, **kwargs)
        training.initialize_megatron = initialize_megatron
        applied.append("T1")
    # T2 and T4: the modules' own view of torch.cuda
    for point, module, needle in (("T2", initialize, "torch.cuda.device_count()"),
                                  ("T4", rsm, "torch.cuda.get_rng_state(")):
        if compat._needed(needle in compat._source(module), point, f"{module.__name__} no longer calls {needle}"):
            compat._require(getattr(module, "torch", None) is torch, point, f"{module.__name__} has no module-level torch")
            module.torch = _CpuTrainingTorch()
            applied.append(point)
    # T6
    from megatron.training import arguments
    if compat._needed("get_device_arch_version()" in compat._source(arguments.validate_args), "T6",
                      "validate_args no longer reads the CUDA architecture"):
        compat._require(hasattr(arguments, "get_device_arch_version"), "T6",
                        "arguments.get_device_arch_version is gone")
        arguments.get_device_arch_version = lambda: 0
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        applied.append("T6")
    # T3
    compat._require(hasattr(training, "set_jit_fusion_options"), "T3", "training.set_jit_fusion_options is gone")
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    applied.append("T3")
    # T5, when pretrain starts: by then the script has imported what the loop uses
    pretrain = megatron.training.pretrain

    @functools.wraps(pretrain)
    def pretrain_on_cpu(*args, **kwargs):
        _sweep()
        return pretrain(*args, **kwargs)
    megatron.training.pretrain = training.pretrain = pretrain_on_cpu
    applied.append("T5")
    _applied = tuple(applied)
    return _applied


def _wheel_helpers() -> tuple:
    """W1 (module docstring): returns ("W1",) when applied."""
    import importlib.util
    from pathlib import Path

    from megatron.core.datasets import utils as dutils

    here = Path(dutils.__file__).parent
    if not compat._needed(not (here / "Makefile").exists(), "W1", "megatron/core/datasets has its Makefile"):
        return ()
    compat._require(hasattr(dutils, "compile_helpers"), "W1", "datasets.utils.compile_helpers is gone")
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return ()           # nothing built and nothing to build with: megatron says so itself
    dutils.compile_helpers = lambda: None
    return ("W1",)


def _sweep() -> int:
    """T5: every loaded megatron module with a module-level torch whose source names the 'cuda' device sees
    `_CpuTrainingTorch`; returns how many."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or getattr(module, "torch", None) is not torch:
            continue
        try:
            text = compat._source(module).replace('"', "'")
        except (OSError, TypeError):
            continue
        if "'cuda'" in text:
            module.torch = _CpuTrainingTorch()
            count += 1
    return count
