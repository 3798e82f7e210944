"""The forkserver runner (fast path used by verify and fuzz) produces traces bitwise equal to the plain
multi-process launch (torchrun: fresh processes, rank/world from the environment).

Torchrun is run on three smoke layouts that between them take every launch path (a single process, P=2
1F1B, P=4 interleaved with a standalone MTP stage) and on P=2 with EP=2, whose pipeline boundaries and expert
collectives go over gloo under torchrun and over the host sockets of `reference_impl.host_pipe` / `host_channel`
under the fork launcher (the same bits: both copy); the layout does not reach the launcher, and each torchrun run costs ~10 s of fresh interpreters on
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
    # the boundaries: host sockets between forked ranks (reference_impl/host_pipe.py), gloo under torchrun
    for launcher, over_sockets in (("fork", True), ("torchrun", False)):
        log = (tmp_path / launcher / "smoke" / "runs" / "pp4-vpp2-mtp-standalone" / "rank1.log").read_text()
        assert ("pipeline p2p over host sockets" in log) is over_sockets, (launcher, log)
    summary = json.loads((tmp_path / "torchrun" / "smoke" / "summary.json").read_text())
    assert summary["environment"]["launcher"] == "torchrun"


@pytest.mark.parametrize("servers_start", [True, False])
def test_the_forkserver_preloads_each_megatron_source_once_on_cpu(monkeypatch, servers_start):
    """One megatron for every run (the interpreter's own or one directory): imported once in the forkserver, from
    that directory; two (verify --megatron-base): the interpreter's own (or the first directory) there, the other in
    a forkserver of its own (`harness.running.forkservers`), with the same modules and its directory; CUDA: each
    rank imports its own (importing megatron initialises CUDA).  Should a source's server not start, the module's
    forkserver holds no megatron and every rank imports its own (a preloaded megatron would be the wrong one for
    the other source's ranks, `megatron_trainer.source.activate`)."""
    from harness.planning.cases import load_case
    from harness.running import forkservers, runner
    from megatron_trainer.source import megatron_source
    from trainerkit.process import PRELOAD_ENV, PRELOAD_SOURCE_ENV
    seen, started = [], []
    monkeypatch.setattr(runner, "_set_preload", lambda modules, source=None: seen.append((modules, source)))
    monkeypatch.setattr(runner, "_start_forkserver", lambda fork=False: None)

    def start(source, env, preload):
        started.append((source, env[PRELOAD_SOURCE_ENV], env[PRELOAD_ENV].split(","), preload))
        return servers_start
    monkeypatch.setattr(forkservers, "start", start)
    config = load_case(ROOT / "cases" / "smoke.yaml").runs[0].config
    mc = config.model_copy(update={"trainer": "megatron-core"})
    a = mc.model_copy(update={"megatron_path": "/a"})
    # --megatron-base installed beside the interpreter's own: two spellings, two servers
    own = megatron_source()["path"] if megatron_source() else "/nonexistent"
    for configs, megatron, source, servers in (([config], False, None, []), ([config, mc], True, None, []),
                                               ([mc, a], servers_start, None, ["/a"]),
                                               ([a] * 2, True, "/a", []),
                                               ([a, mc.model_copy(update={"megatron_path": "/b"})], servers_start,
                                                "/a", ["/b"]),
                                               ([mc.model_copy(update={"device": "cuda"})], False, None, []),
                                               ([mc, mc.model_copy(update={"megatron_path": own})], servers_start,
                                                None, [own])):
        started.clear()
        runner.preload(configs)
        modules, preloaded_from = seen[-1]
        assert ("megatron_trainer.preload" in modules) == megatron, (configs, modules)
        assert modules[0] == "reference_impl.worker", (configs, seen[-1])
        assert preloaded_from == (source if megatron else None), (configs, seen[-1])
        assert [s[0] for s in started] == servers, started
        for server, env_source, env_modules, preload in started:
            assert env_source == server and preload == [runner.PRELOAD_GUARD]
            assert env_modules[:2] == ["reference_impl.worker", "megatron_trainer.worker"]
            assert env_modules[-1] == "megatron_trainer.preload"


def test_runs_on_cuda_never_fork_the_forkserver_from_the_harness(monkeypatch):
    """The harness validates a CUDA case by asking torch for the devices (`planning.cases.load_case`), and torch's
    device query marks the process: a fork of it can never use CUDA ("Cannot re-initialize CUDA in forked
    subprocess", the first CUDA call of every rank, seen on an H100 when the server was the harness forked).  So
    the server of CUDA runs is a new interpreter, whatever the trainer; CPU runs of the reference trainer fork it
    from a harness that holds no megatron (`runner.preload`)."""
    import sys

    from harness.planning.cases import load_case
    from harness.running import runner
    forks = []
    monkeypatch.setattr(runner, "_set_preload", lambda modules, source=None: None)
    monkeypatch.setattr(runner, "_start_forkserver", lambda fork=False: forks.append(fork))
    config = load_case(ROOT / "cases" / "smoke.yaml").runs[0].config
    cuda = config.model_copy(update={"device": "cuda"})
    mc_cuda = cuda.model_copy(update={"trainer": "megatron-core"})
    for configs, fork in (([cuda], False), ([config, cuda], False), ([mc_cuda], False),
                          ([config], "megatron" not in sys.modules)):
        runner.preload(configs)
        assert forks[-1] is fork, ([(c.trainer, c.device) for c in configs], forks[-1])
