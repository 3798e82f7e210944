"""The on-device fingerprint (reference_impl/fingerprint_gpu.py) equals the CPU definition bit for bit.

With a CUDA device the kernels run on it.  Without one, the same kernels run on CPU tensors in Triton's
interpreter (TRITON_INTERPRET=1 is set only while this module imports the kernels and while its tests run,
so the rest of the session and its subprocesses do not see it), with smaller sizes: the interpreter is slow.
Without Triton everything here is skipped.  Tests that need a real GPU are marked `gpu` and skip without one.
"""
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_saved_env = os.environ.get("TRITON_INTERPRET")
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    import triton.language as tl

    from reference_impl import fingerprint_gpu as fg
    if not HAS_CUDA and not fg.INTERPRET:         # imported earlier without the interpreter: re-decorate
        fg = importlib.reload(fg)

    @triton.jit
    def _probe_sum(out):
        tl.store(out, tl.sum(tl.arange(0, 4), axis=0))

    @triton.jit
    def _probe_idx(out, first, N: tl.constexpr, IDX: tl.constexpr, MODE: tl.constexpr, MH: tl.constexpr, P30,
                   P27, P31):
        """Store mix(first + offs) as computed by the kernels' index-side code."""
        offs = tl.arange(0, N)
        h, l = fg._idx_mix(first, offs, IDX, False, MODE, MH, P30, P27, P31)
        tl.store(out + offs, fg._merge(h, l).to(tl.int64, bitcast=True))

    if not HAS_CUDA:   # the interpreter only works if triton itself was first imported with TRITON_INTERPRET=1
        try:
            _probe_sum[(1,)](torch.zeros(1, dtype=torch.int32))
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"Triton was imported earlier in this session without TRITON_INTERPRET=1, so its "
                        f"interpreter cannot run ({exc!r:.80}); run this file alone", allow_module_level=True)
finally:
    if not HAS_CUDA:
        if _saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _saved_env

from reference_impl.fingerprint import _mix, fingerprint, fingerprint_hex  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
# sizes around the block boundaries (BLOCK = 16384 indices for 1/2/4-byte, 8192 for 8-byte elements);
# 1_000_003 only on a GPU: the interpreter is slow
SIZES = [0, 1, 2, 3, 4095, 4096, 4097, 16_384, 16_385, 40_001] + ([1_000_003] if HAS_CUDA else [])
# the interpreter pays per program and per vector op: few, wide programs keep the many-tensor tests fast
SMALL = {} if HAS_CUDA else {"num_warps": 32, "nsub": 1}
MASK64 = (1 << 64) - 1


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """The interpreter reads TRITON_INTERPRET while it runs, not only when the kernels are decorated."""
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def sample(dtype, shape, seed=0):
    """A random tensor of `dtype` on DEVICE with random bits in every position (NaN payloads, -0.0 ...)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if len(shape) else 1
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) < 0.5
    else:
        size = torch.empty((), dtype=dtype).element_size()
        nbits = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
        t = nbits.view(dtype).reshape(shape)
    return t.to(DEVICE)


def ref(t):
    return fingerprint(t.cpu())


def test_runs_on_the_kernels():
    """Guard against a vacuous pass: CPU tensors must go through the interpreted kernels, not the fallback."""
    assert fg.HAVE_TRITON and fg.available()
    if not HAS_CUDA:
        assert fg.INTERPRET
        assert "Interpreted" in type(fg._contig_kernel).__name__


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_cpu_definition(dtype, size):
    t = sample(dtype, (size,), seed=size * 7 + DTYPES.index(dtype))
    got = fg.fingerprint_device(t)
    assert type(got) is int and 0 <= got <= MASK64
    assert got == ref(t)


# every (variant, dtype, index width) is a separate compilation on a GPU (~1-3 s each): fewer there
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64] if HAS_CUDA else
                         [torch.float32, torch.bfloat16, torch.float64, torch.uint8], ids=str)
@pytest.mark.parametrize("variant", sorted(fg.VARIANTS))
def test_every_variant_and_index_width_agrees(variant, dtype):
    """All code variants (u64 / u32 / IMAD.HI shifts) and the 32-bit and 64-bit index paths give the same bits."""
    ts = [sample(dtype, (n,), seed=n) for n in (1, 4097, 5000, 5000)] + [sample(dtype, (37, 29), seed=3).t()]
    want = [ref(t) for t in ts]
    for min_idx in (30, 64) if HAS_CUDA else (30, 32, 64):
        assert fg.fingerprint_many(ts, variant=variant, min_idx=min_idx, **SMALL) == want, min_idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool], ids=str)
def test_non_contiguous_views(dtype):
    """Transposes, step slices, offsets, expands, selects, > 4-dim permutes: the C-order logical index counts."""
    t = sample(dtype, (37, 41), seed=9)
    big = sample(dtype, (3, 4, 5, 6, 7), seed=10)
    views = [t.t(), t[::2], t[:, 1::3], t[1:, 2:], t.t()[::2, 1::2], t[0:1].expand(4, 41), t[:, :1], t[3], t[:, 5],
             big.permute(4, 2, 0, 3, 1), big[:, ::2, :, 1:, ::3], big.transpose(1, 3)[1], t[5:6, 7:8]]
    for v in views:
        assert fg.fingerprint_device(v) == ref(v) == ref(v.contiguous()), (tuple(v.shape), v.stride())
    sq = sample(dtype, (16, 16), seed=11)
    if not torch.equal(sq, sq.t()):
        assert fg.fingerprint_device(sq.t()) != fg.fingerprint_device(sq)


def _mixed_list():
    """Gradients-like list: repeated shapes (shared index mix), all dtypes, empties, scalars, unaligned and
    strided views, the same tensor twice."""
    ts = []
    for k, dtype in enumerate(DTYPES):
        for n in (0, 1, 5, 1000, 1000, 1000, 1000, 1000, 5000, 5000):
            ts.append(sample(dtype, (n,), seed=100 * k + n + len(ts)))
    w = sample(torch.float32, (64, 48), seed=1)
    ts += [w, w, w.t(), sample(torch.float32, (101,), seed=2)[1:], sample(torch.bfloat16, (99,), seed=3)[3:],
           sample(torch.float32, ()), sample(torch.bfloat16, (2, 0, 3)), sample(torch.float64, (7, 9, 11), seed=4)]
    return ts


@pytest.mark.parametrize("share", [1, 2, 4])
def test_many_equals_per_tensor(share):
    ts = _mixed_list()
    want = [ref(t) for t in ts]
    assert fg.fingerprint_many(ts, share=share, **SMALL) == want
    assert fg.fingerprint_hex_many_device(ts, share=share, **SMALL) == [f"{v:016x}" for v in want]  # cached plan
    assert [fg.fingerprint_device(t, **SMALL) for t in ts[::13]] == want[::13]
    assert fg.fingerprint_many([]) == []


def test_cached_plan_sees_new_values_and_async_api():
    """Plans are cached by pointer/shape, results never are: changing the data changes the fingerprint."""
    ts = [sample(torch.float32, (5000,), seed=s) for s in range(3)]
    first = fg.fingerprint_many(ts, **SMALL)
    ts[1][17] += 1
    pending = fg.fingerprint_many_async(ts, **SMALL)
    second = pending.result()
    assert second[0] == first[0] and second[2] == first[2] and second[1] != first[1]
    assert second == [ref(t) for t in ts]
    assert pending.hex() == [fingerprint_hex(t.cpu()) for t in ts]


def test_hex_and_single_bit_sensitivity():
    t = sample(torch.bfloat16, (3000,), seed=5)
    assert fg.fingerprint_hex_device(t) == fingerprint_hex(t.cpu())
    u = t.clone()
    u.view(torch.int16)[1234] ^= 1 << 7
    assert fg.fingerprint_device(u) != fg.fingerprint_device(t)
    assert fg.fingerprint_device(u) == ref(u)


def test_bad_options_are_rejected():
    t = sample(torch.float32, (4,))
    with pytest.raises(TypeError, match="unknown option"):
        fg.fingerprint_device(t, blok=3)
    with pytest.raises(ValueError, match="variant"):
        fg.fingerprint_device(t, variant="fast")
    with pytest.raises(ValueError, match="share"):
        fg.fingerprint_device(t, share=3)


@pytest.mark.parametrize("variant", sorted(fg.VARIANTS))
def test_index_mix_at_large_indices(variant):
    """mix(i + 1) for indices near 2^30, 2^32, 2^40 and 2^64 (tensors that large do not fit a test)."""
    mode, mh = fg.VARIANTS[variant]
    cases = [(30, 1), (30, (1 << 30) - 64), (32, (1 << 30) - 5), (32, (1 << 32) - 64), (64, (1 << 32) - 5),
             (64, (1 << 40) + 3), (64, (1 << 63) - 7), (64, (1 << 64) - 40)]
    for idx, first in cases:
        out = torch.empty(64, dtype=torch.int64, device=DEVICE)
        arg = first - (1 << 64) if first >= (1 << 63) else first
        _probe_idx[(1,)](out, arg, N=64, IDX=idx, MODE=mode, MH=mh, P30=4, P27=32, P31=2)
        want = _mix((np.arange(64, dtype=np.uint64) + np.uint64(first)))
        assert np.array_equal(out.cpu().numpy().view(np.uint64), want), (idx, hex(first))


def test_module_imports_and_falls_back_without_triton():
    """Without Triton: the module imports, CPU tensors use the reference, `available()` is False."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from reference_impl import fingerprint_gpu as fg\n"
            "from reference_impl.fingerprint import fingerprint\n"
            "assert not fg.HAVE_TRITON and not fg.available()\n"
            "t = torch.arange(10.0)\n"
            "assert fg.fingerprint_many([t]) == [fingerprint(t)]\n"
            "assert issubclass(fg.TritonUnavailableError, ImportError)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


# --- GPU only ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("shape", [(1 << 24) + 5, (3000, 4097), (1 << 20, 3)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_large_tensors_and_views(dtype, shape):
    t = sample(dtype, shape if isinstance(shape, tuple) else (shape,), seed=1)
    assert fg.fingerprint_device(t) == ref(t)
    if t.dim() == 2:
        assert fg.fingerprint_device(t.t()) == ref(t.t())
        assert fg.fingerprint_device(t[1::3, ::2]) == ref(t[1::3, ::2])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_many_gradient_like_list_and_streams():
    """A few hundred gradient-shaped tensors in one call; the result follows the current stream's order."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 1024), (1024, 4096), (1024,), (1024,), (4000, 1024)] * 13 + [(7, 13)] * 30
    ts = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
    want = [ref(t) for t in ts]
    assert fg.fingerprint_many(ts) == want
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(1 << 22, device="cuda")
        x.mul_(3)                                  # still running on s when the fingerprint is launched there
        got = fg.fingerprint_device(x)
    assert got == ref(x)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_does_not_copy_the_tensor_to_the_host(tmp_path):
    """Only the 8-byte sum comes back: every memcpy in the profiler trace is tiny (the plan is cached by then)."""
    import json
    t = torch.randn(1 << 22, device="cuda")
    fg.fingerprint_device(t)                      # compile and cache the plan outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fg.fingerprint_device(t)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text()).get("traceEvents", [])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    if not copies:
        pytest.skip("the profiler recorded no memcpy events (CUPTI unavailable?)")
    assert all(int(e.get("args", {}).get("bytes", 0)) <= 64 for e in copies), copies
