"""Run megatron-core on a CPU-only torch over gloo: nine documented points, applied in the rank process.

megatron-core targets CUDA + Transformer Engine; on CPU it fails in nine places, all of them device
plumbing, none of them arithmetic.  Each point below names the megatron file and what it hits, and patches
the smallest thing that makes it run.  Nothing here edits the installed package.  Three points are not about
the CPU but about megatron's local (non-TE) layer specs, which bitparity uses on every device: MLA with the
local core attention (point 2) fails on a GPU too (measured on an H200 with torch 2.11, no TE), and without TE
installed points 3, 7 and 9 as well.  So `apply` takes the device: on CUDA only those (`LOCAL_SPEC_POINTS`) are
applied; the rest of megatron runs as shipped.

Every point first checks that the bug it works around is still there: a newer megatron-core that fixed it runs
without the point, which is recorded (`NOT_NEEDED`: the rank log and the trace header's settings say which and
why).  Where the bug is there but the code it patches moved, `CompatError` names the point, so the layer never
silently patches the wrong thing.  The version list (`SUPPORTED`) is what the points were checked against; on
CPU another version runs only with ``BITPARITY_MEGATRON_UNCHECKED=1`` (a Megatron-LM checkout).

Arithmetic: no point changes a computation.  Streams, events and synchronisation are inert on CPU (gloo
collectives are synchronous); the CUDA RNG tracker is only consulted around dropout, which is 0 in every
bitparity run (`ModelConfig.hidden_dropout` / `attention_dropout` are fixed at 0).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
import types

import torch

VERSION = "4"                        # of this layer; recorded in every manifest beside megatron-core's version
SUPPORTED = ("0.16.", "0.19.")       # megatron-core releases the points were checked against
#: Megatron-LM checkouts the points were checked against (commit -> what it is): main moves daily.
CHECKED_COMMITS = {"d98e8a64ddf34856e74b24714e3bedb2f5a39553": "Megatron-LM main of 2026-08-22 (0.20.0)",
                   "f8837c04ef6cbef6cdefb8de001aad63178aebbf": "Megatron-LM core_r0.19.0 (0.19.1)"}


UNCHECKED_ENV = "BITPARITY_MEGATRON_UNCHECKED"


def version_checked(version: str, commit: str | None = None) -> bool:
    """Whether the CPU points were checked against this megatron-core: a release in `SUPPORTED`, or a checkout
    at one of `CHECKED_COMMITS` (a checkout at another commit is unchecked, whatever its version says)."""
    if commit is not None:
        return commit in CHECKED_COMMITS
    return version.startswith(SUPPORTED)


def unchecked_allowed() -> bool:
    """``BITPARITY_MEGATRON_UNCHECKED=1``: run a megatron-core the CPU points were not checked against (a
    Megatron-LM checkout under development); each point still checks the code it patches and fails loudly."""
    import os
    return os.environ.get(UNCHECKED_ENV) == "1"


def checked_versions() -> str:
    """What the CPU points were checked against, in words (for refusals and errors)."""
    return (", ".join(f"{v}x" for v in SUPPORTED) + " and "
            + ", ".join(f"{what} at {c[:10]}" for c, what in CHECKED_COMMITS.items()))


def unchecked_message(version: str, commit: str | None = None) -> str:
    """The one line refusing an unchecked version on CPU."""
    what = f"megatron-core {version}" + (f" (checkout at {commit[:10]})" if commit else "")
    return (f"{what} is not a version the CPU compatibility layer was checked against ({checked_versions()}): "
            f"set {UNCHECKED_ENV}=1 to run it anyway (every point still checks the code it patches), or update "
            "megatron_trainer/compat.py")


class CompatError(RuntimeError):
    """A compatibility point no longer matches the installed megatron-core (message names the point)."""


NOT_NEEDED: dict[str, str] = {}      # point -> why megatron no longer needs it (fixed upstream); rank log + header


def _needed(bug_present: bool, point: str, fixed: str) -> bool:
    """Whether a point's bug is still in the installed megatron; if not, the point is skipped and recorded
    (`NOT_NEEDED`): a newer megatron-core that fixed it runs without it."""
    if not bug_present:
        NOT_NEEDED[point] = fixed
    return bug_present


def _require(cond: bool, point: str, what: str) -> None:
    if not cond:
        raise CompatError(f"megatron CPU compat point {point}: {what}; the installed megatron-core differs from "
                          f"the versions this layer was written for ({checked_versions()}): update "
                          "megatron_trainer/compat.py")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


class _InertStream:
    """Stand-in for torch.cuda.Stream / Event on CPU: every operation is immediate, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _InertStream()

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _InertStream)

    def __hash__(self):
        return 0


_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")


class _CpuTorch(types.ModuleType):
    """The ``torch`` a megatron module sees (point 6): `torch` itself, except that the tensor factories put a
    ``device="cuda"`` tensor on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _CPU
                return attr(*args, **kwargs)
            return factory
        return attr


#: Where points 1 and 4 look for the CUDA calls they stand in for (the modules named in their comments).
_CURRENT_DEVICE_USERS = ("megatron.core.transformer.moe.router", "megatron.core.transformer.multi_token_prediction",
                         "megatron.core.models.gpt.gpt_model", "megatron.core.distributed.param_and_grad_buffer",
                         "megatron.core.pipeline_parallel.p2p_communication")
_STREAM_USERS = ("megatron.core.transformer.moe.token_dispatcher", "megatron.core.pipeline_parallel.p2p_communication",
                 "megatron.core.distributed.param_and_grad_buffer")


def _megatron_calls(needles, modules) -> bool:
    """Whether any of `modules` (megatron module names) still contains any of `needles` in its source."""
    import importlib
    needles = (needles,) if isinstance(needles, str) else needles
    for name in modules:
        try:
            text = _source(importlib.import_module(name))
        except ImportError:
            continue
        if any(n in text for n in needles):
            return True
    return False


LOCAL_SPEC_POINTS = ("2", "3", "7", "9")   # needed wherever megatron's local specs run without Transformer Engine
_applied: tuple = ()


def _have_te() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None


def points(device_type: str, expert_parallel_or_overlap: bool = False, bf16: bool = False) -> tuple:
    """The points `apply` patches for a rank on `device_type` ("cpu" or "cuda"): all nine on CPU, with EP > 1
    or the MoE 1F1B overlap also `compat_overlap.POINTS`, in bf16 also `compat_overlap.BF16_POINTS`; on CUDA point 2, and 3, 7 and 9 when Transformer
    Engine is not installed (recorded in the manifest)."""
    if device_type == "cpu":
        from .compat_overlap import BF16_POINTS, POINTS  # (imports this module)
        extra = (POINTS if expert_parallel_or_overlap else ()) + (BF16_POINTS if bf16 else ())
        return ("1", "2", "3", "4", "5", "6", "7", "8", "9") + extra
    return ("2",) if _have_te() else LOCAL_SPEC_POINTS


def apply(device_type: str = "cpu") -> tuple:
    """Apply `points(device_type)` (idempotent) and return those applied: the points whose bug the installed
    megatron still has (the others are in `NOT_NEEDED`).  Call in the rank after importing megatron.core,
    before building anything.

    Raises:
        CompatError: megatron-core's version is not in `SUPPORTED`, or a point no longer matches its code.
    """
    global _applied
    wanted = points(device_type)
    if _applied:
        return _applied
    cpu = device_type == "cpu"
    import megatron.core
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    from .source import megatron_source
    src = megatron_source() or {"version": megatron.core.__version__, "commit": None}
    if cpu and not version_checked(src["version"], src["commit"]) and not unchecked_allowed():
        raise CompatError(unchecked_message(src["version"], src["commit"]))

    # 1. torch.cuda.current_device() is used as a device argument all over megatron (router, MTP, gpt_model,
    #    param_and_grad_buffer, p2p shape exchange): on CPU it names the CPU.  The CUDA RNG tracker
    #    (tensor_parallel/random.py) forks CUDA generator states around dropout: with dropout 0 there is no
    #    state to fork, so `fork` is a plain context and `add` only records the seed.
    if cpu and _needed(_megatron_calls("torch.cuda.current_device()", _CURRENT_DEVICE_USERS), "1",
                       "no megatron module the ranks run calls torch.cuda.current_device()"):
        _require(hasattr(mrandom.CudaRNGStatesTracker, "fork") and hasattr(mrandom.CudaRNGStatesTracker, "add"),
                 "1", "tensor_parallel.random.CudaRNGStatesTracker has no fork/add")
        torch.cuda.current_device = lambda: _CPU
        mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
        mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: self.seeds_.add(seed)

    # 2. DotProductAttention (the non-TE core attention) does not accept the k_channels / v_channels that MLA
    #    passes (multi_latent_attention.py, MLASelfAttention.__init__), and sizes its output by kv_channels:
    #    accept them and size the output heads by v_channels (MLA passes its softmax scale explicitly).
    init = dpa.DotProductAttention.__init__
    if _needed("k_channels" not in inspect.signature(init).parameters and "k_channels=" in _source(mla), "2",
               "DotProductAttention.__init__ takes k_channels (or MLA no longer passes it)"):
        @functools.wraps(init)
        def dpa_init(self, *args, k_channels=None, v_channels=None, **kwargs):
            init(self, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels
        dpa.DotProductAttention.__init__ = dpa_init

    # 3. multi_latent_attention.HAVE_TE is true without Transformer Engine (its try-import of megatron's TE
    #    extension module succeeds even when TE is absent), which sends MLA down TE-only paths.
    if "3" in wanted and _needed(getattr(mla, "HAVE_TE", False) is True, "3",
                                 "multi_latent_attention.HAVE_TE is false without Transformer Engine"):
        mla.HAVE_TE = False
    if cpu:
        _cpu_plumbing()
    elif "7" in wanted:
        _patch_te_general_gemm(moe_utils)
    if "9" in wanted:
        _patch_inference_linear_types()
    _applied = tuple(p for p in wanted if p not in NOT_NEEDED)
    return _applied


def _cpu_plumbing() -> None:
    """Points 4 to 8: CUDA plumbing a CPU rank has to do without."""
    from megatron.core import utils as mutils
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.moe import moe_utils

    # 4. CUDA streams, events and synchronize: MoE alltoall dispatcher (moe/token_dispatcher.py: a side stream
    #    for device-to-host copies), p2p shape exchange (pipeline_parallel/p2p_communication.py), DDP's
    #    communication stream (distributed/param_and_grad_buffer.py).  gloo is synchronous: inert stand-ins.
    if _needed(_megatron_calls(("torch.cuda.Stream", "torch.cuda.current_stream", "torch.cuda.Event",
                                "torch.cuda.synchronize", ".record_stream("), _STREAM_USERS), "4",
               "no megatron module the ranks run uses CUDA streams, events or synchronize"):
        torch.cuda.Stream = torch.cuda.Event = _InertStream
        torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: _InertStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
        torch.Tensor.record_stream = lambda self, stream: None

    # 5. LanguageModule.setup_embeddings_and_output_layer moves the MTP stage's embedding with Tensor.cuda()
    #    (models/common/language_module/language_module.py).
    if _needed(".cuda()" in _source(language_module.LanguageModule.setup_embeddings_and_output_layer), "5",
               "setup_embeddings_and_output_layer no longer calls .cuda()"):
        torch.Tensor.cuda = lambda self, *a, **k: self

    # 6. device="cuda" tensor factories in schedules.py (token counts), optimizer.py (found_inf, scale),
    #    clip_grads.py (norm buffers), utils.py (local l2norm fallback), transformer/utils.py (the default causal
    #    mask of the non-TE softmax): these modules see `_CpuTorch`.
    factories = [m for m in (schedules, optimizer, clip_grads, mutils, tutils)
                 if "device='cuda'" in _source(m).replace('"', "'")]
    for module in factories:
        _require(getattr(module, "torch", None) is torch, "6", f"{module.__name__} has no module-level torch")
        module.torch = _CpuTorch()
    _needed(bool(factories), "6", "no module creates tensors with device='cuda'")

    # 7. moe_utils.te_general_gemm is referenced (router gemm, moe_utils.py RouterGatingLinearFunction) but only
    #    defined when the TE import succeeds: without TE the name is missing (NameError), not None.
    _patch_te_general_gemm(moe_utils)

    # 8. clip_grads.clip_grad_by_total_norm_fp32 asserts every gradient is a 'torch.cuda.FloatTensor': the same
    #    function, recompiled from megatron's own source with the CPU type name (nothing else changes), replaces
    #    it where the optimizer looks it up.
    clip = clip_grads.clip_grad_by_total_norm_fp32
    source = _source(clip)
    if not _needed("'torch.cuda.FloatTensor'" in source, "8",
                   "clip_grad_by_total_norm_fp32 no longer asserts 'torch.cuda.FloatTensor'"):
        return
    _require(source.count("'torch.cuda.FloatTensor'") == 1 and getattr(optimizer, clip.__name__, None) is clip, "8",
             "clip_grad_by_total_norm_fp32 asserts the CUDA type more than once, or optimizer.py no longer uses it")
    namespace: dict = {}
    exec(compile(source.replace("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"), inspect.getsourcefile(clip),
                 "exec"), vars(clip_grads), namespace)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = namespace[clip.__name__]


#: the CUDA tensor type names megatron's optimizers sort parameters by, and the CPU names they stand for: the
#: `recompile` replacements of points B1 (compat_overlap) and D1 (compat_distopt)
CUDA_TYPES = (("['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']", "['torch.HalfTensor', 'torch.BFloat16Tensor']"),
              ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'"))


def recompile(cls, name: str, replacements, module) -> None:
    """Replace method `name` of megatron's `cls` by the same method compiled from megatron's own source with
    `replacements` ((old, new) text pairs) applied, in `module`'s globals (where it was defined): the compat
    points that only rename a CUDA type (B1, D1).  A classmethod stays one; the zero-argument ``super()`` of
    the recompiled body names `cls` (its ``__class__`` cell)."""
    original = cls.__dict__[name]
    is_classmethod = isinstance(original, classmethod)
    fn = original.__func__ if is_classmethod else original
    source = textwrap.dedent(_source(fn))
    for old, new in replacements:
        source = source.replace(old, new)
    # compiled inside a class body, so that a zero-argument super() gets its __class__ cell
    namespace: dict = {}
    exec(compile("class _Recompiled:\n" + textwrap.indent(source, "    "), inspect.getsourcefile(fn), "exec"),
         vars(module), namespace)
    new_fn = namespace["_Recompiled"].__dict__[name]
    new_fn = new_fn.__func__ if isinstance(new_fn, classmethod) else new_fn
    closure = tuple(types.CellType(cls) if var == "__class__" else cell
                    for var, cell in zip(new_fn.__code__.co_freevars, new_fn.__closure__ or ()))
    rebuilt = functools.wraps(fn)(types.FunctionType(new_fn.__code__, new_fn.__globals__, name,
                                                     new_fn.__defaults__, closure))
    rebuilt.__kwdefaults__ = new_fn.__kwdefaults__
    setattr(cls, name, classmethod(rebuilt) if is_classmethod else rebuilt)


class _NoInstances:
    """A type nothing is an instance of (point 9's stand-in for a class that could not be defined)."""


def _patch_inference_linear_types() -> None:
    """9. From Megatron-LM #5748 (0.20, main), ``MultiTokenPredictionLayer.__init__`` asks
    ``tensor_parallel/inference_layers.is_inference_column_parallel_linear(eh_proj)``, an isinstance() against
    ``InferenceColumnParallelLinear`` / ``InferenceLayerNormColumnParallelLinear``; those subclass TE linears,
    which are MagicMock instances without TE (extensions/transformer_engine.py), so isinstance raises TypeError
    and no MTP layer can be built.  Without TE neither class can exist, so nothing is an instance of them: stand-in
    types say so.  The function is absent before 0.20 (not needed there)."""
    import importlib.util
    check = None
    if importlib.util.find_spec("megatron.core.tensor_parallel.inference_layers") is not None:
        from megatron.core.tensor_parallel import inference_layers as il
        check = getattr(il, "is_inference_column_parallel_linear", None)
    if not _needed(check is not None, "9", "no is_inference_column_parallel_linear (before Megatron-LM #5748)"):
        return
    names = ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")
    broken = [n for n in names if not isinstance(getattr(il, n, None), type)]
    if not _needed(bool(broken), "9", "the inference linear classes are types (Transformer Engine is installed)"):
        return
    _require(all(n in _source(check) for n in names), "9",
             "is_inference_column_parallel_linear no longer names both inference linear classes")
    for n in broken:
        setattr(il, n, _NoInstances)


def _patch_te_general_gemm(moe_utils) -> None:
    if _needed("te_general_gemm" not in vars(moe_utils) and "te_general_gemm" in _source(moe_utils), "7",
               "moe_utils.te_general_gemm is defined without Transformer Engine"):
        moe_utils.te_general_gemm = None
