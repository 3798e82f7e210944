"""What a reference rank imports: never torch._dynamo / torch._inductor.  Every `bitparity verify` starts a
forkserver that preloads the worker module, and every torchrun rank imports it on its own; dynamo and inductor
(pulled in by ``torch.use_deterministic_algorithms`` and by ``torch.optim.Optimizer.add_param_group``) cost about
as much CPU as torch itself (~2-4 s on 2 cores) and compute nothing here: the trainer compiles nothing."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

pytestmark = pytest.mark.arithmetic_free

# a whole rank in a fresh interpreter: one step of a P = 1 run with MoE layers and MTP, the worker's own entry
# (process set-up, deterministic settings, process group, model, optimizer, capture), then what it imported
RANK = textwrap.dedent("""\
    import json, sys
    from trainerkit.config import RunConfig
    from reference_impl.worker import rank_main

    out = sys.argv[1]
    cfg = RunConfig.model_validate({
        "model": {"num_layers": 3, "moe_layer_freq": "[0]*1+[1]*2", "hidden_size": 32, "mtp_num_layers": 1},
        "training": {"train_iters": 2, "seq_length": 16, "micro_batch_size": 2, "num_microbatches": 2,
                     "weight_decay": 0.1},
        "parallel": {"pipeline_model_parallel_layout": "Et*3mL", "pipeline_model_parallel_size": 1}})
    rank_main(0, 1, cfg.model_dump_json(), out, out + "/store")
    import torch
    import torch.utils.deterministic
    # the rank's stdout is its log (trainerkit.process.enter_rank): the answer goes to a file
    open(out + "/seen.json", "w").write(json.dumps({"imported": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
                      "deterministic": torch.are_deterministic_algorithms_enabled(),
                      "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                      "fill": torch.utils.deterministic.fill_uninitialized_memory}))
    """)


def test_a_rank_trains_deterministically_without_importing_dynamo(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RANK, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    log = (tmp_path / "rank0.log").read_text() if (tmp_path / "rank0.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    assert "rank 0: done" in log, log
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"imported": [], "deterministic": True, "warn_only": False, "fill": False}, seen
