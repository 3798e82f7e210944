"""Two megatron sources in one case (`verify --megatron-base/--megatron-head`, harness.planning.sources): Megatron-LM PR
#2136's first check, the same layouts on the merge request and its target branch, bit for bit.

* two identical sources (the installed megatron-core and a copy of it): every run on base is bitwise equal to
  its run on head, and the report names both sources;
* a head with a planted change in megatron's MTP layer (`MultiTokenPredictionLayer`: the concatenation of
  embedding and hidden state swapped): the layouts within head still agree with each other (the change is the
  same on every layout, which is why check (1) exists), while every base run differs from its head run first
  at step 0, microbatch 0, the MTP loss (the LM loss equal there);
* a source that is not a megatron, cannot be imported, or rejects a layout is one line before anything runs.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, run_cli  # noqa: E402
from planted import planted_megatron, planted_tree, run_planted  # noqa: E402
from test_cli_errors import _check_usage_error  # noqa: E402

from megatron_trainer.source import installed_root  # noqa: E402

CASE = ROOT / "tests" / "cases" / "megatron-small.yaml"
BASELINE, STANDALONE = "pp2-vpp2-mtp-with-loss", "pp4-mtp-only-stage"
MTP = "megatron/core/transformer/multi_token_prediction.py"
SWAP = ("hidden_states = torch.cat((decoder_input, hidden_states), -1)",
        "hidden_states = torch.cat((hidden_states, decoder_input), -1)")

# --megatron-base / --megatron-head are bitparity's own code with megatron-core as their input: run on the newest
# release only (CI: PY=3.12)
pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.newest_megatron]


def _verify(out, *args, env=None):
    proc = run_cli("verify", CASE, "--out", out, "--only", STANDALONE, *args, env=env)
    summary = out / CASE.stem / "summary.json"
    assert summary.exists(), proc.stdout + proc.stderr
    return proc, json.loads(summary.read_text())


def test_identical_sources_pass_and_are_named(tmp_path):
    base = planted_megatron(tmp_path / "base", {})
    proc, summary = _verify(tmp_path / "out", "--megatron-base", base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v = {x["name"]: x for x in summary["variants"]}
    assert set(v) == {BASELINE, STANDALONE, BASELINE + "@base", STANDALONE + "@base"}
    for name in (BASELINE, STANDALONE):
        twin = v[name + "@base"]
        assert (twin["compare_to"], twin["expect"], twin["verdict"], twin["bitwise_equal"]) == \
            (name, "bitwise", "pass", True)
    src = summary["megatron_sources"]
    assert src["base"]["path"] == str(base.resolve()) and src["head"]["path"] == installed_root()
    assert src["base"]["version"] == src["head"]["version"]
    env = summary["environment"]
    assert str(base.resolve()) in env["megatron_base"] and installed_root() in env["megatron_head"]
    md = (tmp_path / "out" / CASE.stem / "summary.md").read_text()
    assert "Megatron base:" in md and "Megatron head:" in md
    # each run records the megatron it imported; the base run's reproduce command repeats the flag
    report = tmp_path / "out" / CASE.stem
    manifest = json.loads((report / "runs" / (STANDALONE + "_base") / "manifest.json").read_text())
    assert manifest["trainer"]["megatron_path"] == str(base.resolve())
    assert manifest["config"]["megatron_path"] == str(base.resolve())
    assert f"--only {STANDALONE} " in manifest["command"] and "--megatron-base" in manifest["command"]
    head = json.loads((report / "runs" / STANDALONE / "manifest.json").read_text())
    assert head["trainer"]["megatron_path"] == installed_root()
    # what the ranks themselves imported (their trace headers), not only what they were told
    for run, path in ((STANDALONE + "_base", str(base.resolve())), (STANDALONE, installed_root())):
        for rank in range(4):
            header = json.loads((report / "runs" / run / f"rank{rank}.jsonl").read_text().splitlines()[0])
            assert header["settings"]["megatron_path"] == path, (run, rank)


# megatron-core's package, planted: each process that imports it appends its pid and the copy's directory to the
# file the test names
_IMPORTED = "\nimport megatron.core.utils\n"
_IMPORTED_LOGGED = ("\nimport os as _bp_os\n"
                    "if _bp_os.environ.get('BITPARITY_TEST_IMPORT_LOG'):\n"
                    "    open(_bp_os.environ['BITPARITY_TEST_IMPORT_LOG'], 'a').write(\n"
                    "        f'{_bp_os.getpid()} {_bp_os.path.dirname(_bp_os.path.dirname(_bp_os.path.dirname(__file__)))}\\n')\n"
                    "import megatron.core.utils\n")


def _imports(log) -> dict:
    """{copy's directory: how many processes imported it} from the planted copies' log."""
    counts = {}
    for line in log.read_text().splitlines():
        where = os.path.realpath(line.split(" ", 1)[1])
        counts[where] = counts.get(where, 0) + 1
    return counts


# the second source's forkserver fails to start (harness/running/forkservers.py, planted)
NO_SERVER = {"harness/running/forkservers.py": [("    server = _SERVERS.get(source)\n",
                                                  "    return False\n    server = _SERVERS.get(source)\n")]}


@pytest.mark.parametrize("sources", ["head", "base and head", "base and head, no server for base"])
def test_each_source_is_imported_once_by_its_forkserver_not_by_every_rank(tmp_path, sources):
    """Every run on one source (here a copy given as --megatron-head), and the same runs on two (a second copy as
    --megatron-base: PR #2136's first check): each copy is imported once by a forkserver of its own and the
    ranks fork with it loaded.  Imports of the head: one, the harness's (it validates the head's runs, and its
    forkserver is the harness forked: `harness.running.forkservers.forked_spawn`); of the base: the validator (a
    process of its own, as for any source the harness does not import) and its forkserver; never one per rank (6
    ranks per source: the baseline's 2 and the standalone run's 4; ~4-8 s of CPU each on 2 cores).  Should the
    second source's server not start, every run still runs, each rank importing its own megatron (the baseline
    alone here: validator + 2 ranks per copy)."""
    log = tmp_path / "imports.txt"
    planted = {"megatron/core/__init__.py": [(_IMPORTED, _IMPORTED_LOGGED)]}
    copies = {"head": planted_megatron(tmp_path / "head", planted)}
    if sources.startswith("base and head"):
        copies["base"] = planted_megatron(tmp_path / "base", planted)
    flags = [a for role, copy in copies.items() for a in (f"--megatron-{role}", copy)]
    env = {"BITPARITY_TEST_IMPORT_LOG": str(log)}
    fallback = sources.endswith("no server for base")
    if fallback:        # the baseline alone (2 ranks a source): every rank imports its megatron, ~8 s of CPU each
        tree = planted_tree(tmp_path / "tree", NO_SERVER)
        proc = run_planted(tree, "verify", CASE, "--out", tmp_path / "out", "--only", BASELINE, *flags, env=env)
        summary = json.loads((tmp_path / "out" / CASE.stem / "summary.json").read_text())
    else:
        proc, summary = _verify(tmp_path / "out", *flags, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    report = tmp_path / "out" / CASE.stem
    ranks = {}
    for run in (x["name"] for x in summary["variants"]):
        copy = copies["base" if run.endswith("@base") else "head"]
        for trace in sorted((report / "runs" / run.replace("@", "_")).glob("rank*.jsonl")):
            header = json.loads(trace.read_text().splitlines()[0])
            assert header["settings"]["megatron_path"] == str(copy.resolve()), (run, trace.name)
            ranks[copy] = ranks.get(copy, 0) + 1
    assert set(ranks.values()) == {2 if fallback else 6}, ranks
    per_copy = {"head": 1 + 2, "base": 1 + 2} if fallback else {"head": 1, "base": 2}
    assert _imports(log) == {str(copy.resolve()): per_copy[role] for role, copy in copies.items()}, log.read_text()


def test_a_planted_megatron_change_fails_at_the_mtp_loss(tmp_path):
    head = planted_megatron(tmp_path / "head", {MTP: [SWAP]})
    proc, summary = _verify(tmp_path / "out", "--megatron-base", "installed", "--megatron-head", head)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    v = {x["name"]: x for x in summary["variants"]}
    assert v[STANDALONE]["verdict"] == "pass" and v[STANDALONE]["bitwise_equal"]   # within head: same change
    for name in (BASELINE, STANDALONE):
        twin = v[name + "@base"]
        assert twin["verdict"] == "fail", twin
        fd = twin["first_divergence"]
        assert (fd["step"], fd["kind"], fd["microbatch"], fd["name"]) == (0, "loss", 0, "mtp_1"), fd
    # the LM loss of that microbatch is equal: the change is in the MTP layer only
    report = tmp_path / "out" / CASE.stem
    a, b = (json.loads((report / "runs" / d / "trace.json").read_text()) for d in (STANDALONE, STANDALONE + "_base"))
    la, lb = a["steps"][0]["losses"][0], b["steps"][0]["losses"][0]
    assert la["lm"]["hex"] == lb["lm"]["hex"] and la["mtp"][0]["hex"] != lb["mtp"][0]["hex"]
    assert summary["megatron_sources"]["head"]["path"] == str(head.resolve())


@pytest.mark.parametrize("flags, fragments", [
    (["--megatron-base", "/nonexistent/mlm"], ["--megatron-base /nonexistent/mlm", "no such directory"]),
    (["--megatron-base", str(ROOT / "README.md")], ["not a directory"]),
    (["--megatron-base", str(ROOT / "cases")], ["not a Megatron-LM checkout", "no megatron/core/"]),
    (["--megatron-head", str(ROOT / "cases")], ["--megatron-head", "no megatron/core/"]),
    (["--megatron-base", ""], ["--megatron-base: empty path"]),
    (["--megatron-base", "installed", "--golden", str(ROOT / "goldens" / "smoke")], ["goldens hold"]),
])
def test_a_bad_source_is_one_line(tmp_path, flags, fragments):
    _check_usage_error(run_cli("verify", CASE, "--out", tmp_path / "out", *flags), tmp_path / "out", *fragments)


def test_a_case_without_megatron_runs_is_one_line(tmp_path):
    proc = run_cli("verify", ROOT / "cases" / "smoke.yaml", "--out", tmp_path / "out", "--megatron-base", "installed")
    _check_usage_error(proc, tmp_path / "out", "no megatron-core run")


def test_a_base_that_cannot_be_imported_is_one_line(tmp_path):
    base = planted_megatron(tmp_path / "base", {"megatron/core/__init__.py": [
        ("from megatron.core.package_info import", "raise ImportError('planted')\nfrom megatron.core.package_info import")]})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--megatron-base", base)
    _check_usage_error(proc, tmp_path / "out", f"--megatron-base {base}", "cannot be imported", "planted")


def test_a_layout_the_base_rejects_is_named_before_anything_runs(tmp_path):
    """megatron's own validator runs for the base too, in a process that imports the base (PR #2136 adds
    layouts its target branch rejects)."""
    base = planted_megatron(tmp_path / "base", {"megatron/core/transformer/transformer_config.py": [
        ("    def __post_init__(self):\n        super().__post_init__()\n",
         "    def __post_init__(self):\n        super().__post_init__()\n"
         "        if self.mtp_num_layers:\n            raise ValueError('planted: no MTP here')\n")]})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--megatron-base", base)
    _check_usage_error(proc, tmp_path / "out", "--megatron-base", f"run {BASELINE!r}", "planted: no MTP here")


def test_a_base_that_prints_on_import_is_validated(tmp_path):
    """Whatever megatron prints while the base is validated is not the validator's answer."""
    base = planted_megatron(tmp_path / "base", {"megatron/core/__init__.py": [
        ("from megatron.core.package_info import", "print('hello from base')\nfrom megatron.core.package_info import")]})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--only", STANDALONE + "@base", "--megatron-base", base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v = {x["name"] for x in json.loads((tmp_path / "out" / CASE.stem / "summary.json").read_text())["variants"]}
    assert v == {BASELINE, STANDALONE, BASELINE + "@base", STANDALONE + "@base"}       # --only X@base: X and X@base


def test_the_reproduce_command_names_an_implicit_head(tmp_path):
    """Head from PYTHONPATH (or the venv) is written into every reproduce command: the command must not depend
    on an environment it does not carry."""
    base = planted_megatron(tmp_path / "base", {})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--only", STANDALONE, "--megatron-base", base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((tmp_path / "out" / CASE.stem / "runs" / STANDALONE / "manifest.json").read_text())
    assert f"--megatron-head {installed_root()}" in manifest["command"]


def test_the_same_directory_twice_is_said(tmp_path):
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--only", STANDALONE, "--megatron-base", "installed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same directory" in proc.stderr and "Traceback" not in proc.stderr
    summary = json.loads((tmp_path / "out" / CASE.stem / "summary.json").read_text())
    assert summary["megatron_sources"]["same"] is True
    assert "same directory" in (tmp_path / "out" / CASE.stem / "summary.md").read_text()


def test_names_ending_in_at_base_are_refused(tmp_path):
    case = tmp_path / "named.yaml"
    case.write_text(f"extends: {CASE}\nname: named\nvariants:\n  - name: x@base\n"
                    "    pipeline_model_parallel_layout: \"Ett|tt|m|L\"\n    pipeline_model_parallel_size: 4\n")
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out", "--megatron-base", "installed"),
                       tmp_path / "out", "'x@base'", "names ending in '@base'")


def test_a_head_that_cannot_be_imported_names_its_directory(tmp_path):
    head = planted_megatron(tmp_path / "head", {"megatron/core/package_info.py": [("\nMAJOR", "\ngarbage(\nMAJOR")]})
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--megatron-head", head, "--megatron-base", "installed",
                   env={"BITPARITY_MEGATRON_UNCHECKED": "1"})
    _check_usage_error(proc, tmp_path / "out", f"the megatron-core in {head.resolve()} cannot be imported")


def test_a_source_whose_megatron_is_a_symlink_is_that_source(tmp_path):
    """A directory whose megatron/ links to another tree: megatron.core comes from that directory's path."""
    src = tmp_path / "linked"
    src.mkdir()
    (src / "megatron").symlink_to(planted_megatron(tmp_path / "copy", {}) / "megatron")
    proc = run_cli("verify", CASE, "--out", tmp_path / "out", "--only", STANDALONE, "--megatron-base", src)
    assert proc.returncode == 0, proc.stdout + proc.stderr
