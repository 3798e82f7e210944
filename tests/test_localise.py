"""capture: activations localises a divergence to the first tensor that differs inside the step."""
import json
import textwrap

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_localisation(tmp_path):
    (tmp_path / "loc.yaml").write_text(textwrap.dedent("""\
        name: loc
        capture: activations
        model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
        training: {train_iters: 1, seq_length: 16, num_microbatches: 4}
        baseline: {name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
        variants:
          - {name: clean, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
          - {name: no-final-norm, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4,
             inject: skip_final_norm_standalone}
          - {name: wrong-mb, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4,
             inject: wrong_microbatch_activation}
          - {name: mtp-renorm, pipeline_model_parallel_layout: "Etttt|m|L", pipeline_model_parallel_size: 3,
             inject: renorm_when_mtp_alone}
        """))
    proc = run_cli("verify", tmp_path / "loc.yaml", "--out", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    loc = {v: json.loads((tmp_path / "loc" / "runs" / v / "comparison.json").read_text())
           for v in ("clean", "no-final-norm", "wrong-mb", "mtp-renorm")}
    assert loc["clean"]["verdict"] == "pass" and loc["clean"]["localisation"] == {}
    assert loc["no-final-norm"]["localisation"]["tensor"] == "decoder.final_layernorm.output"
    assert "computed in the reference only" in loc["no-final-norm"]["localisation"]["message"]
    wm = loc["wrong-mb"]["localisation"]
    assert (wm["tensor"], wm["microbatch"]) == ("head.input", 1)
    assert "differs although the tensor before it matched" in wm["message"]
    mr = loc["mtp-renorm"]["localisation"]
    assert mr["tensor"] == "mtp.output" and mr["message"] == "mtp output, microbatch 0, step 0: inputs equal, output differs"
    trace = json.loads((tmp_path / "loc" / "runs" / "clean" / "trace.json").read_text())
    b = trace["steps"][0]["boundaries"]
    assert b and all(b[k] == b[k[:-5] + "/recv"] for k in b if k.endswith("/send"))
