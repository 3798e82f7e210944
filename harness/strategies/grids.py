"""Valid layouts as stage grids (`stage_grids`): how many layers each flat stage holds, where the MTP stage
sits (the package docstring, `harness.strategies`, is the public description)."""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Sequence, Union

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

Grid = tuple  # tuple[tuple[str, ...], ...]: flat stages in global order (vpp-major, then pp)
SizeArg = Union[None, int, st.SearchStrategy]

MTP_PLACEMENTS = ("standalone", "with_loss")
_MAX_P, _MAX_V = 8, 4
_SYMBOLS = frozenset("EtmL")
_MAX_UNIT = 64  # longest repeated unit considered for a '(..)*n' group

def plain(grid: Iterable[Iterable[str]]) -> str:
    """The plain spelling of a grid: stages joined by '|' (``PipelineLayout.canonical()``)."""
    return "|".join("".join(stage) for stage in grid)



# --------------------------------------------------------------------------------------------------- grids

def _check_count(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgument(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_size(name: str, value: SizeArg) -> SizeArg:
    if value is None or isinstance(value, st.SearchStrategy):
        return value
    return _check_count(name, value, 1)


def _mtp_stages(T: int, D: int, P: int, V: int, allow_empty: bool,
                placement: Optional[str]) -> list[Optional[int]]:
    """Flat MTP stage indices possible for a valid grid (None stands for 'no MTP'), best shrink first.

    Empty list: no valid grid with these sizes and options.
    """
    n = P * V
    if P == 1 and V > 1:  # schedule.check_sizes: no interleaving without pipelining
        return []
    if D == 0:
        return [None] if allow_empty or n - 1 <= T + 1 else []
    # 'with_loss' first: the MTP stage is the last stage, which holds L. rank P-1 is the loss rank.
    ranks = [0] if P == 1 else list(range(P - 1, 0, -1))
    if placement == "standalone":
        ranks = [r for r in ranks if r != P - 1]
    elif placement == "with_loss":
        ranks = [r for r in ranks if r == P - 1]
    out = []
    for r in ranks:
        M = (V - 1) * P + r
        post = n - 1 - M  # stage boundaries after the MTP stage; only empty stages and L may follow
        if allow_empty or (M <= T + 1 and post <= 1):
            out.append(M)
    return out


def _spread(draw, total: int, caps: Sequence[Optional[int]], order: Sequence[int], rare: Iterable[int] = ()):
    """Distribute `total` stage boundaries over gaps (cap None = unbounded), drawing in `order`; the last gap
    in `order` takes the remainder. Gaps in `rare` stay 0 unless a 1-in-4 gate opens (shrinks to 0)."""
    counts = [0] * len(caps)
    rem, rare = total, set(rare)
    for k, g in enumerate(order):
        later = [caps[h] for h in order[k + 1:]]
        later_cap = math.inf if any(c is None for c in later) else sum(later)
        hi = rem if caps[g] is None else min(caps[g], rem)
        lo = max(0, rem - later_cap)
        if lo > hi:
            raise AssertionError("infeasible spread; _mtp_stages should have excluded it")  # pragma: no cover
        if lo == hi:
            c = lo
        elif g in rare and lo == 0 and draw(st.integers(0, 3)) < 3:
            c = 0
        else:
            c = draw(st.integers(lo, hi))
        counts[g] = c
        rem -= c
    return counts


def _build(draw, T: int, D: int, n: int, mstage: Optional[int], allow_empty: bool) -> Grid:
    """A grid of n stages: E, T decoder layers, D MTP layers in flat stage `mstage`, L, in flattened order.

    Symbols are laid out in order and n-1 stage boundaries are placed in the gaps between them, never before
    E or after L (Megatron embeds on the first stage and computes the loss on the last). The MTP block is one
    token, so all 'm' share a stage; exactly `mstage` boundaries precede it.
    """
    internal = None if allow_empty else 1
    end = 0                                  # no stage before E's or after L's
    if D:
        pre = ["E"] + ["t"] * T  # then the MTP block at gap index len(pre)
        pre_caps = [end] + [internal] * len(pre)  # before E, after each pre token (the last: before 'm')
        pre_counts = _spread(draw, mstage, pre_caps, range(len(pre_caps)), rare=[0])
        # after the MTP block: gap before L (takes the rest), gap after L (trailing empty stages)
        post_counts = _spread(draw, n - 1 - mstage, [internal, end], [1, 0], rare=[1])
        tokens, counts = pre + ["m" * D, "L"], pre_counts + post_counts
    else:
        tokens = ["E"] + ["t"] * T + ["L"]
        caps = [end] + [internal] * (len(tokens) - 1) + [end]
        last = len(tokens)  # gap index after L
        order = [0, last] + list(range(1, last))  # the gap before L takes the rest
        counts = _spread(draw, n - 1, caps, order, rare=[0, last])
    stages: list[list[str]] = [[]]
    for gap, token in enumerate(tokens):
        stages.extend([] for _ in range(counts[gap]))
        stages[-1].extend(token)
    stages.extend([] for _ in range(counts[len(tokens)]))
    grid = tuple(tuple(s) for s in stages)
    assert len(grid) == n and (mstage is None or "m" in grid[mstage]), (grid, n, mstage)
    return grid


def _v_list(T, D, P, vpp, allow_empty, placement) -> list[int]:
    """V values (vpp fixed int, or 1..4; 1 when P = 1) that admit a valid grid for P."""
    vs = [vpp] if isinstance(vpp, int) else [1] if P == 1 else range(1, _MAX_V + 1)
    return [V for V in vs if _mtp_stages(T, D, P, V, allow_empty, placement)]


def _p_list(T, D, vpp, allow_empty, placement) -> list[int]:
    vpp = vpp if isinstance(vpp, int) else None
    return [P for P in range(1, _MAX_P + 1) if _v_list(T, D, P, vpp, allow_empty, placement)]


@st.composite
def _grids(draw, T, D, pp, vpp, allow_empty, placement):
    opts = (allow_empty, placement)
    if isinstance(pp, st.SearchStrategy):
        P = draw(pp)
        assume(isinstance(P, int) and not isinstance(P, bool) and P >= 1)
    elif pp is None:  # P then V: each shrinks on its own (a joint (P, V) draw gets stuck in local minima)
        P = draw(st.sampled_from(_p_list(T, D, vpp, *opts)))
    else:
        P = pp
    if isinstance(vpp, st.SearchStrategy):
        V = draw(vpp)
        assume(isinstance(V, int) and not isinstance(V, bool) and V >= 1)
        assume(_mtp_stages(T, D, P, V, *opts))
    else:
        vs = _v_list(T, D, P, vpp, *opts)
        assume(vs)
        V = draw(st.sampled_from(vs))
    mstage = draw(st.sampled_from(_mtp_stages(T, D, P, V, *opts)))
    return _build(draw, T, D, P * V, mstage, allow_empty), P, V


def stage_grids(num_layers: int, mtp_num_layers: int, pp: SizeArg = None, vpp: SizeArg = None, *,
                allow_empty_stages: bool = True, mtp_placement: Optional[str] = None,
                allow_displaced_ends: bool = False) -> st.SearchStrategy:
    """Valid layouts as ``(grid, pp, vpp)``; ``grid`` is a tuple of ``pp * vpp`` flat stages (tuples of symbols).

    Every grid passes ``PipelineLayout.from_string(plain(grid), pp, num_layers, mtp_num_layers)`` and P = 1
    implies V = 1. Covered: empty stages, E-only and L-only stages, decoder layers distributed arbitrarily, MTP
    (when ``mtp_num_layers > 0``) on the last virtual stage of any pp rank 1..P-1 (any rank if P = 1), alone or
    sharing a stage with the last decoder layers, followed only by empty stages up to L; with the loss when on
    rank P-1.

    * ``pp``, ``vpp``: int (fixed), None (P drawn from 1..8, V from 1..4) or a strategy of ints.
    * ``allow_empty_stages``: False gives only grids without empty stages (fewer sizes are then possible).
    * ``mtp_placement``: None (any), ``"standalone"`` (MTP not on the loss rank: Megatron's
      ``config.mtp_standalone``, needs P >= 3) or ``"with_loss"`` (MTP in the loss stage).
    * ``allow_displaced_ends``: deprecated, ignored (a ``DeprecationWarning`` when true). Empty stages before
      E's stage or after L's stage (``"|E|t|L"``, ``"E|tm|L|"``) pass Megatron's validator (it checks E/L in
      flattened order only), but Megatron embeds on the first stage and computes the loss on the last whatever
      the string says, so `trainerkit.layout` now rejects them and no strategy generates them.

    Shrinks toward few stages (P = 1, V = 1), MTP with the loss, E and L in the first and last stage, and
    decoder layers packed together.
    """
    T = _check_count("num_layers", num_layers, 1)
    D = _check_count("mtp_num_layers", mtp_num_layers, 0)
    _check_size("pp", pp)
    _check_size("vpp", vpp)
    if mtp_placement not in (None,) + MTP_PLACEMENTS:
        raise InvalidArgument(f"mtp_placement must be None, 'standalone' or 'with_loss', got {mtp_placement!r}")
    if mtp_placement is not None and D == 0:
        raise InvalidArgument(f"mtp_placement={mtp_placement!r} needs mtp_num_layers > 0")
    if allow_displaced_ends:
        # kept so existing callers still work; every example must pass PipelineLayout.from_string
        warnings.warn("stage_grids/layouts: allow_displaced_ends is deprecated and ignored: layouts with empty "
                      "stages before E or after L are invalid (Megatron embeds on the first stage and computes "
                      "the loss on the last)", DeprecationWarning, stacklevel=3)
    opts = (bool(allow_empty_stages), mtp_placement)
    fixed = isinstance(pp, int) and not isinstance(vpp, st.SearchStrategy)
    if (fixed and not _v_list(T, D, pp, vpp, *opts)) or (pp is None and not _p_list(T, D, vpp, *opts)):
        hint = " (P=1 requires V=1)" if pp == 1 and isinstance(vpp, int) and vpp > 1 else ""
        hint += " ('standalone' needs P >= 3)" if mtp_placement == "standalone" else ""
        raise InvalidArgument(f"no valid layout with num_layers={T}, mtp_num_layers={D}, pp={pp!r}, vpp={vpp!r}, "
                              f"mtp_placement={mtp_placement!r}, allow_empty_stages={allow_empty_stages}{hint}")
    return _grids(T, D, pp, vpp, bool(allow_empty_stages), mtp_placement)


