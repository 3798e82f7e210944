"""`bitparity fuzz`: random valid layouts stay bitwise equal to the baseline; a planted fault that only some
layouts trigger is found and shrunk to the minimal layout, written as a ready-to-run case."""
import json

import pytest
import yaml
from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def test_random_layouts_bitwise_equal(tmp_path):
    # a count, not a time budget: how many layouts fit in 20 s depends on the machine and its load (CI once
    # ran 2 beside other work)
    proc = run_cli("fuzz", ROOT / "cases" / "smoke.yaml", "--budget", "10m", "--max-layouts", "6", "--seed", "3",
                   "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no layout differed from the baseline" in proc.stdout
    tried = int(proc.stdout.split("tried ")[1].split()[0])
    assert tried == 6


# the search is bounded by --budget 5m; the test's own limit (pytest-timeout's default is 300 s, the budget itself)
# leaves the minimal case's report and the exit beyond it, so a slow box ends in the command's verdict, not in a
# kill mid-search (seen on a 2-core box at half speed: 300 s where an idle one takes ~65 s)
@pytest.mark.timeout(480)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_planted_layout_dependent_fault_is_found_and_shrunk(tmp_path, jobs):
    # jobs 2: a batch's layouts run two at a time, then hypothesis replays the batch to shrink the failure it
    # met; jobs 1: one at a time.  Both must reach the same minimal layout
    # bounded by a count, with time to spare on a loaded machine (seed 2 meets the fault within ~40 layouts)
    proc = run_cli("fuzz", ROOT / "cases" / "smoke.yaml", "--budget", "5m", "--max-layouts", "200", "--seed", "2",
                   "--out", tmp_path, "--inject", "renorm_when_mtp_alone", "--jobs", jobs)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    case = yaml.safe_load((tmp_path / "smoke-fuzz-minimal.yaml").read_text())
    minimal = case["variants"][0]
    # the fault needs an MTP-only stage; the smallest such layout has 3 stages on P=3 (E+t*4 | m | L)
    stages = minimal["pipeline_model_parallel_layout"].split("|")
    assert "m" in stages and len(stages) == 3 and minimal["pipeline_model_parallel_size"] == 3
    summary = json.loads((tmp_path / "smoke-fuzz-minimal" / "summary.json").read_text())
    assert [v["verdict"] for v in summary["variants"]] == ["pass", "fail"]


def test_a_seed_draws_the_same_layouts_whatever_jobs(tmp_path):
    """The batches hypothesis draws do not depend on --jobs: one seed, one set of layouts, on any machine."""
    from harness.fuzz import fuzz
    from harness.planning.cases import load_case
    plan = load_case(ROOT / "cases" / "smoke.yaml")
    grids = [fuzz(plan, tmp_path / str(jobs), 600, 11, max_layouts=12, jobs=jobs, progress=lambda _: None).grids
             for jobs in (1, 2)]
    assert len(grids[0]) >= 6 and grids[0] == grids[1]


def test_interrupted_while_reporting_the_minimal_case_writes_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the search, while the minimal case is verified into its report: one line, exit 2, and
    neither the case file nor the --out directory fuzz made is left.  (The interrupt is raised where the
    report is being written, in-process: a real signal's timing against a 2-second report is a race.)"""
    from harness import cli, verify

    def interrupted(plan, out, **kwargs):
        assert (out / f"{plan.name}.yaml").is_file()    # the case is written, its report under way
        raise KeyboardInterrupt
    monkeypatch.setattr(verify, "verify", interrupted)
    out = tmp_path / "out"
    rc = cli.main(["fuzz", str(ROOT / "cases" / "smoke.yaml"), "--budget", "5m", "--max-layouts", "200", "--seed",
                   "2", "--inject", "renorm_when_mtp_alone", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "bitparity: interrupted", err
    assert not out.exists()


def test_bad_budget(tmp_path):
    proc = run_cli("fuzz", ROOT / "cases" / "smoke.yaml", "--budget", "soon", "--out", tmp_path)
    assert proc.returncode == 2 and "--budget 'soon'" in proc.stderr


def test_random_layouts_canonical_with_clipping(tmp_path):
    """Canonical reductions with clipping triggered: random layouts, P=1 included, stay bitwise equal."""
    case = tmp_path / "clip.yaml"
    case.write_text((ROOT / "cases" / "smoke.yaml").read_text().replace(
        "  num_microbatches: 4\n", "  num_microbatches: 4\n  clip_grad: 0.05\n  reductions: canonical\n"))
    # a count, not a time budget (a 15 s budget once went on the baseline alone, beside a loaded test run)
    proc = run_cli("fuzz", case, "--budget", "10m", "--max-layouts", "8", "--seed", "5", "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no layout differed from the baseline" in proc.stdout
    assert int(proc.stdout.split("tried ")[1].split()[0]) == 8


def test_the_minimal_case_keeps_the_whole_computation(tmp_path):
    """The written case reproduces: the case's megatron options and its data (masks, padding) go with it."""
    from harness.fuzz import write_minimal_case
    from harness.planning.cases import load_case
    case = tmp_path / "c.yaml"
    case.write_text(
        "name: c\nmodel: {num_layers: 4, moe_layer_freq: '[0]*1+[1]*3'}\n"
        "megatron: {calculate_per_token_loss: true}\n"
        "training: {train_iters: 2, seq_length: 8, num_microbatches: 4,\n"
        "           data: {pad_fraction: 0.5, empty_microbatches: [[1, 3]]}}\n"
        "baseline: {name: pp2, pipeline_model_parallel_layout: 'Ett|ttmL', pipeline_model_parallel_size: 2}\n"
        "variants:\n  - {name: pp4, pipeline_model_parallel_layout: 'Et|tt|tm|L', pipeline_model_parallel_size: 4}\n")
    plan = load_case(case)
    path = write_minimal_case(plan, {"layout": "Et|tt|tm|L", "pp": 4, "why": "step 0 grad x"}, tmp_path / "o", None)
    again = load_case(path)
    minimal = next(r for r in again.runs if r.spec.name == "minimal")
    assert minimal.config.megatron == {"calculate_per_token_loss": True}
    assert minimal.config.training.data == plan.runs[0].config.training.data
