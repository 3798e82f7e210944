"""Megatron's own options in a case (`RunConfig.megatron`, megatron_trainer.options), on the real megatron-core.

* every kind of option reaches megatron, shown twice: by its effect (tests/cases/megatron-options.yaml: each
  variant differs from the baseline first where its option acts — step 1's update for a learning-rate decay,
  the embedding/head update for ``decoupled_lr``, a router gradient for the z-loss — and the DP average moves no
  bit), and read back from the objects megatron built, as each rank records them in its trace header;
* a misspelt name, a name bitparity sets itself, a value of the wrong type, a field no YAML value can be, a
  value Megatron-LM's arguments refuse and a value megatron's own validators reject are one line each, naming
  the option, exit 2, nothing written;
* the reference trainer refuses what it does not implement, and the cross-implementation check says so.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from conftest import ROOT, refusal, run_cli  # noqa: E402
from test_cli_errors import _check_usage_error  # noqa: E402

pytestmark = [pytest.mark.megatron]

CASE = ROOT / "tests" / "cases" / "megatron-options.yaml"
SMALL = ROOT / "tests" / "cases" / "megatron-small.yaml"

READ_BACK = {
    "loop-lr-linear": {"lr_decay_style": {"scheduler": "linear"},
                       "min_lr": {"OptimizerConfig": 0.0, "scheduler": 0.0}},
    "optimizer-decoupled-lr": {"decoupled_lr": {"OptimizerConfig": 0.0},
                               "decoupled_min_lr": {"OptimizerConfig": 0.0}},
    "transformer-z-loss": {"moe_z_loss_coeff": {"MLATransformerConfig": 0.5}},
    "ddp-average-in-collective": {"average_in_collective": {"DistributedDataParallelConfig": True},
                      "get_embedding_ranks": {"embedding_ranks": [0, 1]}},
}


@pytest.mark.slow
def test_every_kind_of_option_reaches_megatron(tmp_path):
    proc = run_cli("verify", CASE, "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "megatron-options" / "summary.json").read_text())
    runs = {v["name"]: v for v in summary["variants"]}
    assert runs["loop-lr-linear"]["first_divergence"]["step"] == 1
    assert runs["optimizer-decoupled-lr"]["first_divergence"]["name"] in ("embedding.word_embeddings.weight",
                                                                          "output_layer.weight")
    assert runs["ddp-average-in-collective"]["bitwise_equal"] is True
    for name, want in READ_BACK.items():
        header = _header(tmp_path, name)
        assert header["settings"]["megatron_options"] == want, (name, header["settings"]["megatron_options"])
    assert _header(tmp_path, "pp2-vpp2-mtp-with-loss")["settings"]["megatron_options"] == {}


def _header(out, name: str) -> dict:
    """Rank 0's trace header of run `name` (its directory: the name with '/' made '_', `harness.verify`)."""
    path = out / "megatron-options" / "runs" / name.replace("/", "_") / "rank0.jsonl"
    return json.loads(path.read_text().splitlines()[0])


@pytest.mark.parametrize("option,fragments", [
    ("moe_router_load_balancing_typ: aux_loss", ["'moe_router_load_balancing_typ'", "did you mean "
                                                 "moe_router_load_balancing_type"]),
    ("hidden_size: 64", ["'hidden_size'", "bitparity's to set: model.hidden_size"]),
    ("pipeline_model_parallel_layout: Et", ["'pipeline_model_parallel_layout'", "the variant's"]),
    ("moe_z_loss_coeff: abc", ["'moe_z_loss_coeff'", "'abc'"]),
    ("activation_func: relu", ["'activation_func'", "not a value a case file can give"]),
    ("moe_router_load_balancing_type: [aux_loss, bogus]", ["'moe_router_load_balancing_type'", "'bogus'"]),
    ("min_lr: 0.5", ["'min_lr'", "megatron-core rejects this run", "max_lr >= self.min_lr"]),
    ("lr_decay_style: bogus", ["'lr_decay_style'", "megatron-core rejects this run"]),
    ("get_embedding_ranks: first", ["'get_embedding_ranks'", "pretrain_gpt, parallel_state"]),
    ("Bad-Name: 1", ["megatron option 'Bad-Name'", "lower_case_with_underscores"]),
    ("moe_z_loss_coeff: {a: 1}", ["'moe_z_loss_coeff'", "a mapping is not an option value"]),
    ("min_lr: .nan", ["'min_lr'", "nan is not finite"]),
    ("calculate_per_token_loss: 1", ["'calculate_per_token_loss'", "valid boolean"]),
    ("moe_z_loss_coeff: true", ["'moe_z_loss_coeff'", "True"]),
    ("lr_warmup_iters: -1", ["'lr_warmup_iters'", "greater than or equal to 0"]),
    ("lr_decay_iters: 0", ["'lr_decay_iters'", "greater than or equal to 1"]),
    ("recompute_granularity: full", ["'recompute_granularity'", "not supported by bitparity's megatron trainer"]),
    ("check_for_nan_in_grad: true", ["'check_for_nan_in_grad'", "bitparity checks finiteness itself"]),
    ("normalization: LayerNorm", ["'normalization'", "changes the model's parameters"]),
    ("moe_router_load_balancing_type: sinkhorn", ["sinkhorn", "moe_aux_loss_coeff: 0"]),
    (f"moe_z_loss_coeff: '{'x' * 500}'", ["'moe_z_loss_coeff'", "..."]),
    # the distributed optimizer's: megatron's configs take them, Megatron-LM's arguments or its parallel state
    # refuse them (each crashed every rank, or passed as nonsense, before it was checked here)
    ("use_distributed_optimizer: true, num_distributed_optimizer_instances: 3",
     ["'num_distributed_optimizer_instances'", "does not divide data_parallel_size 1"]),
    ("use_distributed_optimizer: true, num_distributed_optimizer_instances: 0", ["'num_distributed_optimizer_instances'",
                                                                                 "(>= 1)"]),
    ("num_distributed_optimizer_instances: 2", ["needs use_distributed_optimizer: true"]),
    ("overlap_param_gather: true", ["'overlap_param_gather'", "needs use_distributed_optimizer: true"]),
    ("use_distributed_optimizer: true, overlap_param_gather: true", ["'overlap_param_gather'",
                                                                     "needs overlap_grad_reduce: true"]),
    ("use_megatron_fsdp: true", ["'use_megatron_fsdp'", "not supported by bitparity's megatron trainer"]),
])
def test_a_bad_option_is_one_line_naming_it(tmp_path, option, fragments):
    """Refused by the case's validation, before anything runs; each of these (but the misspelling and the types)
    passed megatron's config checks and then failed inside every rank, or passed as another value than the case
    wrote.  In this process (megatron-core is imported once, not once per option: ~5 s for all against ~20 s each
    through the command line); the command line's handling of the same error is the test below."""
    message = refusal(_bad_option_case(tmp_path, option))
    assert "variant 'v'" in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("option,fragment", [("moe_router_load_balancing_typ: aux_loss", "did you mean"),
                                             ("min_lr: 0.5", "megatron-core rejects this run")])
def test_a_bad_option_is_one_line_from_the_command_line(tmp_path, option, fragment):
    """Exit 2, one line, nothing written: a name misspelt, and a value megatron-core's own code refuses."""
    case = _bad_option_case(tmp_path, option)
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out", "variant 'v'", fragment)


# what the process knows of torch.compile once megatron's validation has imported megatron (a JSON line)
_COMPILE_STATE = """
import json, sys
{call}
import megatron.core.jit, torch
print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules,
                  "fuser_is_compile": megatron.core.jit.jit_fuser is torch.compile}}))
"""


@pytest.mark.newest_megatron
def test_the_command_imports_megatron_as_its_ranks_do_and_the_validator_process_without_torch_compile(tmp_path):
    """The ``bitparity`` command (``cli.main()`` with no argv) imports megatron for real, with ``torch.compile``:
    its forkserver is forked from it (`harness.running.forkservers.forked_spawn`), so the ranks get this import
    instead of importing megatron a second time (~4 s of CPU per ``verify`` of a megatron case on 2 cores).  Only
    a process that imports megatron just to validate (``python -m megatron_trainer.validate``, for a megatron the
    harness does not import) takes `megatron_trainer.validate.checks_only`'s import without ``torch._dynamo``."""
    import subprocess
    import sys

    case = _bad_option_case(tmp_path, "min_lr: 0.5")     # refused by megatron's own validator: it was imported
    command = ("from harness import cli\nsys.argv = ['bitparity', 'verify', %r, '--out', %r]\n"
               "assert cli.main() == 2" % (str(case), str(tmp_path / "out")))
    validator = ("from megatron_trainer import validate\nvalidate.checks_only()\n"
                 "assert validate.import_problem() is None")
    states = {}
    for who, call in (("command", command), ("validator", validator)):
        done = subprocess.run([sys.executable, "-c", _COMPILE_STATE.format(call=call)], cwd=ROOT, text=True,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        states[who] = json.loads(done.stdout.strip().splitlines()[-1])
    assert states == {"command": {"dynamo": True, "fuser_is_compile": True},
                      "validator": {"dynamo": False, "fuser_is_compile": False}}, states
    assert not (tmp_path / "out").exists()


def _bad_option_case(tmp_path, option: str):
    case = tmp_path / "case.yaml"
    case.write_text(f"extends: {SMALL}\nvariants:\n  - {{name: v, pipeline_model_parallel_layout: 'Et|t|t|tmL', "
                    f"pipeline_model_parallel_size: 2, megatron: {{{option}}}}}\n")
    return case


def test_the_reference_trainer_and_the_cross_implementation_check_name_what_they_cannot_run(tmp_path):
    case = tmp_path / "case.yaml"
    case.write_text(f"extends: {SMALL}\nmegatron: {{moe_z_loss_coeff: 0.5}}\n"
                    "cross_implementation: {variant: pp4-mtp-standalone}\n")
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out", "cross_implementation",
                       "the reference trainer does not implement megatron option 'moe_z_loss_coeff'")
    case.write_text(f"extends: {SMALL}\ntrainer: reference\nmegatron: {{moe_router_load_balancing_type: aux_loss}}\n")
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out",
                       "megatron option 'moe_router_load_balancing_type' only as 'seq_aux_loss'")


def test_a_coefficient_per_load_balancing_type_is_megatrons(tmp_path):
    """``model.moe_aux_loss_coeff`` as a list goes with megatron's list of load-balancing types; the reference
    trainer, with its one seq_aux_loss, refuses it in one line."""
    case = tmp_path / "case.yaml"
    case.write_text(f"extends: {SMALL}\ntrainer: reference\nmodel: {{moe_aux_loss_coeff: [1.0e-4, 1.0e-3]}}\n")
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out",
                       "moe_aux_loss_coeff as a list", "reference trainer")
    case.write_text(f"extends: {SMALL}\nmodel: {{moe_aux_loss_coeff: [1.0e-4, -1.0]}}\n")
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out",
                       "model.moe_aux_loss_coeff", ">= 0")


def test_batch_p2p_alone_is_megatron_lms_pairing(tmp_path):
    """``batch_p2p_comm: true`` alone turns the overlapped p2p off (Megatron-LM: batch_p2p_comm = not
    overlap_p2p_comm), as the rank's trace header shows; megatron refuses the two together.  (At P=2 V=2 the
    batched p2p then pairs the wrong payloads on gloo: cases/megatron-upstream-bugs.yaml.)"""
    case = tmp_path / "case.yaml"
    case.write_text(f"extends: {SMALL}\nvariants:\n  - {{name: v, pipeline_model_parallel_layout: 'Et|t|t|tmL', "
                    "pipeline_model_parallel_size: 2, megatron: {batch_p2p_comm: true}, expect: diverge}\n")
    proc = run_cli("verify", case, "--out", tmp_path / "out")
    header = json.loads((tmp_path / "out/megatron-small/runs/v/rank0.jsonl").read_text().splitlines()[0])
    assert (header["settings"]["batch_p2p_comm"], header["settings"]["overlap_p2p_comm"]) == (True, False), \
        proc.stdout + proc.stderr
