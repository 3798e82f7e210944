"""Tests for trainerkit/fingerprint.py: the 64-bit tensor digest every trace comparison relies on.

Expectations are computed independently: element bits via `struct` (not the module's `raw_bits`), and a
pure-Python splitmix64 finaliser anchored to the published SplitMix64 output sequence.
"""
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainerkit.fingerprint import _header, fingerprint, fingerprints, float_bits_hex

MASK64 = (1 << 64) - 1
# dtype -> (bit width, integer view dtype of the same size) used to flip bits in place
WIDTH = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.float64: 64,
         torch.int64: 64, torch.uint8: 8, torch.bool: 1}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPES = list(WIDTH)


def sample(dtype, shape, seed=0):
    """A deterministic random tensor of `dtype` with mostly distinct elements."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-2**62, 2**62, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def flip_bit(t, pos, bit):
    """Copy of `t` with bit `bit` of flat element `pos` flipped (done on an integer view of the storage)."""
    size = t.element_size()
    ints = t.clone().contiguous().view(INT_VIEW[size])
    arr = ints.numpy().view(NP_UNSIGNED[size]).reshape(-1)   # shares memory with `ints`
    arr[pos] ^= NP_UNSIGNED[size](1 << bit)
    return ints.view(t.dtype)


# --- independent pure-Python reference ------------------------------------------------------------------------

def py_mix(z):
    """splitmix64 finaliser (Steele et al. 2014), pure Python with explicit mod 2^64."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def py_bits(t):
    """Element bit patterns in C order, computed with `struct` from the Python values (not from raw storage)."""
    values = t.reshape(-1).tolist() if t.dtype != torch.bfloat16 else t.float().reshape(-1).tolist()
    if t.dtype == torch.float32:
        return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]
    if t.dtype == torch.float64:
        return [struct.unpack("<Q", struct.pack("<d", v))[0] for v in values]
    if t.dtype == torch.float16:
        return [struct.unpack("<H", struct.pack("<e", v))[0] for v in values]
    if t.dtype == torch.bfloat16:   # bf16 -> fp32 is exact; bf16 bits are the upper half of the fp32 bits
        return [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values]
    if t.dtype == torch.int64:
        return [v & MASK64 for v in values]
    if t.dtype in (torch.uint8, torch.bool):
        return [int(v) for v in values]
    raise AssertionError(t.dtype)


def py_words(t):
    """The C-order byte stream of the element bits (`py_bits`, little-endian), zero-padded to a multiple of 8,
    as 64-bit little-endian words."""
    size = {torch.bool: 1, torch.uint8: 1}.get(t.dtype) or t.element_size()
    stream = b"".join(x.to_bytes(size, "little") for x in py_bits(t))
    stream += bytes(-len(stream) % 8)
    return [int.from_bytes(stream[k:k + 8], "little") for k in range(0, len(stream), 8)]


def py_fingerprint(t):
    """The module docstring's definition, written out: k_j = w_j ^ mix(j+1), S = sum mix(k_j), fp = mix(S ^ mix(H))."""
    s = 0
    for j, w in enumerate(py_words(t)):
        s = (s + py_mix(w ^ py_mix(j + 1))) & MASK64
    return py_mix(s ^ py_mix(int(_header(t.dtype, tuple(t.shape)))))


def test_py_mix_is_splitmix64():
    """Anchor the reference: SplitMix64 seeded with 0 outputs mix(k * golden gamma) = e220a8397b1dcdaf, 6e789e6aa1b965f4."""
    gamma = 0x9E3779B97F4A7C15
    assert py_mix(gamma) == 0xE220A8397B1DCDAF
    assert py_mix((2 * gamma) & MASK64) == 0x6E789E6AA1B965F4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 4), (2, 0, 3)])
def test_matches_pure_python_definition(dtype, shape):
    """`fingerprint` equals the documented definition computed independently in pure Python."""
    t = sample(dtype, shape, seed=len(shape) * 31 + DTYPES.index(dtype))
    assert fingerprint(t) == py_fingerprint(t)


def test_fingerprints_of_a_list_match_the_definition_per_tensor():
    """The one-pass list form (`fingerprints`: word index restarting per tensor, per-tensor reduceat) gives each
    tensor its own definition value, whatever its neighbours: empty tensors, odd byte counts that pad, views
    that are not contiguous, every dtype, in one mixed list."""
    tensors = [sample(dtype, shape, seed=k) for k, (dtype, shape) in
               enumerate((d, s) for d in DTYPES for s in [(), (0,), (3,), (5, 3), (2, 0, 3), (9,)])]
    tensors += [sample(torch.float32, (4, 6), seed=99).t(), sample(torch.bfloat16, (3, 5), seed=98)[:, 1:4]]
    assert fingerprints(tensors) == [py_fingerprint(t) for t in tensors]
    assert fingerprints(tensors[::-1]) == [py_fingerprint(t) for t in tensors[::-1]]
    assert fingerprints([]) == []


def test_returns_python_int_in_range():
    fp = fingerprint(torch.arange(5, dtype=torch.float32))
    assert type(fp) is int and 0 <= fp <= MASK64


# --- sensitivity ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_fingerprint(dtype):
    """Flipping each bit of each element (exhaustively, small tensor) changes the fingerprint, and all the
    flipped tensors have pairwise distinct fingerprints.  For bool only the value bit is a legal flip."""
    t = sample(dtype, (2, 3), seed=5)
    base = fingerprint(t)
    seen = {base}
    for pos in range(t.numel()):
        for bit in range(WIDTH[dtype]):
            fp = fingerprint(flip_bit(t, pos, bit))
            assert fp not in seen, (pos, bit)
            seen.add(fp)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([d for d in DTYPES if d != torch.bool]), n=st.integers(1, 300),
       data=st.data())
def test_random_bit_flip_changes_fingerprint(dtype, n, data):
    """Random position / random bit in a random-length tensor: the fingerprint changes."""
    t = sample(dtype, (n,), seed=n)
    pos = data.draw(st.integers(0, n - 1))
    bit = data.draw(st.integers(0, WIDTH[dtype] - 1))
    flipped = flip_bit(t, pos, bit)
    assert not torch.equal(flipped.view(INT_VIEW[t.element_size()]), t.view(INT_VIEW[t.element_size()]))
    assert fingerprint(flipped) != fingerprint(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapping_two_different_elements_changes_fingerprint(dtype):
    """The digest is position sensitive: exchanging two unequal elements changes it."""
    t = sample(dtype, (16,), seed=11)
    if dtype == torch.bool:
        t = torch.tensor([True, False] * 8)
    rng = random.Random(3)
    base = fingerprint(t)
    checked = 0
    for _ in range(40):
        i, j = rng.sample(range(16), 2)
        if t[i].item() == t[j].item() and py_bits(t[i:i + 1]) == py_bits(t[j:j + 1]):
            continue
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert fingerprint(u) != base, (i, j)
        checked += 1
    assert checked >= 10


def test_same_bits_different_shape_or_dtype_differ():
    """Shape and dtype are bound into the digest even when the raw bits are identical."""
    a = torch.arange(12, dtype=torch.float32)
    fps = {fingerprint(a), fingerprint(a.view(3, 4)), fingerprint(a.view(4, 3)), fingerprint(a.view(1, 12)),
           fingerprint(a.view(torch.int32)), fingerprint(a.view(torch.int32).view(3, 4))}
    assert len(fps) == 6
    h = torch.arange(8, dtype=torch.int16)
    assert len({fingerprint(h), fingerprint(h.view(torch.float16)), fingerprint(h.view(torch.bfloat16))}) == 3
    z = [torch.zeros(4, dtype=d) for d in (torch.float32, torch.int32, torch.float64, torch.int64)]
    assert len({fingerprint(x) for x in z}) == 4
    assert fingerprint(torch.tensor(1.0)) != fingerprint(torch.tensor([1.0]))   # 0-dim vs 1-element


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_signed_zeros_differ(dtype):
    pos, neg = torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype)
    neg[1] = -0.0
    assert torch.equal(pos, neg)                       # equal as numbers ...
    assert fingerprint(pos) != fingerprint(neg)        # ... but not as bits


def test_nan_payloads_differ():
    a = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert fingerprint(a[:1]) != fingerprint(a[1:])


# --- edge shapes and layouts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_element(dtype):
    """0-element tensors work (shape still matters); 1-element tensors follow the definition."""
    empties = [torch.empty(s, dtype=dtype) for s in ((0,), (0, 3), (3, 0), (2, 0, 1))]
    fps = [fingerprint(e) for e in empties]
    assert len(set(fps)) == len(fps)
    assert fps[0] == py_mix(0 ^ py_mix(int(_header(dtype, (0,)))))
    one = sample(dtype, (1,), seed=2)
    assert fingerprint(one) == py_fingerprint(one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_non_contiguous_views_use_logical_order(dtype):
    """Transposed, step-sliced, offset and expanded views fingerprint like their contiguous copies, and the
    logical (not storage) order is what counts."""
    t = sample(dtype, (5, 6), seed=9)
    views = [t.t(), t[::2], t[:, 1::3], t[1:, 2:], t.t()[::2, 1::2], t[0:1].expand(4, 6)]
    for v in views:
        assert fingerprint(v) == fingerprint(v.contiguous()) == py_fingerprint(v.contiguous())
    sq = sample(dtype, (4, 4), seed=10)
    if not torch.equal(sq, sq.t()):
        assert fingerprint(sq.t()) != fingerprint(sq)


def test_requires_grad_tensor():
    x = torch.randn(4, requires_grad=True)
    assert fingerprint(x) == py_fingerprint(x.detach())


def test_float_bits_hex():
    assert float_bits_hex(torch.tensor(1.0)) == "0x3f800000"
    assert float_bits_hex(torch.tensor(-0.0)) == "0x80000000"
    assert float_bits_hex(torch.tensor(1.0, dtype=torch.float64)) == "0x3ff0000000000000"
    assert float_bits_hex(torch.tensor(1.0, dtype=torch.bfloat16)) == "0x3f80"
    assert float_bits_hex(torch.tensor([2.0], dtype=torch.float16)) == "0x4000"
    assert float_bits_hex(torch.tensor(1e-45)) == "0x00000001"      # smallest subnormal keeps leading zeros
