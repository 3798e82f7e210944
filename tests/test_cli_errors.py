"""Bad input: one clear line on stderr naming the problem and where, exit 2, no traceback, nothing written."""
import textwrap

import pytest

GOOD = textwrap.dedent("""\
    name: t
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 1, seq_length: 8, num_microbatches: 4}
    baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: v, pipeline_model_parallel_layout: "%s", pipeline_model_parallel_size: %d}
    """)


def _check_usage_error(proc, out, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bitparity: error:"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert not out.exists() or not any(out.iterdir()), "something was written to the report directory"


@pytest.mark.parametrize("body,fragments", [
    (GOOD % ("Ett|tt*mL", 2), ["variant 'v'", "position 6"]),                         # syntax, with position
    (GOOD % ("Ett|tmL", 2), ["variant 'v'", "decoder"]),                               # t count != num_layers
    (GOOD % ("Ett|tt|mL", 2), ["variant 'v'", "divisible"]),                           # 3 stages, P=2
    (GOOD % ("Ett|ttL", 2), ["variant 'v'", "mtp"]),                                   # m count != mtp_num_layers
    ((GOOD % ("Et|tt|t|mL", 2)).replace("num_microbatches: 4", "num_microbatches: 3"), ["divisible"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("name: t\n", "name: t\nunexpected_key: 1\n"), ["unexpected_key", "Extra inputs"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("num_layers: 4", "num_layers: four"), ["model.num_layers"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("train_iters: 1", "train_iter: 1"), ["training.train_iter"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("pipeline_model_parallel_size: 2}\n", "pipeline_model_parallel_size: 2, "
                                                                           "options: {clip_grad: -1}}\n", 1),
     ["options.clip_grad"]),
    (GOOD % ("Ett|ttmL", 2) + "  - {name: v, pipeline_model_parallel_layout: 'Ett|ttmL', "
                               "pipeline_model_parallel_size: 2}\n", ["duplicate variant name 'v'"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("training: {", "training: {data: {path: nowhere.txt}, "), ["nowhere.txt"]),
    ("model: [1, 2\n", ["invalid YAML", ":1:"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("name: t\n", "name: ..\n"), ["name '..'"]),          # path traversal
    ((GOOD % ("Ett|ttmL", 2)).replace("name: t\n", "name: a/b\n"), ["name 'a/b'"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("name: t\n", "name: t\nname: u\n"), ["duplicate key 'name'"]),
    ((GOOD % ("Ett|ttmL", 2)).split("variants:")[0], ["no variants"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("train_iters: 1", "train_iters: true"), ["training.train_iters"]),
    ((GOOD % ("Ett|ttmL", 2)).replace("train_iters: 1", "train_iters: 1, seed: -5"), ["training.seed"]),
    ("- just a list\n", ["mapping"]),
])
def test_bad_case_files(tmp_path, cli, body, fragments):
    case = tmp_path / "case.yaml"
    case.write_text(body)
    out = tmp_path / "reports"
    _check_usage_error(cli("verify", case, "--out", out), out, str(case), *fragments)


def test_missing_case_file(tmp_path, cli):
    out = tmp_path / "reports"
    _check_usage_error(cli("verify", tmp_path / "nope.yaml", "--out", out), out, "nope.yaml", "no such case file")


def test_unknown_fault_and_only(tmp_path, cli):
    case = tmp_path / "case.yaml"
    case.write_text(GOOD % ("Ett|ttmL", 2))
    out = tmp_path / "reports"
    _check_usage_error(cli("verify", case, "--out", out, "--inject", "nonsense"), out, "unknown fault 'nonsense'")
    _check_usage_error(cli("verify", case, "--out", out, "--only", "zzz"), out, "--only 'zzz'")


def test_bad_arguments(tmp_path, cli):
    out = tmp_path / "x"
    _check_usage_error(cli("verify"), out, "case")
    _check_usage_error(cli("layout", "explain", "Et*|L", "--pp", "1"), out, "position 2")
    _check_usage_error(cli("layout", "explain", "Ett|tmL", "--pp", "3"), out, "divisible")
    _check_usage_error(cli("schedule", "explain", "--pp", "2", "--vpp", "2", "--microbatches", "3"), out, "divisible")


def test_layout_explain(cli):
    proc = cli("layout", "explain", "Et*3|(tt|)*29,m|L", "--pp", "16")
    assert proc.returncode == 0, proc.stderr
    assert "P=16 V=2" in proc.stdout and "standalone" in proc.stdout
    assert "t59 t60" in proc.stdout          # global ids of the last decoder layers
    assert "m0" in proc.stdout


def test_schedule_explain(cli):
    proc = cli("schedule", "explain", "--pp", "4", "--vpp", "2", "--microbatches", "8")
    assert proc.returncode == 0, proc.stderr
    rows = [l for l in proc.stdout.splitlines() if l.startswith("rank")]
    assert len(rows) == 4
    # rank 3 warmup = 2*(4-3-1) + (2-1)*4 = 4 forwards before its first backward
    cells = rows[3].split("|", 1)[1].split()
    assert [c[0] for c in cells[:6]] == ["F", "F", "F", "F", "F", "B"]
