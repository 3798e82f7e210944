"""cases/megatron-upstream-bugs.yaml's two fixed bugs, caught again where their fix is taken out.

The case states what holds on each megatron-core version (fixed after 0.16.1: caught on < 0.17, passing on
>= 0.17; `make verify-upstream-bugs` runs it on 0.16.1 and 0.19.2).  That the 0.19.2 passes are the *fixes*,
not luck, is shown here: each fix reverted in a copy of the installed 0.19.x tree (`planted.planted_megatron`),
run as ``--megatron-head``, fails the case there with the bug's own signature:

* Megatron-LM d7500d4d2a (#3396) reverted (the MTP loss divides by an unclamped token count again): the
  runs with an empty microbatch stop being finite at step 1, microbatch 3, the MTP loss;
* Megatron-LM a22c40e8d6 (#3159) reverted (the per-token MTP loss is no longer rescaled to its own token
  count): the cross-implementation check disagrees, first in dataflow order at the output head's gradient (the MTP
  loss's gradient reaches it through the shared head; measured with this fix alone taken out of 0.16.1: e3fe5508c9's
  fix planted there, 1.86e5 ULP at tensor scale, bound 64).
"""
from __future__ import annotations

import json

import pytest

megatron_core = pytest.importorskip("megatron.core")

from conftest import ROOT, run_cli  # noqa: E402
from packaging.version import Version  # noqa: E402
from planted import planted_megatron  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron,
              pytest.mark.skipif(Version(megatron_core.__version__) < Version("0.17"),
                                 reason="the fixes landed after 0.16.1: they are in megatron-core >= 0.17 (Python 3.12)")]

CASE = ROOT / "cases" / "megatron-upstream-bugs.yaml"
MTP = "megatron/core/transformer/multi_token_prediction.py"
# d7500d4d2a, backwards: both divisions by the MTP token count unguarded again
NAN_FIX_REVERTED = {MTP: [
    ("""            mtp_loss_for_log = (
                torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)
            ) / num_tokens.clamp(min=1)""", "            mtp_loss_for_log = torch.sum(mtp_loss) / num_tokens"),
    ("safe_num_tokens = num_tokens.clamp(min=1)", "safe_num_tokens = num_tokens")]}
# a22c40e8d6, backwards: the per-token MTP loss enters unscaled, so finalize_model_grads divides it by the main
# loss's token count
PER_TOKEN_FIX_REVERTED = {MTP: [("mtp_loss_scale * mtp_loss * (original_num_tokens / num_tokens_safe)",
                                 "mtp_loss_scale * mtp_loss")]}


def _verify(tmp_path, edits, only):
    head = planted_megatron(tmp_path / "megatron-head", edits)
    proc = run_cli("verify", CASE, "--megatron-head", head, "--only", only, "--out", tmp_path / "out")
    summary = tmp_path / "out" / CASE.stem / "summary.json"
    assert summary.exists(), proc.stdout + proc.stderr
    return proc, json.loads(summary.read_text())


def test_the_zero_token_fix_reverted_is_caught_as_not_finite(tmp_path):
    proc, summary = _verify(tmp_path, NAN_FIX_REVERTED, "zero-token/pp2-vpp2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    runs = {v["name"]: v for v in summary["variants"]}
    for name in ("zero-token/pp3-mtp-standalone", "zero-token/pp2-vpp2"):
        v = runs[name]
        assert (v["verdict"], v["outcome"]) == ("fail", "not finite"), v
        assert v["nonfinite"] == "step 1 microbatch 3: mtp_1 loss is nan", v
    assert runs["pp2-mtp-with-loss"]["verdict"] == "pass"


def test_the_per_token_fix_reverted_is_caught_by_the_cross_implementation_check(tmp_path):
    proc, summary = _verify(tmp_path, PER_TOKEN_FIX_REVERTED, "per-token/pp2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cross = summary["cross_implementation"]
    assert (cross["expected_expect"], cross["measured"], cross["verdict"]) == ("agree", "fail", "fail"), cross
    assert cross["first_beyond_bound"]["name"] == "output_layer.weight", cross["first_beyond_bound"]
    # the layouts agree with each other with the bug in: only the independent implementation sees it
    assert all(v["verdict"] == "pass" for v in summary["variants"]), summary["variants"]
