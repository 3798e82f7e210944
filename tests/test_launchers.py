"""The forkserver runner (fast path used by verify and fuzz) produces traces bitwise equal to the plain
multi-process launch (torchrun: fresh processes, rank/world from the environment).

Torchrun is run on three smoke layouts that between them take every launch path (a single process, P=2
1F1B, P=4 interleaved with a standalone MTP stage) and on P=2 with EP=2, whose expert collectives go over gloo
under torchrun and over the host sockets of `reference_impl.host_channel` under the fork launcher (the same bits:
both copy); the layout does not reach the launcher, and each torchrun run costs ~10 s of fresh interpreters on
2 cores."""
import json

import pytest
from conftest import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]


def _steps(report, run_dir):
    trace = json.loads((report / "smoke" / run_dir / "trace.json").read_text())
    # the bits, not the clocks (time_s, the ranks' CPU seconds, the measured action times)
    return [{k: v for k, v in s.items() if k not in ("time_s", "cpu_s", "actions")} for s in trace["steps"]], \
        trace["init"]


ONLY = ("pp2-mtp-with-loss", "pp4-vpp2-mtp-standalone", "canonical/pp1", "ep2/pp2")
EP_VARIANT = """
  - name: ep2/pp2
    pipeline_model_parallel_layout: "Ett|ttmL"
    pipeline_model_parallel_size: 2
    expert_model_parallel_size: 2
    expect: bitwise
"""


def test_torchrun_matches_fork(tmp_path):
    only = [a for name in ONLY for a in ("--only", name)]
    case = tmp_path / "smoke.yaml"
    case.write_text((ROOT / "cases" / "smoke.yaml").read_text() + EP_VARIANT)
    for launcher in ("fork", "torchrun"):
        proc = run_cli("verify", case, "--launcher", launcher, "--out", tmp_path / launcher, *only)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # run directories: runs/<variant name made path-safe> (detail_page is runs/<dir>/index.html)
    variants = [v["detail_page"].rsplit("/", 1)[0]
                for v in json.loads((tmp_path / "fork" / "smoke" / "summary.json").read_text())["variants"]]
    assert len(variants) == 4 and "runs/canonical_pp1" in variants and "runs/ep2_pp2" in variants
    for v in variants:
        assert _steps(tmp_path / "fork", v) == _steps(tmp_path / "torchrun", v), v
    summary = json.loads((tmp_path / "torchrun" / "smoke" / "summary.json").read_text())
    assert summary["environment"]["launcher"] == "torchrun"


def test_the_forkserver_preloads_megatron_only_for_one_source_on_cpu(monkeypatch):
    """One megatron for every run (the interpreter's own or one directory): imported once in the forkserver, from
    that directory; two (verify --megatron-base) or CUDA: each rank imports its own (a preloaded megatron would be
    the wrong one, `megatron_trainer.source.activate`)."""
    from harness.planning.cases import load_case
    from harness.running import runner
    from megatron_trainer.source import megatron_source
    seen = []
    monkeypatch.setattr(runner, "_set_preload", lambda modules, source=None: seen.append((modules, source)))
    config = load_case(ROOT / "cases" / "smoke.yaml").runs[0].config
    mc = config.model_copy(update={"trainer": "megatron-core"})
    # --megatron-base installed beside the interpreter's own: two spellings, each rank imports its own
    own = megatron_source()["path"] if megatron_source() else "/nonexistent"
    for configs, megatron, source in (([config], False, None), ([config, mc], True, None),
                                      ([mc, mc.model_copy(update={"megatron_path": "/a"})], False, None),
                                      ([mc.model_copy(update={"megatron_path": "/a"})] * 2, True, "/a"),
                                      ([mc.model_copy(update={"device": "cuda"})], False, None),
                                      ([mc, mc.model_copy(update={"megatron_path": own})], False, None)):
        runner.preload(configs)
        modules, preloaded_from = seen[-1]
        assert ("megatron_trainer.preload" in modules) == megatron, (configs, modules)
        assert modules[0] == "reference_impl.worker" and preloaded_from == source, (configs, seen[-1])
