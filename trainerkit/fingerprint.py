"""The one fingerprint function: a 64-bit, position-sensitive digest of a tensor's raw bits.

Definition (version ``fp64v2``), for a tensor whose raw little-endian bytes in row-major (C) order of its
logical shape are b_0 .. b_{N-1} (N = numel * element size; bool/uint8 1 byte per element, bf16/fp16 2, fp32 4,
fp64/int64 8), zero-padded to a multiple of 8 and read as n = ceil(N / 8) little-endian 64-bit words w_j:

    k_j  = w_j XOR mix(j + 1)                  (mix = splitmix64 finaliser, a bijection on 64 bits)
    S    = sum_j mix(k_j)   (mod 2^64)
    fp   = mix(S XOR mix(hash(dtype, shape)))

Properties: flipping any bit of any element changes one word, hence k_j, hence mix(k_j), hence S (addition
mod 2^64 is a group), so the fingerprint changes with certainty; moving or swapping different elements changes
it except with probability ~2^-64; dtype and shape are bound in (so the zero padding is unambiguous); -0.0 and
+0.0 (and distinct NaN payloads) differ because the raw bits differ.  The sum is order-free, so a GPU reduction
may add the terms in any order and still match this CPU reference bit for bit.  Hashing 8-byte words rather
than elements makes the cost per byte the same for every dtype: two splitmix64 finalisers per 8 bytes, which
keeps the GPU kernel (`fingerprint_gpu`) memory-bound for 1- and 2-byte dtypes too (``fp64v1`` hashed each
element separately and was integer-bound for bf16).
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import torch

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@lru_cache(maxsize=4096)
def _header(dtype: torch.dtype, shape: tuple[int, ...]) -> np.uint64:
    digest = hashlib.blake2b(f"{dtype}|{tuple(shape)}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """Element bit patterns of `t` (any device, any strides) as a flat uint64 array in C order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    bits = t.view(_BITS_VIEW[size]).numpy().view(_UNSIGNED[size])
    return bits.astype(np.uint64)


def fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of tensor `t` (definition ``fp64v2`` in the module docstring); returns a Python int.

    Works for any dtype of element size 1, 2, 4 or 8 bytes and any shape (0 elements included).
    Raises TypeError for other element sizes (complex128 ...).
    """
    return fingerprints([t])[0]


def fingerprints(tensors: list) -> list[int]:
    """`fingerprint` of each tensor (any devices; non-CPU ones are copied here), computed in one pass: the words
    of all tensors in one array, the word index j restarting at each tensor, the per-tensor sums by
    ``np.add.reduceat`` (wrapping uint64, the same order-free sum), so a list of thousands of small parameters
    costs a few numpy calls instead of a dozen each; `fingerprint` is this on a list of one.

    Raises TypeError for an unsupported element size (as `fingerprint`)."""
    if not tensors:
        return []
    raws = []
    for t in tensors:
        if t.element_size() not in _BITS_VIEW:
            raise TypeError(f"fingerprint: unsupported element size {t.element_size()} bytes ({t.dtype})")
        t = t.detach()
        raws.append((t.cpu() if t.device.type != "cpu" else t).contiguous().reshape(-1).view(torch.uint8).numpy())
    nwords = np.array([-(-r.size // 8) for r in raws], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(nwords)[:-1]]).astype(np.int64)
    buf = np.zeros(int(nwords.sum()) * 8, dtype=np.uint8)
    for r, w0 in zip(raws, starts):
        buf[w0 * 8:w0 * 8 + r.size] = r
    words = buf.view("<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        idx = np.arange(1, words.size + 1, dtype=np.uint64) - np.repeat(starts, nwords).astype(np.uint64)
        terms = _mix(words ^ _mix(idx))
        sums = np.zeros(len(raws), dtype=np.uint64)
        nonempty = nwords > 0
        if nonempty.any():
            sums[nonempty] = np.add.reduceat(terms, starts[nonempty], dtype=np.uint64)
        headers = np.array([_header(t.dtype, tuple(t.shape)) for t in tensors], dtype=np.uint64)
        out = _mix(sums ^ _mix(headers))
    return [int(v) for v in out]


def fingerprint_hex(t: torch.Tensor) -> str:
    """`fingerprint` as 16 lowercase hex digits (the form stored in traces)."""
    return f"{fingerprint(t):016x}"


def float_bits_hex(t: torch.Tensor) -> str:
    """Exact bits of a one-element float tensor as '0x' + hex digits (8 for fp32, 16 for fp64, 4 for bf16)."""
    size = t.element_size()
    value = int(raw_bits(t.reshape(1))[0])
    return f"0x{value:0{2 * size}x}"


class PendingHex:
    """Fingerprints of a list of tensors, some possibly still being computed on a GPU: `hex()` waits for them
    and returns 16-hex-digit strings in input order."""

    def __init__(self, values: list, device_pending=None, device_idx: tuple = ()):
        self._values, self._pending, self._idx = values, device_pending, device_idx

    def hex(self) -> list[str]:
        if self._pending is not None:
            for i, v in zip(self._idx, self._pending.result()):
                self._values[i] = f"{v:016x}"
            self._pending = None
        return list(self._values)


def fingerprint_hex_many_async(tensors: list) -> PendingHex:
    """Start `fingerprint_hex` of each tensor.  CUDA tensors go to the on-device kernel
    (`trainerkit.fingerprint_gpu.fingerprint_many_async`: a few launches for the whole list, on the current
    stream, so later in-place updates of the tensors on that stream cannot race them) when Triton is available,
    and nothing waits for them until `PendingHex.hex()`; everything else is fingerprinted here and now."""
    out: list = [None] * len(tensors)
    cuda = tuple(i for i, t in enumerate(tensors) if t.device.type == "cuda")
    pending = None
    if cuda:
        from . import fingerprint_gpu
        if fingerprint_gpu.available():     # else (no Triton): correct, but copies each tensor to the host
            pending = fingerprint_gpu.fingerprint_many_async([tensors[i] for i in cuda])
    here = [i for i, t in enumerate(tensors) if pending is None or t.device.type != "cuda"]
    for i, v in zip(here, fingerprints([tensors[i] for i in here])):
        out[i] = f"{v:016x}"
    return PendingHex(out, pending, cuda if pending is not None else ())


def fingerprint_hex_many(tensors: list) -> list[str]:
    """`fingerprint_hex` of each tensor (CUDA tensors on the device, see `fingerprint_hex_many_async`)."""
    return fingerprint_hex_many_async(tensors).hex()
