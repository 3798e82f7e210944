"""Layouts that break exactly one rule (`invalid_layouts`) and free text over the layout alphabet
(`layout_text`)."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from .grids import _MAX_P, _MAX_V, SizeArg, _build, _check_count, _check_size, _mtp_stages, plain
from .spellings import _join, _spelling_items

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

