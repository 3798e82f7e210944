"""Benchmark: one MoE decoder layer of the reference trainer (EP = 1), forward + backward, run eagerly on one CPU
core, eagerly on the GPU and replayed as CUDA graphs (``torch.cuda.make_graphed_callables``), side by side in one
process, with the GPU's eager and graphed bits compared (output, input gradient, every parameter gradient).

Why (issue #38, item 3): a dsv3 rank on the GPU is bound by the host's ~10 us per kernel launch, while a hidden-32
layer's ops take 1-3 us on a CPU core, so the GPU loses to the CPU.  A graph replays a layer's whole forward
(or backward) with one launch; this measures what that would save per layer and microbatch, and whether the
replay keeps the eager bits, before the schedules are built around it.

    python3 bench/bench_graph_layer.py [--cases cases/dsv3.yaml,cases/dsv3-gpu.yaml] [--iters 30] [--out FILE]
                                       [--layers N] [--gpu-dtype case|bfloat16|float32]

``--layers N``: N MoE layers in sequence, replayed as one graph (a P = 1 microbatch's decoder is 58 of them in the
dsv3 cases); ``--gpu-dtype``: the GPU's parameter dtype instead of the case's (fp32 cannot be captured: torch's fp32
grouped GEMM reads its group offsets to the host).

Per case (its model and microbatch shape, params in the case's dtype on the GPU, fp32 on the CPU): median time
per forward + backward over `--iters` iterations after warm-up (CUDA events around each iteration on the GPU;
perf_counter on the CPU), and ``bits_equal``: the graphed replay's output and gradients against the GPU eager
run's, bitwise.  A capture that fails (a host read inside the layer, an op that cannot be captured) is recorded
with its error, not raised: that is a finding too.  Deterministic algorithms on, as in the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # before CUDA starts, as the ranks do

import torch  # noqa: E402
from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)
from torch import nn  # noqa: E402

from harness.errors import UsageError  # noqa: E402
from harness.planning.cases import load_case  # noqa: E402
from reference_impl.model.common import rope_cos_sin  # noqa: E402
from reference_impl.model.layer import TransformerLayer  # noqa: E402
from trainerkit.config import RunConfig  # noqa: E402
from trainerkit.fingerprint import raw_bits  # noqa: E402
from trainerkit.init import init_parameters  # noqa: E402


class _LayerFn(nn.Module):
    """x [s, b, h] -> the layers' output, one after the other, with the RoPE tables bound (a graphed callable takes
    tensors only)."""

    def __init__(self, layers: list[TransformerLayer], cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.layers, self.cos, self.sin = nn.ModuleList(layers), cos, sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return x


def _run_config(case: Path) -> RunConfig:
    """The case's baseline run config, read the harness's way (``extends``, defaults, validation)."""
    return load_case(case, only=[], overrides={"device": "cpu"}).runs[0].config


def _build(run: RunConfig, device: str, dtype: torch.dtype, layers: int, seed: int = 0):
    cfg, s, b = run.model, run.training.seq_length, run.training.micro_batch_size
    torch.manual_seed(seed)
    stack = []
    for i in range(layers):
        layer = TransformerLayer(cfg, moe=True)
        # as the trainer does (trainerkit.init, by global name): the router weight is made with torch.empty, so a
        # layer left as constructed routes on whatever the memory held (a stack of such layers went non-finite in
        # some processes and not in others, 2026-12-07)
        with torch.no_grad():
            init_parameters([(f"decoder.layers.{i}.{n}", p) for n, p in layer.named_parameters()], cfg, seed)
        stack.append(layer.to(device=device, dtype=dtype))
    cos, sin = (t.to(device, dtype) for t in rope_cos_sin(s, cfg.qk_pos_emb_head_dim, cfg.rotary_base))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s, b, cfg.hidden_size, generator=g).to(device, dtype)
    dy = torch.randn(s, b, cfg.hidden_size, generator=g).to(device, dtype)
    return _LayerFn(stack, cos, sin), x, dy


def _step(fn, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list:
    """One forward + backward from zeroed gradients; returns [output, dx, every parameter's grad]."""
    for p in module.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_(True)
    y = fn(xi)
    y.backward(dy)
    return [y.detach(), xi.grad] + [p.grad for p in module.parameters()]


def _time(fn, module, x, dy, iters: int, cuda: bool) -> float:
    """Median ms per forward + backward."""
    for _ in range(3):
        _step(fn, module, x, dy)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, module, x, dy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            _step(fn, module, x, dy)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _same_bits(a, b) -> bool:
    """Bitwise equality that a NaN cannot spoil (torch.equal calls NaN unequal to itself; a stack of random,
    untrained layers can overflow bf16)."""
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool((raw_bits(a) == raw_bits(b)).all())


def measure(case: Path, run: RunConfig, iters: int, layers: int = 1, gpu_dtype: str = "case") -> dict:
    dtype = getattr(torch, run.params_dtype if gpu_dtype == "case" else gpu_dtype)
    out: dict = {"case": str(case.relative_to(ROOT)), "gpu_dtype": str(dtype).replace("torch.", ""), "layers": layers}
    module, x, dy = _build(run, "cpu", torch.float32, layers)
    out["cpu_eager_ms"] = _time(module, module, x, dy, iters, cuda=False)
    module, x, dy = _build(run, "cuda", dtype, layers)
    out["cuda_eager_ms"] = _time(module, module, x, dy, iters, cuda=True)
    eager = _step(module, module, x, dy)
    again = _step(module, module, x, dy)        # the control: eager against itself
    out["eager_repeatable"] = all(_same_bits(a, b) for a, b in zip(eager, again))
    out["finite"] = all(t is None or bool(torch.isfinite(t).all()) for t in eager)
    try:
        sample = x.detach().clone().requires_grad_(True)
        graphed = torch.cuda.make_graphed_callables(module, (sample,), num_warmup_iters=3,
                                                   allow_unused_input=True)
    except Exception as exc:  # noqa: BLE001  (a failed capture is a finding: recorded, not raised)
        out["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return out
    out["cuda_graphed_ms"] = _time(graphed, module, x, dy, iters, cuda=True)
    replay = _step(graphed, module, x, dy)
    out["bits_equal"] = len(eager) == len(replay) and all(_same_bits(a, b) for a, b in zip(eager, replay))
    out["tensors_compared"] = len(eager)
    if not out["bits_equal"]:       # which: 0 the output, 1 dx, then the parameters' gradients in module order
        names = ["output", "dx"] + [n for n, _ in module.named_parameters()]
        out["differing"] = [n for n, a, b in zip(names, eager, replay)
                            if not _same_bits(a, b)][:20]
    out["graphed_over_cpu"] = out["cpu_eager_ms"] / out["cuda_graphed_ms"]
    out["graphed_over_eager"] = out["cuda_eager_ms"] / out["cuda_graphed_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="cases/dsv3.yaml,cases/dsv3-gpu.yaml")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--gpu-dtype", default="case", choices=("case", "bfloat16", "float32"))
    args = ap.parse_args()
    out = out_file(args.out)
    if args.iters < 1:
        fail(f"--iters {args.iters}: must be >= 1")
    if not 1 <= args.layers <= 64:
        fail(f"--layers {args.layers}: expected 1 to 64 (a dsv3 decoder has 58 MoE layers)")
    names = args.cases.split(",")
    if not all(n.strip() for n in names):
        fail(f"--cases {args.cases!r}: an empty case name")
    cases = [(ROOT / n).resolve() for n in names]
    runs = []                                         # each case read once, before anything is measured
    for name, case in zip(names, cases):
        if ROOT not in case.parents or not case.is_file():
            fail(f"--cases: {name!r} is not a case file of this repository")
        try:
            runs.append(_run_config(case))
        except UsageError as err:
            fail(f"--cases: {err}")
    if not torch.cuda.is_available():
        fail("needs a CUDA device (none found); nothing measured")
    torch.set_num_threads(1)                          # one CPU rank = one core
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": args.iters,
               "cases": [measure(c, run, args.iters, args.layers, args.gpu_dtype) for c, run in zip(cases, runs)]}
    for r in results["cases"]:
        line = f"{r['case']} ({r['layers']} layer(s), {r['gpu_dtype']} on the GPU): cpu {r['cpu_eager_ms']:.2f} ms, cuda eager {r['cuda_eager_ms']:.2f} ms"
        line += (f", graphed {r['cuda_graphed_ms']:.3f} ms (x{r['graphed_over_eager']:.1f} over eager, "
                 f"x{r['graphed_over_cpu']:.1f} over the CPU core), bits equal: {r['bits_equal']}"
                 if "graph_error" not in r else f", capture failed: {r['graph_error']}")
        print(line)
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
