"""Benchmark: on-device fingerprint throughput (trainerkit/fingerprint_gpu.py) against ``torch.sum`` of the same
tensors, measured side by side in one run (goal, issue #25: >= 0.95 of torch.sum's bytes/s: the fingerprint is a
read-only reduction, so the memory's read limit is its bound), and against a device-to-device copy and a naive
torch int64 implementation of the same hash for reference.

    python bench/bench_fingerprint_gpu.py [--out bench/results/fingerprint_gpu.json] [--no-sweep] [--quick]
    TRITON_INTERPRET=1 python bench/bench_fingerprint_gpu.py --smoke-cpu   # the script's logic, on CPU, tiny sizes

1. sweep (256 MiB: fp32, bf16, and bf16 at an odd address, which takes the element-load path): a few launch
   geometries and both element packings - the numbers to choose `fingerprint_gpu.DEFAULT` from;
2. single tensors of 64 MiB, 256 MiB, 1 GiB (fp32, bf16): fingerprint vs copy_ vs naive torch hash;
3. a gradient-like list (~2000 tensors, ~1.2e9 fp32 parameters, scaled down if memory is short):
   fingerprint_many vs one flat copy of the same bytes and vs torch._foreach_copy_.

Device times use CUDA events with the GPU held busy (torch.cuda._sleep) while the host queues the launches,
so they exclude Python overhead; "e2e" columns are wall-clock times of the full call (host work, launches,
the 8-byte read-back).  Every measured fingerprint is checked against the CPU reference (or, for the largest
tensors, against the device result with other options and the naive torch hash).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _refuse import fail, out_file  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

from trainerkit import fingerprint_gpu as fg  # noqa: E402
from trainerkit.fingerprint import _header, _mix, fingerprint  # noqa: E402

GOAL = 0.95                       # of torch.sum's bytes/s on the same bytes
ALT = {"narrow": not fg.DEFAULT["narrow"]}    # the other whole-word loop (fingerprint_kernels), side by side
ALT_LABEL = f"narrow={ALT['narrow']}"
MiB = 1 << 20
SLEEP_CYCLES = 4_000_000          # ~2 ms of GPU busy-wait so the host can queue the timed launches
DEVICE = "cuda"                   # "cpu" only for --smoke-cpu (Triton interpreter, tiny sizes, no real timing)
SIZES = {"sweep": 256 * MiB, "single": [64 * MiB, 256 * MiB, 1024 * MiB], "many_params": 2e9, "layers": 25}


# --- timing ------------------------------------------------------------------------------------------------------

def device_ms(fn, reps: int, warmup: int = 3, sleep_cycles: int = SLEEP_CYCLES) -> float:
    """Median device time (ms) of fn() between two CUDA events; fn may return an object with .result(), called
    after the end event (the read-back is not part of the device time).  sleep_cycles must keep the GPU busy
    for longer than the host needs to queue fn's launches, or the host time leaks into the measurement."""
    for _ in range(warmup):
        r = fn()
        if hasattr(r, "result"):
            r.result()
    if DEVICE == "cpu":
        return wall_ms(lambda: getattr(fn(), "result", lambda: None)(), reps=1, warmup=0)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        r = fn()
        end.record()
        if hasattr(r, "result"):
            r.result()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median wall-clock time (ms) of a synchronous call."""
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


# --- the naive reference: the same definition in plain torch int64 ops ------------------------------------------

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)       # logical shift on int64


def _tmix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


def naive_fingerprint(t: torch.Tensor) -> int:
    """fp64v2 with torch int64 ops (wrapping multiply and sum): one pass per op, int64 temporaries."""
    raw = t.reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    w = raw.view(torch.int64)
    idx = torch.arange(1, w.numel() + 1, device=t.device, dtype=torch.int64)
    s = int(_tmix(w ^ _tmix(idx)).sum()) & ((1 << 64) - 1)
    h = _mix(np.array([_header(t.dtype, tuple(t.shape))], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        return int(_mix(np.array([np.uint64(s) ^ h], dtype=np.uint64))[0])


# --- workloads ---------------------------------------------------------------------------------------------------

def random_tensor(nbytes: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    return torch.randn(n, device=DEVICE, generator=g, dtype=torch.float32).to(dtype)


def gradient_shapes(scale: float = 1.0, layers: int = 25) -> list:
    """~2000 tensors, ~1.2e9 parameters at scale 1: an MoE-like stack (25 layers x (4 attention matrices, 2 norms,
    router, router bias, 24 experts x 3 matrices)) + embedding + output head."""
    h = max(64, int(2048 * scale ** 0.5) // 64 * 64)
    ffn, vocab, experts = max(8, h * 160 // 2048 // 8 * 8), max(64, int(50048 * scale ** 0.5) // 64 * 64), 24
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(h,), (h,), (experts, h), (experts,)]
        for _ in range(experts):
            shapes += [(ffn, h), (ffn, h), (h, ffn)]
    return shapes + [(h,), (vocab, h)]


def check(name: str, got: int, want: int, results: dict) -> None:
    ok = got == want
    results.setdefault("checks", []).append({"what": name, "ok": ok})
    if not ok:
        print(f"  !! MISMATCH {name}: {got:016x} vs {want:016x}")


# --- sections ----------------------------------------------------------------------------------------------------

def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sweep(results: dict) -> dict:
    """A few launch geometries and both element packings on 256 MiB of fp32, bf16 and bf16 at an odd address
    (element-load path)."""
    best = {}
    rows = []
    geometries = [{}, ALT, {"wpt": 16}, {"wpt": 4}, {"nsub": 4}, {"nsub": 16}, {"nsub": 32},
                  {"num_warps": 8, "wpt": 4}, {"num_warps": 8}, {"num_warps": 16, "wpt": 4}, {"stages": 1},
                  {"stages": 2}, {"stages": 4}, {"pack": "2d"}, {"loop": "static", "narrow": False},
                  {**ALT, "wpt": 16}]
    for label, dtype, shift in (("fp32", torch.float32, 0), ("bf16", torch.bfloat16, 0),
                                ("bf16 odd address", torch.bfloat16, 1)):
        t = random_tensor(SIZES["sweep"] + 2 * shift, dtype, seed=1)[shift:]
        nbytes = t.numel() * t.element_size()
        want = fg.fingerprint_device(t)
        sum_ms = device_ms(lambda: t.sum(), reps=10)
        rows.append({"input": label, "bytes": nbytes, "torch.sum": True, "ms": sum_ms, "TBps": tbps(nbytes, sum_ms)})
        print(f"  {label:17} {'torch.sum':26} {sum_ms:8.3f} ms {tbps(nbytes, sum_ms):6.2f} TB/s")
        scored = []
        for geo in geometries:
            check(f"sweep {label} {geo}", fg.fingerprint_device(t, **geo), want, results)
            ms = device_ms(lambda: fg.fingerprint_many_async([t], **geo), reps=10)
            scored.append((ms, geo))
            rows.append({"input": label, "bytes": nbytes, **geo, "ms": ms, "TBps": tbps(nbytes, ms),
                         "ratio_sum": sum_ms / ms})
            print(f"  {label:17} {str(geo or 'default'):26} {ms:8.3f} ms {tbps(nbytes, ms):6.2f} TB/s"
                  f"  {sum_ms / ms:5.2f} of torch.sum")
        ms, opts = min(scored, key=lambda s: s[0])
        best[label] = {"options": opts, "ms": ms, "TBps": tbps(nbytes, ms), "ratio_sum": sum_ms / ms}
        t = None      # frees the tensor before the next dtype's (not del: the lambdas above name it)
        _empty_cache()
    results["sweep"] = rows
    results["sweep_best"] = best
    best[str(torch.float32)] = best["fp32"]
    best[str(torch.bfloat16)] = best["bf16"]
    return best


def single(results: dict, best: dict) -> None:
    rows = []
    sizes = SIZES["single"]
    print(f"  {'dtype':15} {'size':>8} {'sum TB/s':>9} {'copy TB/s':>10} {'fp TB/s':>8} {'/sum':>6} {'alt':>6}"
          f" {'/sum':>6} {'best':>6} {'/sum':>6} {'fp e2e ms':>9} {'naive TB/s':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in sizes:
            src = random_tensor(nbytes, dtype, seed=nbytes % 97)
            dst = torch.empty_like(src)
            copy_ms = device_ms(lambda: dst.copy_(src), reps=20)
            sum_ms = device_ms(lambda: src.sum(), reps=20)
            fp_ms = device_ms(lambda: fg.fingerprint_many_async([src]), reps=20)
            e2e_ms = wall_ms(lambda: fg.fingerprint_device(src), reps=10)
            bopts = best.get(str(dtype), {}).get("options", {})
            best_ms = device_ms(lambda: fg.fingerprint_many_async([src], **bopts), reps=20) if bopts else fp_ms
            alt_ms = device_ms(lambda: fg.fingerprint_many_async([src], **ALT), reps=20)
            got = fg.fingerprint_device(src)
            check(f"{dtype} {nbytes // MiB} MiB {ALT_LABEL}", fg.fingerprint_device(src, **ALT), got, results)
            naive_ms = device_ms(lambda: naive_fingerprint(src), reps=3, warmup=1)
            naive = naive_fingerprint(src)
            check(f"{dtype} {nbytes // MiB} MiB vs naive torch", got, naive, results)
            check(f"{dtype} {nbytes // MiB} MiB best options", fg.fingerprint_device(src, **bopts), got, results)
            if nbytes <= 64 * MiB and DEVICE == "cuda" or nbytes <= 16 << 10:
                check(f"{dtype} {nbytes // MiB} MiB vs CPU reference", got, fingerprint(src.cpu()), results)
            row = {"dtype": str(dtype), "bytes": nbytes, "sum_ms": sum_ms, "sum_TBps": tbps(nbytes, sum_ms),
                   "copy_ms": copy_ms, "copy_read_TBps": tbps(nbytes, copy_ms),
                   "fp_ms": fp_ms, "fp_TBps": tbps(nbytes, fp_ms), "ratio_sum": sum_ms / fp_ms,
                   "ratio_copy": copy_ms / fp_ms, "alt_options": ALT, "fp_alt_ms": alt_ms,
                   "ratio_sum_alt": sum_ms / alt_ms,
                   "fp_best_ms": best_ms, "best_options": bopts, "ratio_sum_best": sum_ms / best_ms,
                   "fp_e2e_ms": e2e_ms, "naive_ms": naive_ms, "naive_TBps": tbps(nbytes, naive_ms)}
            rows.append(row)
            print(f"  {str(dtype):15} {nbytes // MiB:>5}MiB {row['sum_TBps']:9.2f} {row['copy_read_TBps']:10.2f}"
                  f" {row['fp_TBps']:8.2f} {row['ratio_sum']:6.2f} {tbps(nbytes, alt_ms):6.2f}"
                  f" {row['ratio_sum_alt']:6.2f} {tbps(nbytes, best_ms):6.2f}"
                  f" {row['ratio_sum_best']:6.2f} {e2e_ms:9.3f} {row['naive_TBps']:10.3f}")
            src = dst = None      # not del: the lambdas above name them
            _empty_cache()
    results["single"] = rows


def many(results: dict, best: dict) -> None:
    free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 0
    scale = 1.0
    shapes = gradient_shapes(scale, SIZES["layers"])
    nparams = sum(int(np.prod(s)) for s in shapes)
    while (nparams * 4 * 4.3 > free * 0.8 or nparams > SIZES["many_params"]) and scale > 1e-4:   # grads, flat
        # src + dst, foreach dsts
        scale /= 2
        shapes = gradient_shapes(scale, SIZES["layers"])
        nparams = sum(int(np.prod(s)) for s in shapes)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    grads = [torch.randn(s, device=DEVICE, generator=g) for s in shapes]
    nbytes = nparams * 4
    flat_src = torch.empty(nparams, device=DEVICE)
    flat_dst = torch.empty_like(flat_src)
    dsts = [torch.empty_like(x) for x in grads]
    copy_ms = device_ms(lambda: flat_dst.copy_(flat_src), reps=10)
    # the read limit for these bytes: one torch.sum over a flat tensor of the same size (a torch.sum per tensor
    # would pay ~2000 launches and flatter the fingerprint), and the same per tensor, for completeness
    sum_ms = device_ms(lambda: flat_src.sum(), reps=10)
    sum_each_ms = device_ms(lambda: [x.sum() for x in grads], reps=5, sleep_cycles=10 * SLEEP_CYCLES)
    foreach_ms = device_ms(lambda: torch._foreach_copy_(dsts, grads), reps=10, sleep_cycles=10 * SLEEP_CYCLES)
    dsts = None
    out = {"tensors": len(grads), "params": nparams, "bytes": nbytes, "scale": scale,
           "copy_ms": copy_ms, "copy_read_TBps": tbps(nbytes, copy_ms), "flat_sum_ms": sum_ms,
           "flat_sum_TBps": tbps(nbytes, sum_ms), "sum_per_tensor_ms": sum_each_ms,
           "sum_per_tensor_TBps": tbps(nbytes, sum_each_ms),
           "foreach_copy_ms": foreach_ms, "foreach_copy_read_TBps": tbps(nbytes, foreach_ms)}
    got = fg.fingerprint_many(grads)
    sub = list(range(0, len(grads), 97))
    check("many vs per-tensor", [got[j] for j in sub] == [fg.fingerprint_device(grads[j]) for j in sub], True,
          results)
    small = [j for j in sub if grads[j].numel() <= 1 << 22][:5]
    check("many vs CPU reference", [got[j] for j in small] == [fingerprint(grads[j].cpu()) for j in small], True,
          results)
    print(f"  {len(grads)} tensors, {nparams / 1e9:.2f}e9 fp32 params ({nbytes / 2**30:.1f} GiB);"
          f" flat copy {tbps(nbytes, copy_ms):.2f} TB/s read, _foreach_copy_ {tbps(nbytes, foreach_ms):.2f} TB/s")
    print(f"  torch.sum: flat {tbps(nbytes, sum_ms):.2f} TB/s, one per tensor {tbps(nbytes, sum_each_ms):.2f} TB/s")
    for label, opts in (("default", {}), (ALT_LABEL, ALT), ("nsub=2", {"nsub": 2}),
                        ("best single-tensor options", best.get("torch.float32", {}).get("options", {}))):
        # ~20 ms of GPU sleep: the host needs a few ms to look up the plan of 2000 tensors
        ms = device_ms(lambda: fg.fingerprint_many_async(grads, **opts), reps=10, sleep_cycles=10 * SLEEP_CYCLES)
        e2e = wall_ms(lambda: fg.fingerprint_many(grads, **opts), reps=5)
        check(f"many {label}", fg.fingerprint_many(grads, **opts) == got, True, results)
        out[label] = {"options": opts, "ms": ms, "TBps": tbps(nbytes, ms), "ratio_sum": sum_ms / ms,
                      "ratio_copy": copy_ms / ms, "e2e_ms": e2e, "launches": _launch_count(grads, opts)}
        print(f"  fingerprint_many {label:28} {ms:8.3f} ms {tbps(nbytes, ms):6.2f} TB/s  {sum_ms / ms:5.2f} of flat sum"
              f"  e2e {e2e:8.3f} ms  launches {out[label]['launches']}")
    results["many"] = out


def _launch_count(tensors, opts) -> int:
    plan, _ = fg._plan(list(tensors), fg._cfg(opts))
    return len(plan.launches) + 1      # + the zero fill of the sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/fingerprint_gpu.json"))
    ap.add_argument("--no-sweep", action="store_true", help="skip the geometry sweep")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="check the script end to end on CPU tensors (needs TRITON_INTERPRET=1); times are meaningless")
    args = ap.parse_args()
    out = out_file(args.out)
    global DEVICE
    if args.smoke_cpu:
        if not fg.INTERPRET:
            fail("--smoke-cpu needs TRITON_INTERPRET=1 in the environment")
        DEVICE = "cpu"
        SIZES.update(sweep=64 << 10, single=[16 << 10, 64 << 10], many_params=2e5, layers=1)
    elif args.quick:
        SIZES.update(sweep=64 * MiB, single=[64 * MiB, 256 * MiB], many_params=3e8)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        fail("needs a CUDA device (none found); nothing measured")
    if not fg.HAVE_TRITON:
        fail("needs Triton (pip install triton)")
    import triton
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter smoke run)",
               "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
               "default_options": dict(fg.DEFAULT), "goal_ratio": GOAL}
    print(f"{results['device']}  torch {results['torch']}  triton {results['triton']}  cuda {results['cuda']}")
    t0 = time.monotonic()
    best = {}
    if not args.no_sweep:
        print("sweep (device time, one tensor):")
        best = sweep(results)
    print("single tensors (device time; ratio = copy time / fingerprint time = fingerprint read bandwidth / copy's):")
    single(results, best)
    print("gradient list:")
    many(results, best)
    ok = all(c["ok"] for c in results.get("checks", []))
    results["all_checks_ok"] = ok
    results["wall_s"] = time.monotonic() - t0
    ratios = [r["ratio_sum"] for r in results["single"]]
    alt = [r["ratio_sum_alt"] for r in results["single"]]
    best_ratios = [r["ratio_sum_best"] for r in results["single"]]
    print(f"checks: {'all ok' if ok else 'MISMATCHES (see above)'};  of torch.sum: single tensors {min(ratios):.2f}.."
          f"{max(ratios):.2f} ({ALT_LABEL} {min(alt):.2f}..{max(alt):.2f}; best options {min(best_ratios):.2f}.."
          f"{max(best_ratios):.2f}; goal >= {GOAL});  gradient list {results['many']['default']['ratio_sum']:.2f}"
          f" ({ALT_LABEL} {results['many'][ALT_LABEL]['ratio_sum']:.2f})"
          f" (best options {results['many']['best single-tensor options']['ratio_sum']:.2f});"
          f"  {results['wall_s']:.0f} s")
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
