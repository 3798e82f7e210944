"""The one fingerprint function: a 64-bit, position-sensitive digest of a tensor's raw bits.

Definition (version ``fp64v1``), for a tensor of n elements with element bit patterns x_i (the raw
little-endian bits of each element zero-extended to 64 bits; bool/uint8 as 8 bits, bf16/fp16 as 16, fp32 as 32,
fp64/int64 as 64) in row-major (C) order of its logical shape:

    k_i  = x_i XOR mix(i + 1)                  (mix = splitmix64 finaliser, a bijection on 64 bits)
    S    = sum_i mix(k_i)   (mod 2^64)
    fp   = mix(S XOR mix(hash(dtype, shape)))

Properties: flipping any bit of any element changes k_i, hence mix(k_i), hence S (addition mod 2^64 is a
group), so the fingerprint changes with certainty; swapping two different elements changes it except with
probability ~2^-64; dtype and shape are bound in; -0.0 and +0.0 (and distinct NaN payloads) differ because
the raw bits differ.  The sum is order-free, so a GPU reduction may add the terms in any order and still
match this CPU reference bit for bit.
"""
from __future__ import annotations

import hashlib

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
    """64-bit fingerprint of tensor `t` (definition in the module docstring); returns a Python int.

    Works for any dtype of element size 1, 2, 4 or 8 bytes and any shape (0 elements included).
    """
    x = raw_bits(t)
    with np.errstate(over="ignore"):
        idx = np.arange(1, x.size + 1, dtype=np.uint64)
        s = _mix(x ^ _mix(idx)).sum(dtype=np.uint64) if x.size else np.uint64(0)
        out = _mix(np.array([s ^ _mix(np.array([_header(t.dtype, tuple(t.shape))]))[0]], dtype=np.uint64))[0]
    return int(out)


def fingerprint_hex(t: torch.Tensor) -> str:
    """`fingerprint` as 16 lowercase hex digits (the form stored in traces)."""
    return f"{fingerprint(t):016x}"


def float_bits_hex(t: torch.Tensor) -> str:
    """Exact bits of a one-element float tensor as '0x' + hex digits (8 for fp32, 16 for fp64, 4 for bf16)."""
    size = t.element_size()
    value = int(raw_bits(t.reshape(1))[0])
    return f"0x{value:0{2 * size}x}"


def fingerprint_hex_many(tensors: list) -> list[str]:
    """`fingerprint_hex` of each tensor.  CUDA tensors go to the on-device kernel
    (`reference_impl.fingerprint_gpu.fingerprint_many`, a few launches for the whole list) when Triton is
    available, so gradients are never copied to the host; everything else is fingerprinted here."""
    out: list = [None] * len(tensors)
    cuda = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
    if cuda:
        from . import fingerprint_gpu
        if fingerprint_gpu.available():     # else (no Triton): correct, but copies each tensor to the host
            for i, v in zip(cuda, fingerprint_gpu.fingerprint_many([tensors[i] for i in cuda])):
                out[i] = f"{v:016x}"
    return [o if o is not None else fingerprint_hex(t) for o, t in zip(out, tensors)]
