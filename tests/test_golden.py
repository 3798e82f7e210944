"""Goldens (harness.judging.golden): a change that moves every layout alike passes the layout comparison and fails
the golden check, naming the first tensor computed differently; a golden from another environment is
reported as such before any bit is compared.

The planted bugs are real code changes (tests/planted.py) of the kind measured in issue #14: the MoE aux-loss
scale divided by num_microbatches twice, the LM loss normalised per sample instead of per token."""
import json
from pathlib import Path

import pytest
from conftest import ROOT, once
from planted import planted_tree, run_planted

from harness.errors import UsageError
from harness.judging import golden
from harness.judging.trace import StepTrace, Trace

GOLDENS = ROOT / "goldens" / "smoke"
ONLY = ("--only", "pp2-mtp-with-loss", "--only", "pp4-mtp-standalone")
ROUTER = "mtp.layers.0.transformer_layer.mlp.router.weight"
PLANTED = {
    "aux_loss_scale_twice": {"reference_impl/train.py": [(
        "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches)",
        "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches) / t.num_microbatches")]},
    "lm_loss_per_sample": {"reference_impl/model/losses.py": [(
        "    lm_loss = loss_sum / num_tokens.clamp(min=1)\n",
        "    token_losses = token_ce(head, h0, labels) * loss_mask\n"
        "    lm_loss = (token_losses.sum(-1) / loss_mask.sum(-1).clamp(min=1)).mean()\n")]},
}


@pytest.fixture
def golden_env(monkeypatch):
    """The arithmetic the shipped goldens are recorded under (Makefile GOLDEN_ENV)."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")


def _trace(fp="aaaa", loss="0x3f800000"):
    meta = {"key": "output_layer.weight", "name": "output_layer.weight", "replica": None, "shape": [4, 4],
            "dtype": "float32", "family": "embedding/head", "weight_decay": True, "order": [4, 0, 0], "rank": 1}
    step = StepTrace(step=0, losses=[{"microbatch": 0, "lm": {"hex": loss, "value": 1.0}, "mtp": [],
                                      "num_tokens": 4}], grads={"output_layer.weight": fp},
                     params={"output_layer.weight": "bbbb"}, time_s={"0": 0.1})
    return Trace(format="bitparity-trace/2", params={"output_layer.weight": meta}, order=["output_layer.weight"],
                 init={"output_layer.weight": "cccc"}, steps=[step], world_size=2)


KEY = {"torch": "2.13.0+cpu", "aten_cpu_capability": "DEFAULT", "mkl_cbwr": "COMPATIBLE"}
REF = {"trainer": "reference"}


INTEL, AMD = "GenuineIntel family 6", "AuthenticAMD family 26"


def _record(directory, traces, key=KEY, family=INTEL):
    golden.write(directory, "c", traces, {n: n for n in traces}, key, {"cpu_model": "x", "cpu_family": family},
                 dict.fromkeys(traces, REF))


def _load(directory, names, key=KEY, iters=1, trainer=REF):
    return golden.load(directory, "c", {n: (iters, trainer) for n in names}, key)


def test_golden_round_trip_and_a_changed_bit(tmp_path):
    _record(tmp_path, {"a": _trace(), "b": _trace()})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a.json"]     # identical bits: one file
    loaded = _load(tmp_path, ["a", "b", "new"])
    case, per = golden.check(loaded, tmp_path, {"a": _trace(), "b": _trace(fp="dddd"), "new": _trace()}, INTEL)
    assert per["a"]["status"] == "equal" and case["verdict"] == "fail"
    assert per["b"]["status"] == "differs" and per["b"]["first_divergence"]["name"] == "output_layer.weight"
    assert per["b"]["detail"].startswith("first difference from the golden (golden vs this run): step 0 grad "
                                         "output_layer.weight")
    assert per["new"]["status"] == "missing"


def test_another_cpu_family_is_named_not_blamed_and_confirming_it_adds_it(tmp_path):
    """On a family goldens checked on one family were never checked on, a difference is `unchecked` (one line,
    not a failure); the same bits recorded there add the family to checked_on; other bits start the list again."""
    _record(tmp_path, {"a": _trace()})
    assert json.loads((tmp_path / "golden.json").read_text())["checked_on"] == [INTEL]
    case, per = golden.check(_load(tmp_path, ["a"]), tmp_path, {"a": _trace(fp="dddd")}, AMD)
    assert case["verdict"] == "unchecked" and per["a"]["status"] == "unchecked", case
    assert case["detail"].startswith(f"goldens checked on {INTEL}, never on {AMD}: 1 of 1 run(s) differ")
    case, _ = golden.check(_load(tmp_path, ["a"]), tmp_path, {"a": _trace()}, AMD)
    assert case["verdict"] == "pass" and f"first check on {AMD}" in case["detail"]
    _record(tmp_path, {"a": _trace()}, family=AMD)          # the same bits: confirmed there
    assert json.loads((tmp_path / "golden.json").read_text())["checked_on"] == sorted([INTEL, AMD])
    case, per = golden.check(_load(tmp_path, ["a"]), tmp_path, {"a": _trace(fp="eeee")}, AMD)
    assert case["verdict"] == "fail" and per["a"]["status"] == "differs"
    _record(tmp_path, {"a": _trace(fp="eeee")}, family=AMD)  # other bits: only where they were recorded
    assert json.loads((tmp_path / "golden.json").read_text())["checked_on"] == [AMD]


OTHER = "HygonGenuine family 24"          # a family neither shipped golden was ever checked on


def _check_here(monkeypatch, directory, traces, family=OTHER):
    """`golden.apply` as `verify --golden` calls it, on a machine whose `harness.running.arithmetic.cpu_family` reports
    `family` (the environment it passes on is `harness.running.arithmetic.environment`'s, as in `harness.verify`)."""
    from types import SimpleNamespace

    from harness.running import arithmetic
    monkeypatch.setattr(arithmetic, "cpu_family", lambda: family)
    env = arithmetic.environment()
    assert env["cpu_family"] == family
    req = golden.GoldenRequest(directory, False, KEY, _load(directory, list(traces)))
    variants = [SimpleNamespace(name=n, golden=None) for n in traces]
    lines = []
    case = golden.apply(req, None, env, traces, variants, {}, lines.append)
    return case, {v.name: v.golden for v in variants}, lines


def _exit_ok(case) -> bool:
    """Whether a case with this golden record (and no other finding) exits 0 (`CaseResult.all_pass`)."""
    from harness.judging.results import CaseResult
    return CaseResult(case="c", case_path="c.yaml", baseline="a", variants=[], elapsed_s=0.0, environment={},
                      command="", golden=case).all_pass


@pytest.mark.arithmetic_free
def test_a_difference_on_an_unlisted_family_fails_where_two_families_agreed(tmp_path, monkeypatch):
    """Goldens whose bits held on two CPU families were shown portable: a difference on a third is the code's
    until shown otherwise (a failure, exit 1), the words naming the family as a possible cause and the command
    that adds it once a clean build agrees."""
    _record(tmp_path, {"a": _trace(), "b": _trace()})
    _record(tmp_path, {"a": _trace(), "b": _trace()}, family=AMD)      # the same bits: portable
    assert json.loads((tmp_path / "golden.json").read_text())["checked_on"] == [AMD, INTEL]
    case, per, lines = _check_here(monkeypatch, tmp_path, {"a": _trace(fp="dddd"), "b": _trace()})
    assert case["verdict"] == "fail" and per["a"]["status"] == "differs" and per["b"]["status"] == "equal", case
    hint = (f"may differ, only here: this CPU family ({OTHER}) is not in checked_on [{AMD}, {INTEL}]; once a "
            f"clean build (a known-good commit) agrees here, `make golden` (`bitparity verify CASE --write-golden "
            f"{tmp_path}`) adds it")
    assert case["detail"] == f"1 of 2 run(s) not bitwise equal to their golden: a; {hint}", case["detail"]
    assert per["a"]["detail"].startswith("first difference from the golden (golden vs this run): step 0 grad "
                                         "output_layer.weight") and per["a"]["detail"].endswith(f"({hint})")
    assert any(line.startswith("[golden] a: DIFFERS:") and OTHER in line for line in lines), lines
    # the result fails the command (exit 1), where an `unchecked` verdict would not
    assert not _exit_ok(case)
    # a listed family gets the difference without the hint: nothing points at the CPU there
    case, per, _ = _check_here(monkeypatch, tmp_path, {"a": _trace(fp="dddd")}, family=INTEL)
    assert case["verdict"] == "fail" and "may differ" not in case["detail"] + per["a"]["detail"], case
    # a missing golden alone is no reason to suspect the CPU
    case, per, _ = _check_here(monkeypatch, tmp_path, {"a": _trace(), "new": _trace()})
    assert case["verdict"] == "fail" and per["new"]["status"] == "missing" and "may differ" not in case["detail"]


@pytest.mark.arithmetic_free
def test_a_difference_on_an_unlisted_family_stays_unchecked_with_one_family_listed(tmp_path, monkeypatch):
    """One family shows nothing about another vendor's code paths: the difference cannot be judged."""
    _record(tmp_path, {"a": _trace()})
    assert json.loads((tmp_path / "golden.json").read_text())["checked_on"] == [INTEL]
    case, per, _ = _check_here(monkeypatch, tmp_path, {"a": _trace(fp="dddd")})
    assert case["verdict"] == "unchecked" and per["a"]["status"] == "unchecked", case
    assert case["detail"].startswith(f"goldens checked on {INTEL}, never on {OTHER}: 1 of 1 run(s) differ, not "
                                     "counted as a code change"), case["detail"]
    assert "may differ" not in case["detail"] + per["a"]["detail"]
    assert _exit_ok(case)


@pytest.mark.arithmetic_free
def test_equal_bits_on_an_unlisted_family_pass_and_say_how_to_add_it(tmp_path, monkeypatch):
    _record(tmp_path, {"a": _trace()})
    _record(tmp_path, {"a": _trace()}, family=AMD)
    case, per, _ = _check_here(monkeypatch, tmp_path, {"a": _trace()})
    assert case["verdict"] == "pass" and per["a"]["status"] == "equal", case
    assert case["detail"] == f"1 run(s) bitwise equal to their goldens (first check on {OTHER}: `make golden` adds " \
                             "it to checked_on)", case["detail"]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("family", ["", "  ", None])
def test_a_check_without_a_cpu_family_is_one_line(tmp_path, family):
    _record(tmp_path, {"a": _trace()})
    with pytest.raises(ValueError, match=r"^golden check: the CPU family must be a non-empty string, not "):
        golden.check(_load(tmp_path, ["a"]), tmp_path, {"a": _trace()}, family)


def test_another_environment_or_step_count_is_refused_before_anything_runs(tmp_path):
    _record(tmp_path, {"a": _trace()})
    with pytest.raises(UsageError, match=r"recorded in another environment, nothing run: aten_cpu_capability "
                                         r"'DEFAULT' \(golden\) vs 'AVX512' \(here\)"):
        _load(tmp_path, ["a"], key={**KEY, "aten_cpu_capability": "AVX512"})
    with pytest.raises(UsageError, match="variant 'a' recorded with another trainer"):
        _load(tmp_path, ["a"], trainer={"trainer": "megatron-core", "megatron_core": "0.16.1"})
    with pytest.raises(UsageError, match="variant 'a' has 1 golden steps, the run 8"):
        _load(tmp_path, ["a"], iters=8)


_STEP_DAMAGE = {
    "grads a list": lambda st: st.update(grads=[]),
    "grads null": lambda st: st.update(grads=None),
    "losses a string": lambda st: st.update(losses="x"),
    "a param fingerprint not a string": lambda st: st.update(params={"output_layer.weight": 7}),
    "a gradient of no parameter": lambda st: st["grads"].update(bogus="aaaa"),
    "an unknown step field": lambda st: st.update(surprise=1),
}


@pytest.mark.parametrize("damage", sorted(_STEP_DAMAGE) + ["format", "order", "init null", "inventory"])
def test_a_malformed_golden_trace_is_refused_before_anything_runs(tmp_path, damage):
    """Whatever passes the load check can be compared: a damaged trace is one line naming the file."""
    _record(tmp_path, {"a": _trace()})
    path = tmp_path / "runs" / "a.json"
    raw = json.loads(path.read_text())
    if damage in _STEP_DAMAGE:
        _STEP_DAMAGE[damage](raw["steps"][0])
    elif damage == "format":
        raw["format"] = "nope"
    elif damage == "order":
        raw["order"] = [1, 2]
    elif damage == "init null":
        raw["init"] = {"output_layer.weight": None}
    else:
        raw["params"]["output_layer.weight"]["order"] = "x"
    path.write_text(json.dumps(raw))
    with pytest.raises(UsageError, match=rf"^--golden {path}: not a golden trace"):
        _load(tmp_path, ["a"])


@pytest.mark.parametrize("checked_on", [None, "AuthenticAMD family 26", [1, 2], [["x"]], {"x": 1}, [""]])
def test_a_malformed_checked_on_is_refused(tmp_path, checked_on):
    _record(tmp_path, {"a": _trace()})
    index = json.loads((tmp_path / "golden.json").read_text())
    index["checked_on"] = checked_on
    (tmp_path / "golden.json").write_text(json.dumps(index))
    with pytest.raises(UsageError, match="checked_on must be a list of CPU families"):
        _load(tmp_path, ["a"])
    with pytest.raises(UsageError, match="checked_on must be a list of CPU families"):
        golden.check_writable(tmp_path, "c", False, KEY, AMD)


@pytest.mark.parametrize("damage", ["truncated", "not json", "wrong keys", "path escape", "steps null"])
def test_a_damaged_golden_is_one_line_naming_it(tmp_path, damage):
    _record(tmp_path, {"a": _trace()})
    index = json.loads((tmp_path / "golden.json").read_text())
    run = tmp_path / "runs" / "a.json"
    if damage == "truncated":
        run.write_text(run.read_text()[:50])
    elif damage == "not json":
        run.write_text("{")
    elif damage == "wrong keys":
        run.write_text(json.dumps({"steps": []}))
    elif damage == "steps null":
        raw = json.loads(run.read_text())
        run.write_text(json.dumps({**raw, "steps": None}))
    else:
        index["variants"]["a"]["file"] = "runs/../../../etc/passwd"
        (tmp_path / "golden.json").write_text(json.dumps(index))
    with pytest.raises(UsageError) as e:
        _load(tmp_path, ["a"])
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value), e.value


def test_write_refuses_another_case_and_keeps_foreign_files(tmp_path):
    _record(tmp_path, {"a": _trace(), "b": _trace(loss="0x3f800001")})
    with pytest.raises(UsageError, match="holds the goldens of case 'c', not 'smoke'"):
        golden.check_writable(tmp_path, "smoke", False, KEY)
    with pytest.raises(UsageError, match="a partial refresh"):
        golden.check_writable(tmp_path, "c", True, {**KEY, "torch": "2.11.0"})
    with pytest.raises(UsageError, match=f"a partial refresh \\(--only\\) on {AMD}, which these goldens were never"):
        golden.check_writable(tmp_path, "c", True, KEY, AMD)
    (tmp_path / "runs" / "notes.json").write_text("{}")            # not named by the index: never removed
    golden.check_writable(tmp_path, "c", True, KEY, INTEL)
    _record(tmp_path, {"b": _trace()})                             # --only b: b now shares a's bits (and file)
    index = json.loads((tmp_path / "golden.json").read_text())
    assert index["variants"]["a"]["file"] == index["variants"]["b"]["file"] == "runs/a.json"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a.json", "notes.json"]
    assert index["checked_on"] == [INTEL]
    _record(tmp_path, {"b": _trace()})                             # the same again: nothing moves
    assert json.loads((tmp_path / "golden.json").read_text()) == index


def test_bad_golden_directories_are_one_line(tmp_path, cli):
    with pytest.raises(UsageError, match="no golden.json there"):
        golden.load(tmp_path, "smoke", {}, KEY)
    with pytest.raises(UsageError, match="the goldens are of case 'smoke', not 'other'"):
        golden.load(GOLDENS, "other", {}, KEY)
    (tmp_path / "x.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and holds no golden.json"):
        golden.check_writable(tmp_path, "c", False, KEY)
    proc = cli("verify", "cases/smoke.yaml", "--golden", tmp_path / "nope", "--out", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no golden.json" in proc.stderr
    proc = cli("verify", "cases/smoke.yaml", "--golden", GOLDENS, "--write-golden", tmp_path, "--out", tmp_path)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    for flag in ("--golden", "--write-golden"):
        proc = cli("verify", "cases/smoke.yaml", flag, "", "--out", tmp_path)
        assert proc.returncode == 2 and f"{flag}: empty path" in proc.stderr, proc.stderr
    proc = cli("verify", "cases/smoke.yaml", "--write-golden", tmp_path / "x.txt" / "sub", "--out", tmp_path)
    assert proc.returncode == 2 and "--write-golden" in proc.stderr and "cannot create" in proc.stderr, proc.stderr
    assert not (tmp_path / "smoke").exists()


def test_shipped_goldens_are_small_and_cover_the_smoke_case():
    index = json.loads((GOLDENS / "golden.json").read_text())
    assert sum(p.stat().st_size for p in GOLDENS.iterdir()) < 512 * 1024
    assert index["format"] == golden.FORMAT and set(index["variants"]) == {"pp2-mtp-with-loss", "pp4-mtp-standalone", "pp2-vpp2-mtp-with-loss",
                                      "pp4-vpp2-mtp-standalone", "pp1", "canonical/pp1"}
    assert index["environment"]["aten_cpu_capability"] == "DEFAULT" and index["environment"]["mkl_cbwr"] == "COMPATIBLE"
    assert index["environment"]["python"] and index["checked_on"], index


def _verify(tree: Path, out: Path, goldens: Path = GOLDENS):
    # the shipped goldens hold GOLDEN_ITERS (Makefile) steps; the planted tests' own goldens the case's 2
    iters = ("--train-iters", "8") if goldens == GOLDENS else ()
    proc = run_planted(tree, "verify", ROOT / "cases/smoke.yaml", *ONLY, *iters, "--golden", goldens, "--out", out)
    summary = {n: json.loads((out / f"smoke/runs/{n}/comparison.json").read_text()) for n in ONLY[1::2]}
    return proc, summary


@pytest.fixture(scope="module")
def own_goldens(tmp_path_factory):
    """Goldens of the clean code recorded on this machine (GOLDEN_ENV): the planted bugs are checked against
    them, so the check means the same on every CPU family (the shipped goldens may be unchecked on this one)."""
    env = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    proc, base = once(tmp_path_factory, ["own-goldens", *ONLY], lambda base: run_planted(
        planted_tree(base / "tree", {}), "verify", ROOT / "cases/smoke.yaml", *ONLY,
        "--write-golden", base / "goldens", "--out", base / "out", env=env))
    assert proc.returncode == 0, proc.stdout[-2000:]
    return base / "goldens"


@pytest.mark.slow
def test_clean_code_matches_the_goldens(tmp_path, golden_env):
    """The shipped goldens hold here.  They are checked on two CPU families, so on any family a difference is a
    failure (`golden.check`); with fewer listed, one on an unlisted family would be `unchecked` (exit 0)."""
    proc, runs = _verify(planted_tree(tmp_path / "tree", {}), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-2000:]
    from harness.running.arithmetic import cpu_family
    checked = json.loads((GOLDENS / "golden.json").read_text())["checked_on"]
    judged = cpu_family() in checked or len(checked) >= golden.PORTABLE_FAMILIES
    allowed = {"equal"} if judged else {"equal", "unchecked"}
    assert all(r["golden"]["status"] in allowed for r in runs.values()), runs


SIMULATED = "SimulatedVendor family 99"
#: `harness.running.arithmetic.cpu_family` reporting a family no golden lists, in the planted copy (the CLI's process)
UNLISTED_FAMILY = {"harness/running/arithmetic.py": [(
    "    fields = _first_cpu()\n    if \"vendor_id\" not in fields:\n        return \"unknown\"\n",
    f"    return {SIMULATED!r}\n")]}
AUX_LOSS_THIRD = {"reference_impl/train.py": [(
    "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches)",
    "1.0 / faults.loss_divisor(cfg.inject, t.num_microbatches) / 3")]}


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["none", "aux_loss_scale_third"])
def test_the_shipped_goldens_fail_a_bug_on_an_unlisted_cpu_family(tmp_path, golden_env, bug):
    """The shipped goldens are checked on two families: on a third (simulated) the clean code passes and the
    aux-loss scale divided by 3 fails (exit 1), naming the family as a possible cause (it read "golden unchecked",
    exit 0, before).  Only the baseline runs: one run shows the verdict, and every layout gets the same numbers."""
    edits = {**UNLISTED_FAMILY, **(AUX_LOSS_THIRD if bug != "none" else {})}
    out = tmp_path / "out"
    proc = run_planted(planted_tree(tmp_path / "tree", edits), "verify", ROOT / "cases/smoke.yaml", "--only",
                       "pp2-mtp-with-loss", "--train-iters", "8", "--golden", GOLDENS, "--out", out)
    checked = json.loads((GOLDENS / "golden.json").read_text())["checked_on"]
    assert SIMULATED not in checked and len(checked) >= 2, checked
    g = json.loads((out / "smoke/runs/pp2-mtp-with-loss/comparison.json").read_text())["golden"]
    if bug == "none":
        assert proc.returncode == 0 and "golden pass" in proc.stdout, proc.stdout[-2000:]
        assert g["status"] == "equal" and f"first check on {SIMULATED}" in proc.stdout, proc.stdout[-2000:]
        return
    assert proc.returncode == 1 and "smoke: 1/1 pass, golden fail" in proc.stdout, proc.stdout[-2000:]
    assert g["status"] == "differs" and g["first_divergence"]["step"] == 0, g
    assert (g["first_divergence"]["kind"], g["first_divergence"]["name"]) == ("grad", ROUTER), g
    assert f"may differ, only here: this CPU family ({SIMULATED}) is not in checked_on [{', '.join(checked)}]" \
        in g["detail"] and "`make golden`" in g["detail"], g["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_change_that_moves_every_layout_alike_fails_the_golden(tmp_path, golden_env, own_goldens, bug):
    proc, runs = _verify(planted_tree(tmp_path / "tree", PLANTED[bug]), tmp_path / "out", own_goldens)
    # every layout gets the same wrong numbers: the layout comparison passes (the gap) ...
    assert runs["pp4-mtp-standalone"]["verdict"] == "pass", runs["pp4-mtp-standalone"]["reason"]
    # ... and the goldens catch it, at step 0, naming where it is computed first (dataflow order)
    assert proc.returncode == 1 and "golden fail" in proc.stdout, proc.stdout[-2000:]
    for r in runs.values():
        g = r["golden"]
        assert g["status"] == "differs" and g["first_divergence"]["step"] == 0, g
    fd = runs["pp2-mtp-with-loss"]["golden"]["first_divergence"]
    if bug == "aux_loss_scale_twice":     # only the backward of the aux loss changes: the last MoE layer's router
        assert (fd["kind"], fd["name"]) == ("grad", ROUTER), fd
    else:                                 # the reported LM loss is another number
        assert fd["kind"] == "loss", fd
