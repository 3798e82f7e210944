"""Triton kernels of the fp64v2 fingerprint on the GPU (the host side, plans and launches: `fingerprint_gpu`).

How it is computed
------------------
Definition: ``S = sum_j mix(w_j ^ mix(j + 1)) mod 2^64`` over the tensor's C-order raw bytes read as
little-endian 64-bit words w_j (the last one zero-padded).  The sum is order-free, so each program sums a block
of words with wrapping uint64 adds and adds its block sum to the tensor's accumulator with a 64-bit integer
``atomic_add`` (exact, wraps mod 2^64: any order of programs gives the same bits).

* Contiguous tensors are read as uint64 words (`_contig_kernel`; the pointer is cast in-kernel).  A tensor
  whose data pointer is 8-byte aligned is read word by word (the wide loop: one 64-bit load per word, the cast
  hides the pointer's alignment from the compiler, seen in the SASS) or, in the narrow loop, two words per 128-bit
  load where it is 16-byte aligned (every allocator-made tensor); one that
  starts MIS bytes past an 8-byte boundary (a view at an odd offset) loads the aligned words around each of
  its words and funnel-shifts them together.  Bytes outside the tensor that such whole-word loads read (before
  its first byte, after its last) are shifted or masked off: an aligned 8-byte word holding a byte of the
  tensor never crosses a page, so the read cannot fault, and a word holding none is never loaded.
* One launch per (element size, alignment class) covers all such tensors through a device table (element offset from the
  launch's first tensor, element count, accumulator slot); a program covers ``BLOCKW`` words of one tensor,
  loops over full sub-blocks unmasked and does at most one masked sub-block, so a small tensor costs one
  short program.  A typical gradient list costs one launch + one fill, whatever the number of tensors.
* Non-contiguous views of up to 4 dims (after merging dims that are contiguous with each other) use
  `_strided_kernel`, one launch per view: element addresses computed in-kernel from the C-order index (div/mod
  per element: slower, but no copy), R = 8 / element size elements packed per word in registers.  More than 4 non-mergeable dims: ``.contiguous()`` first (rare).

Cost: two splitmix64 finalisers per 8 bytes.  On 32-bit integer units a 64-bit multiply is 3 multiply-adds and
a 64-bit xor-shift 2 shifts + 2 logic ops, so the ALU pipe (16 lanes per SM sub-partition, half the multiply-add
pipe's rate) bounds the kernel: in the sm_90 SASS (ptxas of Triton 3.9) the whole-word loop costs 49 instructions
per word, 30 of them on the ALU pipe, which on an H200 (132 SMs, ~1.98 GHz) caps it near 4.4 TB/s, about its
HBM read rate: measured 0.80-0.88 of torch.sum there, 0.99-1.05 on an H100 (3.35 TB/s HBM).  The narrow loop
(`_words_block_dyn`, off by default: `fingerprint_gpu.DEFAULT`) brings that to 41.5 per word, 24 on the ALU pipe,
with 128-bit loads (`bench/sass_fingerprint.py`; the GPU machine's Triton 3.6 ships another ptxas).  (The former
per-element definition, fp64v1, was integer-issue bound at ~1.4 TB/s for bf16.)  `bench/bench_fingerprint_gpu.py`
measures it against torch.sum and a device-to-device copy.

Without Triton this module still imports, with `HAVE_TRITON` False and no kernels.  ``TRITON_INTERPRET=1`` set
before the import runs the kernels in Triton's interpreter on CPU tensors (how they are tested without a GPU).
"""
from __future__ import annotations

import os

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if HAVE_TRITON:

    @triton.jit
    def _mix64(z):
        """splitmix64 finaliser on uint64 (wrapping)."""
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _term(w, j):
        """mix(w ^ mix(j + 1)): words w (uint64) at word indices j (int64)."""
        return _mix64(w ^ _mix64((j + 1).to(tl.uint64, bitcast=True)))

    @triton.jit
    def _mix64_lo(z):
        """`_mix64` of a uint64 whose high half is zero, given as its uint32 low half: the first xor-shift on
        32 bits and the first multiply as 32 x 64 bits (same value, ~3 fewer integer instructions)."""
        z = (z ^ (z >> 30)).to(tl.uint64) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _term_lo(w, j1):
        """`_term` for word indices whose successor j1 = j + 1 fits 32 bits (j1: uint32)."""
        return _mix64(w ^ _mix64_lo(j1))

    @triton.jit
    def _elem_offsets(SUBW: tl.constexpr, R: tl.constexpr, PACK2D: tl.constexpr):
        """Element offsets of SUBW words' worth of elements: [SUBW * R] or [SUBW, R], row-major."""
        if PACK2D:
            return tl.arange(0, SUBW)[:, None] * R + tl.arange(0, R)[None, :]
        else:
            return tl.arange(0, SUBW * R)

    @triton.jit
    def _pack(x, SUBW: tl.constexpr, ESIZE: tl.constexpr, PACK2D: tl.constexpr):
        """Raw elements (as loaded through an uint8 / int16 / int32 / int64 pointer, laid out by
        `_elem_offsets`) -> [SUBW] little-endian uint64 words."""
        R: tl.constexpr = 8 // ESIZE
        if ESIZE == 1:
            u = x.to(tl.uint64)
        elif ESIZE == 2:
            u = x.to(tl.uint16, bitcast=True).to(tl.uint64)
        elif ESIZE == 4:
            u = x.to(tl.uint32, bitcast=True).to(tl.uint64)
        else:
            u = x.to(tl.uint64, bitcast=True)
        if not PACK2D:
            u = tl.reshape(u, [SUBW, R])
        shift = (tl.arange(0, R) * (8 * ESIZE)).to(tl.uint64)
        return tl.sum(u << shift[None, :], axis=1)      # disjoint bit fields: the sum is an OR

    @triton.jit
    def _load_words(wp, jj, m_lo, m_hi, MIS: tl.constexpr, MASKED: tl.constexpr):
        """Stream words jj of a tensor whose first byte sits MIS bytes into the aligned word wp[0]: word jj is
        the top 8 - MIS bytes of wp[jj] and the low MIS bytes of wp[jj + 1] (a funnel shift)."""
        if MASKED:
            lo = tl.load(wp + jj, mask=m_lo, other=0)
        else:
            lo = tl.load(wp + jj)
        if MIS != 0:        # (an if/else, not an early return: the MIS == 0 code must not see a 64-bit shift)
            if MASKED:
                hi = tl.load(wp + jj + 1, mask=m_hi, other=0)
            else:
                hi = tl.load(wp + jj + 1)
            lo = (lo >> (8 * MIS)) | (hi << (64 - 8 * MIS))
        return lo

    @triton.jit
    def _tail_terms(wp, jj, numel, jb, SUBW: tl.constexpr, ESIZE: tl.constexpr, MIS: tl.constexpr):
        """Terms of words jj [SUBW] that reach the tensor's end: words past it count 0, the partial last word keeps
        only the tensor's bytes, and no load touches an aligned word that holds none of them (jb: the first
        word's global index, `word_sums`)."""
        R: tl.constexpr = 8 // ESIZE
        nfull = numel // R
        nwords = (numel + R - 1) // R
        m = jj < nwords
        w = _load_words(wp, jj, m, (jj + 1) * 8 - MIS < numel * ESIZE, MIS, True)
        keep = (tl.full([SUBW], 1, tl.uint64) << ((numel - nfull * R) * 8 * ESIZE).to(tl.uint64)) - 1
        w = tl.where(jj == nfull, w & keep, w)
        return tl.where(m, _term(w, jj + jb), 0)

    @triton.jit
    def _words_block(base, off, numel, w0, jb, BLOCKW: tl.constexpr, SUBW: tl.constexpr, ESIZE: tl.constexpr,
                     ALIGN16: tl.constexpr, MIS: tl.constexpr):
        """Sum of the terms of words [w0, w0 + BLOCKW) of a contiguous tensor at element offset `off` from
        `base` whose data pointer is MIS (0..7) bytes past an 8-byte boundary (ALIGN16: 16-byte aligned); its
        word k has the global index jb + k (0 for a whole tensor)."""
        R: tl.constexpr = 8 // ESIZE
        if ALIGN16:
            off = tl.multiple_of(off, 16 // ESIZE)
        wp = (base + (off - MIS // ESIZE)).to(tl.pointer_type(tl.uint64))
        nfull = numel // R                                # whole words; a partial one follows if numel % R
        nwords = (numel + R - 1) // R
        woffs = tl.arange(0, SUBW)
        acc = tl.zeros([SUBW], dtype=tl.uint64)
        # constexpr trip count with run-time branches: a small tensor's program skips the empty sub-blocks
        for it in range(0, BLOCKW, SUBW):
            j = w0 + it
            if ALIGN16:
                j = tl.multiple_of(j, SUBW)
            if j + SUBW <= nfull:                         # whole words: every load is inside the tensor
                acc += _term(_load_words(wp, j + woffs, 0, 0, MIS, False), j + woffs + jb)
            elif j < nwords:                              # < SUBW whole words + the partial one
                acc += _tail_terms(wp, j + woffs, numel, jb, SUBW, ESIZE, MIS)
        return tl.sum(acc, axis=0)

    @triton.jit
    def _words_block_dyn(base, off, numel, w0, jb, BLOCKW: tl.constexpr, SUBW: tl.constexpr, ESIZE: tl.constexpr,
                         ALIGN16: tl.constexpr, MIS: tl.constexpr, NARROW: tl.constexpr):
        """`_words_block` with the whole-word sub-blocks in a loop of run-time trip count and no branch inside
        (so the compiler can keep several sub-blocks' loads in flight), then at most one masked sub-block: the
        tensor's last < SUBW whole words and its partial word.

        NARROW (the launch's every word index + 1 fits 32 bits, `_Plan`): the whole-word loop forms the index
        term on 32 bits (`_term_lo`) and, for 8-byte aligned tensors, loads through a uint64 pointer offset in
        words, which keeps the base pointer's 16-byte alignment visible to the compiler: two words per 128-bit
        load and one address per thread and sub-block.  Measured in the SASS for sm_90 (ptxas of Triton 3.9):
        24 integer-ALU instructions per word instead of 30, the pipe that bounds this kernel on an H200."""
        R: tl.constexpr = 8 // ESIZE
        if ALIGN16:
            off = tl.multiple_of(off, 16 // ESIZE)
        wp = (base + (off - MIS // ESIZE)).to(tl.pointer_type(tl.uint64))
        if NARROW and MIS == 0:
            woff = off // R                               # every tensor of the launch starts on a word
            if ALIGN16:
                woff = tl.multiple_of(woff, 2)
            wq = base.to(tl.pointer_type(tl.uint64)) + woff
        nfull = numel // R
        nwords = (numel + R - 1) // R
        woffs = tl.arange(0, SUBW)
        acc = tl.zeros([SUBW], dtype=tl.uint64)
        nsub_full = tl.maximum(tl.minimum(w0 + BLOCKW, nfull) - w0, 0) // SUBW
        lanes = woffs.to(tl.uint32)
        for it in range(0, nsub_full):
            j = w0 + it * SUBW
            if ALIGN16:
                j = tl.multiple_of(j, SUBW)
            if NARROW and MIS == 0:
                w = tl.load(wq + j + woffs)
            else:
                w = _load_words(wp, j + woffs, 0, 0, MIS, False)
            if NARROW:
                acc += _term_lo(w, (j + jb + 1).to(tl.uint32) + lanes)
            else:
                acc += _term(w, j + woffs + jb)
        j = w0 + nsub_full * SUBW
        if j < tl.minimum(w0 + BLOCKW, nwords):           # <= SUBW words left, the last maybe partial
            acc += _tail_terms(wp, j + woffs, numel, jb, SUBW, ESIZE, MIS)
        return tl.sum(acc, axis=0)

    @triton.jit
    def _contig_kernel(base, items, gtab, sums, BLOCKW: tl.constexpr, SUBW: tl.constexpr, ESIZE: tl.constexpr,
                       ALIGN16: tl.constexpr, MIS: tl.constexpr, DYN: tl.constexpr, NARROW: tl.constexpr):
        """One program = BLOCKW words of one tensor.  items[pid] = table row; row = numel, first item of the
        tensor, element offset from `base`, accumulator slot, global index of its first word (0 but for a
        shard's piece, `word_sums`).  Every tensor of the launch has its data pointer MIS bytes past an 8-byte
        boundary (ALIGN16: all 16-byte aligned); NARROW: see `_words_block_dyn`."""
        pid = tl.program_id(0)
        row = gtab + tl.load(items + pid) * 5
        numel = tl.load(row)
        w0 = (pid - tl.load(row + 1)).to(tl.int64) * BLOCKW
        jb = tl.load(row + 4)
        if DYN:
            total = _words_block_dyn(base, tl.load(row + 2), numel, w0, jb, BLOCKW, SUBW, ESIZE, ALIGN16, MIS,
                                     NARROW)
        else:
            total = _words_block(base, tl.load(row + 2), numel, w0, jb, BLOCKW, SUBW, ESIZE, ALIGN16, MIS)
        # int64 atomic add wraps mod 2^64 exactly like the uint64 sum
        tl.atomic_add(sums + tl.load(row + 3), total.to(tl.int64, bitcast=True), sem="relaxed")

    @triton.jit
    def _strided_kernel(ptr, sums, slot, numel, n1, n2, n3, s0, s1, s2, s3, BLOCKW: tl.constexpr,
                        SUBW: tl.constexpr, ESIZE: tl.constexpr, PACK2D: tl.constexpr):
        """A non-contiguous view of <= 4 dims (sizes n0..n3, element strides s0..s3, C-order index i)."""
        R: tl.constexpr = 8 // ESIZE
        w0 = tl.program_id(0).to(tl.int64) * BLOCKW
        eoffs = _elem_offsets(SUBW, R, PACK2D)
        woffs = tl.arange(0, SUBW)
        acc = tl.zeros([SUBW], dtype=tl.uint64)
        for it in range(0, BLOCKW, SUBW):
            i = (w0 + it) * R + eoffs
            i3 = i % n3
            r = i // n3
            i2 = r % n2
            r = r // n2
            i1 = r % n1
            i0 = r // n1
            x = tl.load(ptr + (i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3), mask=i < numel, other=0)
            jj = w0 + it + woffs
            acc += tl.where(jj * R < numel, _term(_pack(x, SUBW, ESIZE, PACK2D), jj), 0)
        tl.atomic_add(sums + slot, tl.sum(acc, axis=0).to(tl.int64, bitcast=True), sem="relaxed")
