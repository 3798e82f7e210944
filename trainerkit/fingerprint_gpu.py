"""The fp64v2 fingerprint (`trainerkit.fingerprint`) computed on the GPU with Triton kernels.

`fingerprint_device(t)` / `fingerprint_many(tensors)` return exactly `fingerprint.fingerprint(t)` for every
tensor, bit for bit, without copying tensors to the host: only one 8-byte sum per tensor comes back, and the
final ``mix(S ^ mix(header))`` is applied on the host with the reference's own numpy `_mix` and `_header`.

How it is computed
------------------
Definition: ``S = sum_j mix(w_j ^ mix(j + 1)) mod 2^64`` over the tensor's C-order raw bytes read as
little-endian 64-bit words w_j (the last one zero-padded).  The sum is order-free, so each program sums a block
of words with wrapping uint64 adds and adds its block sum to the tensor's accumulator with a 64-bit integer
``atomic_add`` (exact, wraps mod 2^64: any order of programs gives the same bits).

* Contiguous tensors are read as uint64 words (`_contig_kernel`; the pointer is cast in-kernel).  A tensor
  whose data pointer is 16-byte aligned (every allocator-made tensor) gets two words per vector load; one that
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

Cost: two splitmix64 finalisers per 8 bytes (~40 integer instructions, most on the 16-lane ALU pipe), i.e.
~2.8 words/clk/SM, ~5 TB/s of reads on an H200's 132 SMs, about twice its HBM bandwidth: the kernel is
memory-bound for every dtype.  (The former per-element definition, fp64v1, was integer-issue bound at
~1.4 TB/s for bf16.)  `bench/bench_fingerprint_gpu.py` measures it against a device-to-device copy.

Launch geometry (`DEFAULT`): ``num_warps`` warps; ``wpt`` words per thread per sub-block (SUBW = num_warps * 32
* wpt words); ``nsub`` sub-blocks per program (BLOCKW = nsub * SUBW words); ``pack`` ("reshape" or "2d"): how
the strided kernel arranges element loads before packing (a 1-D load reshaped to [SUBW, R], or [SUBW, R]);
``loop`` ("static" or "dynamic", contiguous kernel): the sub-blocks in a loop of constexpr trip count with run-time
branches inside, or the whole-word ones in a branch-free loop of run-time trip count then one masked sub-block
(`_words_block_dyn`); ``stages``: Triton's ``num_stages`` for the contiguous kernel; ``narrow`` (dynamic loop):
32-bit index terms and 128-bit word loads where the launch allows them (`_words_block_dyn`; False: the kernel as
it was before 2026-12-07, kept for the side-by-side benchmark).

`fingerprint_many_async` launches without waiting and returns a `PendingFingerprints` (`.result()`,
`.hex()`): the kernels run on the current stream, in order with the work that produces and later overwrites
the tensors, so the training step can go on while they run.  Plans (the device tables) are cached by the
tensors' pointers, dtypes, shapes and strides: the same gradient buffers every step cost a dictionary lookup
and no host-to-device copy.

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
DEFAULT = {"num_warps": 4, "wpt": 8, "nsub": 8, "pack": "reshape", "loop": "dynamic", "stages": 3, "narrow": True}
PACKS = ("reshape", "2d")
LOOPS = ("static", "dynamic")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GTAB_COLS = 5           # numel, first item, element offset from the launch's base, slot, first word's index
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


def _geometry(cfg: dict) -> tuple[int, int]:
    """(SUBW, BLOCKW): words per sub-block (num_warps * 32 threads * wpt) and per program (nsub sub-blocks)."""
    subw = cfg["num_warps"] * 32 * cfg["wpt"]
    return subw, subw * cfg["nsub"]


def _alignment(m: dict) -> tuple[bool, int]:
    """(16-byte aligned, bytes past the previous 8-byte boundary) of a tensor's data pointer: its launch class."""
    return m["ptr"] % 16 == 0, m["ptr"] % 8


class _Plan:
    """Device table and launch list for one list of tensors (cached: the same gradients every step)."""

    def __init__(self, metas, device, cfg):
        self.hmix = _mix(np.array([_header(m["dtype"], m["shape"]) for m in metas], dtype=np.uint64))
        subw, blockw = _geometry(cfg)
        self.launches: list = []      # ("contig", base, esize, (align16, mis), subw, blockw, row0, item0, nitems,
                                      #  narrow)
                                      # or ("strided", j, sizes4, strides4, esize, subw, blockw)
        by_launch: "OrderedDict[tuple, list]" = OrderedDict()
        strided: list = []
        for j, m in enumerate(metas):
            if m["numel"] == 0:
                continue
            if m["contig"]:
                by_launch.setdefault((m["esize"], _alignment(m)), []).append(j)
            else:
                strided.append(j)
        rows: list = []
        items: list = []              # items[k] = table row (relative to its launch) of program k
        for (esize, align), members in by_launch.items():
            base_ptr = metas[members[0]]["ptr"]
            row0, item0 = len(rows), len(items)
            narrow = cfg["narrow"]
            for r, j in enumerate(members):
                delta = metas[j]["ptr"] - base_ptr
                if delta % esize:
                    raise ValueError(f"tensor {j}: data pointer not aligned to its element size")
                nwords = -(-metas[j]["numel"] * esize // 8)
                narrow = narrow and metas[j].get("wbase", 0) + nwords < 2 ** 32    # j + 1 fits 32 bits
                rows.append([metas[j]["numel"], len(items) - item0, delta // esize, metas[j].get("slot", j),
                             metas[j].get("wbase", 0)])
                items.extend([r] * -(-nwords // blockw))
            self.launches.append(("contig", members[0], esize, align, subw, blockw, row0, item0,
                                  len(items) - item0, narrow))
        # one int64 buffer, one host->device copy: the rows, then the items
        self.items_at = len(rows) * _GTAB_COLS
        flat = np.asarray(rows, dtype=np.int64).reshape(-1)
        self.table = torch.from_numpy(np.concatenate([flat, np.asarray(items, dtype=np.int64)])).to(device)
        for j in strided:
            dims = [(1, 0)] * (_MAX_DIMS - len(metas[j]["dims"])) + list(metas[j]["dims"])
            self.launches.append(("strided", j, [n for n, _ in dims], [s for _, s in dims], metas[j]["esize"],
                                  subw, blockw))


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
    if cfg["pack"] not in PACKS:
        raise ValueError(f"pack must be one of {PACKS}")
    if cfg["loop"] not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}")
    if not isinstance(cfg["narrow"], bool):
        raise ValueError("narrow must be True or False")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16, 32) or cfg["nsub"] < 1 or cfg["wpt"] not in (1, 2, 4, 8, 16) \
            or cfg["stages"] not in (1, 2, 3, 4, 5):
        raise ValueError("num_warps must be a power of two <= 32, wpt 1, 2, 4, 8 or 16, nsub >= 1, stages 1-5")
    return cfg


def _plan(tensors: list, cfg: dict, pieces: "tuple | None" = None) -> "tuple[_Plan, list]":
    """The plan for tensors on one device, cached by (pointer, dtype, shape, strides) of every tensor - the
    same gradient buffers every step cost one dictionary lookup.  Views with > 4 non-mergeable dims are
    replaced by contiguous copies (returned in the list, which the caller keeps alive until the kernels are
    done; such plans are not cached).  `pieces` (`word_sums`): (first word's global index, slot) per tensor."""
    key = (tensors[0].device, tuple(sorted(cfg.items())),
           tuple([(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors]), pieces)
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
        if pieces is not None:
            if not m["contig"]:
                raise ValueError(f"word_sums: piece {j} is not contiguous")
            m["wbase"], m["slot"] = pieces[j]
        metas.append(m)
    plan = _Plan(metas, tensors[0].device, cfg)
    if not copied:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan, tensors


def _launch(tensors: list, cfg: dict, pieces: "tuple | None" = None,
            nslots: "int | None" = None) -> "tuple[torch.Tensor, _Plan, list]":
    """Launch the kernels for tensors that all live on one device; returns the int64 sums tensor (S of each
    tensor, or of each slot's pieces, filled asynchronously on the current stream), the plan and the tensors
    actually read."""
    plan, tensors = _plan(tensors, cfg, pieces)
    nw, pack2d = cfg["num_warps"], cfg["pack"] == "2d"
    sums = torch.zeros(len(tensors) if nslots is None else nslots, dtype=torch.int64, device=tensors[0].device)
    table = plan.table
    items = table[plan.items_at:]
    for launch in plan.launches:
        if launch[0] == "strided":
            _, j, sizes, strides, esize, subw, blockw = launch
            t = tensors[j].detach().view(_INT_VIEW[esize])
            nwords = -(-t.numel() * esize // 8)
            _strided_kernel[(-(-nwords // blockw),)](
                t, sums, j, t.numel(), sizes[1], sizes[2], sizes[3], *strides, BLOCKW=blockw, SUBW=subw,
                ESIZE=esize, PACK2D=pack2d, num_warps=nw)
        else:
            _, base, esize, (align16, mis), subw, blockw, row0, item0, nitems, narrow = launch
            _contig_kernel[(nitems,)](
                tensors[base].detach().view(_INT_VIEW[esize]), items[item0:], table[row0 * _GTAB_COLS:], sums,
                BLOCKW=blockw, SUBW=subw, ESIZE=esize, ALIGN16=align16, MIS=mis, DYN=cfg["loop"] == "dynamic", NARROW=narrow,
                num_warps=nw, num_stages=cfg["stages"])
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
                                         "(pip install triton); trainerkit.fingerprint works on the host")
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            sums, plan, keep = _launch(tensors if len(idxs) == len(tensors) else [tensors[j] for j in idxs], cfg)
        out._pending.append((idxs, sums, plan, keep))
    return out


def fingerprint_many(tensors, **options) -> list[int]:
    """`fingerprint.fingerprint` of every tensor of `tensors`, computed on their device in a few launches.

    CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run through the Triton kernels: one fill +
    one launch per (element size, alignment class) for all contiguous tensors + one per non-contiguous view,
    per device; only 8 bytes per tensor come back.  Other CPU tensors use the reference implementation.
    options (speed only, never the values): num_warps, wpt, nsub, pack (see `DEFAULT`).
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


def word_sums(pieces, word_bases, slots, nslots: int, **options) -> list[int]:
    """Partial sums of fp64v2's S for the pieces of sharded tensors (`trainerkit.fingerprint_shard`): piece k,
    a contiguous 1-D view whose bytes are whole words of a global tensor, the first at global word index
    ``word_bases[k]`` (its last word zero-padded only where the global tensor ends), adds
    ``sum_i mix(w_i ^ mix(word_bases[k] + i + 1))`` to ``slots[k]``; returns the `nslots` sums (ints mod 2^64).
    All pieces on one device, through the contiguous kernel (one launch per alignment class).

    Raises:
        TritonUnavailableError: no Triton.  ValueError: a piece is not contiguous or its pointer not aligned to
            its element size."""
    if not HAVE_TRITON:
        raise TritonUnavailableError("word_sums needs Triton (pip install triton)")
    pieces = [p.detach().reshape(-1) for p in pieces]
    if not pieces:
        return [0] * nslots
    cfg = _cfg(options)
    key = tuple(zip((int(b) for b in word_bases), (int(s) for s in slots)))
    device = pieces[0].device
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        sums, _plan_, _keep = _launch(pieces, cfg, key, nslots)
    return [int(v) for v in sums.cpu().numpy().view(np.uint64).tolist()]
