"""The one place for canonical global parameter names, their families and their canonical order.

Names mirror Megatron's with *global* layer ids (megatron-semantics §1.4), e.g.
``decoder.layers.37.mlp.experts.5.linear_fc1.weight``; a replica (the MTP stage's copy of the word
embedding, ``mtp``; with expert parallelism every non-expert parameter of EP rank r > 0, ``ep{r}``) keeps the
logical name and carries a replica tag instead.
"""
from __future__ import annotations

import re

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

FAMILIES = ("embedding/head", "attention", "dense mlp", "router", "experts", "shared expert", "norms", "mtp")

_SECTION = (("embedding.", 0), ("decoder.layers.", 1), ("decoder.final_layernorm", 2), ("mtp.layers.", 3),
            ("output_layer.", 4))
_LAYER_ID = re.compile(r"^(?:decoder|mtp)\.layers\.(\d+)\.")


#: Adam's per-parameter moments as torch's and Megatron's optimizers name them: the step record fields that
#: carry their fingerprints after the update (TRACE_FORMAT.md)
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")

#: The name of a resumed job's trace directory inside its job's (`trainerkit.capture.segment_dir`): ``iter`` and
#: 7 digits.
SEGMENT_DIR = re.compile(r"^iter\d{7}$")

#: Leaves of the persistent state buffers the trainers trace (``buffers`` in TRACE_FORMAT.md): the routers'
#: ``expert_bias`` (megatron's name, the reference's too).  Not parameters: no gradient, no optimizer state, not
#: in the inventory; a difference there is a ``buffer`` difference (`harness.judging.compare`), not a ``param`` one.
BUFFER_LEAVES = ("expert_bias",)


def is_buffer(name: str) -> bool:
    """Whether a global name (a replica tag allowed) is a traced buffer rather than a parameter."""
    return name.split("@", 1)[0].rsplit(".", 1)[-1] in BUFFER_LEAVES


#: The family of a name `family` does not know, when not strict (a user's own model in megatron's training loop).
OTHER = "other"


def family(name: str, strict: bool = True) -> str:
    """Family of a global parameter/buffer name, used to group mismatch counts.  Not `strict`: a name of no
    known family is `OTHER` (megatron's fused or TE names, e.g. ``linear_qkv.layer_norm_weight``, fall in the
    family of their module).

    Raises:
        ValueError: strict, and the name is not a known parameter of the reference model.
    """
    try:
        return _family(name)
    except ValueError:
        if strict:
            raise
        return OTHER


def _family(name: str) -> str:
    if name.startswith(("embedding.", "output_layer.")):
        return "embedding/head"
    if name.startswith("mtp."):
        return "mtp"
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if "layernorm" in leaf or leaf.endswith("norm"):
        return "norms"
    for key, fam in ((".self_attention.", "attention"), (".mlp.router.", "router"), (".mlp.experts.", "experts"),
                     (".mlp.shared_experts.", "shared expert"), (".mlp.linear_fc", "dense mlp")):
        if key in name:
            return fam
    raise ValueError(f"unknown parameter name {name!r}")


def section_and_layer(name: str) -> tuple[int, int]:
    """(section, layer id) for ordering: embedding < decoder layers by id < final norm < MTP depths < head."""
    for prefix, section in _SECTION:
        if name.startswith(prefix):
            m = _LAYER_ID.match(name)
            return section, int(m.group(1)) if m else 0
    raise ValueError(f"unknown parameter name {name!r}")


_EXPERT_ID = re.compile(r"\.mlp\.experts\.(\d+)\.")
_EP_TAG = re.compile(r"^(?:(.+)\.)?(?:ep|dp|edp)(\d+)$")


def expert_id(name: str) -> int | None:
    """Global expert id of a routed-expert parameter (``...mlp.experts.{e}...``), else None."""
    m = _EXPERT_ID.search(name)
    return int(m.group(1)) if m else None


def ep_replica(replica: str | None, ep_rank: int, tag: str = "ep") -> str | None:
    """Replica tag of a parameter replicated over the EP ranks (everything but the routed experts): EP rank 0
    holds the original (`replica` unchanged), EP rank r > 0 a copy tagged ``ep{r}`` (``mtp.ep{r}`` for the MTP
    stage's embedding replica), so its key ``name@ep{r}`` does not collide and the harness checks that the
    copies stay identical (``replica_status``).  `tag` names the group the copies span: ``ep`` (the reference
    trainer's EP ranks), ``dp`` (Megatron's data-parallel replicas of a dense parameter), ``edp`` (Megatron's
    expert-data-parallel replicas of a routed expert), ``tp`` / ``etp`` (the tensor-parallel copies of a
    parameter no TP layer splits: a norm, the router)."""
    if ep_rank == 0:
        return replica
    return f"{tag}{ep_rank}" if replica is None else f"{replica}.{tag}{ep_rank}"


def base_replica(replica: str | None) -> str | None:
    """The replica tag without its EP / DP part: ``ep1`` -> None, ``mtp.ep1`` -> ``mtp``, ``mtp.dp1`` -> ``mtp``,
    ``mtp`` -> ``mtp``; a tensor-parallel copy's tag stays (``tp1.dp1`` -> ``tp1``)."""
    m = _EP_TAG.match(replica or "")
    return replica if m is None else m.group(1)


def replica_key(name: str, replica: str | None) -> str:
    """Trace key of a parameter: the global name, plus ``@replica`` for a replica copy."""
    return name if replica is None else f"{name}@{replica}"


def is_matrix(name: str, ndim: int) -> bool:
    """Weight decay applies to matrices only (Megatron: no decay on norms and biases)."""
    return ndim >= 2


# Position of each parameter within its layer, in the reference model's registration order (attention, then the
# MLP: dense, or router, routed experts by id, shared expert); the MTP layer wraps a decoder layer.
_LAYER_LEAVES = ("input_layernorm.weight", "self_attention.linear_q_down_proj.weight",
                 "self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.weight",
                 "self_attention.linear_kv_down_proj.weight", "self_attention.kv_layernorm.weight",
                 "self_attention.linear_kv_up_proj.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.router.weight",
                 "mlp.experts.*", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")
_MTP_LEAVES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "transformer_layer.*", "final_layernorm.weight")
_EXPERT_LEAF = re.compile(r"^mlp\.experts\.(\d+)\.linear_fc([12])\.weight$")
_WITHIN = re.compile(r"^(?:decoder|mtp)\.layers\.\d+\.(.*)$")
_SPAN = 1 << 20          # room for the routed experts' entries (2 per expert) inside one leaf slot


def _leaf_index(leaf: str, name: str) -> int:
    m = _EXPERT_LEAF.match(leaf)
    if m:
        return _LAYER_LEAVES.index("mlp.experts.*") * _SPAN + 2 * int(m.group(1)) + int(m.group(2)) - 1
    if leaf in _LAYER_LEAVES:
        return _LAYER_LEAVES.index(leaf) * _SPAN
    raise ValueError(f"unknown parameter name {name!r}")


#: Not strict: where names `order_key` does not know go within their section and layer (after every known one).
_UNKNOWN = 1 << 40


def order_key(name: str, strict: bool = True) -> tuple:
    """Canonical order key ``(section, layer id, index within layer)`` of a global parameter name: section 0
    embedding, 1 decoder layers by global id, 2 final norm, 3 MTP depths, 4 output head; within a layer the
    reference model's registration order (routed experts by id, fc1 before fc2).  A function of the name
    alone, so every trainer and every layout orders parameters alike.  Not `strict`, a name it does not know
    (another model's, e.g. ``linear_qkv.weight``, biases, position embeddings) gets
    ``(section, layer id, 2**40, name)``: after the known names of its layer (a name outside every section after
    all sections, section 5), by name, still a function of the name alone.

    Raises:
        ValueError: strict, and not a known parameter name.
    """
    try:
        return _order_key(name)
    except ValueError:
        if strict:
            raise
        try:
            section, layer = section_and_layer(name)
        except ValueError:
            section, layer = len(_SECTION), 0
        return section, layer, _UNKNOWN, name


def _order_key(name: str) -> tuple[int, int, int]:
    section, layer = section_and_layer(name)
    m = _WITHIN.match(name)
    if m is None:
        if name not in (EMBEDDING, FINAL_NORM, OUTPUT):
            raise ValueError(f"unknown parameter name {name!r}")
        return section, layer, 0
    leaf = m.group(1)
    if section == 1:
        return section, layer, _leaf_index(leaf, name)
    if leaf.startswith("transformer_layer."):
        return section, layer, (_MTP_LEAVES.index("transformer_layer.*") + 1) * _SPAN * len(_LAYER_LEAVES) \
            + _leaf_index(leaf[len("transformer_layer."):], name)
    if leaf in _MTP_LEAVES:
        slot = _MTP_LEAVES.index(leaf)
        return section, layer, slot if slot < 3 else (slot + 2) * _SPAN * len(_LAYER_LEAVES)
    raise ValueError(f"unknown parameter name {name!r}")
