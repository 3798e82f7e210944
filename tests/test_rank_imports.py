"""What a reference rank imports once forked: nothing.  Every `bitparity verify` starts a forkserver that preloads
the worker module (`harness.running.runner`), and its ranks fork from it; a module a rank imports itself is paid
once per rank (the pipeline stages' ``torch.autograd.backward`` with an output gradient imports sympy, ~0.5 s of
CPU on 2 cores: every rank of a 16-stage run but the last).  And the preload itself never holds torch._dynamo /
torch._inductor (pulled in by ``torch.use_deterministic_algorithms`` and ``torch.optim.Optimizer.add_param_group``):
~2-4 s of CPU per forkserver, and per torchrun rank, for code this trainer never compiles."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

pytestmark = pytest.mark.arithmetic_free

# the forkserver's part (import the worker), then a whole P = 2 run forked from it: two steps with MoE layers and MTP
# through the worker's own entry (process set-up, deterministic settings, process group, model, optimizer,
# pipeline, capture); each rank reports what it imported after the fork and its deterministic settings
RUN = textwrap.dedent("""\
    import json, os, sys
    from reference_impl.worker import rank_main
    from trainerkit.config import RunConfig

    out = sys.argv[1]
    cfg = RunConfig.model_validate({
        "model": {"num_layers": 3, "moe_layer_freq": "[0]*1+[1]*2", "hidden_size": 32, "mtp_num_layers": 1},
        "training": {"train_iters": 2, "seq_length": 16, "micro_batch_size": 2, "num_microbatches": 2,
                     "weight_decay": 0.1},
        "parallel": {"pipeline_model_parallel_layout": "Et|ttmL", "pipeline_model_parallel_size": 2}}).model_dump_json()
    preloaded = set(sys.modules)
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(rank, 2, cfg, out, out + "/store")
                import torch
                # the rank's stdout is its log (trainerkit.process.enter_rank): the answer goes to a file
                with open(f"{out}/rank{rank}.seen.json", "w") as f:
                    json.dump({"imported": sorted(set(sys.modules) - preloaded),
                               "deterministic": torch.are_deterministic_algorithms_enabled(),
                               "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                               "fill": torch.utils.deterministic.fill_uninitialized_memory}, f)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    print(json.dumps({"exit": [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids],
                      "preloaded": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in preloaded)}))
    """)


def test_forked_ranks_import_nothing_and_the_preload_no_compiler(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    parent = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parent == {"exit": [0, 0], "preloaded": []}, (parent, logs)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.seen.json").read_text())
        assert seen == {"imported": [], "deterministic": True, "warn_only": False, "fill": False}, (rank, seen)
