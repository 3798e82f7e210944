"""The one registry of trainers (`harness.planning.trainers.REGISTRY`): every name of the run description's vocabulary
(`trainerkit.config.TRAINERS`) has one entry, the runner's workers and the cross-implementation partners derive
from it, the two lists cannot drift apart (planted: a name without an entry, an entry without a name), and a new
trainer is one name plus one entry (planted: a second name for the reference trainer's worker runs a case).
"""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import ROOT
from planted import planted_tree, run_planted

from harness.judging import crossimpl
from harness.planning import trainers
from harness.running import runner
from trainerkit.config import DEFAULT_TRAINER, TRAINERS, RunConfig


def test_every_name_has_one_entry_and_the_runner_derives_from_it():
    assert sorted(trainers.REGISTRY) == sorted(TRAINERS)
    assert DEFAULT_TRAINER in TRAINERS
    assert runner.WORKERS == {name: t.worker for name, t in trainers.REGISTRY.items()}
    for name, t in trainers.REGISTRY.items():
        assert t.name == name
        spec = importlib.util.find_spec(t.worker)
        assert spec is not None, f"{name}: worker module {t.worker} not found"
        assert t.partner in TRAINERS and t.partner != name
        assert trainers.entry(t.partner).partner == name, "cross-implementation partners are pairs"
        assert crossimpl.other_trainer(name) == t.partner
        assert isinstance(t.faults(), tuple) and t.faults(), f"{name}: no planted faults to test its checks with"


def test_worker_modules_have_both_entry_points():
    # the reference worker is cheap to import; the megatron one imports torch.distributed only, not megatron
    for t in trainers.REGISTRY.values():
        mod = importlib.import_module(t.worker)
        assert callable(getattr(mod, "rank_main")) and callable(getattr(mod, "main")), t.worker


def _config(**over) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"num_layers": 2, "moe_layer_freq": "[0]*1+[1]*1", "hidden_size": 32, "mtp_num_layers": 1},
        "training": {"train_iters": 1, "seq_length": 8, "micro_batch_size": 1, "num_microbatches": 2},
        "parallel": {"pipeline_model_parallel_layout": "Et|tmL", "pipeline_model_parallel_size": 2}, **over})


def test_admission_comes_from_the_entry():
    assert trainers.problem(_config()) is None
    why = trainers.problem(_config(inject="no-such-fault"))
    assert why is not None and "no-such-fault" in why
    dp2 = _config(parallel={"pipeline_model_parallel_layout": "Et|tmL", "pipeline_model_parallel_size": 2,
                            "data_parallel_size": 2})
    assert "data_parallel_size" in trainers.problem(dp2)
    assert trainers.is_default(None) and trainers.is_default(DEFAULT_TRAINER)
    assert not trainers.runs_megatron("reference") and trainers.runs_megatron("megatron-core")


def _import_in(tree) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import harness.planning.trainers"], cwd=tree, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("edits, words", [
    ({"trainerkit/config.py": [('TrainerName = Literal["reference", "megatron-core"]',
                                'TrainerName = Literal["reference", "megatron-core", "vllm"]')]},
     "names without an entry ['vllm'], entries without a name []"),
    ({"harness/planning/trainers.py": [('    Trainer("megatron-core", "megatron_trainer.worker", _megatron_problem, '
                               '_megatron_faults, partner="reference",\n'
                               '            megatron=True, library_preload="megatron_trainer.preload", resume_problem=_megatron_resume_problem),\n', '')]},
     "names without an entry ['megatron-core'], entries without a name []"),
], ids=["name-without-entry", "entry-without-name"])
def test_planted_drift_between_the_lists_stops_the_import(tmp_path, edits, words):
    tree = planted_tree(tmp_path / "tree", edits)
    done = _import_in(tree)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: harness.planning.trainers: REGISTRY and trainerkit.config.TRAINERS differ") \
        and words in last, last


def test_planted_new_trainer_is_one_name_and_one_entry(tmp_path):
    """A second name for the reference worker, added in the two places the README names, runs a case and is
    bitwise equal to the reference trainer (the same code): nothing else in the harness needed to know it."""
    tree = planted_tree(tmp_path / "tree", {
        "trainerkit/config.py": [('TrainerName = Literal["reference", "megatron-core"]',
                                  'TrainerName = Literal["reference", "megatron-core", "reference-twin"]')],
        "harness/planning/trainers.py": [(
            '    Trainer("megatron-core", "megatron_trainer.worker",',
            '    Trainer("reference-twin", "reference_impl.worker", _reference_problem, _reference_faults,\n'
            '            partner="reference"),\n'
            '    Trainer("megatron-core", "megatron_trainer.worker",')],
    })
    case = tmp_path / "twin.yaml"
    case.write_text(
        "name: twin\ntimeout_s: 180\n"
        "model: {num_layers: 2, moe_layer_freq: '[0]*1+[1]*1', hidden_size: 32, mtp_num_layers: 1}\n"
        "training: {train_iters: 1, seq_length: 8, micro_batch_size: 1, num_microbatches: 2}\n"
        "baseline: {name: ref, pipeline_model_parallel_layout: 'Et|tmL', pipeline_model_parallel_size: 2}\n"
        "variants:\n"
        "  - {name: twin, trainer: reference-twin, pipeline_model_parallel_layout: 'Et|tmL',\n"
        "     pipeline_model_parallel_size: 2, expect: bitwise}\n")
    done = run_planted(tree, "verify", case, "--out", tmp_path / "out", "--jobs", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2/2 pass" in done.stdout, done.stdout[-2000:]
    # the unplanted tree refuses the name in one line, naming the vocabulary
    plain = subprocess.run([sys.executable, "-m", "harness", "verify", str(case), "--out",
                            str(tmp_path / "out2")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
    assert "variant 'twin': trainer:" in plain.stderr and "'megatron-core'" in plain.stderr, plain.stderr
