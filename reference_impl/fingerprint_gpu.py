"""The fp64v1 fingerprint (`reference_impl.fingerprint`) computed on the GPU with Triton kernels.

`fingerprint_device(t)` / `fingerprint_many(tensors)` return exactly `fingerprint.fingerprint(t)` for every
tensor, bit for bit, without copying tensors to the host: only one 8-byte sum per tensor comes back, and the
final ``mix(S ^ mix(header))`` is applied on the host with the reference's own numpy `_mix` and `_header`.

How it is computed
------------------
Definition: ``S = sum_i mix(x_i ^ mix(i + 1)) mod 2^64`` over the C-order logical index i.  The sum is
order-free, so each program sums a block of elements with wrapping uint64 adds and adds its block sum to the
tensor's accumulator with a 64-bit integer ``atomic_add`` (exact, wraps mod 2^64: any order gives the same
bits).  The accumulators start at zero (one fill kernel per call).

* Contiguous tensors (any dtype of element size 1, 2, 4 or 8; bool, fp8, bf16, fp16, fp32, fp64, ints ...)
  go through `_contig_kernel`: one launch per (element size, 16-byte alignment, share width G) with a device
  table of groups; tensors are addressed by their element offset from the launch's first tensor, so no
  pointer casts are needed and 16-byte vector loads are kept (alignment is asserted with `tl.multiple_of`,
  only for tensors whose address is 16-byte aligned - the rest go to an unaligned launch).  A typical list of
  gradients (one dtype, allocator-aligned) costs 1-3 launches + 1 fill, whatever the number of tensors.
* Index-mix sharing: ``mix(i + 1)`` depends only on the index, so tensors with the same element size and the
  same numel (the same-shaped weights of every layer / expert) are processed G = 2 or 4 at a time by one
  program that computes ``mix(i + 1)`` once and applies it to G tensors (`share=`, default 4; a group of n
  same-sized tensors is split into 4s, then 2s, then 1s, so nothing is padded).
* Non-contiguous views of up to 4 dims (after merging dims that are contiguous with each other) use
  `_strided_kernel`: one launch per such tensor, the element address computed in-kernel from the C-order
  index (integer div/mod per element: slower per element than the contiguous path, but no copy and no extra
  memory).  More than 4 non-mergeable dims: ``.contiguous()`` first, which costs one extra read + write of the
  tensor and a temporary of its size (rare: gradients and parameters are contiguous).

Cost and expected bottleneck
----------------------------
Per element the definition needs two splitmix64 finalisers (``mix(i+1)`` and ``mix(k_i)``): 6 xor-shifts and
4 multiplications by 64-bit constants.  GPUs have no 64-bit integer ALU: a 64-bit xor-shift is 2 shifts (one
a funnel shift) + 2 LOP3, all on the ALU pipe; a 64x64 -> 64 multiply by a constant is IMAD.WIDE.U32 + 2-3
IMAD on the FMA pipe.  The sm_90 SASS of the main loop (compiled offline with Triton 3.6, 3.7 and 3.9 and
counted per element, default variant):

    unshared (G = 1):     ~39 instructions / element, ~22-25 of them on the ALU pipe, ~16 on the FMA pipe
    shared by G = 2 / 4:  ~30 / ~25 per element,       ~18 / ~15 ALU

Each Hopper SM sub-partition issues 1 warp-instruction per clock, but its ALU and FMA-heavy pipes are 16
lanes wide (2 clocks per warp-instruction; IMAD.WIDE / IMAD.HI take 2 issues of the FMA pipe), so the ALU pipe
is the bottleneck: 64 / ~23 = ~2.8 elements/clk/SM, i.e. ~6.4-7.3e11 elements/s on 132 SMs at 1.75-1.98 GHz:

    4-byte elements (fp32):  ~2.6-2.9 TB/s of reads  - close to the memory limit of a read-only stream
    2-byte elements (bf16):  ~1.3-1.5 TB/s           - integer-issue bound
    1-byte elements:         ~0.65-0.7 TB/s          - integer-issue bound
    8-byte elements:         memory bound
    G = 4 sharing:           ~1.5x the above for the issue-bound dtypes (bf16 ~2 TB/s)

A device-to-device copy reads and writes every byte, so its read bandwidth is about half the HBM bandwidth
(~2.0-2.2 TB/s of reads on an H200): fp32 / fp64 should beat it, 2-byte dtypes reach it only with sharing.
What the code does to get there:

* index < 2^32 (`IDX` <= 32, decided per launch): ``i + 1`` is a 32-bit value, so the first multiply is one
  IMAD.WIDE + one IMAD and the first xor-shift is 32-bit; index < 2^30 (`IDX` == 30, every tensor with fewer
  than 2^30 - 1 elements): ``(i+1) >> 30 == 0`` and the first xor-shift disappears.
* element size <= 2: ``x < 2^30`` so ``k ^ (k >> 30) == m' ^ x`` with ``m' = m ^ (m >> 30)``; the first
  xor-shift of ``mix(k)`` moves to the index side, where it is shared by the G tensors of a group.
* index-mix sharing (above) removes ~14 of the ~39 instructions per element for all but one tensor of a group.
* unmasked 16-byte vector loads for full blocks (only a tensor's last block is masked), software-pipelined:
  the next sub-block is loaded before the current one is hashed; <= 128 registers so two 256-thread programs
  fit an SM.
* variants (`VARIANTS`; all give identical results, the tests run every one): ``"u64"`` (default) is plain
  uint64 code, which LLVM / ptxas lower well (it puts the carry of the 64-bit accumulate on the FMA pipe);
  ``"u32"`` spells out the 32-bit halves; ``"u32mh*"`` compute the high-half right shifts as
  ``umulhi(h, 2^(32-s))`` with 2^(32-s) passed at run time, moving 3-5 instructions per element from the ALU
  to the FMA pipe (a win only if IMAD.HI issues at full rate).  `bench/bench_fingerprint_gpu.py` measures them
  and a few launch geometries; `DEFAULT` holds the choice.

Launch geometry (`DEFAULT`): ``num_warps`` warps; ``ept`` elements per thread per iteration for unshared
tensors (``ept_shared`` per tensor in groups, ``ept_strided`` for strided views; capped at 64 bytes);
``nsub`` iterations per program, so a program covers ``BLOCK = nsub * num_warps * 32 * ept`` indices of each
tensor of its group.

`fingerprint_many_async` launches without waiting and returns a `PendingFingerprints` (`.result()`,
`.hex()`): the kernels run on the current stream, so they can overlap host work.  Plans (the device tables)
are cached by the tensors' pointers, dtypes, shapes and strides: the same gradient buffers every step cost a
dictionary lookup (~1 ms of host time for 2000 tensors) and no host-to-device copy.

Without Triton the module still imports (`HAVE_TRITON` / `available()` are False); the functions then raise
`TritonUnavailableError` (an ImportError) for CUDA tensors.  CPU tensors are fingerprinted with the
reference implementation, except under ``TRITON_INTERPRET=1`` (set before this module is imported) where
they run through the same kernels in Triton's interpreter (that is how the kernels are tested without a GPU).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
import torch

from .fingerprint import _header, _mix, fingerprint

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# name -> (MODE, MH): MODE 0 = uint64 code, 1 = explicit 32-bit halves; MH bit 0 / bit 1 = the high-half
# right shifts of the index-side / data-side mix as IMAD.HI (FMA pipe) instead of SHF (ALU pipe)
VARIANTS = {"u64": (0, 0), "u32": (1, 0), "u32mhi": (1, 1), "u32mht": (1, 2), "u32mh": (1, 3)}
DEFAULT = {"variant": "u64", "num_warps": 8, "nsub": 4, "share": 4, "ept": 16, "ept_shared": 4, "ept_strided": 4,
           "min_idx": 30}   # min_idx (30/32/64): force the wider index code paths (a testing aid)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GTAB_COLS = 10          # numel, first_item, off0..off3, slot0..slot3
_MAX_DIMS = 4


class TritonUnavailableError(ImportError):
    """Raised when a CUDA tensor is to be fingerprinted but Triton is not installed."""


def available() -> bool:
    """True when CUDA tensors can be fingerprinted on the device (Triton importable)."""
    return HAVE_TRITON


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _split(z):
        return (z >> 32).to(tl.uint32), z.to(tl.uint32)

    @triton.jit
    def _merge(h, l):
        return (h.to(tl.uint64) << 32) | l.to(tl.uint64)

    @triton.jit
    def _xs(h, l, S: tl.constexpr, MH: tl.constexpr, P):
        """z ^= z >> S on z = h:l (uint32 halves), 0 < S < 32.  MH: the high half's shift as umulhi(h, P) with
        P = 2^(32-S) passed at run time (so the compiler cannot turn it back into a shift): IMAD.HI on the FMA
        pipe instead of SHF on the ALU pipe."""
        nl = l ^ ((l >> S) | (h << (32 - S)))
        if MH:
            nh = h ^ tl.umulhi(h, P)
        else:
            nh = h ^ (h >> S)
        return nh, nl

    @triton.jit
    def _mulc(h, l, CH: tl.constexpr, CL: tl.constexpr):
        """z *= (CH:CL) mod 2^64 on z = h:l (uint32 halves)."""
        p = l.to(tl.uint64) * CL
        nh = (p >> 32).to(tl.uint32) + l * CH + h * CL
        return nh, p.to(tl.uint32)

    @triton.jit
    def _mix_tail_u64(z):
        z = z * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _xs30(h, l, MODE: tl.constexpr, MH: tl.constexpr, P30):
        """The first step of mix: z ^= z >> 30."""
        if MODE == 0:
            z = _merge(h, l)
            h, l = _split(z ^ (z >> 30))
        else:
            h, l = _xs(h, l, 30, MH, P30)
        return h, l

    @triton.jit
    def _tail(h, l, MODE: tl.constexpr, MH: tl.constexpr, P27, P31):
        """The rest of mix: * M1, xs27, * M2, xs31."""
        if MODE == 0:
            h, l = _split(_mix_tail_u64(_merge(h, l)))
        else:
            h, l = _mulc(h, l, 0xBF58476D, 0x1CE4E5B9)
            h, l = _xs(h, l, 27, MH, P27)
            h, l = _mulc(h, l, 0x94D049BB, 0x133111EB)
            h, l = _xs(h, l, 31, MH, P31)
        return h, l

    @triton.jit
    def _idx_mix(first, offs, IDX: tl.constexpr, PRE30: tl.constexpr, MODE: tl.constexpr, MH: tl.constexpr,
                 P30, P27, P31):
        """(h, l) = mix(first + offs) (first: int64 scalar = start index + 1), with PRE30 then xor-shifted by 30.
        IDX: 30 / 32 / 64 = every index + 1 of the launch is < 2^30 / < 2^32 / anything."""
        if IDX <= 32:
            l0 = first.to(tl.uint32) + offs.to(tl.uint32)
            if IDX == 32:
                l0 = l0 ^ (l0 >> 30)
            if MODE == 0:
                h, l = _split(_mix_tail_u64(l0.to(tl.uint64)))
            else:
                p = l0.to(tl.uint64) * 0x1CE4E5B9                # (0:l0) * M1: the high half of l0 is 0
                h = (p >> 32).to(tl.uint32) + l0 * 0xBF58476D
                h, l = _xs(h, p.to(tl.uint32), 27, MH, P27)
                h, l = _mulc(h, l, 0x94D049BB, 0x133111EB)
                h, l = _xs(h, l, 31, MH, P31)
        else:
            h, l = _split((first + offs.to(tl.int64)).to(tl.uint64, bitcast=True))
            h, l = _xs30(h, l, MODE, MH, P30)
            h, l = _tail(h, l, MODE, MH, P27, P31)
        if PRE30:
            h, l = _xs30(h, l, MODE, MH, P30)
        return h, l

    @triton.jit
    def _term(mh, ml, x, PRE30: tl.constexpr, ESIZE: tl.constexpr, MODE: tl.constexpr, MH: tl.constexpr,
              P30, P27, P31):
        """mix(k) as uint64, k = m ^ x with (mh, ml) = mix(i+1) (PRE30: already xor-shifted by 30, valid for
        x < 2^30); x: the raw elements as loaded through an uint8 / int16 / int32 / int64 pointer."""
        if ESIZE == 1:
            kh, kl = mh, ml ^ x.to(tl.uint32)
        elif ESIZE == 2:
            kh, kl = mh, ml ^ x.to(tl.uint16, bitcast=True).to(tl.uint32)
        elif ESIZE == 4:
            kh, kl = mh, ml ^ x.to(tl.uint32, bitcast=True)
        else:
            xh, xl = _split(x.to(tl.uint64, bitcast=True))
            kh, kl = mh ^ xh, ml ^ xl
        if not PRE30:
            kh, kl = _xs30(kh, kl, MODE, MH, P30)
        kh, kl = _tail(kh, kl, MODE, MH, P27, P31)
        return _merge(kh, kl)

    @triton.jit
    def _load(base, off, s, offs, rem, MASKED: tl.constexpr, ESIZE: tl.constexpr, ALIGNED: tl.constexpr):
        """SUB raw elements of one tensor: element offset off + s from `base`."""
        eoff = off + s      # computed here: tl.multiple_of must annotate an op of this function, not an argument
        if ALIGNED:
            eoff = tl.multiple_of(eoff, 16 // ESIZE)
        if MASKED:
            return tl.load(base + eoff + offs, mask=offs < rem, other=0)
        else:
            return tl.load(base + eoff + offs)

    @triton.jit
    def _step(x0, x1, x2, x3, s, offs, rem, a0, a1, a2, a3, P30, P27, P31, MASKED: tl.constexpr, G: tl.constexpr,
              ESIZE: tl.constexpr, IDX: tl.constexpr, MODE: tl.constexpr, MH: tl.constexpr):
        """a_q += mix(x_q ^ mix(i + 1)) for indices i = s + offs of the G loaded tensors x0..x3; mix(i + 1) is
        computed once for all of them.  MH bit 0: IMAD.HI shifts on the index side, bit 1: on the data side."""
        PRE30: tl.constexpr = ESIZE <= 2
        MHI: tl.constexpr = (MH & 1) != 0
        MHT: tl.constexpr = (MH & 2) != 0
        mh, ml = _idx_mix(s + 1, offs, IDX, PRE30, MODE, MHI, P30, P27, P31)
        t0 = _term(mh, ml, x0, PRE30, ESIZE, MODE, MHT, P30, P27, P31)
        if MASKED:
            t0 = tl.where(offs < rem, t0, 0)
        a0 += t0
        if G >= 2:
            t1 = _term(mh, ml, x1, PRE30, ESIZE, MODE, MHT, P30, P27, P31)
            if MASKED:
                t1 = tl.where(offs < rem, t1, 0)
            a1 += t1
        if G >= 4:
            t2 = _term(mh, ml, x2, PRE30, ESIZE, MODE, MHT, P30, P27, P31)
            t3 = _term(mh, ml, x3, PRE30, ESIZE, MODE, MHT, P30, P27, P31)
            if MASKED:
                t2 = tl.where(offs < rem, t2, 0)
                t3 = tl.where(offs < rem, t3, 0)
            a2 += t2
            a3 += t3
        return a0, a1, a2, a3

    @triton.jit
    def _contig_full(base, blk, off0, off1, off2, off3, offs, a0, a1, a2, a3, P30, P27, P31, G: tl.constexpr,
                     BLOCK: tl.constexpr, SUB: tl.constexpr, ESIZE: tl.constexpr, IDX: tl.constexpr,
                     MODE: tl.constexpr, MH: tl.constexpr, ALIGNED: tl.constexpr):
        """A full block: unmasked vector loads, software-pipelined (sub-block k+1 is loaded before sub-block k
        is hashed, so memory latency overlaps the integer work)."""
        x0 = _load(base, off0, blk, offs, 0, False, ESIZE, ALIGNED)
        x1 = x0
        x2 = x0
        x3 = x0
        if G >= 2:
            x1 = _load(base, off1, blk, offs, 0, False, ESIZE, ALIGNED)
        if G >= 4:
            x2 = _load(base, off2, blk, offs, 0, False, ESIZE, ALIGNED)
            x3 = _load(base, off3, blk, offs, 0, False, ESIZE, ALIGNED)
        for it in range(SUB, BLOCK, SUB):
            s = blk + it
            n0 = _load(base, off0, s, offs, 0, False, ESIZE, ALIGNED)
            if G >= 2:
                n1 = _load(base, off1, s, offs, 0, False, ESIZE, ALIGNED)
            if G >= 4:
                n2 = _load(base, off2, s, offs, 0, False, ESIZE, ALIGNED)
                n3 = _load(base, off3, s, offs, 0, False, ESIZE, ALIGNED)
            a0, a1, a2, a3 = _step(x0, x1, x2, x3, s - SUB, offs, 0, a0, a1, a2, a3, P30, P27, P31, False, G, ESIZE,
                                   IDX, MODE, MH)
            x0 = n0
            if G >= 2:
                x1 = n1
            if G >= 4:
                x2 = n2
                x3 = n3
        return _step(x0, x1, x2, x3, blk + (BLOCK - SUB), offs, 0, a0, a1, a2, a3, P30, P27, P31, False, G, ESIZE,
                     IDX, MODE, MH)

    @triton.jit
    def _contig_tail(base, numel, blk, off0, off1, off2, off3, offs, a0, a1, a2, a3, P30, P27, P31,
                     G: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, ESIZE: tl.constexpr,
                     IDX: tl.constexpr, MODE: tl.constexpr, MH: tl.constexpr, ALIGNED: tl.constexpr):
        """The last, partial block of a group: masked loads, terms of indices >= numel zeroed."""
        for it in range(0, BLOCK, SUB):
            s = blk + it
            rem = numel - s
            x0 = _load(base, off0, s, offs, rem, True, ESIZE, ALIGNED)
            x1 = x0
            x2 = x0
            x3 = x0
            if G >= 2:
                x1 = _load(base, off1, s, offs, rem, True, ESIZE, ALIGNED)
            if G >= 4:
                x2 = _load(base, off2, s, offs, rem, True, ESIZE, ALIGNED)
                x3 = _load(base, off3, s, offs, rem, True, ESIZE, ALIGNED)
            a0, a1, a2, a3 = _step(x0, x1, x2, x3, s, offs, rem, a0, a1, a2, a3, P30, P27, P31, True, G, ESIZE, IDX,
                                   MODE, MH)
        return a0, a1, a2, a3

    @triton.jit
    def _flush(sums, slot_ptr, acc):
        """sums[slot] += sum(acc): int64 atomic add, which wraps mod 2^64 exactly like the uint64 sum."""
        tl.atomic_add(sums + tl.load(slot_ptr), tl.sum(acc, axis=0).to(tl.int64, bitcast=True), sem="relaxed")

    @triton.jit(do_not_specialize=["P30", "P27", "P31"])
    def _contig_kernel(base, items, gtab, sums, P30, P27, P31, G: tl.constexpr, BLOCK: tl.constexpr,
                       SUB: tl.constexpr, ESIZE: tl.constexpr, IDX: tl.constexpr, MODE: tl.constexpr,
                       MH: tl.constexpr, ALIGNED: tl.constexpr):
        """One program = BLOCK indices of the G same-sized tensors of one group.
        items[pid] = group row; gtab row = numel, first item of the group, G element offsets from `base`,
        G accumulator slots.  Adds each tensor's block sum to sums[slot].
        P30, P27, P31 = 4, 32, 2 (run-time values, see _xs)."""
        pid = tl.program_id(0)
        row = gtab + tl.load(items + pid) * 10
        numel = tl.load(row)
        blk = (pid - tl.load(row + 1)) * BLOCK
        off0 = tl.load(row + 2)
        off1 = off0
        off2 = off0
        off3 = off0
        if G >= 2:
            off1 = tl.load(row + 3)
        if G >= 4:
            off2 = tl.load(row + 4)
            off3 = tl.load(row + 5)
        offs = tl.arange(0, SUB)
        a0 = tl.zeros([SUB], dtype=tl.uint64)
        a1 = a0
        a2 = a0
        a3 = a0
        if blk + BLOCK <= numel:
            a0, a1, a2, a3 = _contig_full(base, blk, off0, off1, off2, off3, offs, a0, a1, a2, a3, P30, P27, P31,
                                          G, BLOCK, SUB, ESIZE, IDX, MODE, MH, ALIGNED)
        else:
            a0, a1, a2, a3 = _contig_tail(base, numel, blk, off0, off1, off2, off3, offs, a0, a1, a2, a3, P30, P27,
                                          P31, G, BLOCK, SUB, ESIZE, IDX, MODE, MH, ALIGNED)
        _flush(sums, row + 6, a0)
        if G >= 2:
            _flush(sums, row + 7, a1)
        if G >= 4:
            _flush(sums, row + 8, a2)
            _flush(sums, row + 9, a3)

    @triton.jit(do_not_specialize=["P30", "P27", "P31"])
    def _strided_kernel(ptr, sums, slot, numel, n1, n2, n3, s0, s1, s2, s3, P30, P27, P31, BLOCK: tl.constexpr,
                        SUB: tl.constexpr, ESIZE: tl.constexpr, IDX: tl.constexpr, MODE: tl.constexpr,
                        MH: tl.constexpr, ADDR32: tl.constexpr):
        """A non-contiguous view of <= 4 dims (sizes n0..n3, element strides s0..s3, C-order index i)."""
        blk = tl.program_id(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, SUB)
        acc = tl.zeros([SUB], dtype=tl.uint64)
        for it in range(0, BLOCK, SUB):
            s = blk + it
            rem = numel - s
            if ADDR32:
                i = s.to(tl.int32) + offs
            else:
                i = s + offs.to(tl.int64)
            i3 = i % n3
            r = i // n3
            i2 = r % n2
            r = r // n2
            i1 = r % n1
            i0 = r // n1
            x = tl.load(ptr + (i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3), mask=offs < rem, other=0)
            acc, _, _, _ = _step(x, x, x, x, s, offs, rem, acc, acc, acc, acc, P30, P27, P31, True, 1, ESIZE, IDX,
                                 MODE, MH)
        tl.atomic_add(sums + slot, tl.sum(acc, axis=0).to(tl.int64, bitcast=True), sem="relaxed")


# ----------------------------------------------------------------------------------------------------------
# host side: plans (tables), launches, final mix
# ----------------------------------------------------------------------------------------------------------
def _collapse(t: torch.Tensor):
    """(sizes, strides) of `t` with size-1 dims dropped and mergeable neighbours merged (C order)."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    out: list = []
    for n, s in dims:
        if out and out[-1][1] == s * n:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return out


def _idx_class(max_numel: int) -> int:
    if max_numel < (1 << 30):
        return 30
    if max_numel < (1 << 32):
        return 32
    return 64


def _geometry(esize: int, g: int, cfg: dict, idx: int = 30, strided: bool = False) -> tuple[int, int]:
    """(SUB, BLOCK) of a launch: SUB = num_warps * 32 threads * elements per thread per iteration (`ept` for
    unshared tensors, `ept_shared` per tensor for groups of G > 1, `ept_strided` for strided views; halved for
    64-bit indices; at most four 16-byte vectors, so that the registers allow two 256-thread programs per SM);
    BLOCK = nsub * SUB indices per program."""
    ept = cfg["ept_strided"] if strided else cfg["ept"] if g == 1 else cfg["ept_shared"]
    if idx == 64:
        ept //= 2
    ept = max(1, min(ept, 64 // esize))
    sub = cfg["num_warps"] * 32 * ept
    return sub, sub * cfg["nsub"]


class _Plan:
    """Device tables and launch list for one list of tensors (cached: the same gradients every step)."""

    def __init__(self, metas, device, cfg):
        self.n = len(metas)
        self.hmix = _mix(np.array([_header(m["dtype"], m["shape"]) for m in metas], dtype=np.uint64))
        self.launches: list = []      # ("contig", base, esize, G, aligned, idx, sub, block, gofs, iofs, nitems)
                                      # or ("strided", j, sizes4, strides4, esize, idx, addr32, sub, block)
        self.strided: list = []       # indices of non-contiguous tensors (<= 4 dims after merging)
        groups: "OrderedDict[tuple, list]" = OrderedDict()
        for j, m in enumerate(metas):
            if m["numel"] == 0:
                continue
            if m["contig"]:
                aligned = m["ptr"] % 16 == 0
                groups.setdefault((m["esize"], aligned, m["numel"]), []).append(j)
            else:
                self.strided.append(j)
        # group chunks by launch key (esize, aligned, G)
        share = max(1, int(cfg["share"]))
        by_launch: "OrderedDict[tuple, list]" = OrderedDict()
        for (esize, aligned, numel), members in groups.items():
            rest = members
            for g in (4, 2, 1):
                if g > share:
                    continue
                while len(rest) >= g:
                    by_launch.setdefault((esize, aligned, g), []).append((numel, rest[:g]))
                    rest = rest[g:]
        gtab_rows: list = []
        nblocks: list = []            # blocks (programs) per gtab row
        n_items = 0
        for (esize, aligned, g), chunks in by_launch.items():
            base = chunks[0][1][0]
            base_ptr = metas[base]["ptr"]
            idx = max(_idx_class(max(n for n, _ in chunks)), cfg["min_idx"])
            sub, block = _geometry(esize, g, cfg, idx)
            gofs, iofs = len(gtab_rows), n_items
            for numel, members in chunks:
                row = [numel, n_items - iofs] + [0] * 8
                for q, j in enumerate(members):
                    delta = metas[j]["ptr"] - base_ptr
                    if delta % esize:
                        raise ValueError(f"tensor {j}: data pointer not aligned to its element size")
                    row[2 + q] = delta // esize
                    row[6 + q] = j
                gtab_rows.append(row)
                nblocks.append(-(-numel // block))
                n_items += nblocks[-1]
            self.launches.append(("contig", base, esize, g, aligned, idx, sub, block, gofs, iofs, n_items - iofs))
        # one int64 buffer, one host->device copy: gtab rows, then items[k] = gtab row (relative to its launch)
        gtab = np.asarray(gtab_rows, dtype=np.int64).reshape(-1, _GTAB_COLS)
        rel = np.zeros(len(gtab_rows), dtype=np.int64)
        starts = [launch[8] for launch in self.launches] + [len(gtab_rows)]
        for a, b in zip(starts[:-1], starts[1:]):
            rel[a:b] = np.arange(b - a)
        items = np.repeat(rel, np.asarray(nblocks, dtype=np.int64))
        self.items_at = gtab.size
        self.table = torch.from_numpy(np.concatenate([gtab.reshape(-1), items])).to(device)
        for j in self.strided:
            m = metas[j]
            dims = [(1, 0)] * (_MAX_DIMS - len(m["dims"])) + list(m["dims"])
            sizes = [n for n, _ in dims]
            strides = [s for _, s in dims]
            span = sum((n - 1) * s for n, s in dims)
            idx = max(_idx_class(m["numel"]), cfg["min_idx"])
            addr32 = m["numel"] < (1 << 31) and span < (1 << 31) and idx < 64
            sub, block = _geometry(m["esize"], 1, cfg, idx, strided=True)
            self.launches.append(("strided", j, sizes, strides, m["esize"], idx, addr32, sub, block))


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_PLAN_CACHE_SIZE = 8


def _meta(t: torch.Tensor) -> dict:
    esize = t.element_size()
    if esize not in _INT_VIEW:
        raise TypeError(f"fingerprint: unsupported element size {esize} bytes ({t.dtype})")
    dims = None
    contig: "bool | None" = t.is_contiguous()
    if not contig:
        dims = tuple(_collapse(t))
        if len(dims) <= 1 and (not dims or dims[0][1] == 1):
            contig = True          # e.g. a column slice of size 1: contiguous in all but name
        elif len(dims) > _MAX_DIMS:
            contig = None
    return {"esize": esize, "numel": t.numel(), "contig": contig, "dims": dims, "ptr": t.data_ptr(),
            "dtype": t.dtype, "shape": tuple(t.shape)}


def _cfg(overrides: dict) -> dict:
    cfg = dict(DEFAULT)
    for k, v in overrides.items():
        if k not in cfg:
            raise TypeError(f"unknown option {k!r} (known: {sorted(cfg)})")
        if v is not None:
            cfg[k] = v
    if cfg["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}")
    if cfg["share"] not in (1, 2, 4):
        raise ValueError("share must be 1, 2 or 4")
    if cfg["min_idx"] not in (30, 32, 64):
        raise ValueError("min_idx must be 30, 32 or 64")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16, 32) or cfg["nsub"] < 1:
        raise ValueError("num_warps must be a power of two <= 32 and nsub >= 1")
    return cfg


def _plan(tensors: list, cfg: dict) -> "tuple[_Plan, list]":
    """The plan for tensors on one device, cached by (pointer, dtype, shape, strides) of every tensor - the
    same gradient buffers every step cost one dictionary lookup.  Views with > 4 non-mergeable dims are
    replaced by contiguous copies (returned in the list, which the caller keeps alive until the kernels are
    done; such plans are not cached)."""
    key = (tensors[0].device, tuple(sorted(cfg.items())),
           tuple([(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors]))
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan, tensors
    metas, copied = [], False
    for j, t in enumerate(tensors):
        m = _meta(t)
        if m["contig"] is None:
            tensors[j] = t = t.contiguous()
            m, copied = _meta(t), True
        metas.append(m)
    plan = _Plan(metas, tensors[0].device, cfg)
    if not copied:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan, tensors


def _launch(tensors: list, cfg: dict) -> "tuple[torch.Tensor, _Plan, list]":
    """Launch the kernels for tensors that all live on one device; returns the int64 sums tensor (S of each
    tensor, filled asynchronously on the current stream), the plan and the tensors actually read."""
    plan, tensors = _plan(tensors, cfg)
    mode, mh = VARIANTS[cfg["variant"]]
    rt = (4, 32, 2)     # P30, P27, P31 = 2^(32-30), 2^(32-27), 2^(32-31)
    nw = cfg["num_warps"]
    sums = torch.zeros(len(tensors), dtype=torch.int64, device=tensors[0].device)
    table = plan.table
    items = table[plan.items_at:]
    for launch in plan.launches:
        if launch[0] == "strided":
            _, j, sizes, strides, esize, idx, addr32, sub, block = launch
            t = tensors[j].detach().view(_INT_VIEW[esize])
            _strided_kernel[(-(-t.numel() // block),)](
                t, sums, j, t.numel(), sizes[1], sizes[2], sizes[3], strides[0], strides[1], strides[2],
                strides[3], *rt, BLOCK=block, SUB=sub, ESIZE=esize, IDX=idx, MODE=mode, MH=mh, ADDR32=addr32,
                num_warps=nw)
        else:
            _, base, esize, g, aligned, idx, sub, block, gofs, iofs, nitems = launch
            _contig_kernel[(nitems,)](
                tensors[base].detach().view(_INT_VIEW[esize]), items[iofs:], table[gofs * _GTAB_COLS:], sums, *rt, G=g,
                BLOCK=block, SUB=sub, ESIZE=esize, IDX=idx, MODE=mode, MH=mh, ALIGNED=aligned, num_warps=nw)
    return sums, plan, tensors


class PendingFingerprints:
    """Fingerprints whose kernels are launched but not yet read back: `result()` waits (one device-to-host
    copy of 8 bytes per tensor per device) and applies the final mix on the host."""

    def __init__(self, n: int):
        self._values: list = [None] * n
        self._pending: list = []      # (indices, sums tensor, plan, tensors kept alive)

    def result(self) -> list[int]:
        """Wait for the launched kernels and return the fingerprints as ints (input order)."""
        for idxs, sums, plan, _keep in self._pending:
            with np.errstate(over="ignore"):
                fps = _mix(sums.cpu().numpy().view(np.uint64) ^ plan.hmix)
            for j, v in zip(idxs, fps.tolist()):
                self._values[j] = int(v)
        self._pending = []
        return list(self._values)

    def hex(self) -> list[str]:
        """`result` as 16-digit lowercase hex strings."""
        return [f"{v:016x}" for v in self.result()]


def fingerprint_many_async(tensors, **options) -> PendingFingerprints:
    """Launch `fingerprint_many` without waiting: returns a `PendingFingerprints` (`.result()` / `.hex()`)."""
    cfg = _cfg(options)
    tensors = list(tensors)
    out = PendingFingerprints(len(tensors))
    by_device: "OrderedDict[torch.device, list]" = OrderedDict()
    for j, t in enumerate(tensors):
        if t.is_cuda or (INTERPRET and HAVE_TRITON and t.device.type == "cpu"):
            by_device.setdefault(t.device, []).append(j)
        elif t.device.type == "cpu":
            out._values[j] = fingerprint(t)
        else:
            raise ValueError(f"fingerprint_many: unsupported device {t.device}")
    for device, idxs in by_device.items():
        if not HAVE_TRITON:
            raise TritonUnavailableError("fingerprinting CUDA tensors on the device needs Triton "
                                         "(pip install triton); reference_impl.fingerprint works on the host")
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            sums, plan, keep = _launch(tensors if len(idxs) == len(tensors) else [tensors[j] for j in idxs], cfg)
        out._pending.append((idxs, sums, plan, keep))
    return out


def fingerprint_many(tensors, **options) -> list[int]:
    """`fingerprint.fingerprint` of every tensor of `tensors`, computed on their device in a few launches.

    CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run through the Triton kernels: one fill +
    one launch per (element size, alignment, share width) for all contiguous tensors + one per non-contiguous
    view, per device; only 8 bytes per tensor come back.  Other CPU tensors use the reference implementation.
    options (speed only, never the values): variant (see VARIANTS), num_warps, nsub, ept, ept_shared,
    ept_strided, share (1, 2 or 4: how many same-sized tensors share one index mix).
    """
    return fingerprint_many_async(tensors, **options).result()


def fingerprint_device(t: torch.Tensor, **options) -> int:
    """`fingerprint.fingerprint(t)` computed on t's device (see `fingerprint_many`)."""
    return fingerprint_many([t], **options)[0]


def fingerprint_hex_device(t: torch.Tensor, **options) -> str:
    """`fingerprint.fingerprint_hex(t)`: 16 lowercase hex digits, computed on the device."""
    return f"{fingerprint_device(t, **options):016x}"


def fingerprint_hex_many_device(tensors, **options) -> list[str]:
    """`fingerprint_many` as 16-hex-digit strings."""
    return fingerprint_many_async(tensors, **options).hex()
