"""Megatron's own options in a case (`RunConfig.megatron`), by Megatron-LM's argument names.

Megatron-LM builds its configs from its arguments by field name (``training/arguments.py``:
``core_transformer_config_from_args``; ``training/training.py``: ``get_megatron_optimizer_config``, the
``DistributedDataParallelConfig`` of ``get_model``): an argument reaches every config dataclass that has a field
of its name.  So does a case's ``megatron:`` mapping here — ``MLATransformerConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig`` — plus the training loop's own options (`LOOP`: the learning-rate and
weight-decay schedule of ``get_optimizer_param_scheduler``, and which ranks hold the word embedding,
``get_embedding_ranks``).

Refused, one line naming the key, before anything runs (`problem`): a name no config has (with the nearest
names), a name bitparity's own schema sets (`owner`: say it there, once), a field a YAML value cannot be
(callables, dtypes, process groups), a value of the wrong type, and whatever megatron's own validators
(``__post_init__``, ``OptimizerParamScheduler``) reject, attributed to the option that makes them reject it.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import warnings
from typing import Annotated, Optional

from pydantic import Field

from trainerkit.config import ModelConfig, ParallelConfig, RunConfig, TrainingConfig

#: The training loop's options (Megatron-LM arguments.py) and bitparity's defaults for them: a constant learning
#: rate and weight decay (what every case without them trains with).  ``lr_decay_iters`` None: train_iters.
#: ``get_embedding_ranks``: ``pretrain_gpt`` (Megatron-LM's: first stage and the MTP stages) or
#: ``parallel_state`` (megatron-core's ``default_embedding_ranks``: first and last rank, MTP-unaware).
#: ``dist_ckpt_optim_fully_reshardable``: the distributed optimizer's checkpoint format (`checkpoint.sharding_type`).
LOOP = {"lr_decay_style": "constant", "lr_warmup_iters": 0, "lr_decay_iters": None, "lr_warmup_init": 0.0,
        "start_weight_decay": None, "end_weight_decay": None, "weight_decay_incr_style": "constant",
        "get_embedding_ranks": "pretrain_gpt", "dist_ckpt_optim_fully_reshardable": False}
_LOOP_TYPES = {"lr_decay_style": str, "lr_warmup_iters": Annotated[int, Field(ge=0)],
               "lr_decay_iters": Optional[Annotated[int, Field(ge=1)]], "lr_warmup_init": Annotated[float, Field(ge=0)],
               "start_weight_decay": Optional[Annotated[float, Field(ge=0)]],
               "end_weight_decay": Optional[Annotated[float, Field(ge=0)]], "weight_decay_incr_style": str,
               "get_embedding_ranks": str, "dist_ckpt_optim_fully_reshardable": bool}
#: options bitparity's megatron trainer cannot run, measured (each failed inside the ranks after megatron's own
#: config checks passed), with why: refused while planning, so nothing that passes validation crashes later
UNSUPPORTED = {
    "recompute_granularity": "activation recomputation needs CUDA's RNG tracker in megatron (not on CPU / gloo)",
    "moe_grouped_gemm": "grouped GEMM needs Transformer Engine or nv-grouped-gemm",
    "gradient_accumulation_fusion": "needs APEX / Transformer Engine's fused wgrad kernels",
    "enable_cuda_graph": "CUDA graphs need CUDA", "cuda_graph_impl": "CUDA graphs need CUDA",
    "moe_token_dispatcher_type": "the trainer runs the alltoall dispatcher (flex needs DeepEP; allgather untried)",
    "context_parallel_size": "bitparity runs CP = 1", "optimizer_cpu_offload": "megatron's HybridDeviceOptimizer moves GPU state to the host (untried)",
    "microbatch_group_size_per_vp_stage": "the interleaved schedule's grouping is megatron's default (P)",
    "check_for_nan_in_grad": "megatron then stops the rank at a NaN gradient; bitparity checks finiteness itself "
                             "(a run that is not finite fails, `expect: not_finite` states a bug caught so)",
    "use_megatron_fsdp": "megatron's FSDP fails in the ranks on CPU (DTensor parameters; measured)",
    "use_precision_aware_optimizer": "it needs Transformer Engine's FusedAdam",
}
#: options that change the model's parameters: bitparity's model is DeepSeek-V3's (MLA, RMSNorm, no biases, untied
#: head), whose global parameter names both trainers share (trainerkit.names)
_ARCHITECTURE = ("normalization", "multi_latent_attention", "add_bias_linear", "add_qkv_bias", "num_query_groups",
                 "layernorm_zero_centered_gamma", "qk_layernorm", "gated_linear_unit", "share_embeddings_and_output_weights",
                 "position_embedding_type", "mtp_use_repeated_layer")
EMBEDDING_RANKS = ("pretrain_gpt", "parallel_state")
#: values megatron-core's configs take as plain strings and Megatron-LM's argument parser restricts
#: (training/arguments.py ``choices=``): megatron-core itself silently ignores an unknown one (a misspelt
#: load-balancing type trains without load balancing)
_CHOICES = {"moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                               "quantile_balancing", "none")}

#: Megatron names that bitparity's own configuration decides, and where a case says them.
_DERIVED = {
    "virtual_pipeline_model_parallel_size": "it follows from the variant's pipeline_model_parallel_layout",
    "params_dtype": "the case's params_dtype", "bf16": "the case's params_dtype", "fp16": "the case's params_dtype",
    "pipeline_dtype": "the case's params_dtype", "kv_channels": "model.v_head_dim",
    "perform_initialization": "bitparity initialises every parameter by its global name (trainerkit.init)",
    "use_cpu_initialization": "bitparity initialises every parameter by its global name (trainerkit.init)",
    "optimizer": "bitparity trains with Adam (both trainers)",
    "num_microbatches": "training.num_microbatches", "seed": "training.seed",
}
# a YAML scalar or list can be one of these; a Callable, torch.dtype or ProcessGroup field cannot
_PLAIN = {"Optional", "Union", "List", "list", "Tuple", "tuple", "Literal", "bool", "int", "float", "str", "None",
          "NoneType", "typing", "Any"}


def owner(name: str) -> Optional[str]:
    """Where bitparity's schema sets megatron option `name` (e.g. ``model.hidden_size``), or None."""
    if name in _DERIVED:
        return _DERIVED[name]
    for section, cls in (("model", ModelConfig), ("training", TrainingConfig)):
        if name in cls.model_fields and name not in ("data",):
            return f"{section}.{name}"
    if name in ParallelConfig.model_fields:
        return f"the variant's {name}"
    return None


def _classes() -> dict:
    """{label: megatron config dataclass} of the installed megatron, in the order options are applied."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    return {"MLATransformerConfig": MLATransformerConfig, "OptimizerConfig": OptimizerConfig,
            "DistributedDataParallelConfig": DistributedDataParallelConfig}


def _fields(cls) -> dict:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def for_config(cfg: RunConfig, label: str) -> dict:
    """The case's options that are fields of megatron's config `label` (a key of `_classes`), as given."""
    fields = _fields(_classes()[label])
    return {k: v for k, v in cfg.megatron.items() if k in fields}


def loop(cfg: RunConfig) -> dict:
    """The training loop's options (`LOOP`) with the case's values over bitparity's defaults, and ``min_lr``
    (an OptimizerConfig field the scheduler reads too; default: training.lr, a constant rate)."""
    out = {k: cfg.megatron.get(k, v) for k, v in LOOP.items()}
    out["min_lr"] = cfg.megatron.get("min_lr", cfg.training.lr)
    return out


def _plain(annotation) -> bool:
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "", str(annotation))      # Literal['a', 'b'] -> Literal[, ]
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text.replace("<class ", "")))
    return words <= _PLAIN


def _type_problem(name: str, annotation, value, ours: bool = False) -> Optional[str]:
    """Why `value` cannot be megatron option `name` of type `annotation` (None when it can).  `ours`: a
    training-loop option, whose annotation (`_LOOP_TYPES`) is bitparity's and carries its bounds."""
    from pydantic import TypeAdapter, ValidationError
    if not ours and not _plain(annotation):
        return f"megatron option {name!r}: its type ({annotation}) is not a value a case file can give"
    adapter = TypeAdapter(annotation)
    try:
        adapter.validate_python(value, strict=True)     # no bool for an int, no 1 for True, no "4" for 4
    except ValidationError as e:
        if not isinstance(value, bool) and isinstance(value, int):
            try:
                adapter.validate_python(float(value), strict=True)   # YAML `0` for a float
                return None
            except ValidationError:
                pass
        shown = "" if ours else f" is not a valid {getattr(annotation, '__name__', None) or str(annotation).replace('typing.', '')}"
        return f"megatron option {name!r}: {_short(value)}{shown} ({e.errors()[0]['msg']})"
    except Exception:       # an annotation pydantic cannot build a validator for: let megatron decide
        return None
    return None


def _short(value) -> str:
    """`repr(value)` cut to 60 characters (an error line names the value, never a page of it)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown(name: str, known: set) -> str:
    near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return (f"megatron option {name!r} is not a field of megatron's {', '.join(_classes())} nor a training-loop "
            f"option ({', '.join(LOOP)}){hint}")


def names_problem(cfg: RunConfig) -> Optional[str]:
    """The first option that no megatron config has, that bitparity's schema sets, or whose value cannot have
    its field's type, in one line (None when every name and type is one megatron takes)."""
    fields: dict = {}
    for cls in _classes().values():
        fields.update(_fields(cls))
    for name, value in cfg.megatron.items():
        where = owner(name)
        if where is not None:
            return f"megatron option {name!r} is bitparity's to set: {where}"
        if name in UNSUPPORTED:
            return f"megatron option {name!r} is not supported by bitparity's megatron trainer: {UNSUPPORTED[name]}"
        if name in _ARCHITECTURE:
            return (f"megatron option {name!r} changes the model's parameters: bitparity's model is DeepSeek-V3's "
                    "(MLA, RMSNorm, SwiGLU, no biases, untied head), the same in both trainers")
        if name in LOOP:
            problem = _type_problem(name, _LOOP_TYPES[name], value, ours=True)
        elif name in fields:
            problem = _type_problem(name, fields[name], value)
        else:
            return _unknown(name, set(fields) | set(LOOP))
        if problem:
            return problem
        choices = _CHOICES.get(name)
        bad = [x for x in (value if isinstance(value, list) else [value]) if choices and x not in choices]
        if bad:
            return f"megatron option {name!r}: {_short(bad[0])} is not one of {', '.join(choices)} (Megatron-LM's arguments)"
    balancing = cfg.megatron.get("moe_router_load_balancing_type")
    coeff = cfg.model.moe_aux_loss_coeff
    if "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]) and \
            any(coeff if isinstance(coeff, list) else [coeff]):
        return ("megatron option 'moe_router_load_balancing_type': megatron's router takes no aux loss with sinkhorn "
                "(it fails in the ranks): set model.moe_aux_loss_coeff: 0")
    ranks = cfg.megatron.get("get_embedding_ranks", "pretrain_gpt")
    if ranks not in EMBEDDING_RANKS:
        return f"megatron option 'get_embedding_ranks': {ranks!r} is not one of {', '.join(EMBEDDING_RANKS)}"
    return None


def scheduler(optimizer, cfg: RunConfig):
    """Megatron-LM's ``get_optimizer_param_scheduler`` at iteration granularity (one step per iteration: the
    schedule is a function of step ratios, which megatron's sample-based counting leaves unchanged) with the
    case's `loop` options.  It also turns each parameter group's ``wd_mult`` into its weight decay (0 for norms
    and biases) and a ``decoupled_lr`` group's max/min lr into its lr.

    Raises:
        AssertionError: megatron's own checks (e.g. min_lr > lr, warmup >= decay steps)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t, o = cfg.training, loop(cfg)
    wd_start = o["start_weight_decay"] if o["start_weight_decay"] is not None else t.weight_decay
    wd_end = o["end_weight_decay"] if o["end_weight_decay"] is not None else t.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=o["lr_warmup_init"], max_lr=t.lr, min_lr=o["min_lr"], lr_warmup_steps=o["lr_warmup_iters"],
        lr_decay_steps=t.train_iters if o["lr_decay_iters"] is None else o["lr_decay_iters"], lr_decay_style=o["lr_decay_style"], start_wd=wd_start,
        end_wd=wd_end, wd_incr_steps=t.train_iters, wd_incr_style=o["weight_decay_incr_style"])


def problem(cfg: RunConfig, build_transformer_config) -> Optional[str]:
    """Why megatron rejects `cfg`'s options, in one line naming the option (None when it takes them).

    `build_transformer_config(cfg)` is the trainer's (`model.transformer_config`): megatron's
    ``__post_init__`` validators run on the config the ranks will build.  A rejection that goes away without
    the case's options is pinned on the first option that alone brings it back (else on all of them)."""
    problem = names_problem(cfg) or _distributed_optimizer_problem(cfg)
    if problem:
        return problem
    error = _build_error(cfg, build_transformer_config)
    if error is None or not cfg.megatron:
        return error
    if _build_error(cfg.model_copy(update={"megatron": {}}), build_transformer_config) is not None:
        return error            # not the options' doing: megatron rejects the run itself
    culprit = next((k for k, v in cfg.megatron.items()
                    if _build_error(cfg.model_copy(update={"megatron": {k: v}}), build_transformer_config)), None)
    named = repr(culprit) if culprit else ", ".join(map(repr, cfg.megatron))
    return f"megatron option {named}: {error}"


def _distributed_optimizer_problem(cfg: RunConfig) -> Optional[str]:
    """The distributed optimizer's options that megatron-core's configs accept but Megatron-LM's arguments
    (``training/arguments.py``) or its parallel state (``parallel_state.initialize_model_parallel``: the DP and
    expert-DP groups split into instances) reject, in one line; None when they fit."""
    opts, par = cfg.megatron, cfg.parallel
    distributed = opts.get("use_distributed_optimizer", False)
    if opts.get("overlap_param_gather") and not distributed:
        return "megatron option 'overlap_param_gather' needs use_distributed_optimizer: true (Megatron-LM's arguments)"
    if opts.get("overlap_param_gather") and not opts.get("overlap_grad_reduce"):
        return ("megatron option 'overlap_param_gather' needs overlap_grad_reduce: true (Megatron-LM's arguments: "
                "'Must use --overlap-param-gather with --overlap-grad-reduce')")
    n = opts.get("num_distributed_optimizer_instances", 1)
    if n < 1:
        return f"megatron option 'num_distributed_optimizer_instances': {n} is not a number of instances (>= 1)"
    if n > 1 and not distributed:
        return "megatron option 'num_distributed_optimizer_instances' > 1 needs use_distributed_optimizer: true"
    for size, what in ((par.data_parallel_size, "data_parallel_size"),
                       (par.expert_data_parallel_size, "the expert-data-parallel size (tensor_model_parallel_size x "
                        "data_parallel_size / (expert_tensor_parallel_size x expert_model_parallel_size))")):
        if size % n:
            return (f"megatron option 'num_distributed_optimizer_instances': {n} does not divide {what} {size} "
                    "(each instance is an equal part of the group)")
    return None


def _build_error(cfg: RunConfig, build_transformer_config) -> Optional[str]:
    """megatron's rejection of the configs `cfg` builds (transformer, optimizer, DDP, scheduler), or None."""
    classes = _classes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            build_transformer_config(cfg)
            classes["OptimizerConfig"](**{"lr": cfg.training.lr, "min_lr": cfg.training.lr,
                                          **for_config(cfg, "OptimizerConfig")})
            classes["DistributedDataParallelConfig"](**for_config(cfg, "DistributedDataParallelConfig"))
            # the scheduler's own asserts, on an optimizer stand-in with one parameter group
            scheduler(types.SimpleNamespace(param_groups=[{"params": []}]), cfg)
        except Exception as e:      # megatron rejects with assertions, ValueError and plain Exception alike
            return f"megatron-core rejects this run: {_words(e)}"
    return None


#: where the training loop's options live once built: (object in `read_back`'s ``built``, attribute)
_LOOP_ATTRS = {"lr_decay_style": ("scheduler", "lr_decay_style"), "lr_warmup_iters": ("scheduler", "lr_warmup_steps"),
               "lr_decay_iters": ("scheduler", "lr_decay_steps"), "lr_warmup_init": ("scheduler", "init_lr"),
               "min_lr": ("scheduler", "min_lr"), "start_weight_decay": ("scheduler", "start_wd"),
               "end_weight_decay": ("scheduler", "end_wd"), "weight_decay_incr_style": ("scheduler", "wd_incr_style")}


def read_back(cfg: RunConfig, built: dict) -> dict:
    """{option: {where: value}} of every option the case sets, read from the objects megatron built (`built`:
    ``{"MLATransformerConfig": config, "OptimizerConfig": optimizer.config, "DistributedDataParallelConfig":
    ddp.ddp_config, "scheduler": OptimizerParamScheduler, "embedding_ranks": [global ranks]}``): what the rank
    really runs with, for the trace header (a misrouted option shows as a value other than the case's)."""
    out = {}
    for name in cfg.megatron:
        seen = {label: _plain_value(getattr(obj, name)) for label, obj in built.items()
                if label in _classes() and obj is not None and hasattr(obj, name)}
        if name in _LOOP_ATTRS:
            where, attr = _LOOP_ATTRS[name]
            seen[where] = _plain_value(getattr(built[where], attr))
        if name == "get_embedding_ranks":
            seen["embedding_ranks"] = built.get("embedding_ranks")
        out[name] = seen
    return out


def _words(e: Exception) -> str:
    """An exception as one line; a bare ``assert`` (no message) is named by its file, line and source."""
    text = " ".join(str(e).split())
    if text:
        return text
    import traceback
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}: {(frame.line or '').strip()}"


def _plain_value(v):
    return v if v is None or isinstance(v, (bool, int, float, str, list)) else str(v)
