"""Tests for harness/strategies/: the public hypothesis strategies for pipeline layouts.

They check that every generated layout is what it claims (valid, right placement, every spelling parses to its
grid, every invalid layout breaks its rule), that the strategies keep reaching every feature (so coverage cannot
be lost silently), that they shrink to minimal layouts, and fuzz `trainerkit.layout` with arbitrary text.

Profiles: HYPOTHESIS_PROFILE=ci (default, modest example counts) or HYPOTHESIS_PROFILE=fuzz (many examples),
e.g. ``HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest -q tests/test_strategies.py``.
"""
import os
import re
import time

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from harness.strategies import INVALID_RULES, invalid_layouts, layout_text, layouts, plain, spellings, stage_grids
from trainerkit.layout import LayoutError, PipelineLayout, parse_layout
from trainerkit.schedule import check_sizes

# "ci" keeps hypothesis' default example count, so loading it leaves other modules' tests unchanged
settings.register_profile("ci", deadline=None, max_examples=100, print_blob=True)
settings.register_profile("fuzz", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
_SCALE = max(1, settings.default.max_examples // 100)


def examples(n: int) -> int:
    """Per-test example count: n under the ci profile, scaled up under fuzz."""
    return n * _SCALE


def search(max_examples=2000, shrink=True):
    """Settings for `find`: deterministic, no example database, enough tries to reach rare features;
    shrink=False stops at the first example found (coverage checks need no minimal example)."""
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), phases=phases)


def reach(strategy, condition, max_examples=2000):
    """Assert that `strategy` produces an example satisfying `condition` (no shrinking)."""
    return find(strategy, condition, settings=search(max_examples, shrink=False))


def megatron_parse(text: str) -> list[list[str]]:
    """Megatron's `PipelineParallelLayerLayout.parse_str_to_list` string path, re-implemented from its documented
    steps (/work/shared/megatron-semantics.md 1.1): drop commas, one pass of '(..)*n', one pass of 'x*n', split."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda mt: mt.group(1) * int(mt.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda mt: mt.group(1) * int(mt.group(2)), s)
    stages = [list(x) for x in s.split("|")]
    assert all(c in "EtmL" for stage in stages for c in stage), f"invalid layer type in {text!r} -> {s!r}"
    return stages


def validated(text, pp, T, D):
    return PipelineLayout.from_string(text, pp, T, D)


# --- valid grids ----------------------------------------------------------------------------------------------

@st.composite
def grid_args(draw):
    """(num_layers, mtp_num_layers, kwargs) for stage_grids, any combination that is possible."""
    T, D = draw(st.integers(1, 12)), draw(st.integers(0, 3))
    placement = draw(st.sampled_from([None, "standalone", "with_loss"])) if D else None
    allow_empty = draw(st.booleans())
    kw = dict(allow_empty_stages=allow_empty, mtp_placement=placement)
    if not allow_empty:  # few decoder layers cannot fill many stages: fix small sizes so a grid exists
        kw.update(pp=draw(st.integers(3 if placement == "standalone" else 1, 3)), vpp=1)
    return T, D, kw


def check_grid(grid, P, V, T, D, kw):
    assert len(grid) == P * V and (P > 1 or V == 1)
    check_sizes(P, V, P * max(V, 1))  # the schedule accepts the size pair
    lay = validated(plain(grid), P, T, D)
    assert lay.stages == grid and lay.virtual_pipeline_model_parallel_size == V
    if D:
        m = lay.mtp_stage
        pp, vpp = lay.rank_of(m)
        assert vpp == V - 1 and (pp > 0 or P == 1)
        assert all(not any(s in "tE" for s in grid[i]) for i in range(m + 1, len(grid)))
        if kw.get("mtp_placement") == "standalone":
            assert lay.mtp_standalone and pp not in (0, P - 1)
        elif kw.get("mtp_placement") == "with_loss":
            assert not lay.mtp_standalone and lay.mtp_stage == lay.loss_stage == len(grid) - 1
    else:
        assert lay.mtp_stage is None and not lay.mtp_standalone
    if not kw.get("allow_empty_stages", True):
        assert all(grid)
    assert "E" in grid[0] and "L" in grid[-1]
    return lay


@settings(max_examples=examples(100), deadline=None)
@given(st.data())
def test_stage_grids_are_valid_and_placed_as_requested(data):
    T, D, kw = data.draw(grid_args())
    grid, P, V = data.draw(stage_grids(T, D, **kw))
    check_grid(grid, P, V, T, D, kw)


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_stage_grids_sizes_fixed_or_drawn_from_strategies(data):
    grid, P, V = data.draw(stage_grids(6, 1, pp=4, vpp=2))
    assert (P, V) == (4, 2)
    check_grid(grid, P, V, 6, 1, {})
    grid, P, V = data.draw(stage_grids(6, 2, pp=st.integers(1, 3), vpp=st.sampled_from([1, 3])))
    assert P in (1, 2, 3) and V in (1, 3) and (P > 1 or V == 1)
    check_grid(grid, P, V, 6, 2, {})
    grid, P, V = data.draw(stage_grids(2, 1, vpp=3, mtp_placement="standalone"))
    assert V == 3 and P >= 3
    check_grid(grid, P, V, 2, 1, {"mtp_placement": "standalone"})


@pytest.mark.parametrize("args, kw", [
    ((4, 1), dict(pp=2, mtp_placement="standalone")),  # standalone needs P >= 3
    ((4, 0), dict(mtp_placement="with_loss")),  # placement without MTP
    ((4, 1), dict(mtp_placement="colocated")),
    ((4, 0), dict(pp=1, vpp=2)),  # schedule.check_sizes: P = 1 requires V = 1
    ((1, 0), dict(pp=8, allow_empty_stages=False)),  # 1 layer cannot fill 8 stages
    ((0, 0), {}), ((4, -1), {}), ((4, 0), dict(pp=0)), ((4, 0), dict(vpp=True)),
])
def test_stage_grids_rejects_impossible_requests(args, kw):
    with pytest.raises(InvalidArgument):
        stage_grids(*args, **kw)


# --- spellings ------------------------------------------------------------------------------------------------

def repetitive_grids():
    """Grids with repeated stage groups (what '(..)*n' and nesting are for), like the DeepSeek-V3 layouts."""
    unit = st.lists(st.lists(st.sampled_from("tttm"), max_size=3).map(tuple), min_size=1, max_size=3)
    return st.tuples(st.lists(st.sampled_from("Ett"), max_size=4).map(tuple), unit, st.integers(1, 12),
                     st.lists(st.sampled_from("tmL"), max_size=3).map(tuple)).map(
        lambda a: (a[0],) + tuple(a[1]) * a[2] + (a[3],))


any_grids = st.lists(st.lists(st.sampled_from("EtmL"), max_size=4).map(tuple), min_size=1, max_size=12).map(tuple)


@settings(max_examples=examples(100), deadline=None)
@given(st.data(), st.one_of(any_grids, repetitive_grids()), st.booleans())
def test_every_spelling_parses_to_its_grid(data, grid, compat):
    text = data.draw(spellings(grid, megatron_compatible=compat))
    assert parse_layout(text) == [list(s) for s in grid], text
    if compat:
        assert megatron_parse(text) == [list(s) for s in grid], text
        assert not re.search(r"\([^)]*\(", text), f"nested group in {text!r}"
        assert not re.search(r"\)(?!\*\d)", text), f"group without count in {text!r}"


@settings(max_examples=examples(80), deadline=None)
@given(st.data())
def test_spellings_of_valid_grids_validate_identically_and_round_trip(data):
    T, D, kw = data.draw(grid_args())
    grid, P, V = data.draw(stage_grids(T, D, **kw))
    text = data.draw(spellings(grid, megatron_compatible=data.draw(st.booleans())))
    lay, ref = validated(text, P, T, D), validated(plain(grid), P, T, D)
    assert lay.stages == ref.stages == grid
    assert (lay.mtp_stage, lay.mtp_standalone, lay.virtual_pipeline_model_parallel_size) == \
        (ref.mtp_stage, ref.mtp_standalone, V)
    assert lay.canonical() == plain(grid)
    assert validated(lay.canonical(), P, T, D).stages == lay.stages
    assert lay.pretty() == ref.pretty()


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_layouts_are_valid(data):
    T, D, kw = data.draw(grid_args())
    compat = data.draw(st.booleans())
    text, P = data.draw(layouts(T, D, megatron_compatible=compat, **kw))
    lay = validated(text, P, T, D)
    check_grid(lay.stages, P, lay.virtual_pipeline_model_parallel_size, T, D, kw)
    if compat:
        assert megatron_parse(text) == [list(s) for s in lay.stages]


def test_megatron_parse_emulation_matches_documented_behaviour():
    assert megatron_parse("Et*3|(tt|)*29,m|L") == [list("Ettt")] + [["t", "t"]] * 29 + [["m"], ["L"]]
    assert megatron_parse("E|t|t*2|t||(t|)*2,t*2,L") == parse_layout("E|t|t*2|t||(t|)*2,t*2,L")
    with pytest.raises(AssertionError):  # nesting is what megatron_compatible avoids
        megatron_parse("((t|)*2t|)*2L")
    with pytest.raises(AssertionError):  # so are bare groups
        megatron_parse("(t|)tL")


def test_module_docstring_example_runs():
    import textwrap

    import harness.strategies as module
    doc = module.__doc__
    code = textwrap.dedent(doc[doc.index("Example::") + len("Example::"):doc.index("Sizes:")])
    namespace = {"parse_layout": parse_layout}
    exec(code.replace("        ...", "        assert parse_layout(text)"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert len(tests) == 2
    for test in tests:
        settings(max_examples=10, deadline=None)(test)()


def test_spellings_rejects_bad_grids():
    for bad in ([], [["E", "x"]], 3, [["E"], None]):
        with pytest.raises(InvalidArgument):
            spellings(bad)


# --- invalid layouts ------------------------------------------------------------------------------------------

# rule -> substrings of trainerkit.layout's message (None: a syntax error, identified by its position)
KEYWORDS = {
    "syntax": None,
    "t_count": ["decoder layers 't' but num_layers="],
    "m_count": ["MTP layers 'm' but mtp_num_layers="],
    "missing_E": ["exactly one 'E'", "found 0"],
    "two_E": ["exactly one 'E'", "found 2"],
    "E_not_first": ["'E' must be the first"],
    "missing_L": ["exactly one 'L'", "found 0"],
    "two_L": ["exactly one 'L'", "found 2"],
    "L_not_last": ["'L' must be the last"],
    "t_after_m": ["must precede MTP"],
    "m_split": ["must all be in one stage"],
    "m_not_last_vpp": ["must be the last virtual stage"],
    "m_on_pp0": ["must not be on pp rank 0"],
    "stages_not_divisible": ["not divisible"],
}


def test_keywords_cover_every_rule():
    assert set(KEYWORDS) == set(INVALID_RULES)


@settings(max_examples=examples(100), deadline=None)
@given(st.data())
def test_invalid_layouts_break_the_named_rule(data):
    T, D = data.draw(st.integers(1, 10)), data.draw(st.integers(0, 3))
    pp = data.draw(st.one_of(st.none(), st.integers(1, 6), st.just(st.integers(1, 4))))
    text, P, rule = data.draw(invalid_layouts(T, D, pp))
    assert rule in INVALID_RULES and (not isinstance(pp, int) or P == pp)
    with pytest.raises(LayoutError) as info:
        validated(text, P, T, D)
    err = info.value
    if KEYWORDS[rule] is None:
        assert err.position is not None, str(err)
    else:
        assert err.position is None and all(k in err.problem for k in KEYWORDS[rule]), (rule, str(err))


@pytest.mark.parametrize("rule", sorted(INVALID_RULES))
def test_every_invalid_rule_is_reachable(rule):
    text, P, got = reach(invalid_layouts(4, 2), lambda x: x[2] == rule, 500)
    assert got == rule
    with pytest.raises(LayoutError):
        validated(text, P, 4, 2)


def test_invalid_layouts_only_draw_possible_rules():
    assert reach(invalid_layouts(3, 0, pp=1), lambda x: True)[2] in INVALID_RULES
    for rules, args in [(["m_split"], (3, 1)), (["m_on_pp0"], (3, 0)), (["stages_not_divisible"], (3, 1, 1)),
                        (["no_such_rule"], (3, 1)), ([], (3, 1))]:
        with pytest.raises(InvalidArgument):
            invalid_layouts(*args, rules=rules)


# --- fuzzing the parser ---------------------------------------------------------------------------------------

@settings(max_examples=examples(300), deadline=None)
@given(layout_text(), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2))
def test_parser_raises_only_layout_error(text, pp, T, D):
    start = time.perf_counter()
    for parse in (parse_layout, lambda s: PipelineLayout.from_string(s, pp, T, D)):
        try:
            parse(text)
        except LayoutError as err:
            assert "\n" not in str(err) and str(err).startswith("layout ")
    assert time.perf_counter() - start < 5, f"parser took too long on {text!r}"


def test_superscript_count_raises_layout_error():
    with pytest.raises(LayoutError):
        parse_layout("Et*\u00b2|L")


def test_huge_count_raises_layout_error():
    with pytest.raises(LayoutError):
        parse_layout("Et*" + "1" * 5000 + "|L")


# --- coverage: the strategies keep reaching every feature ------------------------------------------------------

def stages_of(x):
    return parse_layout(x[0])


def mtp_lay(x, T=4, D=1):
    return validated(x[0], x[1], T, D)


LAYOUT_FEATURES = {
    "empty stage": lambda x: [] in stages_of(x),
    "E-only stage": lambda x: ["E"] in stages_of(x),
    "L-only stage": lambda x: ["L"] in stages_of(x),
    "standalone MTP": lambda x: mtp_lay(x).mtp_standalone,
    "MTP with the loss": lambda x: not mtp_lay(x).mtp_standalone,
    "MTP sharing a stage with decoder layers, standalone":
        lambda x: mtp_lay(x).mtp_standalone and "t" in stages_of(x)[mtp_lay(x).mtp_stage],
    "MTP alone in its stage": lambda x: stages_of(x)[mtp_lay(x).mtp_stage] == ["m"],
    "V>1": lambda x: len(stages_of(x)) > x[1],
    "V>1 standalone": lambda x: len(stages_of(x)) > x[1] and mtp_lay(x).mtp_standalone,
    "P=1": lambda x: x[1] == 1,
    "P=8": lambda x: x[1] == 8,
    "run length": lambda x: re.search(r"[Etm|]\*\d", x[0]),
    "repeated group": lambda x: re.search(r"\)\*([2-9]|\d\d)", x[0]),
    "nested group": lambda x: "((" in x[0],
    "commas": lambda x: "," in x[0],
    "bare group": lambda x: re.search(r"\)(?!\*)", x[0]),
}


@pytest.mark.parametrize("feature", list(LAYOUT_FEATURES))
def test_layouts_reach(feature):
    reach(layouts(4, 1), LAYOUT_FEATURES[feature])


def test_options_reach():
    grids = stage_grids(6, 2, allow_empty_stages=False)
    reach(grids, lambda g: g[0][0] == ("E",) and g[0][-1] == ("L",) and g[2] > 1)
    reach(grids, lambda g: validated(plain(g[0]), g[1], 6, 2).mtp_standalone)


def test_spellings_reach_the_compact_megatron_style():
    grid = (("E", "t", "t", "t"),) + (("t", "t"),) * 29 + (("m",), ("L",))
    for compat in (False, True):
        text = reach(spellings(grid, megatron_compatible=compat), lambda s: len(s) < 20)
        assert parse_layout(text) == megatron_parse(text) == [list(s) for s in grid]


# --- shrinking ------------------------------------------------------------------------------------------------

def test_shrinks_to_the_simplest_layout():
    assert find(layouts(4, 1), lambda x: True, settings=search()) == ("EttttmL", 1)


def test_shrinks_standalone_mtp_to_three_stages():
    # standalone needs MTP on a rank other than 0 and P-1, so P >= 3 stages: E...|m|L is the least
    text, P = find(layouts(4, 1), lambda x: mtp_lay(x).mtp_standalone, settings=search())
    assert P == 3 and len(parse_layout(text)) == 3
    assert text == "Etttt|m|L"


def test_shrinks_interleaved_to_four_stages():
    text, P = find(layouts(4, 1), lambda x: len(parse_layout(x[0])) > x[1], settings=search())
    assert (P, len(parse_layout(text))) == (2, 4)  # V > 1 needs P > 1: P = 2, V = 2
    assert not re.search(r"[*(,]", text)


def test_shrinks_empty_stage_to_smallest_p_then_v():
    # P shrinks first, then V: (2, 2); a P = 2, V = 1 layout has no room for an empty stage ('E...|...mL')
    text, P = find(layouts(4, 1), lambda x: [] in parse_layout(x[0]), settings=search())
    assert (P, len(parse_layout(text))) == (2, 4)


def test_shrinks_spelling_to_plain():
    grid = (("E", "t", "t", "t"),) + (("t", "t"),) * 29 + (("m",), ("L",))
    small = (("E", "t"), ("t", "t"), ("t", "t"), ("m", "L"))
    assert find(spellings(small), lambda s: True, settings=search()) == "Et|tt|tt|mL"
    assert find(spellings(grid), lambda s: "(" in s, settings=search()) == "Et*3(|tt)*29|m|L"
