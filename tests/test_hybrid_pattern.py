"""HybridModel's ``hybrid_layer_pattern`` as a layout (trainerkit.hybrid_pattern), what a case may say of a HybridModel
run, a run not made on some megatron versions (``not_run``) and a known upstream crash (``crash``): all without
megatron-core (tests/test_megatron_hybrid.py runs the models)."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import ROOT, run_cli
from test_cli_errors import _check_usage_error

from harness.judging.judge import Evidence, Expectation, decide
from harness.planning.case_schema import VariantSpec
from trainerkit.config import ModelConfig
from trainerkit.hybrid_pattern import HybridPatternError, check_against_model, parse_hybrid_pattern, pipeline_layout

pytestmark = pytest.mark.arithmetic_free

SMALL = ModelConfig(num_layers=4, moe_layer_freq="[0]*1+[1]*3")      # tests/cases/megatron-small.yaml's


@pytest.mark.parametrize("text, layout, moe, depths", [
    ("+-+E|+E+E/+E", "Ett|ttmL", [0, 1, 1, 1], 1),
    ("+-|+E|+E|+E/+E", "Et|t|t|tmL", [0, 1, 1, 1], 1),
    ("+-|+E|+E+E|/+E", "Et|t|tt|mL", [0, 1, 1, 1], 1),    # a last segment of MTP and loss only
    ("+-+E+E+E", "EttttL", [0, 1, 1, 1], 0),
    ("+E/+E/+E", "EtmmL", [1], 2),
])
def test_a_pattern_is_the_gpt_layout_of_the_same_placement(text, layout, moe, depths):
    p = parse_hybrid_pattern(text)
    assert (p.layout, p.moe_layers, p.mtp_depths) == (layout, moe, depths)
    assert p.num_layers == 2 * len(moe)


@pytest.mark.parametrize("text, position, fragment", [
    ("+-+|E", 3, "pipeline boundary splits block 1"),
    ("*-", 0, "'*' (attention) is megatron's"),
    ("+-M-", 2, "'M' (Mamba) is megatron's"),
    ("+-x", 2, "unknown symbol 'x'"),
    ("+- +E", 2, "whitespace"),
    ("-+", 0, "layer 0 is '-' where block 0 starts"),
    ("++", 1, "layer 1 is '+' where block 0's MLP belongs"),
    ("+-+", 3, "block 1 has its MLA but no MLP"),
    ("+-/+E/+-", 6, "MTP depth 2's pattern '+-' differs"),
    ("+-//+E", 2, "MTP depth 1 is empty"),
    ("+-/+|E", 4, "'|' in MTP depth 1's pattern"),
    ("+-/+E+E", 3, "is not one DeepSeek-V3 block"),
    ("", None, "is empty"),
    ("|/+E", None, "has no decoder layer"),
])
def test_a_malformed_pattern_is_one_line_with_its_position(text, position, fragment):
    with pytest.raises(HybridPatternError) as e:
        parse_hybrid_pattern(text)
    assert e.value.position == position and fragment in str(e.value), str(e.value)
    assert str(e.value).startswith(f"hybrid_layer_pattern {text!r}: ") and "\n" not in str(e.value)
    if position is not None:
        assert str(e.value).endswith(f" at position {position}")


@pytest.mark.parametrize("text, fragment", [
    ("+-+E+E+-/+E", "block 3 is dense ('+-') but model.moe_layer_freq makes layer 3 MoE"),
    ("+-+E+E/+E", "has 3 blocks"),
    ("+-+E+E+E", "has 0 MTP depth(s)"),
    ("+-+E+E+E/+-", "MTP block '+-' differs from the last decoder block's MLP"),
])
def test_a_pattern_of_another_architecture_than_the_models_is_refused(text, fragment):
    problem = check_against_model(parse_hybrid_pattern(text), SMALL.moe_layers, SMALL.mtp_num_layers)
    assert problem is not None and fragment in problem, problem
    assert check_against_model(parse_hybrid_pattern("+-+E+E+E/+E"), SMALL.moe_layers, 1) is None


def test_the_placement_is_checked_as_a_layout_naming_the_pattern():
    layout = pipeline_layout(parse_hybrid_pattern("+-|+E|+E|+E/+E"), 2, 4, 1)
    assert layout.virtual_pipeline_model_parallel_size == 2 and layout.rank_of(layout.mtp_stage) == (1, 1)
    with pytest.raises(HybridPatternError, match=r"^hybrid_layer_pattern '\+-\+E\|\+E\+E/\+E': 2 segments \('\|'-"
                                                 r"separated\) do not divide over pipeline_model_parallel_size=3"):
        pipeline_layout(parse_hybrid_pattern("+-+E|+E+E/+E"), 3, 4, 1)
    with pytest.raises(HybridPatternError, match=r"has 5 decoder layers 't' but num_layers=4 \(as the GPT layout"):
        pipeline_layout(parse_hybrid_pattern("+-+E+E+E+E/+E"), 1, 4, 1)


def test_layout_explain_reads_a_pattern_and_refuses_a_bad_one_in_one_line(tmp_path):
    proc = run_cli("layout", "explain", "+-|+E|+E+E|/+E", "--pp", "2")
    assert proc.returncode == 0, proc.stderr
    assert "= GPT layout Et|t|tt|mL" in proc.stdout and "segment 3: m0=+E" in proc.stdout
    assert "pp1 | t1   | m0 L" in proc.stdout
    for bad, fragment in (("+-+|E", "position 3"), ("+-+E|+E+E/+E --pp 3", "do not divide over")):
        text, *more = bad.split(" ")
        proc = run_cli("layout", "explain", text, "--pp", *(more[1:] or ["2"]))
        _check_usage_error(proc, tmp_path / "none", fragment)
        assert proc.stdout == ""            # nothing printed before the refusal


CASE = f"""\
name: h
trainer: megatron-core
extends: {ROOT / 'tests' / 'cases' / 'megatron-small.yaml'}
variants:
  - {{name: v, %s}}
"""


@pytest.mark.parametrize("variant, fragment", [
    ("hybrid_layer_pattern: '+-|+E|+E|+E/+E', pipeline_model_parallel_size: 2", "needs model_class: hybrid"),
    ("model_class: hybrid, pipeline_model_parallel_size: 2", "model_class: hybrid needs hybrid_layer_pattern"),
    ("model_class: hybrid, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2",
     "places its layers with hybrid_layer_pattern"),
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E+|E/+E', pipeline_model_parallel_size: 2",
     "position 6"),
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+-/+-', pipeline_model_parallel_size: 2",
     "block 3 is dense"),
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+E/+E', pipeline_model_parallel_size: 3",
     "4 segments ('|'-separated) do not divide over pipeline_model_parallel_size=3"),
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+E/+E/+E', pipeline_model_parallel_size: 2",
     "has 2 MTP depth(s) ('/' parts) but model.mtp_num_layers is 1"),       # the pattern's words, not 't' / 'm'
    ("model_class: hybrid, hybrid_layer_pattern: '+-+E+E+E|/+E', pipeline_model_parallel_size: 1",
     "hybrid_layer_pattern '+-+E+E+E|/+E' (GPT layout 'Etttt|mL'): layout has 2 stages per rank"),        # a schedule refusal names the pattern
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+E/+E', pipeline_model_parallel_size: 2, "
     "megatron_versions: [{versions: '>=0', crash: IndexError}]", "crash: needs bug:"),
    ("model_class: hybrid, trainer: reference, hybrid_layer_pattern: '+-+E|+E+E/+E', pipeline_model_parallel_size: 2",
     "trainer: megatron-core"),
    ("model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+E/+E', pipeline_model_parallel_size: 2, "
     "megatron_versions: [{versions: '<0.17', not_run: x, expect: bitwise}]", "so expect says nothing there"),
    ("model_class: gpt2, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2",
     "model_class"),
])
def test_a_hybrid_variant_the_case_cannot_run_is_one_line(tmp_path, variant, fragment):
    (tmp_path / "h.yaml").write_text(CASE % variant)
    out = tmp_path / "out"
    _check_usage_error(run_cli("verify", tmp_path / "h.yaml", "--out", out), out, fragment)


@pytest.mark.parametrize("more, fragment", [
    # compared with a run stated to crash, without stating it
    ("megatron_versions: [{versions: '>=0', crash: IndexError, bug: b}]}\n"
     "  - {name: w, compare_to: v, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2",
     "variant 'w' needs 'v', which the case states crashes on this megatron ('IndexError')"),
    # the cross-implementation check of a run not made, without saying so
    ("megatron_versions: [{versions: '>=0', not_run: 'not today'}]}\n"
     "cross_implementation: {variant: v, step: 0, max_ulp: 16", "give the check a megatron_versions entry with not_run"),
    # the check says not_run where its variant runs
    ("megatron_versions: [{versions: '<0', not_run: 'never'}]}\n"
     "cross_implementation: {variant: v, step: 0, megatron_versions: [{versions: '>=0', not_run: x}]",
     "says not_run, but its variant 'v' runs here"),
])
def test_what_needs_a_run_not_made_or_crashing_must_say_so(tmp_path, more, fragment):
    # GPT runs (any megatron-core): the rules are the model class's no more than the version's
    (tmp_path / "h.yaml").write_text(CASE % (
        "pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, " + more))
    out = tmp_path / "out"
    _check_usage_error(run_cli("verify", tmp_path / "h.yaml", "--out", out), out, fragment)


def test_what_compares_with_a_run_not_made_must_say_so_too(tmp_path):
    (tmp_path / "h.yaml").write_text(CASE % (
        "model_class: hybrid, hybrid_layer_pattern: '+-|+E|+E|+E/+E', pipeline_model_parallel_size: 2, "
        "megatron_versions: [{versions: '>=0', not_run: 'not today'}]}\n"
        "  - {name: w, compare_to: v, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2"))
    out = tmp_path / "out"
    _check_usage_error(run_cli("verify", tmp_path / "h.yaml", "--out", out), out,
                       "variant 'w' needs 'v', which is not made on this megatron (not today")


def _want(**kw):
    spec = VariantSpec.model_validate({"name": "v", "pipeline_model_parallel_layout": "EtL",
                                       "pipeline_model_parallel_size": 1, **kw})
    return Expectation.of(dataclasses.make_dataclass("R", ["spec", "is_baseline"])(spec, False))


def test_a_stated_crash_passes_only_when_the_run_stops_with_it():
    want = _want(crash="IndexError: index 9", bug="upstream #1")
    said = decide(want, Evidence(error="rank 1 exited with code 1: IndexError: index 9 is out of bounds"))
    assert (said.verdict, said.outcome) == ("pass", "crashed as stated") and "index 9 is out" in said.reason
    other = decide(want, Evidence(error="rank 0 exited with code 1: KeyError: 'x'"))
    assert (other.verdict, other.outcome) == ("error", "error") and "states a crash" in other.reason
    fixed = decide(want, Evidence())
    assert (fixed.verdict, fixed.outcome) == ("fail", "unexpectedly completed") and "update the case" in fixed.reason
