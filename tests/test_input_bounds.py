"""Hostile input: every impossible or oversized value is one line naming the file/key/variant, exit 2, no
traceback, nothing written — before anything runs (so nothing that passed validation can crash a rank later).

Mostly in-process (`harness.cli.main`, `load_case`): fast, and the PermissionError cases can be simulated
with monkeypatch when the tests run as root (root reads and writes through chmod 000)."""
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from conftest import ROOT
from hypothesis import given, settings

from harness.cli import main
from harness.errors import UsageError
from harness.planning.cases import load_case
from harness.strategies import layouts, stage_grids
from trainerkit.config import parse_moe_layer_freq
from trainerkit.layout import LayoutError, PipelineLayout

CASE = textwrap.dedent("""\
    name: t
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 2, seq_length: 8, num_microbatches: 4}
    baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: v, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
    """)


def _cli(capsys, *args):
    """Run the CLI in-process: (exit code, the stderr lines)."""
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err
    return rc, cap.err.strip().splitlines()


def _one_line_error(capsys, out, *args):
    """Assert the bad-input contract and return the error line."""
    rc, lines = _cli(capsys, *args)
    assert rc == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("bitparity: error:") and "internal error" not in line, line
    assert line.isprintable(), repr(line)          # no control characters reach the terminal
    assert not out.exists() or not any(out.iterdir()), "something was written to --out"
    return line


def _verify_error(tmp_path, capsys, body, *fragments):
    case = tmp_path / "case.yaml"
    case.write_text(body)
    out = tmp_path / "reports"
    line = _one_line_error(capsys, out, "verify", case, "--out", out)
    for f in (str(case),) + fragments:
        assert f in line, (f, line)
    return line


# --- 1. empty stages before E / after L -------------------------------------------------------------------

@pytest.mark.parametrize("text, pp, T, D, fragments", [
    ("Et*4|t*4|mL|", 4, 8, 1, ["stage 3 (pp3/vpp0", "after 'L'", "end the layout with L"]),
    ("|Et*4|t*4|mL", 4, 8, 1, ["stage 0 (pp0/vpp0", "before 'E'", "start the layout with E"]),
    ("Ett|ttL|", 3, 4, 0, ["stage 2 (pp2/vpp0", "after 'L'"]),
    ("|Et|tL", 3, 2, 0, ["stage 0 (pp0/vpp0", "before 'E'"]),
    ("E|t|tmL||", 5, 2, 1, ["stages 3 (pp3/vpp0), 4 (pp4/vpp0)", "after 'L'"]),
])
def test_empty_stage_before_E_or_after_L_is_rejected(text, pp, T, D, fragments, tmp_path, capsys):
    with pytest.raises(LayoutError) as err:
        PipelineLayout.from_string(text, pp, T, D)
    assert all(f in str(err.value) for f in fragments), str(err.value)
    out = tmp_path / "x"
    line = _one_line_error(capsys, out, "layout", "explain", text, "--pp", pp)
    assert "empty" in line and "Megatron" in line


def test_empty_stage_in_a_case_file(tmp_path, capsys):
    body = CASE.replace('"Et|tt|tm|L", pipeline_model_parallel_size: 4', '"Ett|ttmL|", pipeline_model_parallel_size: 3')
    _verify_error(tmp_path, capsys, body, "variant 'v'", "after 'L'")


with warnings.catch_warnings():      # the deprecation itself is tested below
    warnings.simplefilter("ignore", DeprecationWarning)
    _DISPLACED = layouts(3, 1, allow_displaced_ends=True)


@settings(max_examples=60, deadline=None)
@given(_DISPLACED)
def test_strategies_never_generate_displaced_ends(case):
    text, pp = case
    lay = PipelineLayout.from_string(text, pp, 3, 1)   # valid under the new rule
    assert lay.embedding_stage == 0 and lay.loss_stage == lay.num_stages - 1


def test_allow_displaced_ends_warns():
    with pytest.warns(DeprecationWarning, match="allow_displaced_ends"):
        stage_grids(3, 1, allow_displaced_ends=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stage_grids(3, 1)


# --- 2. impossible numbers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("old, new, fragments", [
    ("train_iters: 2", "train_iters: 2, lr: .inf", ["training.lr", "finite"]),
    ("train_iters: 2", "train_iters: 2, lr: .nan", ["training.lr", "finite"]),
    ("train_iters: 2", "train_iters: 2, adam_beta1: .nan", ["training.adam_beta1"]),
    ("train_iters: 2", "train_iters: 2, adam_beta1: 1.0", ["training.adam_beta1", "less than 1"]),
    ("train_iters: 2", "train_iters: 2, adam_beta2: -0.5", ["training.adam_beta2"]),
    ("train_iters: 2", "train_iters: 2, adam_eps: 0.0", ["training.adam_eps"]),
    ("train_iters: 2", "train_iters: 2, clip_grad: .inf", ["training.clip_grad"]),
    ("train_iters: 2", "train_iters: 2, weight_decay: .nan", ["training.weight_decay"]),
    ("num_layers: 4,", "num_layers: 4, vocab_size: 1000000000,", ["model.vocab_size"]),
    ("num_layers: 4,", "num_layers: 4, hidden_size: 1000000,", ["model.hidden_size"]),
    ("num_layers: 4,", "num_layers: 4, init_method_std: .inf,", ["model.init_method_std"]),
    ("num_layers: 4,", "num_layers: 4, num_moe_experts: 1048576, moe_router_num_groups: 1, moe_router_group_topk: 1,",
     ["model.num_moe_experts"]),
    ("seq_length: 8", "seq_length: 8, micro_batch_size: 1000000000000", ["training.micro_batch_size"]),
    ("seq_length: 8", "seq_length: 65536, micro_batch_size: 4096", ["seq_length*micro_batch_size"]),
    ("train_iters: 2", "train_iters: 1000000000", ["training.train_iters"]),
    ("train_iters: 2", "train_iters: 2, num_threads: 100000", ["training.num_threads"]),
    ("name: t\n", "name: t\ntimeout_s: .inf\n", ["timeout_s", "finite"]),
    ("name: t\n", "name: t\ntimeout_s: 1.0e+30\n", ["timeout_s"]),
    ("name: t\n", "name: t\nnum_gpus: 100000\n", ["num_gpus"]),
])
def test_impossible_numbers(tmp_path, capsys, old, new, fragments):
    assert old in CASE
    _verify_error(tmp_path, capsys, CASE.replace(old, new, 1), *fragments)


def test_impossible_option_override(tmp_path, capsys):
    body = CASE.replace("pipeline_model_parallel_size: 4}", "pipeline_model_parallel_size: 4, options: {lr: .inf}}")
    _verify_error(tmp_path, capsys, body, "variant 'v'", "options.lr")


def test_too_many_ranks(tmp_path):
    layout = "Ettt" + "|" * 1023 + "tmL"    # 1024 stages, valid at P=1024
    body = CASE.replace('"Et|tt|tm|L", pipeline_model_parallel_size: 4',
                        f'"{layout}", pipeline_model_parallel_size: 1024, expert_model_parallel_size: 64')
    body = body.replace("num_layers: 4,", "num_layers: 4, num_moe_experts: 64,").replace("seq_length: 8", "seq_length: 64")
    (tmp_path / "c.yaml").write_text(body)
    with pytest.raises(UsageError, match=r"variant 'v'.*65536 ranks.*at most 256"):
        load_case(tmp_path / "c.yaml")


def test_schedule_too_long(tmp_path):
    layout = "Ettt" + "|" * 63 + "tmL"      # P=64, V=1
    body = CASE.replace('"Et|tt|tm|L", pipeline_model_parallel_size: 4', f'"{layout}", pipeline_model_parallel_size: 64')
    body = body.replace("num_microbatches: 4", "num_microbatches: 4096")
    (tmp_path / "c.yaml").write_text(body)
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=r"variant 'v'.*num_microbatches"):
        load_case(tmp_path / "c.yaml")
    assert time.monotonic() - t0 < 10


def test_cli_timeout_and_budget_bounds(tmp_path, capsys):
    case = tmp_path / "case.yaml"
    case.write_text(CASE)
    out = tmp_path / "reports"
    assert "--timeout" in _one_line_error(capsys, out, "verify", case, "--out", out, "--timeout", "1e30")
    for budget in ("nan", "infs", "1e400"):
        assert "--budget" in _one_line_error(capsys, out, "fuzz", case, "--out", out, "--budget", budget)
        assert "--budget" in _one_line_error(capsys, out, "verify", case, "--out", out, "--budget", budget)
    assert "--max-pp" in _one_line_error(capsys, out, "fuzz", case, "--out", out, "--max-pp", "100000")
    for n in ("0", "-3", "1000000"):
        assert "--max-layouts" in _one_line_error(capsys, out, "fuzz", case, "--out", out, "--max-layouts", n)
    assert "--max-vpp 0:" in _one_line_error(capsys, out, "fuzz", case, "--out", out, "--max-vpp", "0")
    for n in ("0", "-1", "100000"):
        assert f"--jobs {n}:" in _one_line_error(capsys, out, "fuzz", case, "--out", out, "--jobs", n)
    # argparse's own errors name the command once: "bitparity: error: fuzz: argument --jobs: ..."
    assert _one_line_error(capsys, out, "fuzz", case, "--out", out, "--jobs", "abc").startswith(
        "bitparity: error: fuzz: argument --jobs")


def test_fuzz_refuses_an_unwritable_out_before_searching(tmp_path, capsys):
    """fuzz writes only when a layout differs, after minutes of search: --out is checked first, nothing runs."""
    case = tmp_path / "case.yaml"
    case.write_text(CASE)
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for out, words in ((afile / "sub", "not a directory"), (afile, "not a directory")):
        assert words in _one_line_error(capsys, tmp_path / "unused", "fuzz", case, "--out", out, "--budget", "10m",
                                        "--max-layouts", "1")
    assert afile.read_text() == "mine\n"
    assert "--out: empty path" in _one_line_error(capsys, tmp_path / "none", "fuzz", case, "--out", "")
    out = tmp_path / "out"
    out.mkdir()
    occupied = out / "t-fuzz-minimal.yaml"          # where a minimal case of CASE (name: t) would go
    occupied.write_text("a file of the user's\n")
    rc, lines = _cli(capsys, "fuzz", case, "--out", out, "--budget", "10m", "--max-layouts", "1")
    assert rc == 2 and len(lines) == 1 and "not written by bitparity fuzz" in lines[0], lines
    assert occupied.read_text() == "a file of the user's\n"


# --- 3. bombs --------------------------------------------------------------------------------------------------

def _merge_bomb(levels: int) -> str:
    """Each level merges the previous one twice: PyYAML's merge flattening doubles the node list per level."""
    lines = ["x-l0: &l0 {a: 1, b: 2, c: 3, d: 4}"]
    lines += [f"x-l{i}: &l{i} {{<<: [*l{i - 1}, *l{i - 1}], k{i}: 0}}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb(tmp_path):
    (tmp_path / "c.yaml").write_text(_merge_bomb(17) + CASE)
    with pytest.raises(UsageError, match=r"c\.yaml: YAML aliases expand to more than"):
        load_case(tmp_path / "c.yaml")


def test_yaml_alias_bomb_in_an_extended_file(tmp_path):
    (tmp_path / "parent.yaml").write_text(_merge_bomb(17) + CASE)
    (tmp_path / "child.yaml").write_text("extends: parent.yaml\nname: child\n")
    with pytest.raises(UsageError, match=r"parent\.yaml: YAML aliases expand"):
        load_case(tmp_path / "child.yaml")


def test_yaml_recursive_alias(tmp_path):
    (tmp_path / "c.yaml").write_text("x-r: &r [1, *r]\n" + CASE)
    with pytest.raises(UsageError, match=r"c\.yaml.*recursive"):
        load_case(tmp_path / "c.yaml")


def test_case_file_too_large(tmp_path):
    (tmp_path / "c.yaml").write_text(CASE + "# " + "x" * (2 << 20) + "\n")
    with pytest.raises(UsageError, match=r"c\.yaml: .*larger than"):
        load_case(tmp_path / "c.yaml")


def test_moe_layer_freq_bomb(tmp_path, capsys):
    body = CASE.replace('moe_layer_freq: "[0]*1+[1]*3"', 'moe_layer_freq: "[0]*999999999999"')
    _verify_error(tmp_path, capsys, body, "moe_layer_freq")
    with pytest.raises(ValueError, match="num_layers"):
        parse_moe_layer_freq("[0]*3+[1]*99999999999999999999", 4)
    with pytest.raises(ValueError, match="num_layers"):
        parse_moe_layer_freq("[0,1]*3", 4)


def test_layout_explain_bomb_is_fast():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "layout", "explain", "E(|t)*499998|L", "--pp", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "more than" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_layout_queries_are_linear():
    # 30002 stages at P=2: the old per-stage prefix sums made pretty() quadratic (about a minute here)
    text = "E" + "|t" * 30000 + "|L"
    t0 = time.monotonic()
    lay = PipelineLayout.from_string(text, 2, 30000)
    grid = lay.pretty()
    assert time.monotonic() - t0 < 5
    assert "t29999" in grid and lay.decoder_layer_ids(30000) == [29999]


def test_layout_stage_bound_and_short_messages():
    with pytest.raises(LayoutError, match="more than 65536 stages"):
        PipelineLayout.from_string("E" + "|" * 70000 + "tL", 1, 1)
    with pytest.raises(LayoutError) as err:
        PipelineLayout.from_string("E|" * 40000 + "tL", 1, 1)
    assert len(str(err.value)) < 400, len(str(err.value))
    # the bound leaves room for every legal P x V: 1024 ranks x 64 virtual stages
    PipelineLayout.from_string("E" + "|" * 65535 + "tL", 1024, 1)


# --- 4. compare_to cycles --------------------------------------------------------------------------------------

def test_compare_to_cycle(tmp_path, capsys):
    body = CASE.replace("pipeline_model_parallel_size: 4}", "pipeline_model_parallel_size: 4, compare_to: w}")
    body += "  - {name: w, pipeline_model_parallel_layout: 'Ett|ttmL', pipeline_model_parallel_size: 2, compare_to: v}\n"
    _verify_error(tmp_path, capsys, body, "compare_to cycle", "'v' -> 'w' -> 'v'")


# --- 5. control characters in names ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", [r"bad\e[31mred", r"two\nlines", r"rtl\u202eoverride", r"tab\there"])
def test_control_characters_in_names(tmp_path, capsys, name):
    body = CASE.replace("- {name: v,", f'- {{name: "{name}",')
    line = _verify_error(tmp_path, capsys, body, "variants.0.name", "non-printable")
    assert "\x1b" not in line and "\u202e" not in line


def test_control_characters_in_baseline_and_compare_to(tmp_path, capsys):
    _verify_error(tmp_path, capsys, CASE.replace("{name: base,", r'{name: "b\e[2J",'), "baseline.name")
    body = CASE.replace("pipeline_model_parallel_size: 4}", r'pipeline_model_parallel_size: 4, compare_to: "x\e"}')
    _verify_error(tmp_path, capsys, body, "variant 'v': compare_to")


def test_control_characters_in_a_path_are_escaped(tmp_path, capsys):
    out = tmp_path / "reports"
    line = _one_line_error(capsys, out, "verify", tmp_path / "evil\x1b[2J\nname.yaml", "--out", out)
    assert "no such case file" in line and "\\x1b" in line


# --- 6. OS errors name the path ----------------------------------------------------------------------------------

def _deny(monkeypatch, target, *methods):
    """Make reads/writes of `target` raise PermissionError, as chmod 000 would for a non-root user."""
    target = pathlib.Path(target)
    for meth in methods:
        orig = getattr(pathlib.Path, meth)

        def denied(self, *a, _orig=orig, **k):
            if pathlib.Path(self) == target:
                raise PermissionError(13, "Permission denied", str(self))
            return _orig(self, *a, **k)
        monkeypatch.setattr(pathlib.Path, meth, denied)


def test_unreadable_case_file(tmp_path, capsys, monkeypatch):
    case = tmp_path / "case.yaml"
    case.write_text(CASE)
    if os.geteuid() == 0:
        _deny(monkeypatch, case, "open", "read_text", "read_bytes")
    else:
        case.chmod(0)
    out = tmp_path / "reports"
    line = _one_line_error(capsys, out, "verify", case, "--out", out)
    assert str(case) in line and "permission denied" in line.lower(), line


def test_unreadable_data_file(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data.txt"
    data.write_text("hello world, some text\n\nmore text here\n")
    if os.geteuid() == 0:
        _deny(monkeypatch, data, "open", "read_text", "read_bytes")
    else:
        data.chmod(0)
    body = CASE.replace("training: {", f"training: {{data: {{path: {data}}}, ")
    line = _verify_error(tmp_path, capsys, body, "training.data.path", str(data))
    assert "permission denied" in line.lower(), line


def test_unwritable_out(tmp_path, capsys, monkeypatch):
    case = tmp_path / "case.yaml"
    case.write_text(CASE)
    out = tmp_path / "ro" / "reports"
    if os.geteuid() == 0:
        _deny(monkeypatch, out, "mkdir")
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
    line = _one_line_error(capsys, out, "verify", case, "--out", out)
    assert f"--out {out}" in line and "permission denied" in line.lower(), line


def test_a_schema_error_in_a_variant_names_the_variant(tmp_path, capsys):
    body = CASE.replace("pipeline_model_parallel_size: 4}", "pipeline_model_parallel_size: 4, data_parallel_size: 0}")
    _verify_error(tmp_path, capsys, body, "variant 'v': data_parallel_size: Input should be greater than or equal to 1")
