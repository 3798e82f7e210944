"""Save, stop, resume on megatron-core (cases/megatron-resume.yaml; megatron_trainer/checkpoint.py, the trace's
``resumed`` record, harness.judging.compare `_loaded_diffs`):

* the case passes with its stated outcomes on the installed megatron-core: the resumed runs start after step 0,
  what they loaded is bit-equal to what the saving run held, under the same layout, another P / V with MTP
  standalone, TP 2 + EP 4, both distributed-optimizer formats and plain DDP; the reference trainer's twin too;
* planted, each caught at the first step it can show, named: Adam's state not restored; the data position one
  microbatch late; the routers' expert bias not restored; a resharded load that gives an EP rank another rank's
  experts (a megatron copy); the MTP stage's embedding replica left stale; megatron's shared Adam step counter
  (without Apex / TE) left shared;
* a resume megatron cannot load is refused while planning, one line, exit 2.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, refusal, run_cli, variants, verify_once  # noqa: E402
from planted import planted_megatron, planted_tree, run_planted  # noqa: E402

CASE = ROOT / "cases" / "megatron-resume.yaml"
CKPT = "megatron_trainer/checkpoint.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    proc, out = verify_once(tmp_path_factory, CASE)
    return proc, variants(out / "megatron-resume"), out / "megatron-resume" / "runs"


def test_the_resume_case_passes_with_its_stated_outcomes(resume):
    proc, v, runs = resume
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert all(x["verdict"] == "pass" for x in v.values()), {k: (x["verdict"], x["reason"]) for k, x in v.items()}
    for name in ("resumed-same-layout", "resumed-p3v2-mtp-standalone", "dp-reshardable/resumed-same-layout",
                 "plain-ddp/resumed-p4-mtp-standalone", "reference/resumed-p4-mtp-standalone"):
        assert v[name]["outcome"] == "equal", (name, v[name]["outcome"])
        trace = json.loads((runs / name.replace("/", "_") / "trace.json").read_text())
        assert [s["step"] for s in trace["steps"]] == [1, 2], name
        [loaded] = trace["resumed"]
        assert loaded["step"] == 0 and len(loaded["params"]) == len(trace["params"]), name
        assert loaded["buffers"] and (name.startswith("reference") or loaded["exp_avg"]), name
    # the layout change that computes differently still loaded every bit; it differs only from its first step
    fd = v["resumed-tp2-sp-ep4"]["first_divergence"]
    assert fd["step"] == 1 and fd["kind"] in ("loss", "grad"), fd
    assert list((runs / "p2v2-dp2-ep2" / "checkpoint-step0").glob("*.distcp"))


def _planted_run(tmp_path, edits, variant):
    tree = planted_tree(tmp_path / "tree", edits)
    proc = run_planted(tree, "verify", CASE, "--out", tmp_path / "out", "--only", variant, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    return variants(tmp_path / "out" / "megatron-resume")[variant]


_LOAD_OPT = 'r.optimizer.load_state_dict(loaded["optimizer"])'
_LOAD_MODEL = 'chunk.load_state_dict(loaded["model" if len(r.chunks) == 1 else f"model{i}"], strict=True)'
_UNSHARE = "    _unshare_adam_steps(r.optimizer)\n"
_STALE = ('    stale = [(c.embedding.word_embeddings.weight, c.embedding.word_embeddings.weight.detach().clone())\n'
          '             for c in r.chunks if c.mtp_process and not c.pre_process]\n')

PLANTED = {
    # (edits, variant, first divergence (step, kind), a fragment of its name)
    "adam state not restored": ({CKPT: [(_LOAD_OPT, "pass")]},
                                "resumed-same-layout", (0, "optimizer_state"), ""),
    "data position one microbatch late": (
        {"megatron_trainer/train.py": [("        first_step = done + 1\n",
                                        "        first_step = done + 1\n        consumed += t.micro_batch_size\n")]},
        "resumed-same-layout", (1, "loss"), ""),
    "expert bias not restored": (
        {CKPT: [(_LOAD_MODEL, _LOAD_MODEL + "\n        [b.zero_() for n, b in chunk.named_buffers() "
                                            "if n.endswith('expert_bias')]")]},
        "resumed-same-layout", (0, "buffer"), "expert_bias"),
    "mtp embedding replica stale": (
        {CKPT: [("    _fresh_distributed_state(r.optimizer)\n", _STALE + "    _fresh_distributed_state(r.optimizer)\n"),
                (_UNSHARE, _UNSHARE + "    with torch.no_grad():\n        [w.copy_(s) for w, s in stale]\n")]},
        "resumed-p3v2-mtp-standalone", (0, "param"), "embedding.word_embeddings.weight@mtp"),
    "adam step counter left shared": ({CKPT: [(_UNSHARE, "")]},
                                      "resumed-same-layout", (1, "param"), ""),
}


@pytest.mark.newest_megatron
@pytest.mark.parametrize("what", list(PLANTED))
def test_a_planted_resume_defect_is_caught_where_it_first_shows(tmp_path, what):
    edits, variant, (step, kind), name = PLANTED[what]
    run = _planted_run(tmp_path, edits, variant)
    fd = run["first_divergence"]
    assert run["verdict"] == "fail" and (fd["step"], fd["kind"]) == (step, kind), (what, run["reason"], fd)
    assert name in fd["name"], (what, fd)


# megatron's own code, planted: each EP rank keys its experts one rank further on (save and load alike), so a
# load under the same EP gets its own experts back and one under another EP gets another rank's
_OFFSET = "\n        local_expert_indices_offset = self.ep_group.rank() * self.num_local_experts\n"
_OFFSET_ROTATED = ("\n        local_expert_indices_offset = ((self.ep_group.rank() + 1) % self.ep_group.size()) "
                   "* self.num_local_experts\n")


@pytest.mark.newest_megatron
def test_a_resharded_load_giving_an_ep_rank_another_ranks_experts_fails_at_the_load(tmp_path):
    head = planted_megatron(tmp_path / "mlm", {EXPERTS: [(_OFFSET, _OFFSET_ROTATED)]})
    out = tmp_path / "out"
    proc = run_cli("verify", CASE, "--out", out, "--megatron-head", head, "--only", "resumed-tp2-sp-ep4",
                   "--only", "resumed-same-layout", timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    v = variants(out / "megatron-resume")
    assert v["resumed-same-layout"]["verdict"] == "pass", v["resumed-same-layout"]["reason"]   # same EP: own experts
    fd = v["resumed-tp2-sp-ep4"]["first_divergence"]
    assert v["resumed-tp2-sp-ep4"]["verdict"] == "fail" and fd["step"] == 0 and fd["kind"] in ("optimizer_state", "param"), fd
    assert ".mlp.experts." in fd["name"], fd


@pytest.mark.parametrize("saver, resumer, fragment", [
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2}",
     "{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2, "
     "expert_model_parallel_size: 2}", "megatron builds one optimizer at EP 1 and two"),
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2, "
     "megatron: {use_distributed_optimizer: true}}",
     "{pipeline_model_parallel_layout: 'Ett|ttmL', pipeline_model_parallel_size: 2, data_parallel_size: 2, "
     "megatron: {use_distributed_optimizer: true}}", "dp_reshardable checkpoint"),
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2}",
     "{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2, "
     "megatron: {use_distributed_optimizer: true}}", "the distributed optimizer and one without"),
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2}",
     "{pipeline_model_parallel_layout: 'Ett|ttmL', pipeline_model_parallel_size: 2, trainer: reference}",
     "a run resumes from its own trainer's checkpoint"),
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, data_parallel_size: 2}",
     "{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2}",
     "data_parallel_size 2 -> 1"),
    ("{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, "
     "megatron: {dist_ckpt_optim_fully_reshardable: true}}",
     "{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2}",
     "dist_ckpt_optim_fully_reshardable is the distributed optimizer's checkpoint format"),
])

def test_a_resume_megatron_cannot_load_is_one_line(tmp_path, saver, resumer, fragment):
    assert fragment in refusal(_resume_case(tmp_path, saver, resumer))


def test_a_resume_megatron_cannot_load_is_one_line_from_the_command_line(tmp_path):
    case = _resume_case(tmp_path, "{pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2}",
                        "{pipeline_model_parallel_layout: 'Ett|ttmL', pipeline_model_parallel_size: 2, "
                        "trainer: reference}")
    proc = run_cli("verify", case, "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "a run resumes from its own trainer's checkpoint" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.jsonl"))


def _resume_case(tmp_path, saver: str, resumer: str):
    (tmp_path / "bad.yaml").write_text(
        f"extends: {ROOT / 'tests' / 'cases' / 'megatron-small.yaml'}\nname: bad\ntraining: {{train_iters: 3}}\n"
        f"baseline: {{name: saver, {saver[1:-1]}}}\n"
        f"variants:\n  - {{name: resumer, resume: {{variant: saver, after_step: 0}}, {resumer[1:-1]}}}\n")
    return tmp_path / "bad.yaml"


@pytest.mark.newest_megatron
def test_a_baseline_that_resumes_is_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        f"extends: {ROOT / 'tests' / 'cases' / 'megatron-small.yaml'}\nname: bad\ntraining: {{train_iters: 3}}\n"
        "baseline: {name: saver, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2, "
        "resume: {variant: v, after_step: 0}}\n"
        "variants:\n  - {name: v, pipeline_model_parallel_layout: 'Et|t|t|tmL', pipeline_model_parallel_size: 2}\n")
    proc = run_cli("verify", tmp_path / "bad.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "give resume: to a variant" in proc.stderr, \
        proc.stderr
