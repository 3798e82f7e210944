"""The on-device fingerprint (trainerkit/fingerprint_gpu.py, its kernels in fingerprint_kernels.py) equals the CPU
definition bit for bit.

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

    from trainerkit import fingerprint_gpu as fg
    from trainerkit import fingerprint_kernels as fk
    if not HAS_CUDA and not fk.INTERPRET:         # imported earlier without the interpreter: re-decorate
        fk = importlib.reload(fk)
        fg = importlib.reload(fg)

    @triton.jit
    def _probe_sum(out):
        tl.store(out, tl.sum(tl.arange(0, 4), axis=0))

    @triton.jit
    def _probe_term(out, words, first, N: tl.constexpr):
        """Store the kernels' term mix(w ^ mix(j + 1)) for words w at indices j = first + offs."""
        offs = tl.arange(0, N)
        w = tl.load(words + offs).to(tl.uint64, bitcast=True)
        tl.store(out + offs, fk._term(w, first + offs.to(tl.int64)).to(tl.int64, bitcast=True))

    @triton.jit
    def _probe_term_lo(out, words, first, N: tl.constexpr):
        """The narrow kernels' term for indices j = first + offs, given j + 1 as uint32."""
        offs = tl.arange(0, N)
        w = tl.load(words + offs).to(tl.uint64, bitcast=True)
        j1 = (first + 1).to(tl.uint32) + offs.to(tl.uint32)
        tl.store(out + offs, fk._term_lo(w, j1).to(tl.int64, bitcast=True))

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

from trainerkit.fingerprint import _mix, fingerprint, fingerprint_hex  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
# sizes around word, sub-block and block boundaries (with SMALL: SUBW = 256 words, BLOCKW = 512 words, i.e.
# 2048 / 1024 / 512 / 256 elements of 1 / 2 / 4 / 8 bytes per sub-block); 1_000_003 only on a GPU
SIZES = [0, 1, 2, 3, 5, 7, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, 16_385, 40_001] + (
    [1_000_003] if HAS_CUDA else [])
# the interpreter pays per program and per vector op; small blocks put many boundaries in small tensors
SMALL = {"num_warps": 2, "wpt": 4, "nsub": 2}
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
        assert fg.INTERPRET and fk.INTERPRET
        assert "Interpreted" in type(fg._contig_kernel).__name__


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_cpu_definition(dtype, size):
    t = sample(dtype, (size,), seed=size * 7 + DTYPES.index(dtype))
    got = fg.fingerprint_device(t)
    assert type(got) is int and 0 <= got <= MASK64
    assert got == ref(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pack,loop,narrow", [(p, "static", False) for p in fg.PACKS]
                         + [("reshape", "dynamic", True), ("reshape", "dynamic", False)])
def test_every_alignment_class_and_pack_agrees(pack, loop, narrow, dtype):
    """Every alignment class (offset views of one buffer: 16-byte aligned, 8-byte aligned, and each
    misalignment the element size allows, funnel-shifted), partial last words, both packings of the
    strided kernel's element loads, and the dynamic loop narrow (word loads, 32-bit index terms) and wide
    give the reference bits."""
    buf = sample(dtype, (3000,), seed=21)
    esize = buf.element_size()
    views = [buf[k:k + n] for k in range(0, 16 // esize + 1) for n in (1, 3, 7, 300, 1025)]
    views += [buf.reshape(-1, 2)[1:, 1], buf[1:2996].reshape(-1, 5)[3:, 1:4]]             # strided
    classes = {fg._alignment(fg._meta(v)) for v in views}
    assert classes == {(True, 0), (False, 0)} | {(False, r) for r in range(esize, 8, esize)}
    want = [ref(v) for v in views]
    assert fg.fingerprint_many(views, pack=pack, loop=loop, narrow=narrow, **SMALL) == want
    assert [fg.fingerprint_device(v, pack=pack, loop=loop, narrow=narrow, **SMALL) for v in views[::4]] == want[::4]


def test_partial_word_ignores_the_bytes_after_the_tensor():
    """The last word of a tensor whose byte size is not a multiple of 8 is read whole: the bytes after the
    tensor (here: other data of the same buffer) must not reach the fingerprint."""
    buf = sample(torch.bfloat16, (64,), seed=2)
    a, b = buf[:5], buf.clone()
    b[5:] = -buf[5:]                        # same first 5 elements, different bytes after them
    assert fg.fingerprint_device(a) == fg.fingerprint_device(b[:5]) == ref(a)


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
    """Gradients-like list: repeated shapes, all dtypes, empties, scalars, unaligned and strided views, the
    same tensor twice."""
    ts = []
    for k, dtype in enumerate(DTYPES):
        for n in (0, 1, 5, 1000, 1000, 1000, 1000, 1000, 5000, 5000):
            ts.append(sample(dtype, (n,), seed=100 * k + n + len(ts)))
    w = sample(torch.float32, (64, 48), seed=1)
    ts += [w, w, w.t(), sample(torch.float32, (101,), seed=2)[1:], sample(torch.bfloat16, (99,), seed=3)[3:],
           sample(torch.float32, ()), sample(torch.bfloat16, (2, 0, 3)), sample(torch.float64, (7, 9, 11), seed=4)]
    return ts


@pytest.mark.parametrize("pack,loop,narrow", [(p, loop, False) for p in fg.PACKS for loop in fg.LOOPS]
                         + [(p, "dynamic", True) for p in fg.PACKS])
def test_many_equals_per_tensor(pack, loop, narrow):
    ts = _mixed_list()
    want = [ref(t) for t in ts]
    assert fg.fingerprint_many(ts, pack=pack, loop=loop, narrow=narrow, **SMALL) == want
    opts = {"pack": pack, "loop": loop, "narrow": narrow, **SMALL}
    assert fg.fingerprint_hex_many_device(ts, **opts) == [f"{v:016x}" for v in want]  # the cached plan
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
    with pytest.raises(ValueError, match="pack"):
        fg.fingerprint_device(t, pack="fast")
    with pytest.raises(ValueError, match="wpt"):
        fg.fingerprint_device(t, wpt=3)
    with pytest.raises(ValueError, match="narrow"):
        fg.fingerprint_device(t, narrow="yes")
    with pytest.raises(ValueError, match="narrow=True needs loop='dynamic'"):
        fg.fingerprint_device(t, narrow=True, loop="static")
    for bad in ({"wpt": 8.0}, {"nsub": True}, {"num_warps": "4"}):
        with pytest.raises(ValueError, match="must be an int"):
            fg.fingerprint_device(t, **bad)
    with pytest.raises(ValueError, match="narrow"):
        fg.word_sums([], [], [], 1, narrow="yes")


def test_term_at_large_word_indices():
    """mix(w ^ mix(j + 1)) for word indices near 2^31, 2^32, 2^40 and 2^64 (tensors that large do not fit a
    test): the kernels' 64-bit index arithmetic."""
    words = sample(torch.int64, (64,), seed=7)
    wnp = words.cpu().numpy().view(np.uint64)
    for first in (0, (1 << 31) - 5, (1 << 32) - 64, (1 << 40) + 3, (1 << 63) - 7, (1 << 64) - 40):
        out = torch.empty(64, dtype=torch.int64, device=DEVICE)
        _probe_term[(1,)](out, words, first - (1 << 64) if first >= (1 << 63) else first, N=64)
        with np.errstate(over="ignore"):
            want = _mix(wnp ^ _mix(np.arange(64, dtype=np.uint64) + np.uint64(first) + np.uint64(1)))
        assert np.array_equal(out.cpu().numpy().view(np.uint64), want), hex(first)


def test_narrow_term_up_to_the_last_32_bit_index():
    """`_term_lo` (j + 1 on 32 bits, the first finaliser step narrowed) equals the definition for every j + 1
    that fits 32 bits, up to 2^32 - 1, whose top bits the narrowed first xor-shift must carry."""
    words = sample(torch.int64, (64,), seed=8)
    wnp = words.cpu().numpy().view(np.uint64)
    for first in (0, (1 << 31) - 5, (1 << 32) - 65):
        out = torch.empty(64, dtype=torch.int64, device=DEVICE)
        _probe_term_lo[(1,)](out, words, first, N=64)
        with np.errstate(over="ignore"):
            want = _mix(wnp ^ _mix(np.arange(64, dtype=np.uint64) + np.uint64(first) + np.uint64(1)))
        assert np.array_equal(out.cpu().numpy().view(np.uint64), want), hex(first)


@pytest.mark.parametrize("base,narrow", [((1 << 32) - 301, True), ((1 << 32) - 300, False)])
def test_word_sums_narrow_only_where_every_index_fits_32_bits(base, narrow):
    """A launch is narrow only while its last word index + 1 fits 32 bits: 300 words at base 2^32 - 301 end on
    j + 1 = 2^32 - 1 (narrow), at 2^32 - 300 on 2^32 (the wide kernel); both give the definition's sums."""
    words = sample(torch.int64, (300,), seed=9)
    assert fg.word_sums([words], [base], [0], 1, narrow=True) == [_host_word_sum(words, base)]
    plan, _ = fg._plan([words], fg._cfg({"narrow": True}), ((base, 0),))
    assert [launch[-1] for launch in plan.launches] == [narrow]


def _host_word_sum(words, base):
    w = words.cpu().numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        idx = np.arange(len(w), dtype=np.uint64) + np.uint64(base) + np.uint64(1)
        return int(np.add.reduce(_mix(w ^ _mix(idx)), dtype=np.uint64))


def test_module_imports_and_falls_back_without_triton():
    """Without Triton: the module imports, CPU tensors use the reference, `available()` is False."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from trainerkit import fingerprint_gpu as fg\n"
            "from trainerkit.fingerprint import fingerprint\n"
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64], ids=str)
def test_shard_partials_on_the_kernels_combine_to_the_whole(dtype, monkeypatch):
    """`fingerprint_shard.partial_many` sums a shard's whole words on the device (`word_sums`: one table row
    per run, each with its first word's global index) and only the cut words' bytes come to the host: column
    splits (one run per row, words cut for 1- and 2-byte dtypes), row splits and flat ranges at odd offsets
    combine to the whole tensor's fingerprint."""
    from trainerkit import fingerprint_shard as fs
    calls = []
    real = fg.word_sums
    monkeypatch.setattr(fg, "word_sums", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    t = sample(dtype, (37, 24), seed=5)
    want = ref(t)
    tilings = [(1, [0, 7, 13, 24]), (0, [0, 1, 20, 37]), (None, [0, 3, 411, 888])]
    for dim, cuts in tilings:
        flat = t.reshape(-1)
        locs = [flat[a:b] if dim is None else t.narrow(dim, a, b - a).contiguous() for a, b in zip(cuts, cuts[1:])]
        parts = fs.partial_many(locs, [fs.Shard((37, 24), dim, a) for a in cuts[:-1]])
        assert fs.combine(parts) == want, (dim, cuts)
    assert len(calls) == 3 and all(calls), "the whole words must go through the kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ranges_within_two_piece_tp_slices_on_the_kernels_combine_to_the_whole(dtype):
    """A gated fc1's TP slices (two pieces each, `Shard.pieces`) cut again into distributed-optimizer ranges
    (`Shard.within`) at odd offsets: the device sums of their whole words and the host's cut words combine to
    the whole tensor's fingerprint."""
    from trainerkit import fingerprint_shard as fs
    t = sample(dtype, (40, 24), seed=7)
    want = ref(t)
    locs, shards = [], []
    for r in range(2):                         # rows r*10:(r+1)*10 of the gate half, then of the up half
        pieces = ((r * 10, 10), (20 + r * 10, 10))
        local = torch.cat([t.narrow(0, o, n) for o, n in pieces]).contiguous()
        for a, b in ((0, 131), (131, 317), (317, local.numel())):
            locs.append(local.reshape(-1)[a:b])
            shards.append(fs.Shard((40, 24), 0, pieces[0][0], pieces, (a, b)))
    assert fs.combine(fs.partial_many(locs, shards)) == want


def test_word_sums_at_a_word_base_match_the_definition():
    """A piece's terms use its global word indices: word_sums of words at base 10**12 equal the host terms."""
    words = sample(torch.int64, (300,), seed=6)
    got = fg.word_sums([words[:100], words[100:]], [10 ** 12, 5], [0, 1], 3)
    w = words.cpu().numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        want0 = int(np.add.reduce(_mix(w[:100] ^ _mix(np.arange(10 ** 12 + 1, 10 ** 12 + 101, dtype=np.uint64))),
                                  dtype=np.uint64))
        want1 = int(np.add.reduce(_mix(w[100:] ^ _mix(np.arange(6, 206, dtype=np.uint64))), dtype=np.uint64))
    assert got == [want0, want1, 0]
