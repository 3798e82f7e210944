"""Tests for the reference model (reference_impl/model/*, config.py, init.py, names.py).

Expectations are computed independently of the code under test: rolled ids/labels by slicing, cross-entropy
from logsumexp in fp64, router selection by plain Python sorting (megatron-semantics §9), the MoE output by a
per-token dense loop, and cross-layout equality by comparing two layouts of the same model
(megatron-semantics §2).
"""
from collections import Counter

import pydantic
import pytest
import torch
from torch import nn

from reference_impl.model.chunk import Microbatch, StageChunk
from reference_impl.model.common import LossAutoScaler, roll_left, rope_cos_sin
from reference_impl.model.losses import lm_and_mtp_loss
from reference_impl.model.moe import MoELayer, Router, seq_aux_loss
from reference_impl.model.mtp import MTPBlock
from trainerkit import names
from trainerkit.config import ModelConfig, parse_moe_layer_freq
from trainerkit.init import init_parameters
from trainerkit.layout import PipelineLayout

MOE_CFG = dict(hidden_size=16, num_moe_experts=8, moe_router_topk=2, moe_router_num_groups=4,
               moe_router_group_topk=2, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
               moe_aux_loss_coeff=0.0, init_method_std=0.3)


def moe_cfg(**overrides):
    return ModelConfig(**{**MOE_CFG, **overrides})


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rolled(t, k):
    """`t` [b, s] shifted left by k along the last dim with zeros at the tail, built by slicing."""
    out = torch.zeros_like(t)
    out[:, :t.shape[1] - k] = t[:, k:]
    return out


# --- roll_left ------------------------------------------------------------------------------------------------

def test_roll_left_matches_megatron_roll_tensor():
    """roll_tensor(shifts=-1, dims=-1): shift left, zero the last position; cumulative when applied twice."""
    x = torch.tensor([[1, 2, 3, 4]])
    once = roll_left(x)
    assert once.tolist() == [[2, 3, 4, 0]]
    assert roll_left(once).tolist() == [[3, 4, 0, 0]]
    assert x.tolist() == [[1, 2, 3, 4]]                       # input untouched
    m = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    assert roll_left(m).tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]   # rows independent, last dim only


# --- MTP block ------------------------------------------------------------------------------------------------

def _mtp_setup(depth, s=6, b=2):
    cfg = ModelConfig(hidden_size=16, mtp_num_layers=depth, num_layers=2, moe_layer_freq=[0, 1])
    block = MTPBlock(cfg, moe=True)
    init_parameters(block, cfg, seed=3)
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    nn.init.normal_(emb.weight, generator=gen(4))
    tokens = torch.randint(1, cfg.vocab_size, (b, s), generator=gen(5))
    h0 = torch.randn(s, b, cfg.hidden_size, generator=gen(6))
    cos, sin = rope_cos_sin(s, cfg.qk_pos_emb_head_dim, cfg.rotary_base)
    return cfg, block, emb, tokens, h0, cos, sin


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_block_shape_main_chunk_and_rolled_ids(depth):
    """Output is cat([h0, h1..hD]) [(1+D)s, b, h]; rows [0, s) are h0 bitwise; depth k embeds ids rolled k times."""
    cfg, block, emb, tokens, h0, cos, sin = _mtp_setup(depth)
    s, b = tokens.shape[1], tokens.shape[0]
    seen = []

    def embed(ids):
        seen.append(ids.clone())
        return emb(ids).transpose(0, 1).contiguous()

    tokens_before = tokens.clone()
    with torch.no_grad():
        out = block(h0, tokens, embed, cos, sin)
    assert out.shape == ((1 + depth) * s, b, cfg.hidden_size)
    assert torch.equal(out[:s], h0)
    assert torch.equal(tokens, tokens_before)
    assert len(seen) == depth
    for k in range(1, depth + 1):
        expected = rolled(tokens, k)
        assert torch.equal(seen[k - 1], expected), k
        assert (seen[k - 1][:, s - k:] == 0).all()


def test_mtp_block_chains_depths():
    """Depth k>1 takes depth k-1's output (not h0) as its hidden input."""
    cfg, block, emb, tokens, h0, cos, sin = _mtp_setup(2)
    s = tokens.shape[1]

    def embed(ids):
        return emb(ids).transpose(0, 1).contiguous()

    with torch.no_grad():
        out = block(h0, tokens, embed, cos, sin)
        h1 = block.layers["0"](h0, embed(rolled(tokens, 1)), cos, sin)
        h2 = block.layers["1"](h1, embed(rolled(tokens, 2)), cos, sin)
        h2_from_h0 = block.layers["1"](h0, embed(rolled(tokens, 2)), cos, sin)
    assert torch.equal(out[s:2 * s], h1)
    assert torch.equal(out[2 * s:], h2)
    assert not torch.allclose(out[2 * s:], h2_from_h0)


# --- losses ---------------------------------------------------------------------------------------------------

def _masked_mean_ce(weight, hidden, labels, mask):
    """fp64 masked mean cross-entropy written out: logsumexp(logits) - logit[label]."""
    logits = torch.einsum("sbh,vh->bsv", hidden.double(), weight.double())      # [b, s, V]
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (ce * mask.double()).sum() / mask.double().sum().clamp(min=1)


def _loss_setup(depth=2, s=7, b=3, h=8, v=11):
    g = gen(10)
    head = nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    hidden = torch.randn((1 + depth) * s, b, h, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    mask[0, 1] = 0.0
    mask[1, -1] = 0.0
    assert 0 < mask.sum() < b * s
    return head, hidden, labels, mask


def test_lm_and_mtp_loss_values():
    """lm_loss = masked mean CE of chunk 0; mtp_losses[k-1] = masked mean CE of chunk k against labels and mask
    rolled k times; objective = lm_loss / M exactly."""
    depth, M = 2, 3
    head, hidden, labels, mask = _loss_setup(depth)
    s = labels.shape[1]
    out = lm_and_mtp_loss(head, hidden, labels, mask, depth, 0.3, M)
    w = head.weight.detach()
    assert torch.allclose(out.lm_loss.double(), _masked_mean_ce(w, hidden[:s], labels, mask), rtol=1e-6, atol=0)
    assert len(out.mtp_losses) == depth
    for k in range(1, depth + 1):
        exp = _masked_mean_ce(w, hidden[k * s:(k + 1) * s], rolled(labels, k), rolled(mask, k))
        assert torch.allclose(out.mtp_losses[k - 1].double(), exp, rtol=1e-6, atol=0), k
    assert torch.equal(out.objective, out.lm_loss / M)
    assert out.num_tokens.item() == mask.sum().item()
    assert torch.allclose(out.lm_loss_sum, out.lm_loss * mask.sum())
    assert not out.lm_loss.requires_grad and not any(x.requires_grad for x in out.mtp_losses)


def test_lm_and_mtp_loss_gradient_is_the_explicit_objective():
    """d objective / d hidden (and d head) equal the gradients of (lm + factor/D * sum_k mtp_k) / M."""
    depth, M, factor = 2, 3, 0.3
    head, hidden, labels, mask = _loss_setup(depth)
    s = labels.shape[1]

    x = hidden.clone().requires_grad_(True)
    lm_and_mtp_loss(head, x, labels, mask, depth, factor, M).objective.backward()
    grad_x, grad_w = x.grad.clone(), head.weight.grad.clone()

    head.weight.grad = None
    y = hidden.double().clone().requires_grad_(True)
    w = head.weight.detach().double().clone().requires_grad_(True)
    total = _masked_mean_ce(w, y[:s], labels, mask)
    total = total + factor / depth * sum(_masked_mean_ce(w, y[k * s:(k + 1) * s], rolled(labels, k), rolled(mask, k))
                                         for k in range(1, depth + 1))
    (total / M).backward()
    assert torch.allclose(grad_x.double(), y.grad, rtol=1e-5, atol=1e-8)
    assert torch.allclose(grad_w.double(), w.grad, rtol=1e-5, atol=1e-8)
    assert y.grad[s:].abs().sum() > 0               # the MTP chunks really receive gradient


def test_lm_loss_without_mtp():
    head, hidden, labels, mask = _loss_setup(depth=0)
    out = lm_and_mtp_loss(head, hidden, labels, mask, 0, 0.1, 1)
    assert out.mtp_losses == []
    assert torch.allclose(out.lm_loss.double(), _masked_mean_ce(head.weight.detach(), hidden, labels, mask), rtol=1e-6)


def test_loss_auto_scaler_identity_and_backward_seed():
    """forward is the identity on `output`; backward passes grad_output through and seeds d aux = scale."""
    x = torch.randn(3, 4, requires_grad=True)
    a = torch.randn(5, requires_grad=True)
    aux = (a ** 2).sum()
    out = LossAutoScaler.apply(x, aux, 0.375)
    assert torch.equal(out, x)
    g = torch.randn(3, 4)
    out.backward(g)
    assert torch.equal(x.grad, g)
    assert torch.allclose(a.grad, 0.375 * 2 * a.detach())


# --- router ---------------------------------------------------------------------------------------------------

def _identity_router(cfg, bias=None):
    """A router whose logits are x[:, :E] exactly (weight = [I_E | 0])."""
    r = Router(cfg)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, :cfg.num_moe_experts] = torch.eye(cfg.num_moe_experts)
        if bias is not None:
            r.expert_bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return r


def _logits_input(cfg, rows):
    x = torch.zeros(len(rows), cfg.hidden_size)
    x[:, :cfg.num_moe_experts] = torch.tensor(rows, dtype=torch.float32)
    return x


def ref_route(logits, cfg, bias=None):
    """Independent DeepSeek-V3 routing (megatron-semantics §9) with plain Python sorting.

    Returns (index [t, K] list of lists, probs [t, K] fp32 tensor)."""
    scores = torch.sigmoid(logits.float())
    e, g, k, gk = cfg.num_moe_experts, cfg.moe_router_num_groups, cfg.moe_router_topk, cfg.moe_router_group_topk
    size = e // g
    use_bias = bias is not None and cfg.moe_router_enable_expert_bias
    all_idx, all_probs = [], []
    for row in scores:
        sel = (row + bias if use_bias else row).tolist()
        group_score = [sum(sorted(sel[j * size:(j + 1) * size], reverse=True)[:k // gk]) for j in range(g)]
        groups = sorted(range(g), key=lambda j: (-group_score[j], j))[:gk]
        cands = [i for i in range(e) if i // size in groups]
        idx = sorted(cands, key=lambda i: (-sel[i], i))[:k]
        p = row[idx]
        if k > 1:
            p = p / (p.sum() + 1e-20)
        all_idx.append(idx)
        all_probs.append(p * cfg.moe_router_topk_scaling_factor)
    return all_idx, torch.stack(all_probs)


def test_router_scores_are_sigmoid_of_logits():
    cfg = moe_cfg()
    r = Router(cfg)
    nn.init.normal_(r.weight, generator=gen(1))
    x = torch.randn(5, cfg.hidden_size, generator=gen(2))
    scores, _, _ = r(x)
    assert torch.allclose(scores, 1 / (1 + torch.exp(-(x.double() @ r.weight.detach().double().t()))).float(),
                          rtol=1e-6, atol=1e-7)


def test_router_matches_reference_on_random_tokens():
    """Random logits: index and probs agree with the independent reference (probs sum to the scaling factor)."""
    for overrides in ({}, dict(moe_router_topk=4, moe_router_group_topk=2),
                      dict(num_moe_experts=16, moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=3)):
        cfg = moe_cfg(**overrides)
        r = Router(cfg)
        nn.init.normal_(r.weight, generator=gen(7))
        x = torch.randn(40, cfg.hidden_size, generator=gen(8))
        _, index, probs = r(x)
        exp_idx, exp_probs = ref_route(x @ r.weight.detach().t(), cfg)
        assert index.tolist() == exp_idx
        assert torch.allclose(probs, exp_probs, rtol=1e-6, atol=0)
        assert torch.allclose(probs.sum(-1), torch.full((40,), cfg.moe_router_topk_scaling_factor), rtol=1e-5)


def test_router_group_limited_excludes_best_expert_in_weak_group():
    """Group score = sum of the top-(K/group_topk) of a group: the single best expert (0) sits in a group whose
    partner is terrible, so its group loses and expert 0 is not selected (it would be without group limiting)."""
    row = [6.0, -6.0, 2.0, 2.0, 1.5, 1.4, 1.0, -1.0]
    limited = moe_cfg(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2)
    _, index, _ = _identity_router(limited)(_logits_input(limited, [row]))
    assert index.tolist() == [[2, 3, 4, 5]]
    flat = moe_cfg(moe_router_topk=4, moe_router_num_groups=1, moe_router_group_topk=1)
    _, index, _ = _identity_router(flat)(_logits_input(flat, [row]))
    assert index.tolist() == [[0, 2, 3, 4]]


def test_router_ties_go_to_lower_index():
    """Equal scores: the lower group and the lower expert index win."""
    cfg = moe_cfg()   # 8 experts, 4 groups of 2, top-2 from the best 2 groups (1 expert per group scored)
    rows = [[0.0] * 8,                                    # all equal -> groups 0,1 -> experts 0,1
            [0.0, 3.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0],     # experts 4,5 tie -> 4
            [0.0, 0.0, 0.0, 2.0, 0.0, 2.0, 2.0, 0.0]]     # groups 1,2,3 tie -> groups 1,2 -> experts 3,5
    _, index, probs = _identity_router(cfg)(_logits_input(cfg, rows))
    assert index.tolist() == [[0, 1], [1, 4], [3, 5]]
    assert torch.equal(probs[0], torch.tensor([1.25, 1.25]))     # 0.5/(0.5+0.5) * 2.5


def test_router_expert_bias_changes_selection_not_probs():
    """The bias only steers selection: probs are the unbiased sigmoid scores, normalised, times the factor."""
    row = [3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]
    bias = [0.0] * 7 + [10.0]
    cfg = moe_cfg()
    x = _logits_input(cfg, [row])
    _, idx0, probs0 = _identity_router(cfg)(x)
    _, idx1, probs1 = _identity_router(cfg, bias)(x)
    assert idx0.tolist() == [[0, 1]] and idx1.tolist() == [[7, 0]]
    s = torch.sigmoid(torch.tensor([-4.0, 3.0]))
    assert torch.allclose(probs1[0], s / s.sum() * 2.5, rtol=1e-6, atol=0)
    assert probs1[0, 0] < 0.1                      # the biased-in expert keeps its small unbiased weight
    exp_idx, exp_probs = ref_route(torch.tensor([row]), cfg, torch.tensor(bias))
    assert idx1.tolist() == exp_idx and torch.allclose(probs1, exp_probs, rtol=1e-6, atol=0)
    off = moe_cfg(moe_router_enable_expert_bias=False)
    _, idx2, probs2 = _identity_router(off, bias)(x)
    assert idx2.tolist() == [[0, 1]] and torch.equal(probs2, probs0)


def test_router_counts_tokens_per_expert_across_calls():
    cfg = moe_cfg()
    r = Router(cfg)
    nn.init.normal_(r.weight, generator=gen(11))
    expected = Counter()
    for seed in (12, 13):
        x = torch.randn(30, cfg.hidden_size, generator=gen(seed))
        r(x)
        for idx in ref_route(x @ r.weight.detach().t(), cfg)[0]:
            expected.update(idx)
    assert r.tokens_per_expert.dtype == torch.int64
    assert r.tokens_per_expert.tolist() == [expected[e] for e in range(cfg.num_moe_experts)]
    assert r.tokens_per_expert.sum().item() == 60 * cfg.moe_router_topk


def test_update_expert_bias_sign_rule_and_reset():
    """bias += rate * sign(mean(count) - count), then counts reset; nothing moves without counts or when disabled."""
    cfg = moe_cfg(moe_router_bias_update_rate=0.125)
    r = Router(cfg)
    r.tokens_per_expert.copy_(torch.tensor([5, 3, 3, 3, 0, 2, 6, 2]))          # mean 3
    r.update_expert_bias()
    assert r.expert_bias.tolist() == [-0.125, 0.0, 0.0, 0.0, 0.125, 0.125, -0.125, 0.125]
    assert r.tokens_per_expert.tolist() == [0] * 8
    r.update_expert_bias()                                                     # all counts equal: no change
    assert r.expert_bias.tolist() == [-0.125, 0.0, 0.0, 0.0, 0.125, 0.125, -0.125, 0.125]
    r.tokens_per_expert.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 8]))
    r.update_expert_bias()
    assert r.expert_bias.tolist() == [0.0, 0.125, 0.125, 0.125, 0.25, 0.25, 0.0, 0.0]

    off = Router(moe_cfg(moe_router_enable_expert_bias=False))
    off.tokens_per_expert.copy_(torch.tensor([5, 3, 3, 3, 0, 2, 6, 2]))
    off.update_expert_bias()
    assert off.expert_bias.tolist() == [0.0] * 8 and off.tokens_per_expert.tolist() == [0] * 8


def test_update_expert_bias_default_rate():
    cfg = moe_cfg()
    r = Router(cfg)
    r.tokens_per_expert.copy_(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0]))
    r.update_expert_bias()
    rate = torch.tensor(1e-3, dtype=torch.float32)
    assert torch.equal(r.expert_bias, torch.tensor([-1.0] + [1.0] * 7) * rate)


# --- seq aux loss and MoE layer -------------------------------------------------------------------------------

def ref_seq_aux(scores, s, b, cfg):
    """DeepSeek-V3 eqs. 17-20 per sequence, averaged over the b sequences; rows of `scores` in [s, b] order.
    f_i counts the tokens whose plain top-K of the normalised affinities contains i (eq. 18)."""
    e, k = cfg.num_moe_experts, cfg.moe_router_topk
    index = [sorted(range(e), key=lambda i: (-float(scores[r, i] / scores[r].sum()), i))[:k]
             for r in range(scores.shape[0])]
    total = 0.0
    for seq in range(b):
        rows = [i * b + seq for i in range(s)]
        counts = Counter(x for r in rows for x in index[r])
        f = [e / (k * s) * counts[i] for i in range(e)]
        p = [sum(scores[r, i] / scores[r].sum() for r in rows) / s for i in range(e)]
        total = total + sum(fi * pi for fi, pi in zip(f, p))
    return total / b * cfg.moe_aux_loss_coeff


def test_seq_aux_loss_matches_definition():
    cfg = moe_cfg(moe_aux_loss_coeff=0.01)
    s, b = 5, 3
    scores = torch.rand(s * b, cfg.num_moe_experts, generator=gen(20), dtype=torch.float64).float().double()
    got = seq_aux_loss(scores.float(), s, b, cfg)
    assert torch.allclose(got.double(), torch.as_tensor(ref_seq_aux(scores, s, b, cfg)), rtol=1e-5)


def _moe_layer(cfg, seed=30):
    layer = MoELayer(cfg)
    init_parameters(layer, cfg, seed)
    return layer


def test_moe_layer_matches_dense_per_token_reference():
    """out_t = sum_k prob_k * expert_{idx_k}(x_t) + shared(x_t), computed token by token."""
    cfg = moe_cfg()
    layer = _moe_layer(cfg)
    x = torch.randn(6, 3, cfg.hidden_size, generator=gen(31))
    with torch.no_grad():
        out = layer(x)
        tokens = x.reshape(-1, cfg.hidden_size)
        idx, probs = ref_route(tokens @ layer.router.weight.t(), cfg)
        used = {e for row in idx for e in row}
        assert len(used) >= 4                                  # the test exercises several experts
        expected = torch.stack([
            sum(probs[t, j] * layer.experts[str(e)](tokens[t:t + 1])[0] for j, e in enumerate(idx[t]))
            + layer.shared_experts(tokens[t:t + 1])[0]
            for t in range(tokens.shape[0])]).view_as(x)
    assert out.shape == x.shape
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_moe_layer_forward_backward_bitwise_deterministic():
    cfg = moe_cfg(moe_aux_loss_coeff=1e-2)
    layer = _moe_layer(cfg)
    x = torch.randn(8, 2, cfg.hidden_size, generator=gen(32))
    results = []
    for _ in range(2):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = results
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_moe_layer_tokens_do_not_interact():
    """Changing some tokens (hence which experts receive which rows) leaves the other tokens' outputs unchanged.

    The experts' GEMMs then see other row counts, and a BLAS may block (hence round) a row differently by the
    matrix's shape (MKL's AVX-512 paths do): in float32 that is a few ULP that depend on the machine.  The
    property is about routing, not rounding, so it is checked in float64, where any such blocking effect
    is ~1e-16 relative and a token mixed into another's output would be ~1e-2."""
    cfg = moe_cfg()
    layer = _moe_layer(cfg).double()
    x = torch.randn(10, 1, cfg.hidden_size, generator=gen(33), dtype=torch.float64)
    y = x.clone()
    y[::3] = torch.randn(4, 1, cfg.hidden_size, generator=gen(34), dtype=torch.float64)
    with torch.no_grad():
        ox, oy = layer(x), layer(y)
    keep = [i for i in range(10) if i % 3]
    assert ox.dtype == torch.float64
    assert torch.allclose(ox[keep], oy[keep], rtol=1e-12, atol=1e-14)
    assert not torch.allclose(ox[::3], oy[::3])


def test_moe_aux_loss_enters_backward_only():
    """With moe_aux_loss_coeff > 0 the output is bitwise unchanged, and the router-weight gradient gains
    aux_loss_scale * d(seq aux loss)/dW."""
    base, aux = moe_cfg(), moe_cfg(moe_aux_loss_coeff=5.0)   # large, so the difference is not lost in rounding
    la, lb = _moe_layer(base), MoELayer(aux)
    lb.load_state_dict(la.state_dict())
    lb.aux_loss_scale = 0.25
    s, b = 6, 2
    x = torch.randn(s, b, base.hidden_size, generator=gen(35))
    oa, ob = la(x), lb(x)
    assert torch.equal(oa, ob)
    oa.sum().backward()
    ob.sum().backward()
    w = la.router.weight.detach().clone().requires_grad_(True)
    tokens = x.reshape(-1, base.hidden_size)
    scores = torch.sigmoid(tokens @ w.t())
    ref_seq_aux(scores, s, b, aux).backward()
    expected = 0.25 * w.grad
    assert expected.abs().max() > 1e-3
    assert torch.allclose(lb.router.weight.grad - la.router.weight.grad, expected,
                          rtol=1e-4, atol=1e-4 * expected.abs().max().item())


# --- StageChunk across layouts --------------------------------------------------------------------------------

CHUNK_CFG = ModelConfig(num_layers=4, moe_layer_freq="[0]*1+[1]*3")
M = 2


def _build(text, p, seed=7):
    lay = PipelineLayout.from_string(text, p, CHUNK_CFG.num_layers, CHUNK_CFG.mtp_num_layers)
    chunks = [StageChunk(CHUNK_CFG, lay, i, M) for i in range(lay.num_stages)]
    for c in chunks:
        init_parameters(c, CHUNK_CFG, seed)
    return chunks


def _microbatch(seed=40, b=2, s=8):
    ids = torch.randint(1, CHUNK_CFG.vocab_size, (b, s + 1), generator=gen(seed))
    ids[1, -3:] = 0                                            # padded tail, masked out
    labels = ids[:, 1:].contiguous()
    return Microbatch(ids[:, :-1].contiguous(), labels, (labels != 0).float())


def _run(chunks, mb):
    x = None
    for c in chunks:
        x = c(x, mb)
    return x


def test_chunk_parameter_names_match_across_layouts():
    """P=1 'Et*4mL' and the 4 chunks of 'Et|tt|tm|L' hold the same global names; only the word embedding is
    duplicated, on the MTP stage, tagged as the 'mtp' replica."""
    (one,) = _build("Et*4mL", 1)
    four = _build("Et|tt|tm|L", 4)
    names1 = [n for n, _ in one.named_parameters()]
    assert len(names1) == len(set(names1))
    per_chunk = [[n for n, _ in c.named_parameters()] for c in four]
    owners = Counter(n for names_ in per_chunk for n in names_)
    assert set(owners) == set(names1)
    assert {n for n, c in owners.items() if c > 1} == {names.EMBEDDING}
    assert names.EMBEDDING in per_chunk[0] and names.EMBEDDING in per_chunk[2]
    assert [sorted({r for n, r, _ in c.global_parameters() if n == "embedding.word_embeddings.weight"}, key=str) for c in four] == [[None], [], ["mtp"], []]
    assert {r for n, r, _ in one.global_parameters() if n == "embedding.word_embeddings.weight"} == {None}
    # placement: final norm with the last decoder layer, head on the loss stage, MTP on stage 2
    assert names.FINAL_NORM in per_chunk[2] and names.OUTPUT in per_chunk[3] and per_chunk[3] == [names.OUTPUT]
    assert all(n.startswith("mtp.layers.0.") for n in per_chunk[2] if n.startswith("mtp."))
    assert {n.split(".")[2] for n in per_chunk[1] if n.startswith("decoder.layers.")} == {"1", "2"}
    # independent expectations on the global names: layer 0 dense, layers 1-3 and the MTP layer MoE
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names1
    for i in (1, 2, 3):
        assert f"decoder.layers.{i}.mlp.router.weight" in names1
        assert f"decoder.layers.{i}.mlp.experts.7.linear_fc2.weight" in names1
    assert "mtp.layers.0.transformer_layer.mlp.experts.0.linear_fc1.weight" in names1
    assert "mtp.layers.0.eh_proj.weight" in names1
    assert all(names.family(n) in names.FAMILIES for n in names1)


def test_chunk_init_is_name_keyed_and_layout_invariant():
    """Same-named parameters are bitwise identical in both layouts (the MTP replica included)."""
    (one,) = _build("Et*4mL", 1)
    four = _build("Et|tt|tm|L", 4)
    p1 = dict(one.named_parameters())
    for c in four:
        for n, p in c.named_parameters():
            assert torch.equal(p, p1[n]), n
    assert not torch.equal(p1["decoder.layers.1.mlp.experts.0.linear_fc1.weight"],
                           p1["decoder.layers.1.mlp.experts.1.linear_fc1.weight"])
    other = _build("Et*4mL", 1, seed=8)[0]
    assert not torch.equal(p1[names.OUTPUT], dict(other.named_parameters())[names.OUTPUT])
    # Megatron-style init: norms ones, N(0, std) matrices, scaled std for output projections
    assert torch.equal(p1[names.FINAL_NORM], torch.ones(CHUNK_CFG.hidden_size))
    std = CHUNK_CFG.init_method_std
    assert abs(p1[names.EMBEDDING].std().item() - std) < 0.1 * std
    fc2 = p1["decoder.layers.0.mlp.linear_fc2.weight"]
    assert abs(fc2.std().item() - std / (2 * CHUNK_CFG.num_layers) ** 0.5) < 0.1 * std / 8 ** 0.5


def test_init_does_not_depend_on_the_default_dtype():
    """The draws are fp32 whatever torch's default dtype (the transformers oracle runs under float64)."""
    from trainerkit.init import init_parameters
    a = torch.nn.Parameter(torch.empty(8, 64))
    init_parameters([("decoder.layers.0.mlp.linear_fc1.weight", a)], CHUNK_CFG, 7)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = torch.nn.Parameter(torch.empty(8, 64, dtype=torch.float32))
        init_parameters([("decoder.layers.0.mlp.linear_fc1.weight", b)], CHUNK_CFG, 7)
    finally:
        torch.set_default_dtype(old)
    assert torch.equal(a, b)


def test_chunk_forward_bitwise_equal_across_layouts():
    """Chaining the 4 chunks by hand gives bitwise the P=1 losses, and the same parameter gradients
    (the two embedding copies' gradients sum to the P=1 embedding gradient)."""
    (one,) = _build("Et*4mL", 1)
    four = _build("Et|tt|tm|L", 4)
    mb = _microbatch()
    a, b = _run([one], mb), _run(four, mb)
    assert torch.equal(a.lm_loss, b.lm_loss) and torch.equal(a.objective, b.objective)
    assert len(a.mtp_losses) == len(b.mtp_losses) == 1
    assert torch.equal(a.mtp_losses[0], b.mtp_losses[0])
    assert a.num_tokens.item() == mb.loss_mask.sum().item() == 16 - 3
    assert torch.isfinite(a.lm_loss) and a.lm_loss > 0

    a.objective.backward()
    b.objective.backward()
    g1 = {n: p.grad for n, p in one.named_parameters()}
    for c in four:
        for n, p in c.named_parameters():
            if n != names.EMBEDDING:
                assert torch.equal(p.grad, g1[n]), n
    emb = four[0].embedding.word_embeddings.weight.grad + four[2].embedding.word_embeddings.weight.grad
    assert torch.allclose(emb, g1[names.EMBEDDING], rtol=1e-5, atol=1e-9)
    assert four[2].embedding.word_embeddings.weight.grad.abs().sum() > 0   # the replica is used by MTP


def test_chunk_intermediate_activations():
    """Non-MTP stages send [s, b, h]; the MTP stage sends [(1+D)s, b, h] whose first s rows are the main hidden."""
    four = _build("Et|tt|tm|L", 4)
    mb = _microbatch()
    b, s = mb.tokens.shape
    with torch.no_grad():
        x0 = four[0](None, mb)
        x1 = four[1](x0, mb)
        x2 = four[2](x1, mb)
    assert x0.shape == x1.shape == (s, b, CHUNK_CFG.hidden_size)
    assert x2.shape == (2 * s, b, CHUNK_CFG.hidden_size)
    with torch.no_grad():
        h = four[2].decoder.final_layernorm(four[2].decoder.layers["3"](x1, *four[2].rope(s, "cpu", torch.float32)))
    assert torch.equal(x2[:s], h)


# --- config ---------------------------------------------------------------------------------------------------

def test_parse_moe_layer_freq_forms():
    assert parse_moe_layer_freq("[0]*3+[1]*58", 61) == [0] * 3 + [1] * 58
    assert parse_moe_layer_freq("[0,1]*2", 4) == [0, 1, 0, 1]
    assert parse_moe_layer_freq("[1]", 1) == [1]
    assert parse_moe_layer_freq(1, 3) == [1, 1, 1]
    assert parse_moe_layer_freq(2, 5) == [1, 0, 1, 0, 1]
    assert parse_moe_layer_freq([0, 1, 1], 3) == [0, 1, 1]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("value, n", [("[0]*3+[1]*57", 61), ("[0]*3+[1]*58", 60), ("[2]*4", 4), ("0*4", 4),
                                      ("[0]*3+", 4), ("[0]*x", 4), ("[]*4", 4), ("[0]**4", 4), ("", 4),
                                      ("[0]*3;[1]", 4), ([0, 1], 3), (0, 4)])
def test_parse_moe_layer_freq_rejects(value, n):
    with pytest.raises(ValueError):
        parse_moe_layer_freq(value, n)


def test_model_config_defaults_valid_and_moe_layers():
    cfg = ModelConfig(num_layers=4, moe_layer_freq="[0]*1+[1]*3")
    assert cfg.moe_layers == [0, 1, 1, 1]
    assert ModelConfig().moe_layers == [1, 1, 1, 1]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("bad", [
    dict(unknown_key=1),
    dict(num_moe_expert=8),                                      # typo of a real key
    dict(num_moe_experts=8, moe_router_num_groups=3),            # experts not divisible by groups
    dict(moe_router_num_groups=4, moe_router_group_topk=5),      # group_topk > groups
    dict(moe_router_topk=3, moe_router_group_topk=2),            # topk not divisible by group_topk
    dict(num_moe_experts=8, moe_router_num_groups=4, moe_router_topk=6, moe_router_group_topk=2),  # 3 > 2 per group
    dict(moe_router_score_function="softmax"),
    dict(num_layers=4, moe_layer_freq="[0]*3"),
    dict(num_layers=2, moe_layer_freq=[0, 2]),
    dict(qk_pos_emb_head_dim=7),
    dict(untie_embeddings_and_output_weights=False),
    dict(hidden_dropout=0.1),
])
def test_model_config_rejects(bad):
    with pytest.raises(pydantic.ValidationError):
        ModelConfig(**bad)


@pytest.mark.arithmetic_free
def test_model_config_frozen():
    cfg = ModelConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.hidden_size = 8


# --- names ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fam", [
    ("embedding.word_embeddings.weight", "embedding/head"),
    ("output_layer.weight", "embedding/head"),
    ("decoder.layers.0.self_attention.linear_q_down_proj.weight", "attention"),
    ("decoder.layers.12.self_attention.linear_proj.weight", "attention"),
    ("decoder.layers.0.mlp.linear_fc1.weight", "dense mlp"),
    ("decoder.layers.2.mlp.linear_fc2.weight", "dense mlp"),
    ("decoder.layers.3.mlp.router.weight", "router"),
    ("decoder.layers.3.mlp.router.expert_bias", "router"),
    ("decoder.layers.60.mlp.experts.255.linear_fc1.weight", "experts"),
    ("decoder.layers.3.mlp.shared_experts.linear_fc2.weight", "shared expert"),
    ("decoder.layers.0.input_layernorm.weight", "norms"),
    ("decoder.layers.7.pre_mlp_layernorm.weight", "norms"),
    ("decoder.final_layernorm.weight", "norms"),
    ("mtp.layers.0.eh_proj.weight", "mtp"),
    ("mtp.layers.0.enorm.weight", "mtp"),
    ("mtp.layers.0.transformer_layer.mlp.experts.3.linear_fc1.weight", "mtp"),
])
def test_names_family(name, fam):
    assert names.family(name) == fam
    assert fam in names.FAMILIES


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("name", ["foo.weight", "decoder.layers.0.mystery.weight", "weight"])
def test_names_family_rejects_unknown(name):
    with pytest.raises(ValueError):
        names.family(name)
