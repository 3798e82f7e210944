"""Spellings of a grid (`spellings`, `layouts`): plain, ``t*3``, ``(tt|)*29``, nested groups, commas."""
from __future__ import annotations

from typing import Optional

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from .grids import _MAX_UNIT, _SYMBOLS, SizeArg, _check_count, plain, stage_grids

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


