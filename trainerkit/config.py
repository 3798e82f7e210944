"""Model, training and parallelism configuration, with Megatron-LM's argument names.

Pydantic models (frozen, unknown keys rejected) so a YAML mapping loads straight into them and a typo
is an error naming the key.  Field names follow `megatron/core/transformer/transformer_config.py`
and `megatron/training/arguments.py`.
"""
from __future__ import annotations

import math
import re
from typing import Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import parallel_rules


class _Strict(BaseModel):
    # strict: YAML `true` is not a layer count and "4" is not an int; allow_inf_nan=False: every float is
    # finite (`.inf` / `.nan` would reach the ranks and train garbage, or never time out)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


_FREQ_TERM = re.compile(r"^\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?$")

# Upper bounds on sizes, far above anything a CPU/GPU reference run can use (DeepSeek-V3 itself: vocab 129280,
# hidden 7168, 61 layers, 256 experts), so a typo (`vocab_size: 1000000000`) is a one-line error naming the key
# instead of an allocation failure inside every rank.
MAX_VOCAB = 1 << 20
MAX_WIDTH = 1 << 16          # hidden / ffn / LoRA ranks / head dims
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_TOKENS_PER_MICROBATCH = 1 << 20     # seq_length * micro_batch_size
MAX_TRAIN_ITERS = 100_000
MAX_MICROBATCHES = 4096
MAX_TIMEOUT_S = 86_400.0     # a day: a larger watchdog is as good as none when a rank hangs
MAX_GPUS = 1024
#: Which trainer runs a config: ours (reference_impl) or megatron-core's own model, schedules and optimizer
#: (megatron_trainer).  The one list of trainer names: the harness's registry (`harness.planning.trainers.REGISTRY`) has
#: one entry per name (checked when it is imported).
TrainerName = Literal["reference", "megatron-core"]
TRAINERS: tuple = get_args(TrainerName)
DEFAULT_TRAINER = "reference"
#: Which megatron-core model class a megatron-core run builds: GPTModel (its layout string) or HybridModel (its
#: ``hybrid_layer_pattern``, megatron-core >= 0.17; `trainerkit.hybrid_pattern`)
ModelClass = Literal["gpt", "hybrid"]


def parse_moe_layer_freq(value: Union[int, str, list[int]], num_layers: int) -> list[int]:
    """Expand Megatron's `--moe-layer-freq` into a per-layer 0/1 list (1 = MoE).

    Accepts an int N (every N-th layer is MoE, layer 0 included, as Megatron), a list of 0/1 of length
    `num_layers`, or Megatron's string form such as ``"[0]*3+[1]*58"`` (parsed, never `eval`-ed).

    Raises:
        ValueError: malformed string, or a list whose length differs from `num_layers` (checked before a
            string is expanded, so ``"[0]*999999999999"`` fails fast instead of exhausting memory).
    """
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {value}")
        return [1 if i % value == 0 else 0 for i in range(num_layers)]
    if isinstance(value, str):
        pattern: list[int] = []
        for term in value.split("+"):
            m = _FREQ_TERM.match(term.strip())
            if not m:
                raise ValueError(f"moe_layer_freq {value!r}: cannot parse term {term.strip()!r} "
                                 "(expected e.g. '[0]*3+[1]*58')")
            digits = m.group(2) or "1"
            unit = [int(x) for x in m.group(1).split(",")]
            # compare before expanding (and before int() of a huge digit string)
            if len(digits) > 9 or len(pattern) + len(unit) * int(digits) > num_layers:
                raise ValueError(f"moe_layer_freq {value!r} expands to more than num_layers={num_layers} entries")
            pattern += unit * int(digits)
        value = pattern
    if len(value) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(value)} entries but num_layers is {num_layers}")
    return list(value)


class ModelConfig(_Strict):
    """DeepSeek-V3-structured MoE + MTP transformer (DeepSeek-V3 tech report §2; Megatron TransformerConfig)."""

    vocab_size: int = Field(256, ge=2, le=MAX_VOCAB)
    hidden_size: int = Field(32, ge=2, le=MAX_WIDTH)
    num_layers: int = Field(4, ge=1, le=MAX_LAYERS)
    moe_layer_freq: Union[int, str, list[int]] = 1
    # MLA (DeepSeek-V3 §2.1.1; Megatron MLATransformerConfig)
    num_attention_heads: int = Field(2, ge=1, le=1024)
    q_lora_rank: int = Field(16, ge=1, le=MAX_WIDTH)
    kv_lora_rank: int = Field(16, ge=1, le=MAX_WIDTH)
    qk_head_dim: int = Field(8, ge=1, le=MAX_WIDTH)
    qk_pos_emb_head_dim: int = Field(8, ge=2, le=MAX_WIDTH)
    v_head_dim: int = Field(8, ge=1, le=MAX_WIDTH)
    rotary_base: float = Field(10000.0, gt=0)
    layernorm_epsilon: float = Field(1e-6, gt=0)
    # dense SwiGLU MLP of the first-k layers
    ffn_hidden_size: int = Field(64, ge=1, le=MAX_WIDTH)
    # MoE (DeepSeek-V3 §2.1.2; Megatron moe_utils.topk_routing_with_score_function)
    num_moe_experts: int = Field(8, ge=1, le=MAX_EXPERTS)
    moe_ffn_hidden_size: int = Field(16, ge=1, le=MAX_WIDTH)
    moe_shared_expert_intermediate_size: int = Field(16, ge=1, le=MAX_WIDTH)
    moe_router_topk: int = Field(2, ge=1)
    moe_router_num_groups: int = Field(4, ge=1)
    moe_router_group_topk: int = Field(2, ge=1)
    moe_router_score_function: Literal["sigmoid"] = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = Field(1e-3, ge=0)
    moe_router_topk_scaling_factor: float = Field(2.5, gt=0)
    # seq_aux_loss's; a list: one per load-balancing type of megatron's moe_router_load_balancing_type list
    # (megatron-core trainer, `RunConfig.megatron`)
    moe_aux_loss_coeff: Union[float, list[float]] = 1e-4
    # MTP (DeepSeek-V3 §2.2; Megatron multi_token_prediction.py)
    mtp_num_layers: int = Field(1, ge=0, le=64)
    mtp_loss_scaling_factor: float = Field(0.1, ge=0)
    init_method_std: float = Field(0.02, gt=0)
    # Router weight init std (None = init_method_std), named after Megatron's `embedding_init_method_std`;
    # Megatron itself initialises the router with init_method.  Exists to make router top-k ties happen: the
    # router input is RMS-normalised (|x| = sqrt(hidden)), so a logit is ~N(0, std^2 * hidden); with the
    # default std (0.02) every sigmoid score sits near 0.5, no two are ever equal, and a tie-break bug on one
    # code path moves no bit (measured: 0 ties).  A wide std (hidden 32: 5-20) saturates the sigmoid, so many
    # scores round to exactly 1.0 in fp32 (logit > ~16.6) and tie at the top-k and group-top-k boundaries
    # (counted in the trace's `router_ties`).  Upper bound: far past saturation, and the logits stay finite.
    moe_router_init_method_std: Optional[float] = Field(None, gt=0, le=1000.0)
    # Fixed by design: untied head (the clean case of megatron-semantics §2.6) and no dropout (no RNG in forward).
    untie_embeddings_and_output_weights: Literal[True] = True
    hidden_dropout: Literal[0.0] = 0.0
    attention_dropout: Literal[0.0] = 0.0

    @field_validator("moe_aux_loss_coeff")
    @classmethod
    def _coeff(cls, v):
        if any(x < 0 for x in (v if isinstance(v, list) else [v])):
            raise ValueError("moe_aux_loss_coeff must be >= 0")
        if isinstance(v, list) and not 1 <= len(v) <= 16:
            raise ValueError("moe_aux_loss_coeff as a list has one coefficient per load-balancing type (1..16)")
        return v

    @field_validator("moe_layer_freq")
    @classmethod
    def _freq_shape(cls, v):
        if isinstance(v, list) and any(x not in (0, 1) for x in v):
            raise ValueError("moe_layer_freq list entries must be 0 or 1")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        e, g, k, gk = (self.num_moe_experts, self.moe_router_num_groups,
                       self.moe_router_topk, self.moe_router_group_topk)
        if e % g:
            raise ValueError(f"num_moe_experts={e} is not divisible by moe_router_num_groups={g}")
        if gk > g:
            raise ValueError(f"moe_router_group_topk={gk} exceeds moe_router_num_groups={g}")
        if k % gk:
            raise ValueError(f"moe_router_topk={k} is not divisible by moe_router_group_topk={gk}")
        if k > gk * (e // g):
            raise ValueError(f"moe_router_topk={k} exceeds the {gk * (e // g)} experts in the selected groups")
        if k // gk > e // g:
            raise ValueError(f"moe_router_topk/group_topk={k // gk} exceeds experts per group {e // g}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError("qk_pos_emb_head_dim must be even (RoPE rotates pairs)")
        return self

    @property
    def moe_layers(self) -> list[int]:
        """Per global decoder layer id: 1 if MoE, 0 if dense."""
        return parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)


class DataConfig(_Strict):
    """Token source.  `path=None`: the training text the repo ships (`trainerkit/text/`), byte-level tokens.
    A `.txt` (or any text) file: byte-level tokens of that file.  A Megatron indexed dataset prefix
    (`prefix.bin` + `prefix.idx`, MMIDIDX format): its token ids."""

    path: Optional[str] = None
    # Megatron-LM's data path masks padding out of the loss (GPTDataset: loss_mask 0 where the label is the pad
    # token).  A row starts close to its document's end with this probability, so its tail is padded and masked
    # (0.25: one row in four, what every existing case and golden was recorded with).
    pad_fraction: float = Field(0.25, ge=0.0, le=1.0)
    # [step, global microbatch] pairs whose loss mask is all zero (no loss-bearing token: a fully padded or
    # prompt-only sample, as SFT data makes them): the 0/0 of a per-microbatch token-count normalisation.
    empty_microbatches: list[list[int]] = Field(default_factory=list, max_length=4096)

    @field_validator("empty_microbatches")
    @classmethod
    def _empty(cls, v):
        for i, entry in enumerate(v):
            if len(entry) != 2 or min(entry) < 0:
                raise ValueError(f"entry {i} {entry}: write [step, microbatch], both >= 0")
        return v

    def is_empty(self, step: int, microbatch: int) -> bool:
        """Whether global microbatch `microbatch` of `step` has no loss-bearing token."""
        return [step, microbatch] in self.empty_microbatches


class TrainingConfig(_Strict):
    """Training loop settings (Megatron names)."""

    seed: int = Field(1234, ge=0, lt=1 << 63)
    train_iters: int = Field(3, ge=1, le=MAX_TRAIN_ITERS)
    seq_length: int = Field(32, ge=2, le=MAX_TOKENS_PER_MICROBATCH)
    micro_batch_size: int = Field(2, ge=1, le=MAX_TOKENS_PER_MICROBATCH)
    num_microbatches: int = Field(4, ge=1, le=MAX_MICROBATCHES)
    lr: float = Field(1e-3, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)     # 1.0 divides by 1 - beta^t = 0 in the bias correction
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)   # on matrices only
    clip_grad: float = Field(0.0, ge=0)      # 0 = off
    num_threads: int = Field(1, ge=1, le=256)        # torch.set_num_threads in every rank
    # megatron: Megatron's layout-dependent reductions; canonical: layout-invariant (reference_impl/reductions.py)
    reductions: Literal["megatron", "canonical"] = "megatron"
    data: DataConfig = DataConfig()

    @model_validator(mode="after")
    def _tokens(self):
        tokens = self.seq_length * self.micro_batch_size
        if tokens > MAX_TOKENS_PER_MICROBATCH:      # each rank holds a microbatch's activations
            raise ValueError(f"seq_length*micro_batch_size={tokens} exceeds {MAX_TOKENS_PER_MICROBATCH} tokens "
                             "per microbatch")
        # a microbatch the run never reaches is a typo, which would pass silently (the data-parallel bound on the
        # microbatch index is checked with the run's placement: `parallel_rules.check_data_parallel_microbatches`)
        late = [e for e in self.data.empty_microbatches if e[0] >= self.train_iters]
        if late:
            raise ValueError(f"data.empty_microbatches {list(late[0])}: the run has steps 0..{self.train_iters - 1}")
        return self


def ranks_per_stage(tensor_model_parallel_size: int, data_parallel_size: int,
                    expert_model_parallel_size: int) -> int:
    """Rank processes per pipeline stage: max(TP x DP, EP) (`ParallelConfig.world_size`)."""
    return max(tensor_model_parallel_size * data_parallel_size, expert_model_parallel_size)


class ParallelConfig(_Strict):
    """Pipeline placement.  `virtual_pipeline_model_parallel_size` is derived from the layout."""

    pipeline_model_parallel_layout: str
    pipeline_model_parallel_size: int = Field(ge=1, le=1024)
    # HybridModel's layout (model_class: hybrid): pipeline_model_parallel_layout is then the GPT layout of the
    # same placement (`trainerkit.hybrid_pattern.HybridPattern.layout`), which the schedule and the trace use
    hybrid_layer_pattern: Optional[str] = Field(None, max_length=100_000)
    # EP: routed experts split over this many ranks per pipeline rank (world = P x EP); tokens go to their
    # experts with all-to-all.  Unlike Megatron, the EP ranks of a pipeline rank see the same microbatches
    # (no data parallelism), so EP=1 and EP>1 must agree bit for bit.
    expert_model_parallel_size: int = Field(1, ge=1, le=64)
    # DP (megatron-core trainer only): data-parallel replicas per pipeline rank, world = P x DP, global rank =
    # pp_rank * DP + dp_rank (Megatron's order at TP = CP = 1); DP rank d trains global microbatch m * DP + d
    # of each step.  Megatron carves EP out of DP: EP divides DP, EP rank = dp_rank % EP.
    data_parallel_size: int = Field(1, ge=1, le=64)
    # TP (megatron-core trainer only): each matrix split over this many ranks (megatron.core.tensor_parallel),
    # world = P x TP x DP, global rank = (pp_rank * DP + dp_rank) * TP + tp_rank (Megatron's order tp-cp-ep-dp-pp);
    # sequence_parallel: the norms' and the MoE layers' activations split along the sequence over the TP ranks;
    # expert_tensor_parallel_size: each routed expert split over this many ranks (None: TP, as Megatron-LM's
    # arguments default it); the expert grid ETP x EP x expert-DP covers the same TP x DP ranks
    tensor_model_parallel_size: int = Field(1, ge=1, le=64)
    sequence_parallel: bool = False
    expert_tensor_parallel_size: Optional[int] = Field(None, ge=1, le=64)
    # Megatron's 1F1B overlap: forward of one microbatch and backward of another run merged, node by node
    # (model/plan.py); delay_wgrad_compute: weight gradients of attention / experts / eh_proj run after the
    # input gradients of their node (model/linear.py)
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    # megatron: only megatron's own layout rules (megatron-core trainer; `PipelineLayout.megatron_rules_only`),
    # to run a layout megatron accepts and trains wrong (cases/megatron-upstream-bugs.yaml)
    layout_rules: Literal["bitparity", "megatron"] = "bitparity"

    @property
    def world_size(self) -> int:
        """Processes of one run: P x TP x DP on the megatron-core trainer (ETP x EP divides TP x DP), P x EP on
        the reference trainer (TP = DP = 1, its EP ranks share their microbatches); global rank =
        (pp_rank * (DP or EP) + (dp_rank or ep_rank)) * TP + tp_rank, Megatron's order with CP = 1."""
        return self.pipeline_model_parallel_size * ranks_per_stage(
            self.tensor_model_parallel_size, self.data_parallel_size, self.expert_model_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert-DP as megatron's expert grid makes it (ETP x EP x expert-DP over the same ranks as TP x DP):
        how many ranks hold a copy of each routed expert (the reference trainer: 1)."""
        return max(1, self.tensor_model_parallel_size * self.data_parallel_size
                   // (self.expert_tensor_parallel * self.expert_model_parallel_size))

    @property
    def expert_tensor_parallel(self) -> int:
        """ETP as megatron runs it: the given one, else TP (Megatron-LM's ``--expert-tensor-parallel-size``)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


class DumpConfig(_Strict):
    """Full tensor dump at one step (for ULP evidence): main_grad and updated fp32 value of the listed
    parameter keys (``"*"``: every key), written by each rank to ``rank{r}.dump.safetensors`` (``grad/<key>``,
    ``param/<key>``)."""

    step: int = Field(ge=0)
    keys: list[str]

    def wants(self, key: str) -> bool:
        """Whether `key` is to be dumped."""
        return key in self.keys or "*" in self.keys
    max_bytes: int = Field(256 << 20, ge=1)


class CheckpointConfig(_Strict):
    """Save a checkpoint (`reference_impl.checkpoint`) into `dir` after step `step` completes."""

    step: int = Field(ge=0)
    dir: str


class RunConfig(_Strict):
    """One complete training run: what every rank receives."""

    model: ModelConfig
    training: TrainingConfig
    parallel: ParallelConfig
    device: Literal["cpu", "cuda"] = "cpu"
    # Megatron's params_dtype: bf16 keeps fp32 main_grad and fp32 optimizer master weights (as --bf16)
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    num_gpus: Optional[int] = Field(None, ge=1, le=MAX_GPUS)  # cuda: spread ranks over this many GPUs (default: all)
    # full: losses, grads, params; activations: also every layer's input/output (+grads) and every boundary
    # tensor per microbatch (reference_impl/probe.py); losses: no fingerprints (capture-overhead benchmark only)
    capture: Literal["full", "activations", "losses"] = "full"
    dump: Optional[DumpConfig] = None
    checkpoint: Optional[CheckpointConfig] = None
    resume_from: Optional[str] = None            # checkpoint directory: continue after its step
    # which trainer runs it: ours (reference_impl) or megatron-core's own model, schedules and optimizer
    # (megatron_trainer); both write the same trace (TRACE_FORMAT.md)
    trainer: TrainerName = DEFAULT_TRAINER
    # megatron-core's model class (megatron-core trainer): GPTModel, or HybridModel built from
    # parallel.hybrid_layer_pattern (megatron_trainer.hybrid)
    model_class: ModelClass = "gpt"
    inject: Optional[str] = None             # test-only planted fault (reference_impl.faults, megatron_trainer.faults)
    # megatron-core: the directory holding the ``megatron/`` package this run imports (a Megatron-LM checkout, or
    # the site-packages of an installed release): put first on the rank's sys.path before megatron is imported.
    # None: the one the interpreter imports.  Two sources in one case (`verify --megatron-base`) compare them.
    megatron_path: Optional[str] = None
    # megatron's own options by Megatron-LM's argument names (`megatron_trainer.options`): any field of its
    # TransformerConfig / MLATransformerConfig, OptimizerConfig, DistributedDataParallelConfig, the training
    # loop's (learning-rate and weight-decay schedule) and get_embedding_ranks; validated by megatron itself.
    megatron: dict[str, Union[bool, int, float, str, None, list[Union[bool, int, float, str]]]] = \
        Field(default_factory=dict, max_length=256)
    rank_timeout_s: float = Field(120.0, gt=0, le=MAX_TIMEOUT_S)  # gloo collective / p2p timeout inside ranks

    @field_validator("megatron", mode="before")
    @classmethod
    def _megatron_values(cls, v):
        # before the typed check, whose Union reports its first member ("should be a valid boolean") for a NaN or
        # a mapping: name the option and the real problem (the error's place already reads "megatron: ")
        for name, value in (v.items() if isinstance(v, dict) else []):
            for x in (value if isinstance(value, list) else [value]):
                if isinstance(x, float) and not math.isfinite(x):
                    raise ValueError(f"option {name!r}: {x} is not finite")
                if isinstance(x, (dict, list)):
                    raise ValueError(f"option {name!r}: a {'mapping' if isinstance(x, dict) else 'nested list'} "
                                     "is not an option value (a scalar, or a list of scalars)")
        return v

    @model_validator(mode="after")
    def _expert_parallel(self):
        parallel_rules.check_expert_parallel(self.model, self.training, self.parallel)
        parallel_rules.check_tensor_parallel(self.model, self.training, self.parallel)
        parallel_rules.check_data_parallel_microbatches(self.training, self.parallel)
        hybrid_problem(self)
        bad = next((k for k in self.megatron if not re.fullmatch(r"[a-z_][a-z0-9_]{0,99}", k)), None)
        if bad is not None:
            raise ValueError(f"megatron option {bad!r}: Megatron-LM's argument names are lower_case_with_underscores")
        return self

    def megatron_option(self, name: str, default=None):
        """The case's value of megatron option `name`, or `default` when the case leaves it out."""
        return self.megatron.get(name, default)


def hybrid_problem(config: "RunConfig") -> None:
    """A HybridModel run's pattern against its model, class and trainer (`trainerkit.hybrid_pattern`).

    Raises:
        ValueError: one line naming what disagrees (the pattern's own syntax errors carry their position)."""
    from .hybrid_pattern import check_against_model, parse_hybrid_pattern

    pattern_text = config.parallel.hybrid_layer_pattern
    if config.model_class != "hybrid":
        if pattern_text is not None:
            raise ValueError("hybrid_layer_pattern is HybridModel's layout: it needs model_class: hybrid")
        return
    if pattern_text is None:
        raise ValueError("model_class: hybrid needs hybrid_layer_pattern (HybridModel's layout)")
    if config.trainer != "megatron-core":
        raise ValueError("model_class: hybrid is megatron-core's HybridModel (trainer: megatron-core)")
    pattern = parse_hybrid_pattern(pattern_text)
    problem = check_against_model(pattern, config.model.moe_layers, config.model.mtp_num_layers)
    if problem:
        raise ValueError(f"hybrid_layer_pattern {pattern_text!r}: {problem}")
    if pattern.layout != config.parallel.pipeline_model_parallel_layout:
        raise ValueError(f"hybrid_layer_pattern {pattern_text!r} places layers as "
                         f"{pattern.layout!r}, not as pipeline_model_parallel_layout "
                         f"{config.parallel.pipeline_model_parallel_layout!r}")


def overlap_problem(model: ModelConfig, overlap: bool, delay_wgrad: bool) -> Optional[str]:
    """Why the 1F1B overlap settings cannot run with `model`, in one line (None when they can).

    Mirrors the checks of Megatron's ``TransformerConfig.__post_init__`` / ``arguments.py`` that concern the
    schedule: delay_wgrad_compute needs the overlap; the overlap supports at most one MTP layer, whose inner
    layer must be MoE (``build_mtp_layer_callables``).  (P>1 needs V>1: `schedule.check_sizes`.)  Megatron
    also demands EP>1 and bf16; the reference trainer relaxes those two, because the reordering it verifies
    does not depend on them and CPU runs are fp32.
    """
    if delay_wgrad and not overlap:
        return "delay_wgrad_compute needs overlap_moe_expert_parallel_comm (as in Megatron)"
    if overlap and model.mtp_num_layers > 1:
        return (f"overlap_moe_expert_parallel_comm supports at most one MTP layer (mtp_num_layers is "
                f"{model.mtp_num_layers}), as in Megatron")
    if overlap and model.mtp_num_layers and not model.moe_layers[-1]:
        return ("overlap_moe_expert_parallel_comm needs an MoE layer inside the MTP layer (the last decoder "
                "layer must be MoE), as in Megatron")
    return None
