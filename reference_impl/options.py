"""Which of megatron's options (`RunConfig.megatron`, Megatron-LM's names) the reference trainer implements.

A case can set any of megatron's options; the reference trainer runs a config only when it computes what megatron
computes with those options, so that the cross-implementation check (`harness.judging.crossimpl`) compares like with
like.  Everything else is refused in one line naming the option (the cross-implementation check then says it
cannot compare that run).
"""
from __future__ import annotations

from typing import Optional

#: option -> the values the reference implements (None: any value)
IMPLEMENTED = {
    "calculate_per_token_loss": None,            # model/losses.py lm_and_mtp_loss(per_token=...), scale_by_tokens
    "moe_router_load_balancing_type": ("seq_aux_loss",),      # DeepSeek-V3 §2.1.2's, model/moe.py
    "get_embedding_ranks": ("pretrain_gpt",),    # the first stage and the MTP stages share the embedding
}
#: megatron's communication choices: how megatron moves tensors, not what it computes (the reference has its own
#: transport), so a megatron run with them is compared with the reference as it is
TRANSPORT = ("batch_p2p_comm", "overlap_p2p_comm", "overlap_grad_reduce", "bucket_size", "deterministic_mode",
             "check_for_nan_in_grad", "check_for_large_grads")


def problem(megatron: dict) -> Optional[str]:
    """The first option in `megatron` that the reference trainer does not implement, in one line (None)."""
    for name, value in megatron.items():
        if name in TRANSPORT:
            continue
        if name not in IMPLEMENTED:
            return (f"the reference trainer does not implement megatron option {name!r} (it implements "
                    f"{', '.join(IMPLEMENTED)}; megatron's transport options {', '.join(TRANSPORT[:2])}, ... apply "
                    "to megatron alone)")
        allowed = IMPLEMENTED[name]
        if allowed is not None and value not in allowed:
            return f"the reference trainer implements megatron option {name!r} only as {' or '.join(map(repr, allowed))}"
    return None
