"""Independent oracle for the reference model: Hugging Face transformers' DeepseekV3, same weights, float64.

The reference model (reference_impl/model/*: one P=1 chunk "Et*3mmL", D=2 MTP depths) and
``transformers.DeepseekV3ForCausalLM`` (eager attention, eager experts) get the same weights, mapped by name
(`hf_pieces`), and the same microbatch.  Both run in float64 except the float32 islands that the reference,
Megatron and HF share by design (RMSNorm's normalisation, the attention softmax, the router: logits, sigmoid,
top-k weights; the per-token cross-entropy).  Checked (`compare`, tolerances `TOL` / `FP32_TOL`):

1. main logits [b, s, V] of HF's forward, and every MTP depth's logits;
2. the LM loss, Megatron's per-token mean over the loss mask ``sum(CE * mask) / sum(mask)`` (pretrain_gpt
   ``loss_func``; per-token CE in float32, as ``vocab_parallel_cross_entropy`` and HF's ``ForCausalLMLoss`` cast);
   HF's own ``loss_function`` (float32 mean) against it at float32 precision;
3. every parameter gradient of ``lm_loss + (lambda / D) * sum_k mtp_loss_k`` (one microbatch: Megatron's
   MTPLossAutoScaler seed), HF's vs the reference's, mapped by name;
4. each MTP depth's loss against DeepSeek-V3 §2.2 as Megatron computes it (`mtp_oracle`, built from HF blocks:
   HF 5.x's own ``MtpModel`` is a speculative-decoding drafter with shifted positions, so it is not used).

Conventions aligned, each of which breaks agreement when wrong (`test_oracle_detects_planted_defect`):
RoPE on de-interleaved pairs (Megatron MLA, ``rotary_interleaved=False``; HF ``rope_interleave=True``); group
score = sum of the top ``topk / group_topk`` scores of a group (Megatron) vs HF's fixed top-2, so topk/group_topk
is 2; one shared expert of width ``moe_intermediate_size``; ``first_k_dense_replace`` = the dense prefix of
``moe_layer_freq``; softmax scale ``1/sqrt(qk_nope + qk_rope)`` (no yarn mscale); a non-zero expert bias (it
selects, it does not weight, in both); no seq aux loss (HF has none: ``moe_aux_loss_coeff=0``; tests/test_model.py
checks it against eqs. 17-20).
"""
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("transformers", minversion="5.0", reason="transformers is not installed")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm  # noqa: E402

from reference_impl.model.chunk import Microbatch, StageChunk  # noqa: E402
from trainerkit.config import ModelConfig  # noqa: E402
from trainerkit.init import init_parameters  # noqa: E402
from trainerkit.layout import PipelineLayout  # noqa: E402

D = 2
# Sizes distinct wherever a swap would still be shape-legal (q/kv LoRA ranks, nope/rope/v head dims); 4 experts per
# group, so the group score (top-2 of 4) differs from "top-1" and from "sum of the group"; std 0.2, so routing and
# attention are far from uniform.  topk = 2 (topk / group_topk = 2 for HF's group score): the float32 sum of the
# selected scores that normalises the top-k weights is then order-free (a + b == b + a), whereas for K > 2 the
# reference (sorted descending) and HF (``topk(sorted=False)``) add in different orders and differ by float32 ULPs.
CFG = ModelConfig(vocab_size=96, hidden_size=24, num_layers=3, moe_layer_freq=[0, 1, 1], num_attention_heads=3,
                  q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
                  ffn_hidden_size=20, num_moe_experts=16, moe_ffn_hidden_size=7, moe_shared_expert_intermediate_size=7,
                  moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=1, moe_aux_loss_coeff=0.0,
                  mtp_num_layers=D, mtp_loss_scaling_factor=0.3, init_method_std=0.2)
S = 10
# Relative to the larger max magnitude of the two tensors compared (logits, each gradient; |loss| for a loss).
# b = 1: the float64 paths agree to a few ULP because every float32 island sees bitwise-equal inputs (measured:
# logits <= 2.5e-16, bitwise unless MKL_CBWR=COMPATIBLE; losses bitwise; gradients <= 5.1e-16); 1e-12 leaves
# 1000x headroom and is ~1e4x below one float32 ULP (6e-8), less than any convention or mapping error makes.
TOL = 1e-12
# b > 1: the reference holds tokens as [s, b] rows, HF as [b, s]; a GEMM may round a row differently by its
# position (MKL_CBWR=COMPATIBLE does, by ~1e-16 in float64), the float32 router turns that into a float32 ULP of a
# routing weight, and the router weight gradient is a float32 sum over the tokens in another order.  Measured:
# router weight gradients <= 1.4e-7 and the rest <= 4.4e-16 by default; with MKL_CBWR=COMPATIBLE (6 seeds)
# <= 1.4e-7 forward and <= 1.1e-6 gradients.  A batch-axis defect is O(1e-2) or more.
FP32_TOL = 1e-5
HF_LOSS_TOL = 1e-6      # HF's ForCausalLMLoss: float32 mean (sum order differs from Megatron's masked sum)


def hf_config(cfg: ModelConfig, strict: bool = True, **overrides) -> DeepseekV3Config:
    """DeepseekV3Config equal to `cfg`.  HF has first_k_dense_replace (a dense prefix, then all MoE) where
    Megatron has moe_layer_freq, and a fixed top-2 group score; `strict=False` lets the latter differ (a planted
    defect)."""
    moe = cfg.moe_layers
    k_dense = moe.index(1)
    assert moe == [0] * k_dense + [1] * (cfg.num_layers - k_dense), "HF supports only first-k-dense layouts"
    assert not strict or cfg.moe_router_topk // cfg.moe_router_group_topk == 2, "HF's group score is a top-2 sum"
    assert cfg.moe_shared_expert_intermediate_size == cfg.moe_ffn_hidden_size, "HF: shared width = n_shared * moe"
    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=1, n_routed_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
        n_group=cfg.moe_router_num_groups, topk_group=cfg.moe_router_group_topk, norm_topk_prob=True,
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor, first_k_dense_replace=k_dense,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, hidden_act="silu",
        rms_norm_eps=cfg.layernorm_epsilon, rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        rope_interleave=True, max_position_embeddings=64, attention_bias=False, attention_dropout=0.0,
        tie_word_embeddings=False, num_mtp_layers=0, attn_implementation="eager", experts_implementation="eager")
    return DeepseekV3Config(**{**kw, **overrides})


# reference name (inside a decoder or MTP transformer layer) -> HF name pieces, concatenated along dim 0;
# "name[e]" is row e of a packed [E, ...] expert tensor
_LAYER_RULES = [
    (r"input_layernorm\.weight", ["input_layernorm.weight"]),
    (r"self_attention\.linear_q_down_proj\.weight", ["self_attn.q_a_proj.weight"]),
    (r"self_attention\.q_layernorm\.weight", ["self_attn.q_a_layernorm.weight"]),
    (r"self_attention\.linear_q_up_proj\.weight", ["self_attn.q_b_proj.weight"]),
    (r"self_attention\.linear_kv_down_proj\.weight", ["self_attn.kv_a_proj_with_mqa.weight"]),
    (r"self_attention\.kv_layernorm\.weight", ["self_attn.kv_a_layernorm.weight"]),
    (r"self_attention\.linear_kv_up_proj\.weight", ["self_attn.kv_b_proj.weight"]),
    (r"self_attention\.linear_proj\.weight", ["self_attn.o_proj.weight"]),
    (r"pre_mlp_layernorm\.weight", ["post_attention_layernorm.weight"]),
    (r"mlp\.linear_fc1\.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),     # [gate; up] rows
    (r"mlp\.linear_fc2\.weight", ["mlp.down_proj.weight"]),
    (r"mlp\.router\.weight", ["mlp.gate.weight"]),
    (r"mlp\.router\.expert_bias", ["mlp.gate.e_score_correction_bias"]),
    (r"mlp\.shared_experts\.linear_fc1\.weight", ["mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"]),
    (r"mlp\.shared_experts\.linear_fc2\.weight", ["mlp.shared_experts.down_proj.weight"]),
    (r"mlp\.experts\.(\d+)\.linear_fc1\.weight", [r"mlp.experts.gate_up_proj[\1]"]),
    (r"mlp\.experts\.(\d+)\.linear_fc2\.weight", [r"mlp.experts.down_proj[\1]"]),
]
_GLOBAL_RULES = [
    (r"embedding\.word_embeddings\.weight", ["hf.model.embed_tokens.weight"]),
    (r"decoder\.final_layernorm\.weight", ["hf.model.norm.weight"]),
    (r"output_layer\.weight", ["hf.lm_head.weight"]),
    (r"mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|final_layernorm)\.weight", [r"mtp.\1.\2.weight"]),
]


def hf_pieces(ref_name: str) -> list[tuple[str, int | None]]:
    """Oracle (name, expert row or None) pieces whose dim-0 concatenation is the reference tensor `ref_name`."""
    m = re.fullmatch(r"(decoder\.layers\.(\d+)|mtp\.layers\.(\d+)\.transformer_layer)\.(.+)", ref_name)
    if m:
        prefix = f"hf.model.layers.{m[2]}." if m[2] is not None else f"mtp.{m[3]}.layer."
        rules, rest = _LAYER_RULES, m[4]
    else:
        prefix, rules, rest = "", _GLOBAL_RULES, ref_name
    for pattern, targets in rules:
        hit = re.fullmatch(pattern, rest)
        if hit:
            out = []
            for t in targets:
                name = prefix + hit.expand(t)
                row = re.fullmatch(r"(.+)\[(\d+)\]", name)
                out.append((row[1], int(row[2])) if row else (name, None))
            return out
    raise KeyError(f"no HF mapping for reference tensor {ref_name}")


class MTPDepth(nn.Module):
    """One MTP module from HF blocks (DeepSeek-V3 §2.2; Megatron ``MultiTokenPredictionLayer``): enorm, hnorm
    [h], eh_proj [h, 2h], layer (a DeepseekV3DecoderLayer: MoE, as Megatron builds it from the last decoder layer's
    spec), final_layernorm [h] (Megatron's ``final_layernorm``; ``shared_head.norm`` in DeepSeek's checkpoint)."""

    def __init__(self, hc: DeepseekV3Config, depth: int):
        super().__init__()
        h, eps = hc.hidden_size, hc.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(hc, layer_idx=hc.num_hidden_layers + depth)   # >= first_k: MoE
        self.final_layernorm = DeepseekV3RMSNorm(h, eps)


def build_pair(ref_cfg: ModelConfig = CFG, seed: int = 11, strict: bool = True, **hf_overrides):
    """(reference StageChunk, oracle ``ModuleDict{hf: DeepseekV3ForCausalLM, mtp: [MTPDepth] * D}``), both float64,
    with the same weights (the reference's name-keyed init) and the same random expert biases."""
    lay = PipelineLayout.from_string("Et*3" + "m" * D + "L", 1, ref_cfg.num_layers, D)
    ref = StageChunk(ref_cfg, lay, 0, num_microbatches=1)
    init_parameters(ref, ref_cfg, seed)
    ref.double()       # no float64 option in the reference: its parameters and buffers follow the module's dtype
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for moe in ref.moe_layers():      # a small random bias flips some selections (it never weights)
            moe.router.expert_bias.copy_(0.05 * torch.randn(ref_cfg.num_moe_experts, generator=g))
    hc = hf_config(ref_cfg, strict, **hf_overrides)
    with torch.random.fork_rng(devices=[]):     # HF's own init (overwritten below) draws from the global RNG
        oracle = nn.ModuleDict({"hf": DeepseekV3ForCausalLM(hc),
                                "mtp": nn.ModuleList(MTPDepth(hc, k) for k in range(D))})
    oracle.double()    # HF builds the router weight and bias in float32 explicitly
    assert oracle["hf"].config._attn_implementation == "eager" == oracle["hf"].config._experts_implementation
    tensors = {**dict(oracle.named_parameters()), **dict(oracle.named_buffers())}
    covered = set()
    with torch.no_grad():
        for name, t in [*ref.named_parameters(), *((n, b) for n, b in ref.named_buffers() if "expert_bias" in n)]:
            pieces = hf_pieces(name)
            dsts = [tensors[n] if e is None else tensors[n][e] for n, e in pieces]
            for dst, src in zip(dsts, t.split([d.shape[0] for d in dsts], dim=0)):
                assert dst.shape == src.shape, name
                dst.copy_(src)
            covered |= set(pieces)
    # every oracle parameter (each expert row of the packed ones) got a reference tensor: nothing keeps HF's init
    expected = {(n, e) for n, p in oracle.named_parameters() for e in (range(p.shape[0]) if p.ndim == 3 else [None])}
    assert expected <= covered, f"oracle tensors without a reference source: {sorted(expected - covered)[:4]}"
    return ref, oracle


def microbatch(b: int, seed: int = 3) -> Microbatch:
    """tokens/labels [b, S] int64 (labels = next token), loss_mask [b, S] float64 with the last row's tail masked."""
    ids = torch.randint(1, CFG.vocab_size, (b, S + 1), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, S, dtype=torch.float64)
    mask[-1, -3:] = 0
    return Microbatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask)


def grads_of(module: nn.Module) -> dict:
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}


def run_reference(ref: StageChunk, mb: Microbatch) -> dict:
    """Forward + backward of the reference chunk.  logits [1+D, b, S, V] float64 (its output head applied to the
    head input [(1+D)·S, b, h] that the chunk's probe hook sees), lm_loss [], mtp_losses [D], grads {name: tensor}."""
    seen = {}

    def probe(_mb, key, t):
        seen[key] = t
        return t
    ref.probe = probe
    out = ref(None, mb)
    out.objective.backward()      # one microbatch: lm_loss, plus the MTP losses through their autoscaler
    with torch.no_grad():
        logits = ref.output_layer(seen["head.input"].view(1 + D, S, mb.tokens.shape[0], -1).transpose(1, 2))
    return dict(logits=logits, lm_loss=out.lm_loss, mtp_losses=torch.stack(out.mtp_losses), grads=grads_of(ref))


def megatron_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(CE * mask) / sum(mask)``: logits [b, S, V], labels [b, S], mask [b, S] float64; per-token CE in
    float32 (Megatron's ``vocab_parallel_cross_entropy`` casts the logits to float32), the sum in the mask's dtype."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """t [b, S] shifted left by k along S, zero-filled (Megatron's ``roll_tensor`` applied k times), by slicing."""
    out = torch.zeros_like(t)
    out[:, :t.shape[1] - k] = t[:, k:]
    return out


def mtp_oracle(oracle: nn.ModuleDict, h0: torch.Tensor, mb: Microbatch, ctx: dict, hidden_first=False) -> list:
    """Per depth k = 1..D: (logits [b, S, V], loss []).  h0 [b, S, h]: HF's final-normed hidden.
    ``h'_k = eh_proj([enorm(Emb(tokens shifted k)); hnorm(h_{k-1})])`` (Megatron ``_concat_embeddings``: embedding
    first), ``h_k = final_layernorm(layer(h'_k))``, which also feeds depth k+1 (Megatron's
    ``MultiTokenPredictionBlock``), logits = the shared head ``lm_head(h_k)``, loss over labels and mask shifted k
    with depth k's own token count (``GPTModel._postprocess``).  The layer sees the main model's positions and
    causal mask (`ctx`).  `hidden_first`: eq. 21 of the DeepSeek-V3 paper as printed, a planted defect."""
    hf, h, out = oracle["hf"], h0, []
    for k, depth in enumerate(oracle["mtp"], start=1):
        e = depth.enorm(hf.model.embed_tokens(shifted(mb.tokens, k)))
        pair = (depth.hnorm(h), e) if hidden_first else (e, depth.hnorm(h))
        h = depth.final_layernorm(depth.layer(depth.eh_proj(torch.cat(pair, dim=-1)), **ctx))
        logits = hf.lm_head(h)
        out.append((logits, megatron_loss(logits, shifted(mb.labels, k), shifted(mb.loss_mask, k))))
    return out


def run_oracle(oracle: nn.ModuleDict, mb: Microbatch, hidden_first=False) -> dict:
    """HF's forward (``DeepseekV3ForCausalLM``) + `mtp_oracle` + backward of ``lm_loss + lambda/D * sum_k loss_k``.
    Same keys as `run_reference` (grads by oracle name) plus hf_loss (HF's own loss function)."""
    hf, seen = oracle["hf"], {}

    def keep_ctx(_module, _args, kwargs):         # what HF feeds its decoder layers, reused for the MTP layers
        seen["ctx"] = {k: kwargs[k] for k in ("attention_mask", "position_embeddings")}

    hooks = [hf.model.norm.register_forward_hook(lambda _m, _i, out: seen.__setitem__("h0", out)),
             hf.model.layers[0].register_forward_pre_hook(keep_ctx, with_kwargs=True)]
    try:
        logits = hf(input_ids=mb.tokens, use_cache=False).logits                          # [b, S, V]
    finally:
        for hook in hooks:
            hook.remove()
    lm_loss = megatron_loss(logits, mb.labels, mb.loss_mask)
    hf_loss = hf.loss_function(logits=logits, labels=None, vocab_size=hf.config.vocab_size,
                               shift_labels=mb.labels.masked_fill(mb.loss_mask == 0, -100))
    mtp = mtp_oracle(oracle, seen["h0"], mb, seen["ctx"], hidden_first)
    mtp_losses = torch.stack([loss for _, loss in mtp])
    (lm_loss + CFG.mtp_loss_scaling_factor / D * mtp_losses.sum()).backward()
    return dict(logits=torch.stack([logits, *(lg for lg, _ in mtp)]).detach(), lm_loss=lm_loss.detach(),
                mtp_losses=mtp_losses.detach(), hf_loss=hf_loss.detach(), grads=grads_of(oracle))


def compare(ref: dict, orc: dict) -> dict:
    """{check: max |ref - oracle| / max(max |ref|, max |oracle|)} for ``logits``, ``lm_loss``, ``mtp_logits.{k}``,
    ``mtp_loss.{k}`` and ``grad:{reference name}`` (the oracle's pieces of that tensor concatenated, `hf_pieces`)."""
    def rel(a, b):
        a, b = a.double(), b.double()
        return ((a - b).abs().max() / torch.maximum(a.abs().max(), b.abs().max()).clamp(min=1e-300)).item()
    errs = {"logits": rel(ref["logits"][0], orc["logits"][0]), "lm_loss": rel(ref["lm_loss"], orc["lm_loss"])}
    for k in range(1, D + 1):
        errs[f"mtp_logits.{k}"] = rel(ref["logits"][k], orc["logits"][k])
        errs[f"mtp_loss.{k}"] = rel(ref["mtp_losses"][k - 1], orc["mtp_losses"][k - 1])
    for name, g in ref["grads"].items():
        errs[f"grad:{name}"] = rel(g, torch.cat([orc["grads"][n] if e is None else orc["grads"][n][e]
                                                 for n, e in hf_pieces(name)], dim=0))
    return errs


def failures(errs: dict, b: int) -> dict:
    tol = TOL if b == 1 else FP32_TOL
    return {k: v for k, v in errs.items() if not v <= tol}     # `not <=`: NaN fails


@pytest.fixture(autouse=True)
def float64_default():
    """Default dtype float64 inside these tests only (HF builds and makes its masks in it), restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("b", [1, 2])
def test_reference_matches_transformers_deepseek_v3(b):
    """Logits, LM loss, MTP losses and all gradients agree with HF + the MTP oracle: to `TOL` with b = 1 (tokens
    in the same order on both sides), to `FP32_TOL` with b = 2 (Megatron's [s, b] vs HF's [b, s] token order)."""
    ref, oracle = build_pair()
    mb = microbatch(b)
    r, o = run_reference(ref, mb), run_oracle(oracle, mb)
    assert r["logits"].dtype == o["logits"].dtype == torch.float64
    # not vacuous: the masked tail is excluded, every non-expert parameter gets a gradient, many experts are hit
    assert mb.loss_mask.sum() < mb.loss_mask.numel()
    assert all(g.abs().max() > 0 for n, g in r["grads"].items() if ".experts." not in n)
    hit = [n for n, g in r["grads"].items() if ".experts." in n and g.abs().max() > 0]
    assert len(hit) > len([n for n in r["grads"] if ".experts." in n]) // 4
    errs = compare(r, o)
    worst = max(errs, key=errs.get)
    assert not failures(errs, b), (failures(errs, b), f"worst {worst}: {errs[worst]:.3g}")
    assert abs(o["hf_loss"] - o["lm_loss"]) <= HF_LOSS_TOL * o["lm_loss"]


def _drop_expert_bias(oracle):
    for name, buf in oracle.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()


def _swap_shared_gate_up(oracle):
    mlp = oracle["hf"].model.layers[1].mlp.shared_experts
    mlp.gate_proj.weight, mlp.up_proj.weight = mlp.up_proj.weight, mlp.gate_proj.weight


# defect -> (build_pair kwargs, oracle mutation, run_oracle kwargs, a check that must fail, checks that must pass)
DEFECTS = {
    # HF's plain rotate-half on the stored layout, not Megatron's de-interleaved pairs
    "rope_not_interleaved": (dict(rope_interleave=False), None, {}, "logits", []),
    # the paper's printed [hidden; embedding] order: only the MTP depths change, the main model still agrees
    "mtp_hidden_first": ({}, None, dict(hidden_first=True), "mtp_loss.1", ["logits", "lm_loss"]),
    # selection without the expert bias (a missing buffer in the mapping)
    "expert_bias_dropped": ({}, _drop_expert_bias, {}, "logits", []),
    # gate and up rows of linear_fc1 mapped the wrong way round
    "shared_gate_up_swapped": ({}, _swap_shared_gate_up, {}, "logits", []),
    # reference group score = top-1 per group (topk / group_topk = 1) against HF's top-2
    "group_score_top1": (dict(ref_cfg=ModelConfig(**{**CFG.model_dump(), "moe_router_group_topk": 2}), strict=False),
                         None, {}, "logits", []),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_oracle_detects_planted_defect(defect):
    """With one convention or mapping planted wrong, `compare` reports a mismatch far above `TOL`."""
    build_kw, mutate, run_kw, must_fail, must_pass = DEFECTS[defect]
    ref, oracle = build_pair(**build_kw)
    if mutate is not None:
        with torch.no_grad():
            mutate(oracle)
    mb = microbatch(1)
    errs = compare(run_reference(ref, mb), run_oracle(oracle, mb, **run_kw))
    bad = failures(errs, 1)
    assert errs[must_fail] > 1e-6 and must_fail in bad, errs[must_fail]
    assert not set(must_pass) & set(bad), {k: errs[k] for k in must_pass}
