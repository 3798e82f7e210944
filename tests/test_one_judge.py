"""One judge for every verdict (harness.judging.judge.decide): `bitparity verify` and `bitparity compare` give the same
verdict, outcome and first divergence for the same pair of traces, and replicas are checked whatever a run
expects.

* every run of the shipped smoke case (and, with megatron-core, of cases/megatron-dsv3.yaml) is judged again by
  `harness.compare_dirs.run` from its report's rank traces, with the run's own expectation: the two entry points
  must agree; a judging rule dropped from `compare`'s evidence (planted) makes them disagree;
* a real defect planted in a copy of the reference trainer (the embedding group's all-reduce skipped: the MTP
  stage's embedding replica keeps its own gradient) fails a run that expects a divergence for another reason
  (another learning rate), and a run that states the drift (``replica_drift``) passes; without the defect the
  same run passes and the stated drift fails (the bug it states is not caught).
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import ROOT, once, run_cli, verify_once
from planted import planted_tree, run_planted

pytestmark = pytest.mark.slow


def _judged_again(report, case_path, monkeypatch=None):
    """{run: (verify's (verdict, outcome, first divergence), compare's)} for every run of the report at
    `report` (a `bitparity verify` output directory of `case_path`), each run's rank traces compared with its
    reference run's by `harness.compare_dirs.run` under the run's resolved expectation."""
    from harness import compare_dirs
    from harness.judging.judge import Expectation
    from harness.planning import trainers
    from harness.planning.cases import load_case
    from harness.planning.expectations import resolve

    summary = json.loads((report / "summary.json").read_text())
    plan = load_case(case_path)
    runs = {r.spec.name: r for r in plan.runs}
    dirs = {v["name"]: report / "runs" / v["name"].replace("/", "_") for v in summary["variants"]}
    out = {}
    # compare's own reports go to a directory of this call: `report` may be a fixture's, shared by tests
    again = Path(tempfile.mkdtemp(prefix="again-", dir=report.parent))
    for i, v in enumerate(summary["variants"]):
        run = runs[v["name"]]
        if run.config.trainer == "megatron-core":       # verify judges the expectation of the megatron it ran
            run = resolve(run, trainers.megatron_version(run.config.megatron_path))
        fd = v["first_divergence"]
        mine = (v["verdict"], v["outcome"], fd and (fd["step"], fd["kind"], fd["name"], fd["microbatch"]))
        ref = dirs[v["compare_to"] or summary["baseline"]]
        res = compare_dirs.run(ref, dirs[v["name"]], again / str(i), "test",
                               want=Expectation.of(run), name="again", progress=lambda _: None,
                               warn=lambda _: None)
        theirs = res.variants[0 if run.is_baseline else 1]
        tfd = theirs.first_divergence and asdict(theirs.first_divergence)
        out[v["name"]] = mine, (theirs.verdict, theirs.outcome,
                                tfd and (tfd["step"], tfd["kind"], tfd["name"], tfd["microbatch"]))
    return out


def _assert_agree(judged):
    differ = {n: pair for n, pair in judged.items() if pair[0] != pair[1]}
    assert not differ, f"verify vs compare: {differ}"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    proc, out = verify_once(tmp_path_factory, ROOT / "cases" / "smoke.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "smoke"


def test_verify_and_compare_agree_on_every_smoke_run(smoke):
    judged = _judged_again(smoke, ROOT / "cases" / "smoke.yaml")
    assert len(judged) == 6
    _assert_agree(judged)


@pytest.mark.megatron
def test_verify_and_compare_agree_on_every_megatron_dsv3_run(tmp_path):
    pytest.importorskip("megatron.core")
    case = ROOT / "cases" / "megatron-dsv3.yaml"
    proc = run_cli("verify", case, "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    judged = _judged_again(tmp_path / "megatron-dsv3", case)
    assert len(judged) >= 10
    _assert_agree(judged)


# the embedding group's all-reduce between the first stage and the MTP stage (reference_impl.reductions), gone:
# each copy keeps its own gradient, the replicas train apart from step 0
SKIP_EMBEDDING_SUM = {"reference_impl/reductions.py": [
    ("            self.transport.all_reduce(p.main_grad, group=self.group)", "            pass")]}
DRIFT_CASE = textwrap.dedent("""\
    name: drift
    timeout_s: 120
    model: {num_layers: 3, moe_layer_freq: "[0]*1+[1]*2"}
    training: {train_iters: 2, seq_length: 16, num_microbatches: 2}
    baseline: {name: base, pipeline_model_parallel_layout: "Ett|tmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: other-lr, pipeline_model_parallel_layout: "Ett|tmL", pipeline_model_parallel_size: 2,
         options: {lr: 0.002}, expect: diverge, first_divergence: {step: 0, kind: param}}
      - {name: other-lr-stated, pipeline_model_parallel_layout: "Ett|tmL", pipeline_model_parallel_size: 2,
         options: {lr: 0.002}, expect: diverge, first_divergence: {step: 0, kind: param},
         replica_drift: {name: "embedding.word_embeddings.weight@mtp", step: 0}}
    """)


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    """(clean verdicts, planted verdicts, planted report, case path) of DRIFT_CASE."""
    def both(tmp: Path) -> subprocess.CompletedProcess:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "drift.yaml").write_text(DRIFT_CASE)
        clean = run_cli("verify", tmp / "drift.yaml", "--out", tmp / "clean")
        tree = planted_tree(tmp / "tree", SKIP_EMBEDDING_SUM)
        planted = run_planted(tree, "verify", tmp / "drift.yaml", "--out", tmp / "planted")
        return subprocess.CompletedProcess([], 0, clean.stdout + planted.stdout, clean.stderr + planted.stderr)

    proc, tmp = once(tmp_path_factory, ["drift", DRIFT_CASE], both)
    case = tmp / "drift.yaml"
    clean = planted = proc
    verdicts = []
    for proc, out in ((clean, tmp / "clean"), (planted, tmp / "planted")):
        summary = out / "drift" / "summary.json"
        assert summary.exists(), proc.stdout + proc.stderr
        verdicts.append({v["name"]: v for v in json.loads(summary.read_text())["variants"]})
    return verdicts[0], verdicts[1], tmp / "planted" / "drift", case


def test_a_replica_drift_fails_a_run_that_expects_a_divergence(drift):
    clean, planted, _, _ = drift
    assert clean["other-lr"]["verdict"] == "pass", clean["other-lr"]
    assert clean["other-lr"]["outcome"] == "differs as expected"
    # without the bug, the stated drift does not happen: the bug it states is not caught
    assert clean["other-lr-stated"]["verdict"] == "fail"
    assert "but every replica matches its original" in clean["other-lr-stated"]["reason"]
    v = planted["other-lr"]
    assert (v["verdict"], v["outcome"]) == ("fail", "unexpected difference"), v
    assert "replica inconsistent from step 0: embedding.word_embeddings.weight@mtp" in v["reason"], v
    assert planted["base"]["verdict"] == "fail"         # the reference run keeps its replicas too
    stated = planted["other-lr-stated"]
    assert stated["verdict"] == "pass" and "replica drifts as stated" in stated["reason"], stated


def test_verify_and_compare_agree_on_the_planted_drift(drift):
    _, _, report, case = drift
    judged = _judged_again(report, case)
    assert judged["other-lr"][0][0] == "fail"
    _assert_agree(judged)


def test_a_rule_dropped_from_one_entry_point_is_seen(drift, monkeypatch):
    """`bitparity compare` planted without the replica evidence: the agreement test sees it."""
    from harness import compare_dirs

    real = compare_dirs._evidence

    def no_replicas(trace, header, cmp, replicas, nonfinite, where):
        return real(trace, header, cmp, None, nonfinite, where)
    monkeypatch.setattr(compare_dirs, "_evidence", no_replicas)
    _, _, report, case = drift
    judged = _judged_again(report, case)
    assert judged["other-lr"][0] != judged["other-lr"][1]
    with pytest.raises(AssertionError, match="verify vs compare"):
        _assert_agree(judged)
