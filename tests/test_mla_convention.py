"""The reference MLA's RoPE against megatron-core's own code, bit for bit in fp32 on the CPU.

Megatron (megatron/core/models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd`` with
``multi_latent_attention=True``, ``rotary_interleaved=False``) de-interleaves the rope dims before a
rotate-half with ``emb = cat(freqs, freqs)`` from ``rotary_pos_embedding.RotaryEmbedding``; the reference's
`apply_rope` / `rope_cos_sin` (reference_impl/model/common.py) must give the same bits, forward and backward.

CPU paths taken through megatron (it assumes CUDA in two places, TE in one):
- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``: patched to "cpu", so
  megatron's own table code runs on the CPU.
- ``apply_rotary_pos_emb`` with ``apply_rope_fusion=False`` takes the unfused torch path; its ``cp_group``
  (read only for packed/fused inputs) is given a placeholder instead of an initialised CP group.
- ``MLASelfAttention`` tests ``isinstance(linear_proj, TELinear)`` where TELinear is a mock without TE:
  ``HAVE_TE`` is patched off.  Megatron's local ``DotProductAttention`` takes no ``k_channels`` (MLA needs
  TE's), so the attention test plugs in a plain causal softmax core, the same math as the reference's.
"""
import inspect

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from reference_impl.model.attention import MLASelfAttention  # noqa: E402
from reference_impl.model.common import apply_rope, rope_cos_sin  # noqa: E402
from trainerkit.config import ModelConfig  # noqa: E402

CP_UNUSED = object()   # apply_rotary_pos_emb's cp_group: unused on the unfused bshd path
# How MLASelfAttention asks for its rope: up to megatron-core 0.16 the config's multi_latent_attention selects the
# de-interleave; from 0.19 (rope_utils.apply_rotary_pos_emb's `mla_rotary_interleaved`, default False) MLA passes
# mla_rotary_interleaved=True itself (multi_latent_attention.py), so the tests pass it as MLA does.
MLA_ROPE = ({"mla_rotary_interleaved": True}
            if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters else {})


def mla_config(cfg: ModelConfig) -> MLATransformerConfig:
    """Megatron's MLA config for the reference's `ModelConfig`: plain RoPE, unfused, CPU, fp32, q/kv layernorms
    (as the megatron trainer's; megatron >= 0.19 checks the spec's norms against qk_layernorm)."""
    return MLATransformerConfig(
        num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
        qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_type="rope",
        rotary_base=cfg.rotary_base, apply_rope_fusion=False, layernorm_epsilon=cfg.layernorm_epsilon,
        normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False, use_cpu_initialization=True,
        perform_initialization=False, params_dtype=torch.float32)


@pytest.fixture
def cpu_megatron(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def megatron_emb(s: int, r: int, base: float) -> torch.Tensor:
    """``RotaryEmbedding(r)(s)``: freqs [s, 1, 1, r] = cat(angles, angles), fp32 (needs `cpu_megatron`)."""
    return RotaryEmbedding(r, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True)(s)


def old_half_rotation(x, cos, sin):
    """The reference's previous convention: rotate-half on x as stored, no de-interleave."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _both(s, b, n, r, base, seed):
    """(reference out, megatron out, reference grad, megatron grad) for a rope input [s, b, n, r] taken, as in
    MLA, as the last r dims of a wider per-head tensor (a strided view), with one random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(s, b, n, 8 + r, generator=g)
    up = torch.randn(s, b, n, r, generator=g)
    cfg = mla_config(ModelConfig(qk_pos_emb_head_dim=r, rotary_base=base))
    cos, sin = rope_cos_sin(s, r, base)
    outs, grads = [], []
    for fn in (lambda t: apply_rope(t, cos, sin),
               lambda t: apply_rotary_pos_emb(t, megatron_emb(s, r, base), cfg, cp_group=CP_UNUSED, **MLA_ROPE)):
        leaf = full.clone().requires_grad_()
        out = fn(leaf[..., 8:])
        out.backward(up)
        outs.append(out.detach())
        grads.append(leaf.grad)
    return (*outs, *grads)


@pytest.mark.parametrize("s, b, n, r, base", [(7, 3, 4, 8, 10000.0), (33, 2, 2, 64, 10000.0),
                                              (5, 1, 3, 2, 500.0), (64, 2, 1, 16, 1e6)])
def test_rope_matches_megatron_bitwise(cpu_megatron, s, b, n, r, base):
    """q_pos_emb [s, b, n, r] and k_pos_emb [s, b, 1, r]: reference == megatron bit for bit, forward and
    backward; the output stays de-interleaved (megatron never re-interleaves)."""
    for heads in (n, 1):
        ref, meg, ref_grad, meg_grad = _both(s, b, heads, r, base, seed=heads)
        assert ref.dtype == meg.dtype == torch.float32
        assert torch.equal(ref, meg)
        assert torch.equal(ref_grad, meg_grad)


def test_rope_tables_match_megatron_bitwise(cpu_megatron):
    """cos/sin of megatron's ``cat(freqs, freqs)`` table are the reference's half tables, twice, bit for bit."""
    s, r, base = 4097, 64, 10000.0
    emb = megatron_emb(s, r, base)
    cos, sin = rope_cos_sin(s, r, base)
    assert emb.dtype == cos.dtype == torch.float32
    assert torch.equal(torch.cos(emb), torch.cat((cos, cos), dim=-1))
    assert torch.equal(torch.sin(emb), torch.cat((sin, sin), dim=-1))


def test_old_half_rotation_differs_from_megatron(cpu_megatron):
    """The previous rotate-half-without-de-interleave convention is not megatron's: the tests above can fail."""
    s, b, n, r, base = 7, 3, 4, 8, 10000.0
    x = torch.randn(s, b, n, r, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(s, r, base)
    meg = apply_rotary_pos_emb(x, megatron_emb(s, r, base), mla_config(ModelConfig()), cp_group=CP_UNUSED,
                               **MLA_ROPE)
    assert not torch.allclose(old_half_rotation(x, cos, sin), meg, atol=1e-3)
    assert torch.equal(apply_rope(x, cos, sin), meg)
    # position 0 is the identity rotation: the two differ only by the de-interleave permutation there
    assert torch.equal(meg[0], torch.cat((x[0, ..., 0::2], x[0, ..., 1::2]), dim=-1))


class PlainCoreAttention(torch.nn.Module):
    """Causal softmax attention [s, b, n, d] -> [s, b, n*dv]: the reference MLA's core, with megatron's
    core-attention signature (``softmax_scale`` from ``MLASelfAttention.__init__``)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        s = query.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")).float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).permute(2, 0, 1, 3)
        return out.reshape(s, out.shape[1], -1)


@pytest.fixture
def megatron_world(cpu_megatron, monkeypatch):
    """A one-process gloo world with megatron's parallel state (TP=PP=CP=1), torn down afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state
    monkeypatch.setattr(mla, "HAVE_TE", False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_mla_attention_matches_megatron_bitwise(megatron_world):
    """Megatron's MLASelfAttention (local spec, qk_layernorm=True, plain RoPE) and the reference's, same
    weights: output and every gradient bit for bit in fp32.  Checks the wiring around the rope: q_pos_emb per
    head, k_pos_emb from the last r rows of linear_kv_down_proj shared by all heads, softmax scale."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    cfg = ModelConfig(hidden_size=16, num_attention_heads=3)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm", qk_layernorm=True)
    spec = spec.submodules.self_attention
    spec.submodules.core_attention = PlainCoreAttention
    meg = build_module(spec, config=mla_config(cfg), layer_number=1)
    ref = MLASelfAttention(cfg)
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        assert sorted(n for n, _ in meg.named_parameters()) == sorted(ref_params)
        for name, p in meg.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if "layernorm" in name else 0.0))
            ref_params[name].copy_(p)
    s, b = 9, 2
    x = torch.randn(s, b, cfg.hidden_size, generator=g)
    up = torch.randn(s, b, cfg.hidden_size, generator=g)
    x_meg, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_meg, _ = meg(x_meg, attention_mask=None)
    out_ref = ref(x_ref, *rope_cos_sin(s, cfg.qk_pos_emb_head_dim, cfg.rotary_base))
    out_meg.backward(up)
    out_ref.backward(up)
    assert torch.equal(out_meg, out_ref)
    assert torch.equal(x_meg.grad, x_ref.grad)
    for name, p in meg.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name
