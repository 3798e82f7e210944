"""Tests for trainerkit/layout.py (Megatron's PipelineParallelLayerLayout semantics, no torch)."""
import enum
import pickle

import pytest

from trainerkit.layout import SYMBOLS, LayoutError, PipelineLayout, parse_layout

E, t, m, L = "E", "t", "m", "L"
DSV3 = "Et*3|(tt|)*29,m|L"  # Megatron docs: DeepSeek-V3, 61 layers, 1 MTP layer
GOLDEN_LIST = [[E], [t], [t, t], [t], [], [t], [t], [t, t, L]]  # test_transformer_block.py::test_layout_layer_number


def layout(text, p, n, d=0):
    return PipelineLayout.from_string(text, p, n, d)


def error(fn, *args):
    with pytest.raises(LayoutError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("layout ")
    return info.value


# --- Megatron's documented examples -------------------------------------------------------------------------------

def test_dsv3_example_parses():
    assert parse_layout(DSV3) == [[E, t, t, t]] + [[t, t] for _ in range(29)] + [[m], [L]]


@pytest.mark.parametrize("p, v, rank", [(16, 2, (14, 1)), (8, 4, (6, 3))])
def test_dsv3_example_standalone_mtp(p, v, rank):
    lay = layout(DSV3, p, 61, 1)
    assert (lay.num_stages, lay.virtual_pipeline_model_parallel_size) == (32, v)
    assert lay.mtp_stage == 30 and lay.rank_of(30) == rank and lay.mtp_standalone
    assert lay.loss_stage == 31 and lay.rank_of(31) == (p - 1, v - 1)
    assert lay.last_decoder_stage == 29 and lay.decoder_layer_ids(29) == [59, 60]
    assert lay.mtp_layer_ids(30) == [0] and lay.mtp_layer_ids(29) == []


def test_dsv3_colocated_example():
    lay = layout("Et*2|(tt|)*29,t|mL", 16, 61, 1)
    assert lay.stages[0] == (E, t, t) and lay.stages[30] == (t,) and lay.stages[31] == (m, L)
    assert lay.mtp_stage == 31 and lay.rank_of(31) == (15, 1) and not lay.mtp_standalone
    assert lay.last_decoder_stage == 30 and lay.decoder_layer_ids(30) == [60]


@pytest.mark.parametrize("text, stages, mtp_stage, last_dec, standalone", [
    ("E|t*3|(t|)*5mL", [[E], [t] * 3] + [[t]] * 5 + [[m, L]], 7, 6, False),
    ("E|t*3|(t|)*4tm|L", [[E], [t] * 3] + [[t]] * 4 + [[t, m], [L]], 6, 6, True),
    ("E|t*3|(t|)*3tt|m|L", [[E], [t] * 3] + [[t]] * 3 + [[t, t], [m], [L]], 6, 5, True),
])
def test_mtp_doc_examples(text, stages, mtp_stage, last_dec, standalone):
    assert parse_layout(text) == stages
    lay = layout(text, 4, 8, 1)
    assert lay.virtual_pipeline_model_parallel_size == 2
    assert (lay.mtp_stage, lay.last_decoder_stage, lay.mtp_standalone) == (mtp_stage, last_dec, standalone)
    assert lay.rank_of(mtp_stage) == (mtp_stage % 4, 1)


def test_empty_stage_example():
    lay = layout("E|t|t*2|t||(t|)*2,t*2,L", 4, 8)
    assert [list(s) for s in lay.stages] == GOLDEN_LIST
    assert lay.decoder_layer_ids(4) == [] and lay.mtp_stage is None and not lay.mtp_standalone


# --- layer ids (Megatron's test_layout_layer_number golden) --------------------------------------------------------

MEGATRON_LAYER_NUMBERS = {0: [[], []], 1: [[1], [5]], 2: [[2, 3], [6]], 3: [[4], [7, 8]]}  # 1-based


@pytest.mark.parametrize("source", [
    GOLDEN_LIST,
    [["Embedding"], [" decoder "], ["DECODER", "t"], ["t"], [], ["t"], ["t"], ["t", "decoder", "loss"]],
    "E|t|t*2|t||(t|)*2,t*2,L",
])
def test_golden_layer_numbers(source):
    lay = layout(source, 4, 8)
    got = {pp: [lay.decoder_layer_ids(f) for f in lay.stages_of_rank(pp)] for pp in range(4)}
    assert got == {pp: [[n - 1 for n in cell] for cell in cells] for pp, cells in MEGATRON_LAYER_NUMBERS.items()}
    assert lay.embedding_stage == 0 and lay.loss_stage == 7 and lay.last_decoder_stage == 7


def test_list_input_text_is_canonical_and_enum_members_accepted():
    LayerType = enum.Enum("LayerType", "embedding decoder mtp loss")
    lay = layout([[LayerType.embedding, LayerType.decoder], [LayerType.mtp, LayerType.loss]], 2, 1, 1)
    assert lay.stages == ((E, t), (m, L)) and lay.text == "Et|mL" and lay.mtp_standalone is False
    assert layout(GOLDEN_LIST, 4, 8).text == "E|t|tt|t||t|t|ttL"
    assert set(SYMBOLS) == {E, t, m, L}


def test_list_input_errors():
    assert "unknown layer type 'T'" in str(error(parse_layout, [[E, "T"], [L]]))
    assert error(parse_layout, [[E, 3]]).position is None
    with pytest.raises(TypeError):
        parse_layout([E, L])
    with pytest.raises(TypeError):
        parse_layout(None)


def test_rank_mapping():
    lay = layout(DSV3, 8, 61, 1)
    assert lay.stages_of_rank(6) == [6, 14, 22, 30]
    for flat in range(lay.num_stages):
        assert lay.flat_index(*lay.rank_of(flat)) == flat
    assert lay.rank_of(9) == (1, 1) and lay.flat_index(1, 1) == 9
    for bad in (lambda: lay.rank_of(32), lambda: lay.rank_of(-1), lambda: lay.flat_index(8, 0),
                lambda: lay.flat_index(0, 4), lambda: lay.decoder_layer_ids(32)):
        with pytest.raises(IndexError):
            bad()


def test_multi_depth_mtp_ids():
    lay = layout("E|t*3|(t|)*4tmm|L", 4, 8, 2)
    assert lay.mtp_layer_ids(6) == [0, 1] and lay.decoder_layer_ids(6) == [7]
    assert all(lay.mtp_layer_ids(f) == [] for f in range(8) if f != 6)


def test_empty_stage_before_embedding_or_after_loss_is_rejected():
    """Megatron embeds on the first stage and computes the loss on the last whatever the string says, so an
    empty stage before E or after L would put them elsewhere than the grid shows: refused before any run."""
    with pytest.raises(LayoutError, match="before 'E'"):
        layout("|Et|tL", 3, 2)
    with pytest.raises(LayoutError, match="after 'L'"):
        layout("Et|tL|", 3, 2)


def test_mtp_on_single_rank_allowed():
    lay = layout("EtmL", 1, 1, 1)
    assert lay.mtp_stage == 0 and not lay.mtp_standalone


# --- grammar -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("((t|)*2t|)*2L", "t|t|t|t|t|t|L"),  # breaks Megatron's regex parser
    ("E(t(t|)*2|)*2L", "Ett|t||tt|t||L"),
    ("E|((t|)*2t|)*2mL", "E|t|t|t|t|t|t|mL"),
    ("(E(t)*2)|L", "Ett|L"),
    ("t|*3", "t|||"),
    ("Et*12|L", "E" + "t" * 12 + "|L"),
    (",E,,t,|,L,", "Et|L"),
    ("E|t*02|L", "E|tt|L"),
    ("", ""),
])
def test_grammar(text, expected):
    assert parse_layout(text) == [list(s) for s in expected.split("|")]


def test_nested_layout_validates():
    lay = layout("E|((t|)*2t|)*2mL", 4, 6, 1)
    assert lay.stages == layout("E|t|t|t|t|t|t|mL", 4, 6, 1).stages
    assert lay.decoder_layer_ids(6) == [5] and lay.mtp_stage == 7 and not lay.mtp_standalone


@pytest.mark.parametrize("text, position, problem", [
    ("Et*3|(tt|)*x", 10, "expected a repeat count after '*'"),
    ("Et*", 2, "expected a repeat count"),
    ("()", 0, "empty group"),
    ("E(t|())*2L", 4, "empty group"),
    ("Et*0|L", 3, "repeat count must be >= 1"),
    ("E|(t|)*00L", 7, "repeat count must be >= 1"),
    ("Et |L", 2, "whitespace"),
    ("E\tt|L", 1, "whitespace"),
    ("Etx|L", 2, "unknown character 'x'"),
    ("Et|T", 3, "unknown character 'T'"),
    ("(t|L", 0, "unclosed '('"),
    ("E(t(t|)*2|L", 1, "unclosed '('"),
    ("t)|L", 1, "unmatched ')'"),
    ("E|(t|)*2)L", 8, "unmatched ')'"),
    ("t*2*3", 3, "chained repeat counts"),
    ("Et*1,0|L", 5, "unexpected digit '0'"),  # Megatron strips commas first and reads 10
    ("Et,*2|L", 3, "'*' must directly follow"),
    ("*2", 0, "'*' must directly follow"),
    ("E|2", 2, "unexpected digit"),
    ("t*10000000", 1, "more than"),
])
def test_syntax_errors(text, position, problem):
    err = error(parse_layout, text)
    assert err.position == position
    assert str(err) == f"layout {text!r}: {err.problem} at position {position}"
    assert problem in err.problem


def test_documented_error_message():
    assert str(error(parse_layout, "Et*3|(tt|)*x")) == \
        "layout 'Et*3|(tt|)*x': expected a repeat count after '*' at position 10"


def test_error_survives_pickling():  # errors cross process boundaries in multiprocessing workers
    err = pickle.loads(pickle.dumps(error(parse_layout, "Et*3|(tt|)*x")))
    assert isinstance(err, LayoutError) and err.position == 10 and "position 10" in str(err)


def test_deep_nesting_is_a_layout_error():
    text = "(" * 200 + "t" + ")" * 200
    assert "nested deeper" in error(parse_layout, text).problem


def test_syntax_error_through_from_string():
    assert error(layout, "E|t*0|L", 3, 0).position == 4


# --- validation rules ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, p, n, d, fragments", [
    ("E|t|L", 2, 1, 0, ["3 stages are not divisible by pipeline_model_parallel_size=2"]),
    ("t|tL", 2, 2, 0, ["exactly one 'E'", "found 0"]),
    ("E|tE|t|L", 4, 2, 0, ["exactly one 'E'", "found 2", "0 (pp0/vpp0), 1 (pp1/vpp0)"]),
    ("tE|L", 2, 1, 0, ["'E' must be the first", "stage 0 (pp0/vpp0)"]),
    ("Et|t", 2, 2, 0, ["exactly one 'L'", "found 0"]),
    ("EtL|L", 2, 1, 0, ["exactly one 'L'", "found 2"]),
    ("EL|t", 2, 1, 0, ["'L' must be the last", "stage 0 (pp0/vpp0)"]),
    ("Et|tL", 2, 3, 0, ["has 2 decoder layers", "num_layers=3"]),
    ("Et|tL", 2, 2, 1, ["has 0 MTP layers", "mtp_num_layers=1"]),
    ("Et|tmL", 2, 2, 0, ["has 1 MTP layers", "mtp_num_layers=0"]),
    ("E|t|mt|L", 4, 2, 1, ["comes after the first MTP layer", "stage 2 (pp2/vpp0)"]),
    ("E|tm|t|L", 4, 2, 1, ["'t' in stage 2 (pp2/vpp0)", "first MTP layer in stage 1 (pp1/vpp0)"]),
    ("E|t|m|mL", 4, 1, 2, ["all be in one stage", "2 (pp2/vpp0), 3 (pp3/vpp0)"]),
    ("Et|m||L", 2, 1, 1, ["MTP stage 1 (pp1/vpp0) must be the last virtual stage", "vpp1"]),
    ("Et|t|m|L", 2, 2, 1, ["MTP stage 2 (pp0/vpp1) must not be on pp rank 0"]),  # Megatron misses this one
    ("Etm|L", 2, 1, 1, ["MTP stage 0 (pp0/vpp0) must not be on pp rank 0"]),
    ("EtL", 0, 1, 0, ["pipeline_model_parallel_size must be an integer >= 1"]),
    ("EtL", True, 1, 0, ["pipeline_model_parallel_size must be an integer >= 1"]),
    ("EL", 1, 0, 0, ["num_layers must be an integer >= 1"]),
    ("EtL", 1, 1, -1, ["mtp_num_layers must be an integer >= 0"]),
])
def test_validation_rules(text, p, n, d, fragments):
    err = error(layout, text, p, n, d)
    assert err.position is None and str(err).startswith(f"layout {text!r}: ")
    for fragment in fragments:
        assert fragment in str(err)


def test_direct_construction_is_validated():
    with pytest.raises(LayoutError, match="virtual_pipeline_model_parallel_size must be 1"):
        PipelineLayout("EtL", ((E, t, L),), 1, 2, 1, 0)
    with pytest.raises(LayoutError, match="exactly one 'E'"):
        PipelineLayout("t", ((t,),), 1, 1, 1, 0)


# --- canonical form and pretty printing ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, p, n, d", [
    (DSV3, 16, 61, 1), ("E|t|t*2|t||(t|)*2,t*2,L", 4, 8, 0), ("E|((t|)*2t|)*2mL", 4, 6, 1), ("Et||tL", 3, 2, 0),
    ("E|t*3|(t|)*3tt|m|L", 4, 8, 1),
])
def test_canonical_round_trip(text, p, n, d):
    lay = layout(text, p, n, d)
    canon = lay.canonical()
    assert not set(canon) & set("*(),")
    assert [tuple(s) for s in parse_layout(canon)] == list(lay.stages)
    assert layout(canon, p, n, d).stages == lay.stages


def test_canonical_value():
    assert layout("E|t*3|(t|)*3tt|m|L", 4, 8, 1).canonical() == "E|ttt|t|t|t|tt|m|L"


def test_pretty_golden():
    assert layout("E|t*3|(t|)*3tt|m|L", 4, 8, 1).pretty() == "\n".join([
        "PipelineLayout P=4 V=2 stages=8 mtp=standalone at stage 6 (pp2/vpp1)",
        "    | vpp0     | vpp1",
        "pp0 | E        | t5",
        "pp1 | t0 t1 t2 | t6 t7",
        "pp2 | t3       | m0",
        "pp3 | t4       | L",
    ])


def test_pretty_global_ids_and_empty_cells():
    text = layout(GOLDEN_LIST, 4, 8).pretty()
    lines = text.splitlines()
    assert "P=4" in lines[0] and "V=2" in lines[0] and "stages=8" in lines[0] and "mtp=none" in lines[0]
    assert [c.strip() for c in lines[2].split("|")] == ["pp0", "E", "-"]  # pp0: embedding only, then an empty chunk
    assert lines[5].split("|")[2].strip() == "t6 t7 L"
    assert "co-located" in layout("E|t*3|(t|)*5mL", 4, 8, 1).pretty()
    assert "t60" in layout(DSV3, 16, 61, 1).pretty() and "m0" in layout(DSV3, 16, 61, 1).pretty()
