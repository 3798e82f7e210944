"""Hypothesis strategies for Megatron pipeline layouts (``pipeline_model_parallel_layout`` strings).

Public API for property tests of anything that consumes a layout: the parser and validator in
`trainerkit.layout`, schedules, the reference trainer, your own tooling. Layout semantics are Megatron-LM's
``PipelineParallelLayerLayout`` (see /work/shared/megatron-semantics.md, section 1): stages are joined by ``|``,
``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss; flat stage ``i`` runs on pp rank ``i % P``,
virtual stage ``i // P``.

Strategies (all shrink toward few stages, small P, V = 1, layers packed into few stages, MTP co-located with the
loss and the plain ``|``-joined spelling):

* `stage_grids` -> ``(grid, pp, vpp)``: a valid layout as a tuple of flat stages (tuples of symbols).
* `spellings` -> strings that parse to exactly a given grid (plain, ``t*3``, ``(tt|)*29``, nested groups, commas).
* `layouts` -> ``(text, pp)``: `stage_grids` + `spellings`; V is implied by the number of stages.
* `invalid_layouts` -> ``(text, pp, rule)``: a layout breaking exactly one named rule (see `INVALID_RULES`).
* `layout_text` -> arbitrary text over the layout alphabet plus noise, for fuzzing parsers.

Every valid layout also satisfies `trainerkit.schedule.check_sizes` for the size pair: P = 1 implies V = 1
(interleaving additionally needs ``num_microbatches % P == 0``, which is the caller's choice of M).

Example::

    from hypothesis import given
    from harness.strategies import layouts, stage_grids, spellings
    from trainerkit.layout import PipelineLayout

    @given(layouts(num_layers=8, mtp_num_layers=1, mtp_placement="standalone"))
    def test_standalone_mtp_is_not_on_the_loss_rank(case):
        text, pp = case
        lay = PipelineLayout.from_string(text, pp, 8, 1)
        assert lay.mtp_standalone and lay.rank_of(lay.mtp_stage)[0] not in (0, pp - 1)

    @given(stage_grids(4, 0, pp=2, vpp=2, allow_empty_stages=False).flatmap(
        lambda g: spellings(g[0], megatron_compatible=True)))
    def test_megatron_style_spellings(text):
        ...

Sizes: ``pp``/``vpp`` accept an int (fixed), None (drawn: P in 1..8, V in 1..4, P = 1 forces V = 1) or a
strategy of ints (drawn, combinations that cannot hold a valid layout are rejected). Impossible fixed requests
(e.g. ``mtp_placement="standalone"`` with ``pp=2``, which needs P >= 3) raise hypothesis' ``InvalidArgument``.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Sequence, Union

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

__all__ = ["INVALID_RULES", "MTP_PLACEMENTS", "Grid", "stage_grids", "spellings", "layouts", "invalid_layouts",
           "layout_text", "plain"]

Grid = tuple  # tuple[tuple[str, ...], ...]: flat stages in global order (vpp-major, then pp)
SizeArg = Union[None, int, st.SearchStrategy]

MTP_PLACEMENTS = ("standalone", "with_loss")
_MAX_P, _MAX_V = 8, 4
_SYMBOLS = frozenset("EtmL")
_MAX_UNIT = 64  # longest repeated unit considered for a '(..)*n' group

# rule -> what the layout breaks (messages of trainerkit.layout name the rule in these terms)
INVALID_RULES = {
    "syntax": "not a well-formed layout string (unknown character, whitespace, '*0', '()', unbalanced "
              "parentheses, missing or chained count, stray digit)",
    "t_count": "number of 't' differs from num_layers",
    "m_count": "number of 'm' differs from mtp_num_layers",
    "missing_E": "no 'E'",
    "two_E": "two 'E'",
    "E_not_first": "'E' is not the first layer in flattened order",
    "missing_L": "no 'L'",
    "two_L": "two 'L'",
    "L_not_last": "'L' is not the last layer in flattened order",
    "t_after_m": "a decoder layer 't' comes after the first MTP layer 'm'",
    "m_split": "MTP layers spread over two stages",
    "m_not_last_vpp": "MTP stage is not the last virtual stage of its pp rank",
    "m_on_pp0": "MTP stage on pp rank 0 although P > 1",
    "stages_not_divisible": "number of stages not divisible by P",
}


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


# ------------------------------------------------------------------------------------------------ spellings

def _repeats(s: str, i: int) -> list[tuple[int, int]]:
    """(unit length, max repeat count >= 2) for units s[i:i+l] repeated back to back from i."""
    out = []
    for length in range(1, min(_MAX_UNIT, (len(s) - i) // 2) + 1):
        unit, k = s[i:i + length], 1
        while s.startswith(unit, i + k * length):
            k += 1
        if k >= 2:
            out.append((length, k))
    return out


def _items(draw, s: str, depth: int, compat: bool, max_depth: int, commas: bool) -> list[str]:
    """Top-level items (atom, atom*n, (..)*n, (..)) whose expansion is exactly s."""
    items, i = [], 0
    group_ok = depth < (1 if compat else max_depth)
    while i < len(s):
        kind = draw(st.sampled_from(("literal", "run", "group") if group_ok else ("literal", "run")))
        if kind == "run":
            c = s[i]
            r = len(s) - i - len(s[i:].lstrip(c))
            k = r if r == 1 or draw(st.integers(0, 3)) < 3 else draw(st.integers(1, r))  # mostly the whole run
            items.append(f"{c}*{k}")
            i += k
        elif kind == "group":
            reps = _repeats(s, i)
            if reps and draw(st.integers(0, 3)) < 3:
                length, kmax = draw(st.sampled_from(reps))
                k = draw(st.integers(2, kmax))
            else:  # a group used once: '(..)*1', or bare '(..)' where the parser allows it
                length, k = draw(st.integers(1, min(_MAX_UNIT, len(s) - i))), 1
            inner = _join(draw, _items(draw, s[i:i + length], depth + 1, compat, max_depth, commas), commas)
            bare = k == 1 and not compat and draw(st.booleans())
            items.append(f"({inner})" + ("" if bare else f"*{k}"))
            i += length * k
        else:
            items.append(s[i])
            i += 1
    return items


def _join(draw, items: list[str], commas) -> str:
    """Join items, with 0-2 cosmetic commas at some item boundaries (also leading/trailing) when `commas`."""
    if not commas or not draw(st.booleans()):
        return "".join(items)
    out = []
    for item in items + [""]:
        n = draw(st.integers(0, 5))
        out.append("," * max(0, n - 3) + item)
    return "".join(out)


def _compact(s: str, groups: int, memo: dict) -> list[str]:
    """Greedy short spelling of s (Megatron style, e.g. 'Et*3(|tt)*29|m|L'), groups nested `groups` deep."""
    key = (s, groups)
    if key in memo:
        return memo[key]
    items, i = [], 0
    while i < len(s):
        best = (0, 1, s[i])  # (characters saved, characters covered, item)
        r = len(s) - i - len(s[i:].lstrip(s[i]))
        if r >= 3:
            item = f"{s[i]}*{r}"
            best = max(best, (r - len(item), r, item))
        if groups:
            for length, k in _repeats(s, i):
                if length > 1:
                    item = "(" + "".join(_compact(s[i:i + length], groups - 1, memo)) + f")*{k}"
                    best = max(best, (length * k - len(item), length * k, item))
        items.append(best[2])
        i += best[1]
    memo[key] = items
    return items


@st.composite
def _spelling_items(draw, s, compat, max_depth, commas):
    style = draw(st.sampled_from(("plain", "random", "compact")))  # shrinks to the plain spelling
    if style == "plain":
        return list(s)
    if style == "compact":
        return list(_compact(s, 1 if compat else max_depth, {}))
    return _items(draw, s, 0, compat, max_depth, commas)


def _grid_string(grid) -> str:
    try:
        stages = [list(stage) for stage in grid]
    except TypeError:
        raise InvalidArgument(f"grid must be an iterable of stages (iterables of symbols), got {grid!r}") from None
    bad = {sym for stage in stages for sym in stage if sym not in _SYMBOLS}
    if bad or not stages:
        raise InvalidArgument(f"grid must be a non-empty sequence of stages of symbols E, t, m, L; got {grid!r}")
    return plain(stages)


def spellings(grid, *, megatron_compatible: bool = False, commas: bool = True,
              max_depth: int = 3) -> st.SearchStrategy:
    """Strings that parse (``trainerkit.layout.parse_layout``) to exactly ``grid``.

    Forms: the plain spelling (stages joined by '|'; the shrink target), a greedy compact spelling in Megatron's
    style (``Et*3(|tt)*29|m|L``), and random mixes of: run lengths ``t*3`` (also ``|*2`` and ``x*1``), repeated
    groups ``(tt|)*29``, groups used once (``(..)*1``, bare ``(..)``), nested groups up to
    ``max_depth`` (``((t|)*2t|)*2``) and, if ``commas``, cosmetic commas at item boundaries.

    ``megatron_compatible=True`` keeps to what Megatron's regex expansion (``parse_str_to_list``) handles: no
    nested groups and no bare groups (every group carries ``*n``); counts are never 0 and never chained, so the
    text expands to the same grid under Megatron's parser (checked against a re-implementation of its regex
    steps in tests/test_strategies.py).
    ``grid``: a non-empty sequence of stages, each a sequence (or string) of symbols E, t, m, L; any grid works,
    valid layout or not.
    """
    s = _grid_string(grid)
    _check_count("max_depth", max_depth, 1)
    return _spelling(s, bool(megatron_compatible), max_depth, bool(commas))


@st.composite
def _spelling(draw, s, compat, max_depth, commas):
    return _join(draw, draw(_spelling_items(s, compat, max_depth, commas)), commas)


@st.composite
def _layouts(draw, grids, compat, commas):
    grid, P, _V = draw(grids)
    return draw(_spelling(plain(grid), compat, 3, commas)), P


def layouts(num_layers: int, mtp_num_layers: int, pp: SizeArg = None, vpp: SizeArg = None, *,
            allow_empty_stages: bool = True, mtp_placement: Optional[str] = None,
            allow_displaced_ends: bool = False, megatron_compatible: bool = False,
            commas: bool = True) -> st.SearchStrategy:
    """Valid layout strings as ``(text, pp)``: a `stage_grids` grid in one of its `spellings`.

    ``PipelineLayout.from_string(text, pp, num_layers, mtp_num_layers)`` accepts every example; V is
    ``len(stages) // pp``. Keyword arguments are those of `stage_grids` and `spellings`.
    """
    grids = stage_grids(num_layers, mtp_num_layers, pp, vpp, allow_empty_stages=allow_empty_stages,
                        mtp_placement=mtp_placement, allow_displaced_ends=allow_displaced_ends)
    return _layouts(grids, bool(megatron_compatible), bool(commas))


# ------------------------------------------------------------------------------------------ invalid layouts

_RULE_MIN_P = {"m_split": 3, "m_not_last_vpp": 2, "m_on_pp0": 2, "stages_not_divisible": 2}
_RULE_MIN_D = {"t_after_m": 1, "m_split": 2, "m_not_last_vpp": 1, "m_on_pp0": 1}

# Inserted as an item of a valid spelling, each of these makes it malformed whatever surrounds it.
_BREAKERS = ["x", "T", "M", "e", "l", "-", "[", "]", "+", "/", "\u03c4", "\u00e9", "\x00", " ", "\t", "\n",
             "\u00a0", "()", "(", ")", "*", "*0", "t*0", "t*2*3", "t*", ",7", ",*2", "(t)*", "t*1000001"]


def _feasible_rules(T: int, D: int, P: int, rules: Sequence[str]) -> list[str]:
    return [r for r in rules if P >= _RULE_MIN_P.get(r, 1) and D >= _RULE_MIN_D.get(r, 0)]


def _sym_positions(s: str) -> list[int]:
    return [i for i, c in enumerate(s) if c != "|"]


def _insert(s: str, p: int, c: str) -> str:
    return s[:p] + c + s[p:]


def _remove(s: str, c: str) -> str:
    i = s.index(c)
    return s[:i] + s[i + 1:]


def _base(draw, T, D, P, V, mstage="legal"):
    if mstage == "legal":
        mstage = draw(st.sampled_from(_mtp_stages(T, D, P, V, True, None)))
    return plain(_build(draw, T, D, P * V, mstage, True))


@st.composite
def _invalid(draw, T, D, pp, rules):
    if isinstance(pp, int):
        P = pp
        rule = draw(st.sampled_from(_feasible_rules(T, D, P, rules)))
    elif pp is None:
        rule = draw(st.sampled_from(_feasible_rules(T, D, _MAX_P, rules)))
        P = draw(st.integers(_RULE_MIN_P.get(rule, 1), _MAX_P))
    else:
        P = draw(pp)
        assume(isinstance(P, int) and P >= 1)
        feasible = _feasible_rules(T, D, P, rules)
        assume(feasible)
        rule = draw(st.sampled_from(feasible))
    V = 1 if P == 1 else draw(st.integers(2 if rule == "m_not_last_vpp" else 1, _MAX_V))

    if rule == "t_count":
        other = draw(st.sampled_from([x for x in range(max(0, T - 3), T + 4) if x != T]))
        s = _base(draw, other, D, P, V)
    elif rule == "m_count":
        other = draw(st.sampled_from([x for x in range(0, D + 4) if x != D]))
        s = _base(draw, T, other, P, V)
    elif rule == "m_not_last_vpp":
        s = _base(draw, T, D, P, V, draw(st.integers(0, V - 2)) * P + draw(st.integers(1, P - 1)))
    elif rule == "m_on_pp0":
        s = _base(draw, T, D, P, V, (V - 1) * P)
    elif rule == "m_split":
        M = (V - 1) * P + draw(st.integers(1, P - 2))  # standalone: at least one stage follows
        stages = [list(x) for x in _build(draw, T, D, P * V, M, True)]
        target = draw(st.integers(M + 1, P * V - 1))  # empty stages and the final L stage follow M
        moved = draw(st.integers(1, D - 1))
        del stages[M][stages[M].index("m"):stages[M].index("m") + moved]
        stages[target][:0] = ["m"] * moved
        s = plain(stages)
    else:
        s = _base(draw, T, D, P, V)
        syms = _sym_positions(s)
        iE, iL = s.index("E"), s.index("L")
        if rule == "missing_E":
            s = _remove(s, "E")
        elif rule == "missing_L":
            s = _remove(s, "L")
        elif rule == "two_E":
            s = _insert(s, draw(st.integers(iE + 1, iL)), "E")
        elif rule == "two_L":
            s = _insert(s, draw(st.integers(iE + 1, iL)), "L")
        elif rule == "E_not_first":
            s = _remove(s, "E")  # put it back after the first remaining symbol, still before L
            s = _insert(s, draw(st.integers(_sym_positions(s)[0] + 1, s.index("L"))), "E")
        elif rule == "L_not_last":
            s = _remove(s, "L")  # put it back after E, before the last remaining symbol
            s = _insert(s, draw(st.integers(s.index("E") + 1, _sym_positions(s)[-1])), "L")
        elif rule == "t_after_m":
            last_t = max(i for i in syms if s[i] == "t")
            s = s[:last_t] + s[last_t + 1:]
            after_m = s.rindex("m") + 1
            s = _insert(s, draw(st.integers(after_m, s.index("L"))), "t")
        elif rule == "stages_not_divisible":
            for _ in range(draw(st.integers(1, P - 1))):
                s = _insert(s, draw(st.integers(0, len(s))), "|")
    items = draw(_spelling_items(s, False, 3, True))
    if rule == "syntax":  # one malformed item at a top-level item boundary
        breaker = draw(st.one_of(st.sampled_from(_BREAKERS),
                                 st.characters(exclude_characters="EtmL|()*,").filter(
                                     lambda c: not c.isdigit())))
        items.insert(draw(st.integers(0, len(items))), breaker)
    return _join(draw, items, True), P, rule


def invalid_layouts(num_layers: int, mtp_num_layers: int, pp: SizeArg = None, *,
                    rules: Optional[Iterable[str]] = None) -> st.SearchStrategy:
    """Invalid layouts as ``(text, pp, rule)``; each breaks exactly the one rule named (a key of
    `INVALID_RULES`), so ``PipelineLayout.from_string(text, pp, num_layers, mtp_num_layers)`` must raise
    ``LayoutError`` for that rule.

    Rules needing MTP or pipelining are drawn only when possible: ``t_after_m``, ``m_not_last_vpp`` and
    ``m_on_pp0`` need mtp_num_layers >= 1, ``m_split`` mtp_num_layers >= 2 and P >= 3, ``m_not_last_vpp`` /
    ``m_on_pp0`` / ``stages_not_divisible`` P >= 2 (and V >= 2 for ``m_not_last_vpp``). ``rules`` restricts
    the choice. Apart from the broken rule the layout is valid (and P = 1 implies V = 1).
    """
    T = _check_count("num_layers", num_layers, 1)
    D = _check_count("mtp_num_layers", mtp_num_layers, 0)
    _check_size("pp", pp)
    chosen = list(INVALID_RULES) if rules is None else list(rules)
    unknown = [r for r in chosen if r not in INVALID_RULES]
    if unknown or not chosen:
        raise InvalidArgument(f"unknown or no rules {unknown or chosen!r}; known: {list(INVALID_RULES)}")
    if not _feasible_rules(T, D, pp if isinstance(pp, int) else _MAX_P, chosen):
        raise InvalidArgument(f"none of the rules {chosen} can be broken alone with num_layers={T}, "
                              f"mtp_num_layers={D}, pp={pp!r}")
    return _invalid(T, D, pp, tuple(chosen))


# --------------------------------------------------------------------------------------------- fuzz text

_TOKENS = list("EtmL|()*,0123456789") + [" ", "t*2", "(t|)*3", "|*2", "*1000000", "((", "))", "\t", "x",
                                         "\u00b2", "\u0663", "\u00a0"]


def layout_text(max_size: int = 40) -> st.SearchStrategy:
    """Arbitrary text for fuzzing layout parsers: mostly layout alphabet and syntax ('E t m L | ( ) * ,',
    digits, small valid fragments such as 't*2' or '(t|)*3', a large count), plus whitespace, unicode digits
    ('\\u00b2', '\\u0663') and any other character. At most ``max_size`` pieces; shrinks toward ''."""
    _check_count("max_size", max_size, 0)
    piece = st.one_of(st.sampled_from(_TOKENS), st.characters())
    return st.lists(piece, max_size=max_size).map("".join)
