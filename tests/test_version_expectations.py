"""What a case expects per megatron-core version (`megatron_versions`, harness.planning.expectations.resolve), a run
expected to stop being finite (``expect: not_finite``), a cross-implementation comparison expected to disagree
(harness.judging.judge.judge_cross_implementation), and layouts only megatron's rules allow (``layout_rules: megatron``)."""
from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import run_cli
from test_cli_errors import GOOD, _check_usage_error

from harness.judging.crossimpl import CrossImplementationSpec, expected
from harness.judging.judge import judge_cross_implementation as judge_cross
from harness.judging.judge import judge_nonfinite
from harness.judging.trace import NonFinite
from harness.planning.case_schema import VariantSpec
from harness.planning.expectations import entry_for, resolve
from trainerkit.layout import LayoutError, PipelineLayout

SPEC = VariantSpec.model_validate({
    "name": "v", "pipeline_model_parallel_layout": "Ett|tmL", "pipeline_model_parallel_size": 2,
    "expect": "diverge", "first_divergence": {"step": 1, "kind": "loss", "name": "lm"},
    "megatron_versions": [
        {"versions": "<0.17", "expect": "not_finite", "first_divergence": {"step": 1, "kind": "loss", "name": "mtp_1"},
         "bug": "d7500d4d2a"},
        {"versions": ">=0.20", "expect": "bitwise"}]})


@dataclasses.dataclass
class _Run:
    spec: VariantSpec
    declared: VariantSpec | None = None


@pytest.mark.parametrize("version,expect", [("0.16.1", "not_finite"), ("0.16.0rc2", "not_finite"),
                                            ("0.19.2", "diverge"), ("0.20.0", "bitwise"),
                                            ("0.20.0rc0", "diverge"),     # PEP 440: a pre-release of 0.20 is before it
                                            (None, "diverge"), ("not-a-version", "diverge")])
def test_the_first_matching_entry_holds_for_the_runs_megatron(version, expect):
    run = resolve(_Run(SPEC), version)
    assert run.spec.expect == expect and run.declared is SPEC
    if expect == "not_finite":
        assert run.spec.bug == "d7500d4d2a" and run.spec.first_divergence[0].name == "mtp_1"
    # resolving again (another megatron, `verify --megatron-head`) starts from the spec as written
    assert resolve(run, "0.19.2").spec.expect == "diverge"
    assert (entry_for(SPEC, version) is None) == (expect == "diverge")


def test_not_finite_is_judged_by_where_training_stopped_being_finite():
    spec = resolve(_Run(SPEC), "0.16.1").spec
    at = NonFinite(1, 3, "mtp_1", math.nan)
    assert judge_nonfinite(spec, at, "pass", "", "")[:2] == ("pass", "not finite as expected")
    assert judge_nonfinite(spec, None, "pass", "", "")[:2] == ("fail", "unexpectedly finite")
    verdict, outcome, why = judge_nonfinite(spec, NonFinite(1, 3, "lm", math.nan), "pass", "", "")
    assert (verdict, outcome) == ("fail", "unexpected difference") and "name 'lm' (expected 'mtp_1')" in why
    # a diverge run fails when not finite, unless it carries a planted fault (broken on purpose)
    diverge = resolve(_Run(SPEC), "0.19.2").spec
    assert judge_nonfinite(diverge, at, "pass", "differs as expected", "r")[:2] == ("fail", "not finite")
    assert judge_nonfinite(diverge, at, "pass", "differs as expected", "r", planted=True) == \
        ("pass", "differs as expected", "r; training not finite: step 1 microbatch 3: mtp_1 loss is nan")


def _measured(verdict, key="embedding.word_embeddings.weight", broken=False):
    return {"verdict": verdict, "reason": "r", "init_differs": ["x"] if broken else [], "step": 0, "max_ulp": 64,
            "inventory": {"only_in_reference": []}, "first_beyond_bound": None if verdict == "pass" else
            {"step": 0, "kind": "grad", "microbatch": None, "name": key, "ulp": 2e5}}


def test_a_cross_implementation_disagreement_passes_only_where_it_is_expected():
    spec = CrossImplementationSpec.model_validate({"megatron_versions": [
        {"versions": "<0.17", "expect": "disagree", "first_beyond_bound": "embedding.word_embeddings.weight",
         "bug": "a22c40e8d6"}]})
    want = expected(spec, "0.16.1")
    assert want == {"expect": "disagree", "first_beyond_bound": "embedding.word_embeddings.weight",
                    "bug": "a22c40e8d6", "more_bugs": [], "bug_elsewhere": []}
    assert judge_cross(_measured("fail"), want)["verdict"] == "pass"
    assert judge_cross(_measured("pass"), want)["verdict"] == "fail"
    assert judge_cross(_measured("fail", key="output_layer.weight"), want)["verdict"] == "fail"
    assert judge_cross(_measured("fail", broken=True), want)["verdict"] == "fail"
    agree = expected(spec, "0.19.2")
    assert agree["expect"] == "agree" and agree["bug_elsewhere"] == ["a22c40e8d6 (megatron-core <0.17)"]
    rec = judge_cross(_measured("fail"), agree)
    assert (rec["verdict"], rec["measured"]) == ("fail", "fail")


def test_mtp_on_pp_rank_0_is_megatron_rules_only():
    with pytest.raises(LayoutError, match="must not be on pp rank 0.*layout_rules: megatron"):
        PipelineLayout.from_string("Et|t|tm|L", 2, 3, 1)
    layout = PipelineLayout.from_string("Et|t|tm|L", 2, 3, 1, megatron_rules_only=True)
    assert layout.rank_of(2) == (0, 1)


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("extra,fragments", [
    ("megatron_versions: [{versions: 'newer than 0.17', expect: bitwise}]",
     ["variant 'v'", "megatron_versions.0.versions", "PEP 440"]),
    ("megatron_versions: [{versions: '<0.17', expect: bitwise}]", ["megatron_versions needs trainer: megatron-core"]),
    ("layout_rules: megatron", ["layout_rules: megatron needs trainer: megatron-core"]),
    ("expect: not_finite, first_divergence: {kind: grad}", ["expect: not_finite", "not grad"]),
    ("expect: not_finite, signature: [{from_step: 0}]", ["signature is not meaningful with expect: not_finite"]),
    ("megatron_versions: [{versions: ' ', expect: bitwise}]", ["' ' is not a PEP 440 version specifier"]),
    ("expect: diverge, first_divergence: {kind: loss, microbatch: -1}", ["microbatch", "greater than or equal to 0"]),
])
def test_bad_version_expectations_are_one_line(tmp_path, extra, fragments):
    case = tmp_path / "c.yaml"
    case.write_text((GOOD % ("Et|tt|tm|L", 4)).replace("pipeline_model_parallel_size: 4}",
                                                         f"pipeline_model_parallel_size: 4, {extra}}}"))
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out", *fragments)
