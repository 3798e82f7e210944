"""The one place for canonical global parameter names, their families and their canonical order.

Names mirror Megatron's with *global* layer ids (megatron-semantics §1.4), e.g.
``decoder.layers.37.mlp.experts.5.linear_fc1.weight``; a replica (the MTP stage's copy of the word
embedding) keeps the logical name and carries a replica tag instead.
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


def family(name: str) -> str:
    """Family of a global parameter/buffer name, used to group mismatch counts.

    Raises:
        ValueError: the name is not a known parameter of the reference model.
    """
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


def replica_key(name: str, replica: str | None) -> str:
    """Trace key of a parameter: the global name, plus ``@replica`` for a replica copy."""
    return name if replica is None else f"{name}@{replica}"


def is_matrix(name: str, ndim: int) -> bool:
    """Weight decay applies to matrices only (Megatron: no decay on norms and biases)."""
    return ndim >= 2
