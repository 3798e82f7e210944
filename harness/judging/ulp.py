"""ULP distances between two tensors of the same floating dtype, and the statistics the report shows.

Definition: for IEEE binary formats (fp32, bf16, fp16, fp64) map each bit pattern b of width w to the
integer line ``o(b) = b`` if the sign bit is clear, else ``2^(w-1) - b`` (sign-magnitude -> two's-complement
order); the ULP distance of x and y is ``|o(x) - o(y)|`` = the number of representable values between them
(adjacent floats are 1 apart).  So +0 and -0 are 0 apart, the smallest subnormals on either side of zero
are 2 apart, and the distance never overflows (computed in Python ints / int64 with w <= 32; fp64 in
uint64 arithmetic on differences).  NaN: two NaNs (any payload) count as equal-valued but are reported in
``nan_mismatch`` when only one side is NaN (distance undefined, excluded from max/median).
"""
from __future__ import annotations

import numpy as np


def ordered(bits: int, width: int) -> int:
    """The monotone integer of one sign-magnitude bit pattern of `width` bits (the module's definition)."""
    sign = 1 << (width - 1)
    return bits if bits < sign else sign - bits


def ulp_distance(a_hex: str, b_hex: str) -> int:
    """ULP distance of two bit patterns of the same width given as hex ('0x3f800000' fp32, 16 digits fp64,
    4 digits bf16/fp16), e.g. for losses and grad norms.

    Raises:
        ValueError: the two patterns have different widths.
    """
    a, b = a_hex.removeprefix("0x"), b_hex.removeprefix("0x")
    if len(a) != len(b):
        raise ValueError(f"cannot compare {a_hex} and {b_hex}: different widths")
    width = 4 * len(a)
    return abs(ordered(int(a, 16), width) - ordered(int(b, 16), width))


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """`ordered` over an array (vectorised in int64 for widths <= 32, Python ints for 64)."""
    if width == 64:
        return np.array([ordered(int(v), 64) for v in bits.astype(np.uint64)], dtype=object)
    u = bits.astype(np.int64) & ((1 << width) - 1)
    sign = 1 << (width - 1)
    return np.where(u < sign, u, sign - u)


def ulp_distances(a_bits: np.ndarray, b_bits: np.ndarray, width: int) -> np.ndarray:
    """Element-wise ULP distances of two flat arrays of raw bit patterns of `width` bits (16, 32 or 64)."""
    return np.abs(_ordered(a_bits, width) - _ordered(b_bits, width))


def tensor_stats(a, b, bins: int = 12) -> dict:
    """Compare two torch tensors of the same floating dtype and shape.

    Returns {dtype, numel, differing, fraction, max_ulp, median_ulp (over differing elements), histogram:
    [[upper ulp bound, count], ...] on power-of-two buckets, max_abs_err, max_rel_err, nan_mismatch}.
    Raises ValueError on a dtype/shape mismatch or a non-floating dtype.
    """
    from trainerkit.fingerprint import raw_bits
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    if not a.dtype.is_floating_point:
        raise ValueError(f"ULP distance is defined for floating dtypes, not {a.dtype}")
    width = 8 * a.element_size()
    ab, bb = raw_bits(a), raw_bits(b)
    av, bv = a.detach().double().cpu().reshape(-1).numpy(), b.detach().double().cpu().reshape(-1).numpy()
    nan_a, nan_b = np.isnan(av), np.isnan(bv)
    differing = (ab != bb) & ~(nan_a & nan_b)
    comparable = differing & ~(nan_a | nan_b)
    d = ulp_distances(ab[comparable], bb[comparable], width).astype(np.float64)
    hist = []
    if d.size:
        edges = [1, 2, 4, 8, 16, 64, 256, 1024, 2 ** 16, 2 ** 24, float("inf")][:bins]
        lower = 0
        for upper in edges:
            n = int(((d > lower) & (d <= upper)).sum())
            if n:
                hist.append([upper if upper != float("inf") else None, n])
            lower = upper
    abs_err = np.abs(av[comparable] - bv[comparable])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = abs_err / np.maximum(np.abs(av[comparable]), np.finfo(np.float64).tiny)
    n = int(av.size)
    return {"dtype": str(a.dtype).replace("torch.", ""), "numel": n, "differing": int(differing.sum()),
            "fraction": float(differing.sum() / n) if n else 0.0,
            "max_ulp": int(d.max()) if d.size else 0, "median_ulp": float(np.median(d)) if d.size else 0.0,
            "histogram": hist, "max_abs_err": float(abs_err.max()) if abs_err.size else 0.0,
            "max_rel_err": float(rel.max()) if rel.size else 0.0,
            "nan_mismatch": int((nan_a ^ nan_b).sum())}


def zero_side(a, b, names: tuple[str, str]) -> "str | None":
    """Which of two same-shape tensors (`a` named ``names[0]``, `b` ``names[1]``) is all zero while the other is
    not: that one's name, else None (both zero, both non-zero, or empty)."""
    za, zb = not bool(a.detach().ne(0).any()), not bool(b.detach().ne(0).any())
    if a.numel() == 0 or za == zb:
        return None
    return names[0] if za else names[1]


def scale_words(entry: dict, names: tuple[str, str]) -> str:
    """A tensor comparison at its own scale in words: ``"3.3e+05 ULP at tensor scale"``; or, when one side is all
    zero (`entry["zero_in"]`, a name of `names`), ``"zero in megatron-core, non-zero in reference (largest
    |difference| 3.1e-04)"``, because a ULP at the scale of an all-zero tensor is the smallest subnormal's
    (1.4e-45 in fp32): a count in it (~1e41) says nothing a reader can use.

    `entry`: ``{"scaled_ulp": float, "zero_in": str | None, "max_abs_err": float}`` (`harness.judging.crossimpl`)."""
    zero = entry.get("zero_in")
    if zero:
        other = names[1] if zero == names[0] else names[0]
        largest = entry.get("max_abs_err", float("nan"))
        return f"zero in {zero}, non-zero in {other} (largest |difference| {largest:.2g})"
    return f"{entry['scaled_ulp']:.3g} ULP at tensor scale"
